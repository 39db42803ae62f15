#!/usr/bin/env bash
# Pipeline benchmark: the 1F1B pipeline's measured bubble (idle fraction of
# train_batch) against (S-1)/(M+S-1) for S equal stages and M micro
# batches, and activation checkpointing on GPT-2 small against none: peak
# activation bytes and forward+backward time, as ratios.
set -euo pipefail

usage() {
    cat <<'EOF2'
usage: bench/pipe.sh [-b BUILD_DIR] [-s STAGES] [-m "M..."] [-q]
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -s STAGES     pipeline stages, one rank each (default: 2; more than the cores time-share them)
  -m "M..."     micro batch counts (default: "1 2 4 8 16")
  -q            quick: tiny sizes, a smoke test, not a measurement
EOF2
}

me=bench/pipe.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
stages=2
micro="1 2 4 8 16"
while getopts "b:s:m:qh" opt; do
    case $opt in
    s) stages=$OPTARG ;;
    m) micro=$OPTARG ;;
    *) bench_opt "$opt" ;;
    esac
done
if ! [[ $stages =~ ^[1-9][0-9]*$ ]] || ((stages < 2)); then
    echo "$me: -s wants a whole number >= 2 (got '$stages')" >&2
    exit 2
fi
for m in $micro; do
    if ! [[ $m =~ ^[1-9][0-9]*$ ]]; then echo "$me: -m wants whole numbers >= 1 (got '$m')" >&2; exit 2; fi
done

bench_build
bench_title "pipeline bench"
echo "cpu: $(bench_cpu), $cores cores; load $(bench_load)"

# one thread per stage rank, the stages on cores of their own where there are enough
bench_export_threads 1
export DSLUA_COMM_CHECK=0 DSLUA_DEVICE=cpu
# shellcheck disable=SC2086  # the micro batch counts are words
(cd "$root" && bench_mpirun "$stages" "$build/dslua" bench/pipe.lua bubble "${quick:-full}" $micro) |
    awk '$1 == "result" && $2 == "bubble" {
        if (!head++) {
            printf "\n1F1B bubble, %d stages of 4 Linear+ReLU each (one rank, one thread each)\n", $3
            printf "%6s %10s %22s %10s %12s  %s\n", "micro", "measured", "ideal (S-1)/(M+S-1)", "ratio", "ms/batch", "per stage"
        }
        printf "%6d %10.3f %22.3f %9.2fx %12.1f  %s\n", $4, $5, $6, $5 / $6, 1000 * $7, $8
    }'

bench_export_threads "$cores"
(cd "$root" && "$build/dslua" bench/pipe.lua ckpt none $quick && "$build/dslua" bench/pipe.lua ckpt every $quick) |
    awk -v cores="$cores" '$1 == "result" && $2 == "ckpt" {
        name = $4; b = $5; t = $6; act[$3] = $7; tot[$3] = $8; sec[$3] = $9
    }
    END {
        printf "\nactivation checkpointing, %s, batch %d x %d tokens, forward+backward (%d threads)\n", name, b, t, cores
        printf "%-26s %14s %14s %10s\n", "", "none", "every block", "ratio"
        printf "%-26s %14d %14d %9.2fx\n", "peak activation bytes", act["none"], act["every"], act["every"] / act["none"]
        printf "%-26s %14d %14d %9.2fx\n", "peak bytes in all", tot["none"], tot["every"], tot["every"] / tot["none"]
        printf "%-26s %14.3f %14.3f %9.2fx\n", "seconds per step", sec["none"], sec["every"], sec["every"] / sec["none"]
    }'
