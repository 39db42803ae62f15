#!/usr/bin/env bash
# Checkpoint benchmark: save and load time of GPT-2 124M with its AdamW
# state, in MB/s against the disk's own write rate measured in the same
# run and folder (dd with conv=fsync, as a save fsyncs every file).
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bench/ckpt.sh [-b BUILD_DIR] [-n RANKS] [-d fp32|bf16] [-o DIR] [-q]
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -n RANKS      ranks, each writing its own shard (default: 1)
  -d DTYPE      fp32 or bf16 (default: fp32; the files hold fp32 masters either way)
  -o DIR        where the checkpoint goes, removed after (default: BUILD_DIR/ckpt-bench)
  -q            quick: a tiny model, a smoke test, not a measurement
EOF
}

me=bench/ckpt.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
ranks=1
dtype=fp32
out=
while getopts "b:n:d:o:qh" opt; do
    case $opt in
    n) ranks=$OPTARG ;;
    d) dtype=$OPTARG ;;
    o) out=$(realpath -m "$OPTARG") ;;
    *) bench_opt "$opt" ;;
    esac
done
if ! [[ $ranks =~ ^[1-9][0-9]*$ ]]; then echo "$me: -n wants a whole number >= 1" >&2; exit 2; fi
case $dtype in fp32 | bf16) ;; *) echo "$me: -d wants fp32 or bf16" >&2; exit 2 ;; esac
out=${out:-$build/ckpt-bench}

bench_build
bench_rank_threads
export DSLUA_COMM_CHECK=0
rm -rf "$out"
mkdir -p "$out"
trap 'rm -rf "$out"' EXIT

bench_title "checkpoint bench"
echo "cpu: $(bench_cpu), $cores cores; $ranks rank(s) of $threads thread(s); folder $out ($(df -hT "$out" | awk 'NR==2 {print $2}'))"

# the disk's rate: dd writing as much as the checkpoint holds (1424 MiB,
# 32 quick), so neither fits in a cache the other does not, fsync at the end
count=$([[ -n $quick ]] && echo 32 || echo 1424)
dd_line=$(dd if=/dev/zero of="$out/dd.bin" bs=1M count="$count" conv=fsync 2>&1 | tail -1)
rm -f "$out/dd.bin"
dd_mbs=$(awk -v c="$count" '{for (i = 1; i <= NF; i++) if ($i == "s,") s = $(i - 1)} END {printf "%.1f", c * 1.048576 / s}' <<<"$dd_line")
echo "dd conv=fsync: $dd_line"

if ((ranks == 1)); then
    (cd "$root" && "$build/dslua" bench/ckpt.lua "$out" "$dtype" $quick)
else
    (cd "$root" && bench_mpirun "$ranks" "$build/dslua" bench/ckpt.lua "$out" "$dtype" $quick)
fi | grep -v '^ZeRO stage\|^\[Rank 0\]'
read -r mb save_s load_s load_nv_s <"$out/result.txt"
awk -v mb="$mb" -v s="$save_s" -v l="$load_s" -v n="$load_nv_s" -v dd="$dd_mbs" 'BEGIN {
    printf "files: %.1f MB (fp32 weights, exp_avg, exp_avg_sq)\n", mb
    printf "%-34s %8s %9s %10s\n", "", "seconds", "MB/s", "vs dd"
    printf "%-34s %8s %9.1f %9.2fx\n", "dd write + fsync (the disk)", "", dd, 1
    printf "%-34s %8.2f %9.1f %9.2fx\n", "save_checkpoint (write, fsync, hash)", s, mb / s, mb / s / dd
    printf "%-34s %8.2f %9.1f %9.2fx\n", "load_checkpoint (SHA-256 checked)", l, mb / l, mb / l / dd
    printf "%-34s %8.2f %9.1f %9.2fx\n", "load_checkpoint (verify = false)", n, mb / n, mb / n / dd
    print "(loads read what the save just wrote: from the page cache, not the disk)"
}'
