#!/usr/bin/env bash
# Partitioned construction benchmark: peak resident memory per rank of a
# Llama trained one step at ZeRO stage 3 on N CPU ranks, built whole on
# every rank and built inside ds.zero.Init, and the ratio of the two.
set -euo pipefail

usage() {
    cat <<'EOF2'
usage: bench/zinit.sh [-b BUILD_DIR] [-n RANKS] [-l LAYERS] [-e EMBD] [-s] [-q]
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -n RANKS      ranks (default: 4)
  -l LAYERS     decoder layers (default: 18)
  -e EMBD       hidden size, a multiple of 64 (default: 1024; with 18 layers ~297M parameters)
  -s            also one training step (32 tokens): its working set on top
  -q            quick: 2 layers of 256, a smoke test, not a measurement
EOF2
}

me=bench/zinit.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
ranks=4
layers=18
embd=1024
step=
while getopts "b:n:l:e:sqh" opt; do
    case $opt in
    n) ranks=$OPTARG ;;
    l) layers=$OPTARG ;;
    e) embd=$OPTARG ;;
    s) step=step ;;
    q) layers=2 embd=256 ;;
    *) bench_opt "$opt" ;;
    esac
done
if ! [[ $ranks =~ ^[1-9][0-9]*$ && $layers =~ ^[1-9][0-9]*$ && $embd =~ ^[1-9][0-9]*$ ]] || ((ranks < 2 || embd % 64)); then
    echo "$me: -n wants a whole number >= 2, -l one >= 1, -e a multiple of 64 (got '$ranks', '$layers', '$embd')" >&2
    exit 2
fi

bench_build
# no block cache: freed blocks go back to the system, so the resident set
# is what the run holds, not what the allocator keeps for reuse
bench_export_threads 1
export DSLUA_COMM_CHECK=0 DSLUA_ALLOC_CACHE_MB=0

bench_title "partitioned construction bench"
echo "$ranks CPU ranks, Llama of $layers layers x $embd, fp32, AdamW${step:+, one step of 32 tokens}; peak resident MiB (VmHWM)"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for way in whole zinit; do
    (cd "$root" && bench_mpirun "$ranks" "$build/dslua" bench/zinit.lua "$way" "$layers" "$embd" $step) | grep "^$way rank" >>"$out"
done
awk -v step="$step" '
    { way = $1; r = $3; params = $5; start[way, r] = $7; built[way, r] = $9; init[way, r] = $11; stepped[way, r] = $13
      if ($9 > pb[way]) pb[way] = $9
      if ($11 > pi[way]) pi[way] = $11
      if ($13 > ps[way]) ps[way] = $13
      n = r + 1 }
    END {
        printf "parameters %d\n", params
        printf "%-6s %4s %8s %8s %12s%s\n", "build", "rank", "start", "built", "initialized", step ? "  stepped" : ""
        for (r = 0; r < n; r++) for (w = 0; w < 2; w++) {
            way = w ? "zinit" : "whole"
            printf "%-6s %4d %8d %8d %12d", way, r, start[way, r], built[way, r], init[way, r]
            if (step) printf " %8d", stepped[way, r]
            printf "\n"
        }
        printf "peak per rank, zinit / whole: built %d / %d MiB = %.2f; through initialize %d / %d MiB = %.2f\n",
            pb["zinit"], pb["whole"], pb["zinit"] / pb["whole"], pi["zinit"], pi["whole"], pi["zinit"] / pi["whole"]
        if (step) printf "through one step %d / %d MiB = %.2f\n", ps["zinit"], ps["whole"], ps["zinit"] / ps["whole"]
    }' "$out"
