# The table of bench/gpu.sh (and scripts/device_check.sh) from the lines
# bench/gpu.lua and bench/gpu_torch.py print, fields split on tabs
# (awk -F'\t' -f bench/gpu_table.awk RAW): one row per (row, shape), ratio
# > 1 where dslua is faster. MFU: nanoGPT's 6N + 12 L H Q T FLOPs per
# token (each model's, from bench/gpu.lua) over torch's bf16 GEMM rate
# (dslua's without torch; no MFU without the ops rows).

# A variant of a dslua row against dslua's base row of the same shape with
# `from` replaced by `to`: fp8 against bf16, the real vocab against the
# padded one, offload against none, f32 attention's math backend against
# its fused kernel.
function against(row, shape, d, u, from, to, label,    base, b) {
    if (index(shape, from) == 0) return
    base = shape; sub(from, to, base)
    b = val["dslua", row "\t" base]
    if (d != "" && b != "" && b > 0)
        printf "%-24s %-28s against %s: %.2fx\n", "", "", label, lower_better(u) ? b / d : d / b
}

# units where less is better: the ratio is the other way round
function lower_better(u) { return u == "s" || u == "GiB" || u == "kernels per step" }

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
    printf "%-24s %-28s %12s %12s %14s %8s\n", "row", "shape", "dslua", "torch", "torch.compile", "ratio"
    for (i = 1; i <= n; i++) {
        key = order[i]; split(key, k, "\t"); u = unit[key]
        d = val["dslua", key]; t = val["torch", key]; c = val["torch_compile", key]
        ratio = "n/a"
        if (d != "" && t != "" && d > 0 && t > 0)
            ratio = sprintf("%.2fx", lower_better(u) ? t / d : d / t)
        printf "%-24s %-28s %12s %12s %14s %8s  %s\n", k[1], k[2], d == "" ? "-" : d, t == "" ? "-" : t,
               c == "" ? "" : c, ratio, u
        against(k[1], k[2], d, u, "_fp8_", "_bf16_", "dslua bf16")
        against(k[1], k[2], d, u, "_V50257", "_V50304", "dslua at the padded vocab 50304")
        against(k[1], k[2], d, u, "_offload", "", "dslua without offload")
        against(k[1], k[2], d, u, "_f32_math", "_f32", "dslua fused (3xTF32)")
        if (u == "TB/s" && k[1] != "copy" && copy > 0) {
            of = ""
            if (d != "") of = of sprintf(" dslua %.0f%%", 100 * d / copy)
            if (t != "") of = of sprintf(" torch %.0f%%", 100 * t / copy)
            printf "%-24s %-28s of the copy rate (%.2f TB/s):%s\n", "", "", copy, of
        }
        if ((k[1] in fpt) && gemm > 0) {
            flops = fpt[k[1]]
            mfu = ""
            if (d != "") mfu = mfu sprintf(" dslua %.1f%%", 100 * d * flops / (gemm * 1e12))
            if (t != "") mfu = mfu sprintf(" torch %.1f%%", 100 * t * flops / (gemm * 1e12))
            if (c != "") mfu = mfu sprintf(" torch.compile %.1f%%", 100 * c * flops / (gemm * 1e12))
            printf "%-24s %-28s MFU vs %.0f TFLOP/s:%s\n", "", "", gemm, mfu
        }
    }
}
