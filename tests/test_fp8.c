/* FP8 without Lua: kernels/ds_fp8.h's conversions against the formats'
 * definitions (every code decoded and encoded back; a sweep of f32 values
 * and every halfway point against the nearest code, ties to the even one,
 * saturating), the CPU cast with current scaling against the scalar
 * conversion, the fp8 GEMM's fallback on values whose products and sums
 * are exact, and its argument errors. */
#include "ds_ops.h"
#include "ds_error.h"
#include "ds_fp8.h"

#include <math.h>
#include <string.h>

#include "check.h"

typedef struct { int m, bias; double max; const char *name; } format;
static const format FORMATS[DS_NFP8] = { { 3, 7, 448, "e4m3" }, { 2, 15, 57344, "e5m2" } };

/* A code's value from the format's definition; NaN for NaN codes. */
static double decode_ref(int c, ds_fp8_format f) {
    const format *d = &FORMATS[f];
    int e_bits = 7 - d->m, top = (1 << e_bits) - 1;
    int e = (c & 0x7f) >> d->m, m = c & ((1 << d->m) - 1);
    double s = c & 0x80 ? -1 : 1;
    if (f == DS_FP8_E4M3 && e == top && m == (1 << d->m) - 1) return NAN;
    if (f == DS_FP8_E5M2 && e == top) return m ? NAN : s * INFINITY;
    if (e == 0) return s * ldexp(m, 1 - d->bias - d->m);
    return s * ldexp(1 + m / (double)(1 << d->m), e - d->bias);
}

/* The non-negative finite codes' values ascending: code c holds values[c]. */
static int finite_count(ds_fp8_format f) { return f == DS_FP8_E4M3 ? 0x7f : 0x7c; }

/* The nearest non-negative finite code to a >= 0, ties to the even code,
 * saturating at the largest. */
static int nearest(double a, ds_fp8_format f) {
    int n = finite_count(f);
    if (a >= decode_ref(n - 1, f)) return n - 1;
    int lo = 0;
    while (lo + 1 < n && decode_ref(lo + 1, f) <= a) lo++;
    if (lo + 1 == n) return lo;
    double dl = a - decode_ref(lo, f), dh = decode_ref(lo + 1, f) - a;
    if (dl < dh) return lo;
    if (dh < dl) return lo + 1;
    return lo % 2 == 0 ? lo : lo + 1;
}

static int encode_ref(float x, ds_fp8_format f) {
    if (isnan(x)) return 0x7f;
    return (signbit(x) ? 0x80 : 0) | nearest(fabs((double)x), f);
}

static void test_codes(ds_fp8_format f) {
    const char *name = FORMATS[f].name;
    for (int c = 0; c < 256; c++) {
        double want = decode_ref(c, f);
        float v = ds_fp8_to_f32((uint8_t)c, f);
        if (isnan(want)) {
            check(isnan(v), "%s 0x%02x: %g, expected NaN", name, c, v);
            check(ds_f32_to_fp8(v, f) == 0x7f, "%s NaN 0x%02x encodes to 0x%02x", name, c, ds_f32_to_fp8(v, f));
            continue;
        }
        check((double)v == want, "%s 0x%02x: %.9g, expected %.9g", name, c, v, want);
        int back = isinf(want) ? (c & 0x80) | (finite_count(f) - 1) : c;
        check(ds_f32_to_fp8(v, f) == back, "%s 0x%02x: encodes back to 0x%02x", name, c, ds_f32_to_fp8(v, f));
    }
}

/* Halfway points between neighbours (exact in f32) and one f32 step either
 * side, then every 4099th f32 bit pattern of either sign. */
static void test_rounding(ds_fp8_format f) {
    const char *name = FORMATS[f].name;
    int n = finite_count(f), bad = 0;
    for (int c = 0; c + 1 < n; c++) {
        float mid = (float)((decode_ref(c, f) + decode_ref(c + 1, f)) / 2);
        float pts[3] = { mid, nextafterf(mid, 0), nextafterf(mid, INFINITY) };
        for (int k = 0; k < 3; k++)
            for (int s = 0; s < 2; s++) {
                float x = s ? -pts[k] : pts[k];
                if (ds_f32_to_fp8(x, f) != encode_ref(x, f) && bad++ < 10)
                    check(0, "%s %.9g: 0x%02x, expected 0x%02x", name, x, ds_f32_to_fp8(x, f), encode_ref(x, f));
            }
        check(ds_f32_to_fp8(mid, f) == (c % 2 == 0 ? c : c + 1), "%s tie %.9g goes to the even code", name, mid);
    }
    for (uint64_t u = 0; u <= 0xffffffffu; u += 4099) {
        float x = ds_bits_f32((uint32_t)u);
        if (isnan(x)) continue;
        if (ds_f32_to_fp8(x, f) != encode_ref(x, f) && bad++ < 10)
            check(0, "%s %.9g: 0x%02x, expected 0x%02x", name, x, ds_f32_to_fp8(x, f), encode_ref(x, f));
    }
    check(bad == 0, "%s: %d values rounded wrong", name, bad);
    check(ds_f32_to_fp8(INFINITY, f) == n - 1 && ds_f32_to_fp8(-INFINITY, f) == (0x80 | (n - 1)),
          "%s: infinities saturate", name);
    check(ds_f32_to_fp8(NAN, f) == 0x7f, "%s: NaN is 0x7f", name);
}

static ds_tensor *filled(int64_t rows, int64_t cols, double (*at)(int64_t, int64_t)) {
    int64_t shape[2] = { rows, cols };
    ds_tensor *t = ds_tensor_new(2, shape, DS_F32, DS_CPU_DEVICE);
    for (int64_t i = 0; i < rows * cols; i++) ds_tensor_set(t, i, at(i / cols, i % cols));
    return t;
}

static ds_tensor *meta_new(void) {
    int64_t three = 3;
    ds_tensor *m = ds_tensor_new(1, &three, DS_F32, DS_CPU_DEVICE);
    ds_tensor_set(m, 0, 1), ds_tensor_set(m, 1, 1), ds_tensor_set(m, 2, 0);
    return m;
}

static double wave(int64_t i, int64_t j) { return sin((double)(3 * i + 7 * j)) * 37.0; }

static void test_cast(void) {
    ds_tensor *x = filled(40, 33, wave), *meta = meta_new();
    for (int f = 0; f < DS_NFP8; f++) {
        ds_tensor_set(meta, 2, 0);
        ds_tensor *q = ds_fp8_cast(x, meta, f, 1, 2, NULL);
        float amax = 0;
        for (int64_t i = 0; i < 40 * 33; i++) amax = fmaxf(amax, fabsf((float)ds_tensor_get(x, i)));
        float s = (float)ds_tensor_get(meta, 0);
        check(ds_tensor_get(meta, 2) == amax, "%s cast: amax %g, expected %g", FORMATS[f].name,
              ds_tensor_get(meta, 2), amax);
        check(s == ds_fp8_scale(amax, f, 2, 1.0f) && s == (float)(FORMATS[f].max / amax) / 4,
              "%s cast: scale %g for amax %g and margin 2", FORMATS[f].name, s, amax);
        check((float)ds_tensor_get(meta, 1) == 1.0f / s, "%s cast: scale_inv", FORMATS[f].name);
        int bad = 0;
        for (int64_t i = 0; i < 40 * 33; i++)
            bad += ds_tensor_get(q, i) != encode_ref((float)ds_tensor_get(x, i) * s, f);
        check(bad == 0, "%s cast: %d codes differ from the scalar conversion", FORMATS[f].name, bad);
        ds_tensor_release(q);
    }
    ds_tensor_release(x);
    ds_tensor_release(meta);
}

static double small_a(int64_t i, int64_t k) { return (double)((i + 2 * k) % 7) - 3; }
static double small_b(int64_t j, int64_t k) { return (double)((3 * j + k) % 5) - 2; }

/* Integers below 8 are exact in both formats and their sums in f32: the
 * fallback's result is the exact product, times both scale_invs. */
static void test_gemm(void) {
    ds_tensor *a = filled(5, 24, small_a), *b = filled(6, 24, small_b), *ma = meta_new(), *mb = meta_new();
    ds_tensor *qa = ds_fp8_cast(a, ma, DS_FP8_E4M3, 0, 0, NULL), *qb = ds_fp8_cast(b, mb, DS_FP8_E5M2, 0, 0, NULL);
    ds_tensor_set(ma, 1, 0.5), ds_tensor_set(mb, 1, 4);
    int64_t n = 6;
    ds_tensor *bias = ds_tensor_new(1, &n, DS_F32, DS_CPU_DEVICE);
    for (int j = 0; j < 6; j++) ds_tensor_set(bias, j, j);
    ds_tensor *c = ds_fp8_gemm(qa, ma, DS_FP8_E4M3, qb, mb, DS_FP8_E5M2, bias, DS_F32);
    check(c && c->shape[0] == 5 && c->shape[1] == 6, "gemm: a [5, 6] result");
    for (int i = 0; c && i < 5; i++)
        for (int j = 0; j < 6; j++) {
            double want = j;
            for (int k = 0; k < 24; k++) want += 2 * small_a(i, k) * small_b(j, k);
            check(ds_tensor_get(c, i * 6 + j) == want, "gemm [%d][%d]: %g, expected %g", i, j,
                  ds_tensor_get(c, i * 6 + j), want);
        }
    ds_tensor_release(c);
    ds_tensor *wide = filled(6, 23, small_b), *qw = ds_fp8_cast(wide, mb, DS_FP8_E4M3, 0, 0, NULL);
    c = ds_fp8_gemm(qa, ma, DS_FP8_E4M3, qw, mb, DS_FP8_E4M3, NULL, DS_F32);
    check(c == NULL && strstr(ds_error_message(), "a [m, k] and b [n, k] expected, got a [5,24] and b [6,23]"),
          "gemm: k mismatch named, got \"%s\"", c ? "(none)" : ds_error_message());
    c = ds_fp8_gemm(a, ma, DS_FP8_E4M3, qb, mb, DS_FP8_E4M3, NULL, DS_F32);
    check(c == NULL && strstr(ds_error_message(), "a must hold fp8 codes (u8), got f32"),
          "gemm: f32 a refused, got \"%s\"", c ? "(none)" : ds_error_message());
    c = ds_fp8_cast(a, bias, DS_FP8_E4M3, 0, 0, NULL);
    check(c == NULL && strstr(ds_error_message(), "meta must be f32 [3]"), "cast: a [6] meta refused, got \"%s\"",
          c ? "(none)" : ds_error_message());
    ds_tensor *tensors[] = { a, b, ma, mb, qa, qb, bias, wide, qw };
    for (size_t k = 0; k < sizeof tensors / sizeof *tensors; k++) ds_tensor_release(tensors[k]);
}

int main(void) {
    for (int f = 0; f < DS_NFP8; f++) {
        test_codes(f);
        test_rounding(f);
    }
    test_cast();
    test_gemm();
    return check_summary("test_fp8");
}
