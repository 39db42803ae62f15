#!/usr/bin/env bash
# Token shards larger than memory: writes a corpus of llm.c uint16 shards
# (default 20 x 100M tokens: 2 billion, 4 GB), trains a tiny GPT-2 on it on
# 2 CPU ranks, and prints each rank's resident memory (peak and anonymous)
# and the tokens/s. The corpus is deleted on exit, whatever happens.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bench/shards.sh [-b BUILD_DIR] [-d DIR] [-n SHARDS] [-t TOKENS] [-s STEPS] [-q]
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -d DIR        where the corpus is written (a new folder inside it; default: $TMPDIR or /tmp)
  -n SHARDS     shards (default: 20)
  -t TOKENS     tokens per shard (default: 100000000)
  -s STEPS      timed steps (default: 300)
  -q            quick: 2 shards of 1M tokens, 20 steps (a smoke test, not a measurement)
EOF
}

me=bench/shards.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
parent=${TMPDIR:-/tmp}
shards=20
tokens=100000000
steps=300
while getopts "b:d:n:t:s:qh" opt; do
    case $opt in
    d) parent=$OPTARG ;;
    n) shards=$OPTARG ;;
    t) tokens=$OPTARG ;;
    s) steps=$OPTARG ;;
    q) quick=quick shards=2 tokens=1000000 steps=20 ;;
    *) bench_opt "$opt" ;;
    esac
done
for v in "$shards" "$tokens" "$steps"; do
    if ! [[ $v =~ ^[1-9][0-9]*$ ]]; then
        echo "$me: -n, -t and -s want whole numbers >= 1 (got '$shards', '$tokens', '$steps')" >&2
        exit 2
    fi
done
# the header's token count is an int32
if ((tokens > 2147483647)); then
    echo "$me: -t $tokens: a shard holds at most 2147483647 tokens" >&2
    exit 2
fi
need=$((shards * (2 * tokens + 1024) / 1024 + 1024))
avail=$(df -Pk "$parent" | awk 'NR == 2 { print $4 }')
if ((avail < need)); then
    echo "$me: $parent has $((avail / 1024)) MB free, the corpus needs $((need / 1024)) MB; point -d elsewhere" >&2
    exit 1
fi

bench_build
dir=$(mktemp -d "$parent/dslua-shards.XXXXXX")
trap 'rm -rf "$dir"' EXIT
bench_export_threads 1

bench_title "shards bench"
echo "cpu: $(bench_cpu), $cores cores; 2 ranks of 1 thread, each with 2 loader threads"
t0=$(date +%s.%N)
"$build/dslua" "$root/bench/shards.lua" write "$dir" "$shards" "$tokens"
printf 'wrote %d shards of %d tokens in %.1f s\n' "$shards" "$tokens" "$(echo "$(date +%s.%N) - $t0" | bc)"
(cd "$root" && bench_mpirun 2 "$build/dslua" bench/shards.lua train "$dir" "$steps" $quick)
