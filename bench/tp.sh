#!/usr/bin/env bash
# Tensor parallelism on CPU ranks: tokens/s of GPT-2 (gpt-mini's shape)
# with tensor degree 2 against data parallel on the same 2 ranks, the same
# global batch, one thread per rank. A CPU figure: what splitting the
# layers costs against splitting the batch where the ranks share one
# machine's memory, not what it gains on GPUs over a network.
set -euo pipefail

usage() {
    cat <<'EOF2'
usage: bench/tp.sh [-b BUILD_DIR] [-q]
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -q            quick: a tiny model, a smoke test, not a measurement
EOF2
}

me=bench/tp.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
bench_build_quick_options "$@"

bench_build
bench_title "tensor-parallel bench (CPU)"
echo "cpu: $(bench_cpu), $cores cores; load $(bench_load)"

bench_export_threads 1
export DSLUA_COMM_CHECK=0 DSLUA_DEVICE=cpu
for mode in data2 tensor2; do
    (cd "$root" && bench_mpirun 2 "$build/dslua" bench/tp.lua "$mode" $quick)
done | awk '$1 == "result" && $2 == "tp" { tok[$3] = $4; sec[$3] = $5; loss[$3] = $6 }
    END {
        printf "\nGPT-2, 2 CPU ranks of one thread, global batch %d tokens per step, AdamW fp32\n", tok["data2"]
        printf "%-26s %12s %12s %10s\n", "", "s/step", "tokens/s", "loss"
        printf "%-26s %12.3f %12.0f %10.4f\n", "data parallel 2", sec["data2"], tok["data2"] / sec["data2"], loss["data2"]
        printf "%-26s %12.3f %12.0f %10.4f\n", "tensor parallel 2", sec["tensor2"], tok["tensor2"] / sec["tensor2"], loss["tensor2"]
        printf "%-26s %25.2fx  (tensor 2 tokens/s over data 2, CPU)\n", "ratio", (tok["tensor2"] / sec["tensor2"]) / (tok["data2"] / sec["data2"])
    }'
