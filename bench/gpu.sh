#!/usr/bin/env bash
# dslua against PyTorch on the same GPU in one run: GPT-2 124M training
# tokens/s (T=1024, AdamW, clip 1.0) at B=8 and B=16 in bf16 and fp32 (vocab
# padded to 50304, and bf16 B=8 also at 50257), fp32 at B=8 also with both
# sides' allow_tf32 on ("tf32"), bf16 at B=16 also in fp8 (the fp8 block,
# dslua's alone), GPT-2 XL (1.5B, T=1024) and TinyLlama's
# 1.1B shape (T=2048) in bf16, peak memory, MFU against the bf16 GEMM rate
# measured here, where a step's time goes, and the per-op table.
# Needs a CUDA build of dslua and python3 with torch on a GPU machine
# (../shared/device/README.md says how to carry the build to one); without
# a GPU it stops at once with an error.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bench/gpu.sh [-b BUILD_DIR] [-o RESULTS] [-c] [-q]
  -b BUILD_DIR  dslua's build (default: build; built first unless it holds only a carried binary)
  -o RESULTS    also keep the raw result lines in this file
  -c            also time torch.compile on the bf16 rows at B=16, GPT-2 XL and Llama (minutes of compiling)
  -q            quick: few steps and short samples (a smoke test, not a measurement)
EOF
}

me=bench/gpu.sh
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
results=
compiled=
while getopts "b:o:cqh" opt; do
    case $opt in
    o) results=$OPTARG ;;
    c) compiled=1 ;;
    *) bench_opt "$opt" ;;
    esac
done
# no GPU: stop before building anything
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "$me: no GPU on this machine (nvidia-smi lists none); run it on a GPU machine" >&2
    exit 1
fi
bench_build
if ! "$build/dslua" "$root/bench/gpu.lua" probe >/dev/null; then
    echo "$me: $build/dslua sees no GPU (built without CUDA?); build it with DSLUA_CUDA=ON" >&2
    exit 1
fi
py=python3
if ! $py -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    echo "$me: python3 has no torch with CUDA here; the torch columns show n/a" >&2
    py=
fi
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
cd "$root"

# A row that fails (out of memory, say) is named at the end and the exit
# status is 1; the rows before and after it still run.
failed=()
run() {
    local rc=0
    "$@" | tee -a "$raw" | grep -v '^result\|^flops' || rc=${PIPESTATUS[0]}
    ((rc == 0)) || failed+=("$* (exit $rc)")
}
run "$build/dslua" bench/gpu.lua ops $quick
[[ -n $py ]] && run $py bench/gpu_torch.py ops $quick
# GPT-2's vocab padded to 50304 (nanoGPT, llm.c) on both sides; bf16 at B=8
# also with the 50257 of the checkpoints; B=16 in fp8 beside bf16 (PyTorch
# has no fp8 training of its own: no torch column). GPT-2 XL and Llama 1.1B
# in bf16.
for row in "8 bf16 50304" "8 bf16 50257" "16 bf16 50304" "16 fp8 50304" "8 f32 50304" "16 f32 50304" "8 tf32 50304" \
    "4 bf16 50304 gpt2_xl" "4 bf16 32000 llama_1B"; do
    run "$build/dslua" bench/gpu.lua train $row $quick
    [[ -n $py && $row != *fp8* ]] && run $py bench/gpu_torch.py train $row $quick
done
if [[ -n $py && -n $compiled ]]; then
    for row in "16 bf16 50304" "4 bf16 50304 gpt2_xl" "4 bf16 32000 llama_1B"; do
        run $py bench/gpu_torch.py train $row compile $quick
    done
fi
[[ -n $results ]] && cp "$raw" "$results"

# The table: one row per (row, shape); ratio > 1 means dslua is faster.
# MFU: nanoGPT's 6N + 12 L H Q T FLOPs per token (each model's, from
# bench/gpu.lua) over torch's bf16 GEMM rate (dslua's without torch).
awk -F'\t' '
$1 == "info" { dev[$2] = $4 }
$1 == "flops" { fpt[$2] = $3 }
$1 == "result" {
    key = $3 "\t" $4
    if (!(key in unit)) order[++n] = key
    val[$2, key] = $5; unit[key] = $6
}
END {
    printf "GPU: %s\n", dev["torch"] != "" ? dev["torch"] : dev["dslua"]
    gemm = val["torch", "matmul\t8192^3_bf16"]
    if (gemm == "") gemm = val["dslua", "matmul\t8192^3_bf16"]
    copy = val["torch", "copy\t1GiB"]
    if (copy == "") copy = val["dslua", "copy\t1GiB"]
    printf "%-24s %-22s %12s %12s %14s %8s\n", "row", "shape", "dslua", "torch", "torch.compile", "ratio"
    for (i = 1; i <= n; i++) {
        key = order[i]; split(key, k, "\t"); u = unit[key]
        d = val["dslua", key]; t = val["torch", key]; c = val["torch_compile", key]
        ratio = "n/a"
        if (d != "" && t != "" && d > 0 && t > 0)
            ratio = sprintf("%.2fx", (u == "s" || u == "GiB") ? t / d : d / t)
        printf "%-24s %-22s %12s %12s %14s %8s  %s\n", k[1], k[2], d == "" ? "-" : d, t == "" ? "-" : t,
               c == "" ? "" : c, ratio, u
        # an fp8 row against the dslua bf16 row of its shape
        if (k[2] ~ /_fp8_/) {
            shape16 = k[2]; sub(/_fp8_/, "_bf16_", shape16)
            b16 = val["dslua", k[1] "\t" shape16]
            if (d != "" && b16 != "" && b16 > 0)
                printf "%-24s %-22s against dslua bf16: %.2fx\n", "", "", (u == "s" || u == "GiB") ? b16 / d : d / b16
        }
        if (u == "TB/s" && k[1] != "copy" && copy > 0) {
            of = ""
            if (d != "") of = of sprintf(" dslua %.0f%%", 100 * d / copy)
            if (t != "") of = of sprintf(" torch %.0f%%", 100 * t / copy)
            printf "%-24s %-22s of the copy rate (%.2f TB/s):%s\n", "", "", copy, of
        }
        if ((k[1] in fpt) && gemm > 0) {
            flops = fpt[k[1]]
            mfu = ""
            if (d != "") mfu = mfu sprintf(" dslua %.1f%%", 100 * d * flops / (gemm * 1e12))
            if (t != "") mfu = mfu sprintf(" torch %.1f%%", 100 * t * flops / (gemm * 1e12))
            if (c != "") mfu = mfu sprintf(" torch.compile %.1f%%", 100 * c * flops / (gemm * 1e12))
            printf "%-24s %-22s MFU vs %.0f TFLOP/s:%s\n", "", "", gemm, mfu
        }
    }
}' "$raw"
if ((${#failed[@]})); then
    printf '%s: failed: %s\n' "$me" "${failed[@]}" >&2
    exit 1
fi
