#!/usr/bin/env bash
# dslua against PyTorch on the same GPU in one run: GPT-2 124M training
# tokens/s (T=1024, AdamW, clip 1.0) at B=8 and B=16 in bf16 and fp32 (vocab
# padded to 50304, and bf16 B=8 also at 50257), fp32 at B=8 also with both
# sides' allow_tf32 on ("tf32"), bf16 at B=16 also in fp8 (the fp8 block,
# dslua's alone), GPT-2 XL (1.5B, T=1024, also with ZeRO-Offload: dslua's
# alone) and TinyLlama's 1.1B shape (T=2048) in bf16, peak memory, MFU against the bf16 GEMM rate
# measured here, where a step's time goes, and the per-op table (the bf16
# attention forward, and forward and backward, also by kernel: wgmma on a compute
# capability 9.0 GPU, mma.sync).
# Needs a CUDA build of dslua and python3 with torch on a GPU machine
# (../shared/device/README.md says how to carry the build to one); without
# a GPU it stops at once with an error.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bench/gpu.sh [-b BUILD_DIR] [-o RESULTS] [-c] [-q]
  -b BUILD_DIR  dslua's build (default: build; built first unless it holds only a carried binary)
  -o RESULTS    also keep the raw result lines in this file
  -c            also time torch.compile on the bf16 rows at B=16, GPT-2 XL and Llama (minutes of compiling)
  -q            quick: few steps and short samples (a smoke test, not a measurement)
EOF
}

me=bench/gpu.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
results=
compiled=
while getopts "b:o:cqh" opt; do
    case $opt in
    o) results=$OPTARG ;;
    c) compiled=1 ;;
    *) bench_opt "$opt" ;;
    esac
done
# no GPU: stop before building anything
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "$me: no GPU on this machine (nvidia-smi lists none); run it on a GPU machine" >&2
    exit 1
fi
bench_build
if ! "$build/dslua" "$root/bench/gpu.lua" probe >/dev/null; then
    echo "$me: $build/dslua sees no GPU (built without CUDA?); build it with DSLUA_CUDA=ON" >&2
    exit 1
fi
py=python3
if ! $py -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    echo "$me: python3 has no torch with CUDA here; the torch columns show n/a" >&2
    py=
fi
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
cd "$root"

# A row that fails (out of memory, say) is named at the end and the exit
# status is 1; the rows before and after it still run.
failed=()
run() {
    local rc=0
    "$@" | tee -a "$raw" | grep -v '^result\|^flops' || rc=${PIPESTATUS[0]}
    ((rc == 0)) || failed+=("$* (exit $rc)")
}
run "$build/dslua" bench/gpu.lua ops $quick
[[ -n $py ]] && run $py bench/gpu_torch.py ops $quick
# GPT-2's vocab padded to 50304 (nanoGPT, llm.c) on both sides; bf16 at B=8
# also with the 50257 of the checkpoints; B=16 in fp8 beside bf16 (PyTorch
# has no fp8 training of its own: no torch column). GPT-2 XL and Llama 1.1B
# in bf16, GPT-2 XL also with ZeRO-Offload (dslua's alone, as fp8).
for row in "8 bf16 50304" "8 bf16 50257" "16 bf16 50304" "16 fp8 50304" "8 f32 50304" "16 f32 50304" "8 tf32 50304" \
    "4 bf16 50304 gpt2_xl" "4 bf16 50304 gpt2_xl offload" "4 bf16 32000 llama_1B"; do
    run "$build/dslua" bench/gpu.lua train $row $quick
    [[ -n $py && $row != *fp8* && $row != *offload ]] && run $py bench/gpu_torch.py train $row $quick
done
if [[ -n $py && -n $compiled ]]; then
    for row in "16 bf16 50304" "4 bf16 50304 gpt2_xl" "4 bf16 32000 llama_1B"; do
        run $py bench/gpu_torch.py train $row compile $quick
    done
fi
[[ -n $results ]] && cp "$raw" "$results"

awk -F'\t' -f bench/gpu_table.awk "$raw"
if ((${#failed[@]})); then
    printf '%s: failed: %s\n' "$me" "${failed[@]}" >&2
    exit 1
fi
