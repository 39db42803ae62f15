#!/usr/bin/env bash
# Training throughput, dslua against PyTorch on the same threads and
# batches: GPT-2 124M (B=4, T=128, AdamW) and the MNIST MLP (B=128, SGD).
# Builds dslua if needed, runs bench/train.lua and bench/train_torch.py one
# after the other and prints a table with ratio = dslua / torch throughput
# (> 1: dslua faster).
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bench/train.sh [-t THREADS] [-r ROUNDS] [-b BUILD_DIR] [-m gpt2|mlp|all] [-o RESULTS] [-q]
  -t THREADS    threads for dslua, OpenBLAS and PyTorch (default: nproc)
  -r ROUNDS     run both programs this many times, keep each row's best (default: 1)
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -m MODEL      gpt2, mlp or all (default: all)
  -o RESULTS    also keep the raw result lines in this file
  -q            quick: fewer steps (a smoke test, not a measurement)
EOF
}

me=bench/train.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
threads=$cores
build=$root/build
rounds=1
model=all
results=
quick=
while getopts "t:r:b:m:o:qh" opt; do
    case $opt in
    t) threads=$OPTARG ;;
    r) rounds=$OPTARG ;;
    b) build=$(realpath -m "$OPTARG") ;;
    m) model=$OPTARG ;;
    o) results=$OPTARG ;;
    q) quick=quick ;;
    h) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
    esac
done
bench_threads
case $model in gpt2 | mlp | all) ;; *) echo "bench/train.sh: -m wants gpt2, mlp or all" >&2; exit 2 ;; esac
bench_build
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
torch=1
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
    echo "bench/train.sh: no PyTorch in /usr/bin/python3; the ratio column shows n/a" >&2
    torch=
fi

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for ((round = 1; round <= rounds; round++)); do
    echo "bench/train.sh: round $round of $rounds" >&2
    (cd "$root" && "$build/dslua" bench/train.lua "$model" $quick) >>"$raw"
    [[ -n $torch ]] && /usr/bin/python3 "$root/bench/train_torch.py" "$threads" "$model" $quick >>"$raw"
done
[[ -n $results ]] && cp "$raw" "$results"

commit=$(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown)
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
echo "dslua training bench  $(date -u '+%Y-%m-%d %H:%M UTC')  commit $commit${quick:+  (quick)}"
echo "cpu: $cpu, $cores cores; load average before $load_before, after $(cut -d' ' -f1-3 /proc/loadavg)"
echo "best of $rounds round(s); ratio = dslua / torch throughput (> 1: dslua faster), aim 1.3"
awk -F'\t' '
    $1 == "info" { thr[$2] = $4 }
    $1 == "result" {
        key = $3 "\t" $4
        if (!(key in unit)) order[n++] = key
        unit[key] = $6
        if ($5 + 0 > best[$2, key] + 0) best[$2, key] = $5
    }
    END {
        printf "threads: dslua %s, torch %s\n", (thr["dslua"] ? thr["dslua"] : "?"), (thr["torch"] ? thr["torch"] : "?")
        printf "%-16s %-10s %12s %12s %-10s %7s  %s\n", "model", "shape", "dslua", "torch", "unit", "ratio", "verdict"
        for (i = 0; i < n; i++) {
            key = order[i]; split(key, p, "\t")
            d = best["dslua", key]; t = best["torch", key]
            ratio = (d > 0 && t > 0) ? sprintf("%.2f", d / t) : "n/a"
            verdict = ratio == "n/a" ? "n/a" : (d / t >= 1.3 ? "ok (aim 1.3)" : "BELOW aim (1.3)")
            printf "%-16s %-10s %12s %12s %-10s %7s  %s\n", p[1], p[2], (d ? d : "n/a"), (t ? t : "n/a"), unit[key], ratio, verdict
        }
    }' "$raw"
