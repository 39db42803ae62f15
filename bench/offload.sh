#!/usr/bin/env bash
# ZeRO-Offload benchmark (bench/offload.lua): the CPU AdamW step in GB/s
# against a large memcpy's rate in the same run, per instruction set and
# thread count; then stage 2 and 3 step times with offload_optimizer
# device cpu against without, on N CPU ranks.
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
build=$root/build
ranks=2
elements=16777216
steps=6
quick=
while getopts "b:n:e:s:qh" opt; do
    case $opt in
    b) build=$(realpath -m "$OPTARG") ;;
    n) ranks=$OPTARG ;;
    e) elements=$OPTARG ;;
    s) steps=$OPTARG ;;
    q) quick=quick ;;
    h) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
    esac
done
if ! [[ $ranks =~ ^[1-9][0-9]*$ && $elements =~ ^[1-9][0-9]*$ && $steps =~ ^[1-9][0-9]*$ ]]; then
    echo "$me: -n, -e and -s want whole numbers >= 1 (got '$ranks', '$elements', '$steps')" >&2
    exit 2
fi
[[ -n $quick ]] && elements=262144

bench_build
commit=$(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown)
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
echo "dslua offload bench  $(date -u '+%Y-%m-%d %H:%M UTC')  commit $commit${quick:+  (quick)}"
echo "cpu: $cpu, $cores cores"
echo
export DSLUA_NUM_THREADS=$cores OMP_NUM_THREADS=$cores OPENBLAS_NUM_THREADS=$cores
(cd "$root" && "$build/dslua" bench/offload.lua adam "$elements" $quick) | grep -v '^result'
echo
threads=$((cores / ranks > 0 ? cores / ranks : 1))
export DSLUA_NUM_THREADS=$threads OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads DSLUA_COMM_CHECK=0
(cd "$root" && mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader \
    -x DSLUA_NUM_THREADS -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS -x DSLUA_COMM_CHECK \
    -np "$ranks" "$build/dslua" bench/offload.lua zero "$steps" $quick) | grep -v '^ZeRO\|^result'
