#!/usr/bin/env bash
# dslua's loss curve against PyTorch's in the same run: GPT-2 124M (vocab
# padded to 50304, the loss over the 50257 real classes) trained 100 steps
# at B=8, T=1024 in bf16 on tiny Shakespeare's bytes (tokens 0-255) by both
# (bench/curve.lua, bench/curve_torch.py), from the same weights, on the
# same batches with the same lrs (AdamW, clipping 1.0, warmup and cosine),
# each step's loss compared: every step within 2% of PyTorch's, the steps
# at the starting weights within 1% (bench/curve.lua's compare says why).
# Needs a CUDA build of dslua and python3 with torch on a GPU machine
# (../shared/device/README.md); without a GPU it stops at once with an
# error; without ../shared/data/tinyshakespeare (or $DSLUA_DATA's) it says
# it skipped, with exit status 0.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bench/curve.sh [-b BUILD_DIR] [-o DIR] [-q]
  -b BUILD_DIR  dslua's build (default: build; built first unless it holds only a carried binary)
  -o DIR        keep the weights, batches and both curves in DIR (default: a temporary folder, removed)
  -q            quick: 10 steps (a smoke test, not the check)
EOF
}

me=bench/curve.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
keep=
while getopts "b:o:qh" opt; do
    case $opt in
    o) keep=$(realpath -m "$OPTARG") ;;
    *) bench_opt "$opt" ;;
    esac
done
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "$me: no GPU on this machine (nvidia-smi lists none); run it on a GPU machine" >&2
    exit 1
fi
text=${DSLUA_DATA:-$root/../shared/data}/tinyshakespeare/input.txt
if [[ ! -f $text ]]; then
    echo "$me: skipped: $text is absent (../shared/data's README)"
    exit 0
fi
bench_build
if ! "$build/dslua" "$root/bench/gpu.lua" probe >/dev/null; then
    echo "$me: $build/dslua sees no GPU (built without CUDA?); build it with DSLUA_CUDA=ON" >&2
    exit 1
fi
if ! python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    echo "$me: python3 has no torch with CUDA here" >&2
    exit 1
fi
dir=${keep:-$(mktemp -d)}
[[ -z $keep ]] && trap 'rm -rf "$dir"' EXIT
cd "$root"
steps=100
[[ -n $quick ]] && steps=10
"$build/dslua" bench/curve.lua prepare "$dir" "$text" steps=$steps
"$build/dslua" bench/curve.lua train "$dir" "$dir/dslua.json"
python3 bench/curve_torch.py "$dir" "$dir/dslua.json" "$dir/torch.json"
"$build/dslua" bench/curve.lua compare "$dir/dslua.json" "$dir/torch.json"
