#!/usr/bin/env bash
# The mixed-precision step phase (bench/step.lua): GPT-2 124M in bf16 with
# fp32 masters and AdamW, one rank, ZeRO stages 0-3, against PyTorch's
# fused AdamW step plus the bf16 copy over as many weights in the same run.
set -euo pipefail

usage() {
    cat <<'EOF2'
usage: bench/step.sh [-b BUILD_DIR] [-q]
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -q            quick: a tiny GPT-2, a smoke test, not a measurement
EOF2
}

me=bench/step.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
bench_build_quick_options "$@"

bench_build
echo "dslua step-phase bench  $(date -u '+%Y-%m-%d %H:%M UTC')${quick:+  (quick)}"
"$build/dslua" --report 2>/dev/null | grep -i -m2 "device\|gpu" || true
n=
for stage in 0 1 2 3; do
    line=$(cd "$root" && "$build/dslua" bench/step.lua "$stage" $quick | grep '^result dslua')
    read -r _ _ _ dev n ms _ <<<"$line"
    printf 'stage %d  %-8s %12s parameters  step %9.3f ms\n' "$stage" "$dev" "$n" "$ms"
    eval "ms$stage=$ms"
done
# Debian's python3-torch here; the GPU machine's python3 carries its own torch
py=python3
/usr/bin/python3 -c 'import torch' 2>/dev/null && py=/usr/bin/python3
if "$py" -c 'import torch' 2>/dev/null; then
    read -r _ _ _ tdev _ tms _ <<<"$("$py" "$root/bench/step_torch.py" "$n" $quick | grep '^result torch')"
    printf 'torch    %-8s %12s weights     step %9.3f ms (fused AdamW + clip + bf16 copy)\n' "$tdev" "$n" "$tms"
    for stage in 0 1 2 3; do
        ms=ms$stage
        awk -v a="${!ms}" -v b="$tms" -v s="$stage" 'BEGIN { printf "stage %d / torch: %.2fx\n", s, a / b }'
    done
else
    echo "torch: not installed here (python3-torch); no reference in this run"
fi
