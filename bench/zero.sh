#!/usr/bin/env bash
# ZeRO benchmark: step time of stages 0-3 relative to stage 0 and the peak
# per-rank memory of each (allocator counters), on N ranks of this machine.
set -euo pipefail

usage() {
    cat <<'EOF2'
usage: bench/zero.sh [-b BUILD_DIR] [-n RANKS] [-s STEPS] [-d fp32|bf16] [-q]
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -n RANKS      ranks (default: 2)
  -s STEPS      timed steps per stage (default: 12)
  -d DTYPE      fp32 or bf16 (default: fp32)
  -q            quick: a tiny model, a smoke test, not a measurement
EOF2
}

me=bench/zero.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
ranks=2
steps=12
dtype=fp32
while getopts "b:n:s:d:qh" opt; do
    case $opt in
    n) ranks=$OPTARG ;;
    s) steps=$OPTARG ;;
    d) dtype=$OPTARG ;;
    *) bench_opt "$opt" ;;
    esac
done
if ! [[ $ranks =~ ^[1-9][0-9]*$ && $steps =~ ^[1-9][0-9]*$ ]] || ((ranks < 2)); then
    echo "$me: -n wants a whole number >= 2 and -s one >= 1 (got '$ranks', '$steps')" >&2
    exit 2
fi
case $dtype in fp32 | bf16) ;; *) echo "$me: -d wants fp32 or bf16" >&2; exit 2 ;; esac

bench_build
bench_rank_threads
export DSLUA_COMM_CHECK=0

bench_title "ZeRO bench"
echo "cpu: $(bench_cpu), $cores cores; $ranks ranks of $threads thread(s)"
(cd "$root" && bench_mpirun "$ranks" "$build/dslua" bench/zero.lua "$steps" "$dtype" $quick) | grep -v '^ZeRO stage'
