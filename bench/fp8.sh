#!/usr/bin/env bash
# FP8 training against bf16: a small character-level GPT-2 (bench/fp8.lua)
# trained STEPS steps in bf16 and again from the same weights and batches
# with the fp8 block on (delayed scaling, hybrid formats), on this rank's
# device (a GPU where there is one). Prints the loss of the first 10 and
# last 50 steps of each and how far fp8's last 50 are from bf16's (the aim:
# within 1%), and each run's seconds.
set -euo pipefail

usage() {
    cat <<'EOF2'
usage: bench/fp8.sh [-b BUILD_DIR] [-s STEPS] [-d TEXT] [-q]
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -s STEPS      steps of each run (default: 1000)
  -d TEXT       a text file to train on (default: ../shared/data/tinyshakespeare/input.txt where it
                exists, else the text the dslua binary carries)
  -q            quick: 100 steps, a smoke test, not a measurement
EOF2
}

me=bench/fp8.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
steps=1000
text=
while getopts "b:s:d:qh" opt; do
    case $opt in
    s) steps=$OPTARG ;;
    d) text=$(realpath "$OPTARG") ;;
    *) bench_opt "$opt" ;;
    esac
done
[[ -n $quick ]] && steps=100
if ! [[ $steps =~ ^[1-9][0-9]*$ ]] || ((steps < 60)); then
    echo "$me: -s wants a whole number >= 60 (got '$steps')" >&2
    exit 2
fi
shakespeare=$root/../shared/data/tinyshakespeare/input.txt
[[ -z $text && -f $shakespeare ]] && text=$(realpath "$shakespeare")

bench_build
out=$(mktemp)
trap 'rm -f "$out"' EXIT
bench_title "fp8 bench"
echo "$steps steps each; text: ${text:-the text the dslua binary carries}; $(bench_cpu), $cores cores"
(cd "$root" && "$build/dslua" bench/fp8.lua "$out" "steps=$steps" ${text:+"text=$text"} 2>&1) |
    grep -v '^attach:\|^ZeRO stage'
