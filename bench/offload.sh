#!/usr/bin/env bash
# ZeRO-Offload benchmark (bench/offload.lua): the CPU AdamW step in GB/s
# against a large memcpy's rate in the same run, per instruction set and
# thread count; then stage 2 and 3 step times with offload_optimizer
# device cpu against without, on N CPU ranks, offload through its
# pipeline as from a GPU with the host's copies standing in for the
# device's (DSLUA_TEST_OFFLOAD_CPU, chunks of 2^20 elements as on a GPU).
set -euo pipefail

usage() {
    cat <<'EOF2'
usage: bench/offload.sh [-b BUILD_DIR] [-n RANKS] [-e ELEMENTS] [-s STEPS] [-q]
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -n RANKS      ranks of the training half (default: 2)
  -e ELEMENTS   AdamW's buffer length (default: 16777216, 256 MiB of p, g, m, v)
  -s STEPS      timed steps per run of the training half (default: 6)
  -q            quick: small buffers and a tiny model, a smoke test, not a measurement
EOF2
}

me=bench/offload.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
ranks=2
elements=16777216
steps=6
while getopts "b:n:e:s:qh" opt; do
    case $opt in
    n) ranks=$OPTARG ;;
    e) elements=$OPTARG ;;
    s) steps=$OPTARG ;;
    *) bench_opt "$opt" ;;
    esac
done
if ! [[ $ranks =~ ^[1-9][0-9]*$ && $elements =~ ^[1-9][0-9]*$ && $steps =~ ^[1-9][0-9]*$ ]]; then
    echo "$me: -n, -e and -s want whole numbers >= 1 (got '$ranks', '$elements', '$steps')" >&2
    exit 2
fi
[[ -n $quick ]] && elements=262144

bench_build
bench_title "offload bench"
echo "cpu: $(bench_cpu), $cores cores"
echo
bench_export_threads "$cores"
(cd "$root" && "$build/dslua" bench/offload.lua adam "$elements" $quick) | grep -v '^result'
echo
bench_rank_threads
export DSLUA_COMM_CHECK=0
(cd "$root" && bench_mpirun "$ranks" -x DSLUA_TEST_OFFLOAD_CPU=1048576 "$build/dslua" bench/offload.lua zero "$steps" $quick) |
    grep -v '^ZeRO\|^result'
