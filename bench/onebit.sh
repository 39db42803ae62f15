#!/usr/bin/env bash
# 1-bit optimizers benchmark: loss and bytes sent per step of OneBitAdam and
# ZeroOneAdam against AdamW without bias correction, on N ranks of this
# machine (bench/onebit.lua). Bytes are counted, not timed: the table means
# the same on a loaded machine.
set -euo pipefail

usage() {
    cat <<'EOF2'
usage: bench/onebit.sh [-b BUILD_DIR] [-n RANKS] [-s STEPS] [-f FREEZE] [-l LR] [-q]
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -n RANKS      ranks (default: 2)
  -s STEPS      steps per optimizer (default: 600)
  -f FREEZE     OneBitAdam's freeze_step and ZeroOneAdam's var_freeze_step (default: 150)
  -l LR         the lr of AdamW, OneBitAdam and ZeroOneAdam (default: 1e-3; the Lambs keep 1e-2)
  -q            quick: a small model, a smoke test, not a measurement
EOF2
}

me=bench/onebit.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
ranks=2
steps=600
freeze=150
lr=1e-3
while getopts "b:n:s:f:l:qh" opt; do
    case $opt in
    n) ranks=$OPTARG ;;
    s) steps=$OPTARG ;;
    f) freeze=$OPTARG ;;
    l) lr=$OPTARG ;;
    *) bench_opt "$opt" ;;
    esac
done
number='^[0-9]*\.?[0-9]+([eE]-?[0-9]+)?$'
if ! [[ $ranks =~ ^[1-9][0-9]*$ && $steps =~ ^[1-9][0-9]*$ && $freeze =~ ^[0-9]+$ && $lr =~ $number ]] ||
    ((ranks < 2)); then
    echo "$me: -n wants a whole number >= 2, -s one >= 1, -f one >= 0 and -l a number (got '$ranks', '$steps'," \
        "'$freeze', '$lr')" >&2
    exit 2
fi

bench_build
bench_rank_threads
export DSLUA_DEVICE=cpu

bench_title "1-bit optimizers bench"
(cd "$root" && bench_mpirun "$ranks" "$build/dslua" bench/onebit.lua "$steps" "$freeze" "$lr" $quick 2>&1) | grep -v '^attach:\|uses the CPU'
