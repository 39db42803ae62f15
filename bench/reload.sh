#!/usr/bin/env bash
# Live reload's cost when nothing changes: the step boundary's check (rank
# 0 stats the watched files, one exchange between the ranks, the attach
# queue looked at) against the quickstart's step, on 1 rank (every core)
# and on 2 ranks (one thread each). bench/reload.lua does the measuring.
set -euo pipefail

usage() {
    cat <<'EOF2'
usage: bench/reload.sh [-b BUILD_DIR] [-s STEPS] [-c CALLS]
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -s STEPS      quickstart steps timed (default: 10)
  -c CALLS      boundary checks timed (default: 2000)
EOF2
}

me=bench/reload.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
steps=10
calls=2000
while getopts "b:s:c:h" opt; do
    case $opt in
    s) steps=$OPTARG ;;
    c) calls=$OPTARG ;;
    *) bench_opt "$opt" ;;
    esac
done
bench_build
cd "$root"
attach_dir=$(mktemp -d)
trap 'rm -rf "$attach_dir"' EXIT
export DSLUA_ATTACH_DIR=$attach_dir

echo "load average before: $(bench_load)"
printf '%-6s %-8s %-18s %-24s %s\n' ranks watched 'quickstart step' 'boundary, no change' share
row() {
    local line
    line=$("$@" | grep '^ranks=')
    eval "$(echo "$line" | tr ' ' '\n' | sed 's/^/local_/')"
    # shellcheck disable=SC2154  # set by the eval
    printf '%-6s %-8s %-18s %-24s %s\n' "$local_ranks" "$local_watched" "$local_step_ms ms" \
        "$local_boundary_us us" "$local_share_pct %"
    if [[ $local_swaps != 0 ]]; then echo "$me: $local_swaps swaps while nothing changed" >&2; exit 1; fi
}
row "$build/dslua" bench/reload.lua --steps "$steps" --calls "$calls"
row env DSLUA_NUM_THREADS=1 "$build/dslua" -n 2 bench/reload.lua --steps "$steps" --calls "$calls"
echo "load average after: $(bench_load)"
