#!/usr/bin/env bash
# Communication benchmark on 2 ranks of this machine: all-reduce bus
# bandwidth of ds.comm next to MPI_Allreduce called from C in the same run,
# and the share of GPT-2's gradient all-reduce hidden behind backward.
# Builds dslua if needed and bench/allreduce_ref.c into a shared library
# (mpicc), then runs bench/comm.lua under mpirun.
set -euo pipefail

usage() {
    cat <<'EOF2'
usage: bench/comm.sh [-b BUILD_DIR] [-n RANKS] [-p bandwidth|overlap|all] [-q]
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -n RANKS      ranks (default: 2)
  -p PART       bandwidth, overlap or all (default: all)
  -q            quick: short samples, one step (a smoke test, not a measurement)
EOF2
}

me=bench/comm.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
ranks=2
part=all
while getopts "b:n:p:qh" opt; do
    case $opt in
    n) ranks=$OPTARG ;;
    p) part=$OPTARG ;;
    *) bench_opt "$opt" ;;
    esac
done
if ! [[ $ranks =~ ^[1-9][0-9]*$ ]] || ((ranks < 2)); then
    echo "$me: -n wants a whole number >= 2 (got '$ranks')" >&2
    exit 2
fi
case $part in bandwidth | overlap | all) ;; *) echo "$me: -p wants bandwidth, overlap or all" >&2; exit 2 ;; esac

bench_build
ref=$build/libbench_allreduce_ref.so
if [[ ! -f $ref || $root/bench/allreduce_ref.c -nt $ref ]]; then
    mpicc -O2 -std=gnu11 -Wall -Wextra -shared -fPIC "$root/bench/allreduce_ref.c" -o "$ref"
fi

# One thread per rank, ranks spread over the cores; shared memory only.
bench_rank_threads
# The agreement before each collective stays as configured (on unless
# DSLUA_COMM_CHECK=0); the bandwidth table also times it off.
export DSLUA_COMM_CHECK=${DSLUA_COMM_CHECK:-1}

load_before=$(bench_load)
bench_title "comm bench"
echo "cpu: $(bench_cpu), $cores cores; $ranks ranks of $threads thread(s), OpenMPI $(mpirun --version | sed -n 's/.*(Open MPI) //p'), btl self,vader"
(cd "$root" && bench_mpirun "$ranks" "$build/dslua" bench/comm.lua "$ref" "$part" $quick)
echo "load average before $load_before, after $(bench_load)"
