#!/usr/bin/env bash
# Resuming mid-epoch on another world size at corpus scale: writes llm.c
# shards (bench/shards.lua's tokens; default 2 x 80M tokens, 20M windows
# of 8), trains a tiny GPT-2 on 2 CPU ranks for a few steps and saves, then
# loads that on 3 ranks: prints each rank's sampler state in the checkpoint
# and the anonymous memory load_checkpoint added. The corpus and the
# checkpoint are deleted on exit, whatever happens.
set -euo pipefail

usage() {
    cat <<'EOF2'
usage: bench/resume.sh [-b BUILD_DIR] [-d DIR] [-n SHARDS] [-t TOKENS] [-p uneven|deepspeed] [-q]
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -d DIR        where the corpus and checkpoint go (a new folder inside it; default: $TMPDIR or /tmp)
  -n SHARDS     shards (default: 2)
  -t TOKENS     tokens per shard (default: 80000000)
  -p POLICY     uneven (the sampler block's policy) or deepspeed (DeepSpeed's loader; default: uneven)
  -q            quick: 2 shards of 1M tokens (a smoke test, not a measurement)
EOF2
}

me=bench/resume.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
parent=${TMPDIR:-/tmp}
shards=2
tokens=80000000
policy=uneven
while getopts "b:d:n:t:p:qh" opt; do
    case $opt in
    d) parent=$OPTARG ;;
    n) shards=$OPTARG ;;
    t) tokens=$OPTARG ;;
    p) policy=$OPTARG ;;
    q) quick=quick shards=2 tokens=1000000 ;;
    *) bench_opt "$opt" ;;
    esac
done
for v in "$shards" "$tokens"; do
    if ! [[ $v =~ ^[1-9][0-9]*$ ]]; then
        echo "$me: -n and -t want whole numbers >= 1 (got '$shards', '$tokens')" >&2
        exit 2
    fi
done
case $policy in uneven | deepspeed) ;; *) echo "$me: -p wants uneven or deepspeed, got '$policy'" >&2; exit 2 ;; esac

bench_build
dir=$(mktemp -d "$parent/dslua-resume.XXXXXX")
trap 'rm -rf "$dir"' EXIT
bench_export_threads 1

bench_title "resume bench"
echo "cpu: $(bench_cpu), $cores cores; ranks of 1 thread"
"$build/dslua" "$root/bench/shards.lua" write "$dir" "$shards" "$tokens"
cd "$root"
bench_mpirun 2 "$build/dslua" bench/resume.lua save "$dir" "$dir/ckpt" 3 "$policy" | grep -v '^dslua: rank'
bench_mpirun 3 "$build/dslua" bench/resume.lua load "$dir" "$dir/ckpt" "$policy" | grep -v '^dslua: rank'
