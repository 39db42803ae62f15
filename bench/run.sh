#!/usr/bin/env bash
# Builds dslua if needed, runs every benchmark on one thread count and
# prints one table of ratios against references measured in the same run:
# raw OpenBLAS sgemm for matmul, PyTorch (/usr/bin/python3) for the rest.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bench/run.sh [-t THREADS] [-r ROUNDS] [-b BUILD_DIR] [-o RESULTS] [-q]
  -t THREADS    threads for dslua, OpenBLAS and PyTorch (default: nproc)
  -r ROUNDS     run the three programs in turn this many times and keep each
                row's best round, which filters out other load (default: 3)
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -o RESULTS    also keep the raw result lines in this file
  -q            quick: fewer and shorter samples (a smoke test, not a measurement)
EOF
}

me=bench/run.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
threads=$cores
rounds=3
results=
while getopts "t:r:b:o:qh" opt; do
    case $opt in
    t) threads=$OPTARG ;;
    r) rounds=$OPTARG ;;
    o) results=$OPTARG ;;
    *) bench_opt "$opt" ;;
    esac
done
bench_threads
bench_build
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
gemm=$build/bench_gemm_ref
if [[ ! -x $gemm || $root/bench/gemm_ref.c -nt $gemm ]]; then
    # shellcheck disable=SC2046  # pkg-config prints several words on purpose
    cc -O2 -std=gnu11 -Wall -Wextra $(pkg-config --cflags openblas) "$root/bench/gemm_ref.c" \
        $(pkg-config --libs openblas) -o "$gemm"
fi

bench_torch "torch rows show n/a"

# One program at a time, so none of them shares the cores with another.
load_before=$(bench_load)
for ((round = 1; round <= rounds; round++)); do
    echo "$me: round $round of $rounds" >&2
    "$gemm" "$threads" >>"$raw"
    "$build/dslua" "$root/bench/ops.lua" $quick >>"$raw"
    [[ -n $torch ]] && /usr/bin/python3 "$root/bench/ops_torch.py" "$threads" $quick >>"$raw"
done
[[ -n $results ]] && cp "$raw" "$results"

bench_title "bench"
echo "cpu: $(bench_cpu), $cores cores; load average before $load_before, after $(bench_load)"
echo "best of $rounds round(s); ratio = reference time / dslua time (> 1: dslua faster)"
"$build/dslua" "$root/bench/table.lua" "$raw"
