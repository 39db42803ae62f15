#!/usr/bin/env bash
# Training throughput, dslua against PyTorch on the same threads and
# batches: GPT-2 124M (B=4, T=128, AdamW) and the MNIST MLP (B=128, SGD).
# Builds dslua if needed, runs bench/train.lua and bench/train_torch.py one
# after the other and prints a table with ratio = dslua / torch throughput
# (> 1: dslua faster).
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bench/train.sh [-t THREADS] [-r ROUNDS] [-b BUILD_DIR] [-m gpt2|mlp|all] [-o RESULTS] [-p] [-q]
  -t THREADS    threads for dslua, OpenBLAS and PyTorch (default: nproc)
  -r ROUNDS     run the programs in turn this many times, keep each row's best (default: 1)
  -b BUILD_DIR  a Release build of dslua, configured here if absent (default: build)
  -m MODEL      gpt2, mlp or all (default: all)
  -o RESULTS    also keep the raw result lines in this file
  -p            also run PyTorch with OMP_WAIT_POLICY=PASSIVE (column "torch-p"): its
                OpenMP threads then stop spinning against OpenBLAS's own threads
  -q            quick: fewer steps (a smoke test, not a measurement)
EOF
}

me=bench/train.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
threads=$cores
rounds=1
model=all
results=
passive=
while getopts "t:r:b:m:o:pqh" opt; do
    case $opt in
    t) threads=$OPTARG ;;
    r) rounds=$OPTARG ;;
    m) model=$OPTARG ;;
    o) results=$OPTARG ;;
    p) passive=1 ;;
    *) bench_opt "$opt" ;;
    esac
done
case $model in gpt2 | mlp | all) ;; *) echo "$me: -m wants gpt2, mlp or all" >&2; exit 2 ;; esac
bench_threads
bench_build
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
bench_torch "the ratio column shows n/a"

# One program at a time, so none of them shares the cores with another.
load_before=$(bench_load)
for ((round = 1; round <= rounds; round++)); do
    echo "$me: round $round of $rounds" >&2
    (cd "$root" && "$build/dslua" bench/train.lua "$model" $quick) >>"$raw"
    if [[ -n $torch ]]; then
        /usr/bin/python3 "$root/bench/train_torch.py" "$threads" "$model" $quick >>"$raw"
        if [[ -n $passive ]]; then
            OMP_WAIT_POLICY=PASSIVE /usr/bin/python3 "$root/bench/train_torch.py" "$threads" "$model" $quick \
                | sed 's/^\(result\|info\)\ttorch\t/\1\ttorch-p\t/' >>"$raw"
        fi
    fi
done
if [[ -n $results ]]; then cp "$raw" "$results"; fi

bench_title "training bench"
echo "cpu: $(bench_cpu), $cores cores; load average before $load_before, after $(bench_load)"
echo "best of $rounds round(s); ratio = dslua / torch throughput (> 1: dslua faster), aim 1.3"
awk -F'\t' -v passive="$passive" '
    $1 == "info" { thr[$2] = $4 }
    $1 == "result" {
        key = $3 "\t" $4
        if (!(key in unit)) order[n++] = key
        unit[key] = $6
        if ($5 + 0 > best[$2, key] + 0) best[$2, key] = $5
    }
    function num(v) { return v ? sprintf("%.1f", v) : "n/a" }
    function ratio(a, b) { return a > 0 && b > 0 ? sprintf("%.2f", a / b) : "n/a" }
    END {
        printf "threads: dslua %s, torch %s\n", (thr["dslua"] ? thr["dslua"] : "?"), (thr["torch"] ? thr["torch"] : "?")
        printf "%-15s %-9s %-10s %10s %10s %6s", "model", "shape", "unit", "dslua", "torch", "ratio"
        if (passive) printf " %10s %6s", "torch-p", "ratio-p"
        printf "  %s\n", "verdict"
        for (i = 0; i < n; i++) {
            key = order[i]; split(key, p, "\t")
            d = best["dslua", key]; t = best["torch", key]; r = ratio(d, t)
            verdict = r == "n/a" ? "n/a" : (d / t >= 1.3 ? "ok (aim 1.3)" : "BELOW aim (1.3)")
            printf "%-15s %-9s %-10s %10s %10s %6s", p[1], p[2], unit[key], num(d), num(t), r
            if (passive) printf " %10s %6s", num(best["torch-p", key]), ratio(d, best["torch-p", key])
            printf "  %s\n", verdict
        }
    }' "$raw"
