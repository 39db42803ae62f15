#!/usr/bin/env bash
# The staged path's cost: all_reduce bytes per second on 2 ranks through
# MPI directly (CPU tensors), through the staged backend with memcpy for
# its copies (the CPU stand-in, DSLUA_TEST_STAGE_CPU=1), and where a GPU
# is, with device tensors of 2 ranks sharing it (DSLUA_COMM_BACKEND=mpi),
# each beside the host copy rate of the same bytes (bench/staged.lua).
set -euo pipefail

usage() {
    cat <<'EOF2'
usage: bench/staged.sh [-b BUILD_DIR] [-q]
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -q            quick: 2 samples a size (a smoke test, not a measurement)
EOF2
}

me=bench/staged.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
bench_build_quick_options "$@"
bench_build
cd "$root"
bench_export_threads 1
# shellcheck disable=SC2054  # self,vader is one argument
mpi=(mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader
     -x DSLUA_NUM_THREADS -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS -x DSLUA_TEST_STAGE_CPU -x DSLUA_COMM_BACKEND
     -np 2 "$build/dslua" bench/staged.lua)
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
DSLUA_TEST_STAGE_CPU=0 DSLUA_COMM_BACKEND='' DSLUA_DEVICE=cpu "${mpi[@]}" mpi_direct cpu $quick | tee -a "$raw"
DSLUA_TEST_STAGE_CPU=1 DSLUA_COMM_BACKEND='' DSLUA_DEVICE=cpu "${mpi[@]}" staged_cpu cpu $quick | tee -a "$raw"
if "$build/dslua" -e "os.exit(require('dslua').cuda.is_available() and 0 or 1)"; then
    DSLUA_TEST_STAGE_CPU=0 DSLUA_COMM_BACKEND=mpi "${mpi[@]}" staged_gpu cuda:0 $quick | tee -a "$raw"
fi
echo "cpu: $(bench_cpu)"
awk -F'\t' '$1 == "result" { printf "%-12s %-9s all_reduce %8.3f GB/s   host copy %8.3f GB/s   %5.1f%%\n",
    $2, $3, $4, $5, 100 * $4 / $5 }' "$raw"
