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
build=$root/build
parent=${TMPDIR:-/tmp}
shards=20
tokens=100000000
steps=300
quick=
while getopts "b:d:n:t:s:qh" opt; do
    case $opt in
    b) build=$(realpath -m "$OPTARG") ;;
    d) parent=$OPTARG ;;
    n) shards=$OPTARG ;;
    t) tokens=$OPTARG ;;
    s) steps=$OPTARG ;;
    q) quick=quick shards=2 tokens=1000000 steps=20 ;;
    h) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
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
export DSLUA_NUM_THREADS=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

commit=$(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown)
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
echo "dslua shards bench  $(date -u '+%Y-%m-%d %H:%M UTC')  commit $commit${quick:+  (quick)}"
echo "cpu: $cpu, $cores cores; 2 ranks of 1 thread, each with 2 loader threads"
t0=$(date +%s.%N)
"$build/dslua" "$root/bench/shards.lua" write "$dir" "$shards" "$tokens"
printf 'wrote %d shards of %d tokens in %.1f s\n' "$shards" "$tokens" "$(echo "$(date +%s.%N) - $t0" | bc)"
(cd "$root" && mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader \
    -x DSLUA_NUM_THREADS -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS \
    -np 2 "$build/dslua" bench/shards.lua train "$dir" "$steps" $quick)
