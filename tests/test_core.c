/* Unit tests of the core runtime, without Lua: Philox known answers, the
 * bf16/f16 conversions, storage refcounts and byte accounting, autograd
 * driven from C (values, freeing during backward, very deep graphs), the
 * linear backward shared by linear and gelu_mlp, and the GEMM epilogues
 * reached through the dispatch table. */
#include "ds_ops.h"
#include "ds_error.h"
#include "ds_half.h"
#include "ds_op_linalg_impl.h"
#include "ds_philox.h"
#include "cpu/cpu_kernels.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* ---- Philox4x32-10 against Random123's kat_vectors ---- */

static void test_philox(void) {
    static const struct { uint32_t ctr[4], key[2], out[4]; } kat[] = {
        { { 0, 0, 0, 0 }, { 0, 0 }, { 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8 } },
        { { 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff }, { 0xffffffff, 0xffffffff },
          { 0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd } },
        { { 0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344 }, { 0xa4093822, 0x299f31d0 },
          { 0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1 } },
    };
    for (size_t i = 0; i < sizeof kat / sizeof *kat; i++) {
        ds_philox4 c = {{ kat[i].ctr[0], kat[i].ctr[1], kat[i].ctr[2], kat[i].ctr[3] }};
        ds_philox4 r = ds_philox4x32_10(c, kat[i].key[0], kat[i].key[1]);
        for (int j = 0; j < 4; j++)
            check(r.v[j] == kat[i].out[j], "philox vector %zu word %d: %08x, expected %08x", i, j,
                  r.v[j], kat[i].out[j]);
    }
    /* block b of seed s is counter (b lo, b hi, 0, 0) under key (s lo, s hi) */
    ds_philox4 a = ds_philox_block(0xa4093822299f31d0ull, 0), z = {{ 0, 0, 0, 0 }};
    ds_philox4 b = ds_philox4x32_10(z, 0x299f31d0u, 0xa4093822u);
    check(memcmp(&a, &b, sizeof a) == 0, "philox_block splits seed into key (lo, hi)");
    check(ds_u32_to_unit(0) > 0 && ds_u32_to_unit(0xffffffffu) == 1.0f, "u32_to_unit maps into (0, 1]");
}

/* ---- bf16 / f16 ---- */

static int is_nan_f(float f) { return f != f; }

/* Reference decoders written from the formats' definitions. */
static double ref_decode(uint16_t h, int mant_bits, int exp_bits) {
    int bias = (1 << (exp_bits - 1)) - 1;
    int e = (h >> mant_bits) & ((1 << exp_bits) - 1), m = h & ((1 << mant_bits) - 1);
    double s = (h >> 15) ? -1.0 : 1.0;
    if (e == (1 << exp_bits) - 1) return m ? NAN : s * INFINITY;
    if (e == 0) return s * ldexp(m, 1 - bias - mant_bits);
    return s * ldexp((double)((1 << mant_bits) | m), e - bias - mant_bits);
}

/* Round-to-nearest-even of a finite x to a binary format with mant_bits
 * stored mantissa bits, in double arithmetic: scale by the quantum of x's
 * binade (exact), nearbyint (ties to even), scale back. */
static double ref_round(double x, int mant_bits, int exp_bits) {
    int bias = (1 << (exp_bits - 1)) - 1, emin = 1 - bias;
    double maxv = ldexp(2.0 - ldexp(1.0, -mant_bits), bias);
    if (x == 0) return x;
    int e;
    frexp(fabs(x), &e);
    e -= 1;                                   /* |x| in [2^e, 2^(e+1)) */
    if (e < emin) e = emin;                   /* subnormal: fixed quantum */
    double q = ldexp(1.0, e - mant_bits);
    double r = nearbyint(x / q) * q;
    if (fabs(r) > maxv) return copysign(INFINITY, x);
    return r == 0 ? copysign(0.0, x) : r;
}

static void check_convert(float f, uint16_t got, int mant_bits, int exp_bits, const char *what) {
    double want = ref_round(f, mant_bits, exp_bits), have = ref_decode(got, mant_bits, exp_bits);
    int ok = have == want && signbit(have) == signbit(want);
    check(ok, "%s(%a = %08x) = %04x (%a), expected %a", what, (double)f, ds_f32_bits(f), got, have, want);
}

static uint32_t xorshift(uint64_t *s) {
    *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17;
    return (uint32_t)(*s >> 32);
}

static void test_half(void) {
    int before = failures;
    for (uint32_t h = 0; h < 65536; h++) {
        float b = ds_bf16_to_f32((uint16_t)h), f = ds_f16_to_f32((uint16_t)h);
        uint16_t b2 = ds_f32_to_bf16(b), f2 = ds_f32_to_f16(f);
        int b_nan = ((h >> 7) & 0xff) == 0xff && (h & 0x7f);
        int f_nan = ((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff);
        if (b_nan) check(is_nan_f(b) && is_nan_f(ds_bf16_to_f32(b2)), "bf16 NaN %04x stays NaN", h);
        else check(b2 == h, "bf16 %04x -> %a -> %04x", h, (double)b, b2);
        if (f_nan) check(is_nan_f(f) && is_nan_f(ds_f16_to_f32(f2)), "f16 NaN %04x stays NaN", h);
        else check(f2 == h, "f16 %04x -> %a -> %04x", h, (double)f, f2);
        if (!f_nan) check(ref_decode((uint16_t)h, 10, 5) == (double)f || (isinf(f) && isinf(ref_decode((uint16_t)h, 10, 5))),
                          "f16 %04x decodes to %a", h, (double)f);
        if (failures - before > 20) return;
    }
    /* every rounding boundary: each representable value, the midpoint to
     * its neighbour (exact in f32: 8 or 11 bits of 24) and the f32 values
     * one ulp either side of it; past the largest finite value the
     * neighbour is the next power of two, where rounding gives inf */
    for (uint32_t h = 0; h < 65536 && failures - before <= 20; h++) {
        for (int fmt = 0; fmt < 2; fmt++) {
            int mant = fmt ? 10 : 7, ex = fmt ? 5 : 8;
            double lo = ref_decode((uint16_t)h, mant, ex), hi = ref_decode((uint16_t)(h + 1), mant, ex);
            if (!isfinite(lo) || (h & 0x7fff) == 0x7fff) continue;
            if (isinf(hi)) hi = copysign(ldexp(1.0, 1 << (ex - 1)), lo);
            float mid = (float)((lo + hi) / 2);
            float c[4] = { (float)lo, mid, nextafterf(mid, -INFINITY), nextafterf(mid, INFINITY) };
            for (int k = 0; k < 4; k++) {
                if (fmt) check_convert(c[k], ds_f32_to_f16(c[k]), 10, 5, "f32_to_f16");
                else check_convert(c[k], ds_f32_to_bf16(c[k]), 7, 8, "f32_to_bf16");
            }
        }
    }
    /* and a few million arbitrary f32 bit patterns */
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < 4000000 && failures - before <= 20; i++) {
        float f = ds_bits_f32(xorshift(&s));
        if (is_nan_f(f)) {
            check(is_nan_f(ds_bf16_to_f32(ds_f32_to_bf16(f))) && is_nan_f(ds_f16_to_f32(ds_f32_to_f16(f))),
                  "NaN %08x converts to NaN", ds_f32_bits(f));
            continue;
        }
        check_convert(f, ds_f32_to_bf16(f), 7, 8, "f32_to_bf16");
        check_convert(f, ds_f32_to_f16(f), 10, 5, "f32_to_f16");
    }
    check(ds_f32_to_bf16(INFINITY) == 0x7f80 && ds_f32_to_bf16(-INFINITY) == 0xff80, "bf16 infinities");
    check(ds_f32_to_f16(INFINITY) == 0x7c00 && ds_f32_to_f16(-INFINITY) == 0xfc00, "f16 infinities");
}

/* ---- storage, refcounts, byte accounting ---- */

static void count_oom(void *ud) { (*(int *)ud)++; }

static void test_memory(void) {
    int64_t start = ds_mem_live_bytes();
    ds_mem_stats st0, st;
    ds_mem_get_stats(&st0);

    int64_t shape[2] = { 4, 8 };
    ds_tensor *t = ds_tensor_full(2, shape, DS_F32, DS_CPU_DEVICE, 3.0);
    check(t != NULL, "full: %s", ds_error_message());
    check(ds_mem_live_bytes() == start + 128, "a 4x8 f32 tensor counts 128 bytes, got %lld",
          (long long)(ds_mem_live_bytes() - start));
    ds_mem_get_stats(&st);
    check(st.current[DS_MEM_OTHER] == st0.current[DS_MEM_OTHER] + 128, "new tensors count as 'other'");

    /* a view keeps the storage alive after its base goes */
    ds_tensor *v = ds_narrow(t, 1, 2, 3);
    check(v && v->storage == t->storage && atomic_load(&t->storage->refcount) == 2, "narrow shares storage");
    ds_tensor_release(t);
    check(ds_mem_live_bytes() == start + 128, "the view keeps the storage");
    check(ds_tensor_get(v, 5) == 3.0, "view still reads its data");
    ds_tensor *w = ds_transpose(v, 0, 1);
    ds_tensor_release(v);
    check(ds_mem_live_bytes() == start + 128 && ds_tensor_get(w, 0) == 3.0, "a view of a view keeps it too");
    ds_tensor_release(w);
    check(ds_mem_live_bytes() == start, "releasing the last view frees the storage");

    /* categories, recategorize, peak */
    ds_mem_reset_peak();
    ds_mem_get_stats(&st0);
    ds_tensor *p = ds_tensor_full(1, (int64_t[]){ 256 }, DS_F64, DS_CPU_DEVICE, 0);
    ds_tensor_set_category(p, DS_MEM_PARAM);
    ds_mem_get_stats(&st);
    check(st.current[DS_MEM_PARAM] == st0.current[DS_MEM_PARAM] + 2048, "set_category moves bytes to parameters");
    check(st.current[DS_MEM_OTHER] == st0.current[DS_MEM_OTHER], "... and out of other");
    check(st.peak[DS_MEM_PARAM] == st.current[DS_MEM_PARAM], "peak follows current while growing");
    ds_tensor_set_category(p, DS_MEM_PARAM);
    ds_mem_get_stats(&st);
    check(st.current[DS_MEM_PARAM] == st0.current[DS_MEM_PARAM] + 2048, "same category again is a no-op");
    ds_tensor_release(p);
    ds_mem_get_stats(&st);
    check(st.current[DS_MEM_PARAM] == st0.current[DS_MEM_PARAM], "freeing uncounts its category");
    check(st.peak[DS_MEM_PARAM] == st0.current[DS_MEM_PARAM] + 2048 && st.total_peak >= st0.total_current + 2048,
          "peaks stay after the free");
    ds_mem_reset_peak();
    ds_mem_get_stats(&st);
    check(st.total_peak == st.total_current && st.peak[DS_MEM_PARAM] == st.current[DS_MEM_PARAM], "reset_peak");

    void *raw = ds_mem_alloc(&ds_cpu_allocator, 1000, DS_MEM_OPTIM);
    check(raw && ((uintptr_t)raw & 63) == 0, "cpu allocations are 64-byte aligned");
    ds_mem_recategorize(1000, DS_MEM_OPTIM, DS_MEM_GRAD);
    ds_mem_get_stats(&st);
    check(st.current[DS_MEM_OPTIM] == st0.current[DS_MEM_OPTIM] && st.current[DS_MEM_GRAD] == st0.current[DS_MEM_GRAD] + 1000,
          "recategorize moves the count");
    check(st.total_current == st0.total_current + 1000, "recategorize keeps the total");
    ds_mem_free(&ds_cpu_allocator, raw, 1000, DS_MEM_GRAD);
    check(ds_mem_live_bytes() == start, "raw free uncounts");

    for (int c = 0; c < DS_MEM_NCATEGORIES; c++)
        check(ds_mem_category_parse(ds_mem_category_name((ds_mem_category)c)) == c, "category %d name round trip", c);
    check(ds_mem_category_parse("bogus") == -1, "unknown category is -1");

    /* impossible sizes fail cleanly, after asking the OOM handler once */
    int oom_calls = 0;
    ds_mem_set_oom_handler(count_oom, &oom_calls);
    ds_error_clear();
    void *huge = ds_mem_alloc(&ds_cpu_allocator, SIZE_MAX - 10, DS_MEM_OTHER);
    check(huge == NULL && ds_error_code() == DS_ERR_NOMEM, "SIZE_MAX-10 bytes fails with NOMEM (got %p)", huge);
    if (huge) ds_mem_free(&ds_cpu_allocator, huge, SIZE_MAX - 10, DS_MEM_OTHER);
    huge = ds_mem_alloc(&ds_cpu_allocator, (size_t)1 << 60, DS_MEM_OTHER);
    check(huge == NULL && ds_error_code() == DS_ERR_NOMEM, "2^60 bytes fails with NOMEM");
    check(oom_calls == 2, "the OOM handler ran once per failed allocation (%d)", oom_calls);
    ds_mem_set_oom_handler(NULL, NULL);
    check(ds_mem_live_bytes() == start, "failed allocations count nothing");

    /* shapes whose element or byte count overflows are refused */
    int64_t big[][3] = { { (int64_t)1 << 62, 4, 1 }, { 3, 6148914691236517376, 1 },
                         { (int64_t)1 << 31, (int64_t)1 << 31, (int64_t)1 << 31 }, { INT64_MAX, 1, 1 } };
    for (size_t i = 0; i < sizeof big / sizeof *big; i++) {
        ds_error_clear();
        ds_tensor *b = ds_tensor_new(3, big[i], DS_F32, DS_CPU_DEVICE);
        check(b == NULL && ds_error_code() != DS_OK, "shape %zu with an overflowing size is refused", i);
        ds_tensor_release(b);
    }
    check(ds_tensor_new(2, (int64_t[]){ 2, -1 }, DS_F32, DS_CPU_DEVICE) == NULL, "negative sizes are refused");
    ds_tensor *e = ds_tensor_new(2, (int64_t[]){ 0, (int64_t)1 << 62 }, DS_F32, DS_CPU_DEVICE);
    check(e != NULL && ds_tensor_numel(e) == 0, "an empty tensor with a huge other dim is fine");
    ds_tensor_release(e);
    check(ds_mem_live_bytes() == start, "live bytes back to the start");
}

/* ---- autograd from C ---- */

static ds_tensor *leaf(int n, const double *vals) {
    int64_t shape[1] = { n };
    ds_tensor *t = ds_tensor_new(1, shape, DS_F64, DS_CPU_DEVICE);
    for (int i = 0; i < n; i++) ds_tensor_set(t, i, vals[i]);
    t->requires_grad = true;
    return t;
}

static void test_autograd(void) {
    int64_t start = ds_mem_live_bytes();
    /* loss = sum(exp(x) * exp(x) * w): dloss/dx = 2 exp(2x) w, dloss/dw = exp(2x) */
    double xv[3] = { 0.5, -1.0, 2.0 }, wv[3] = { 1.0, 2.0, -3.0 };
    ds_tensor *x = leaf(3, xv), *w = leaf(3, wv);
    ds_tensor *h = ds_unary(DS_UN_EXP, x, 0);
    ds_tensor *z = ds_mul(h, h);
    ds_tensor *zw = ds_mul(z, w);
    ds_tensor *loss = ds_sum(zw, -1, NULL, false);
    check(loss && loss->grad_fn && strcmp(loss->grad_fn->name, "sum") == 0, "loss has a sum node");
    check(h->storage->category == DS_MEM_ACT, "op outputs that record history count as activations");
    int64_t hbytes = (int64_t)h->storage->nbytes, zbytes = (int64_t)z->storage->nbytes;
    ds_tensor_release(h);
    ds_tensor_release(z);
    ds_tensor_release(zw);
    /* h lives on in the exp node (saved output) and the mul node (saved
     * inputs); z lives in the second mul node */
    int64_t before = ds_mem_live_bytes();
    check(before == start + 2 * 24 + hbytes + zbytes + 8, "graph holds h and z (live %lld)", (long long)(before - start));
    check(ds_backward(loss, NULL, false) == 0, "backward: %s", ds_error_message());
    int64_t after = ds_mem_live_bytes();
    check(after == before - hbytes - zbytes + 2 * 24, "backward freed saved h and z, added two grads (delta %lld)",
          (long long)(after - before));
    for (int i = 0; i < 3; i++) {
        double gx = ds_tensor_get(x->grad, i), gw = ds_tensor_get(w->grad, i);
        double ex = 2 * exp(2 * xv[i]) * wv[i], ew = exp(2 * xv[i]);
        check(fabs(gx - ex) <= 1e-12 * fabs(ex), "dx[%d] = %g, expected %g", i, gx, ex);
        check(fabs(gw - ew) <= 1e-12 * fabs(ew), "dw[%d] = %g, expected %g", i, gw, ew);
    }
    check(x->grad->storage->category == DS_MEM_GRAD, "leaf grads count as gradients");
    check(x->grad->storage != w->grad->storage, "each leaf owns its grad");
    /* a second backward through freed saved tensors is an error, not a crash */
    ds_error_clear();
    check(ds_backward(loss, NULL, false) == -1 && strstr(ds_error_message(), "retain_graph"),
          "second backward names retain_graph: %s", ds_error_message());
    ds_tensor_release(loss);
    ds_tensor_release(x);
    ds_tensor_release(w);
    check(ds_mem_live_bytes() == start, "everything freed (live %lld)", (long long)(ds_mem_live_bytes() - start));

    /* retain_graph: two passes accumulate */
    double one[2] = { 1.0, 2.0 };
    x = leaf(2, one);
    ds_tensor *y = ds_mul(x, x);
    loss = ds_sum(y, -1, NULL, false);
    ds_tensor_release(y);
    check(ds_backward(loss, NULL, true) == 0 && ds_backward(loss, NULL, false) == 0, "retain_graph then again");
    check(ds_tensor_get(x->grad, 1) == 8.0, "two passes accumulate 2*2x = 8, got %g", ds_tensor_get(x->grad, 1));
    ds_tensor_release(loss);
    ds_tensor_release(x);
    check(ds_mem_live_bytes() == start, "retain_graph case frees everything");

    /* grad mode off records nothing */
    x = leaf(2, one);
    bool was = ds_set_grad_enabled(false);
    y = ds_mul(x, x);
    ds_set_grad_enabled(was);
    check(y->grad_fn == NULL && !y->requires_grad, "no history with grad mode off");
    ds_tensor_release(y);
    ds_tensor_release(x);
}

/* An op whose backward returns a gradient of the wrong shape. */
static int bad_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    (void)n;
    gin[0] = ds_tensor_full(1, (int64_t[]){ 7 }, g->dtype, DS_CPU_DEVICE, 1.0);
    return gin[0] ? 0 : -1;
}

static void test_bad_backward(void) {
    int64_t start = ds_mem_live_bytes();
    double v[3] = { 1, 2, 3 };
    ds_tensor *x = leaf(3, v);
    ds_tensor *out = ds_tensor_full(1, (int64_t[]){ 3 }, DS_F64, DS_CPU_DEVICE, 0.0);
    check(ds_autograd_record("bad", bad_backward, 1, &x, out) != NULL, "record a custom node");
    ds_tensor *g = ds_tensor_full(1, (int64_t[]){ 3 }, DS_F64, DS_CPU_DEVICE, 1.0);
    ds_error_clear();
    check(ds_backward(out, g, false) == -1, "a wrongly shaped gradient fails backward");
    check(strstr(ds_error_message(), "backward of bad: gradient of input 1 has shape [7], the input [3]") != NULL,
          "message names op and shapes: %s", ds_error_message());
    check(x->grad == NULL, "nothing accumulated into the leaf");
    ds_tensor_release(g);
    ds_tensor_release(out);
    ds_tensor_release(x);
    check(ds_mem_live_bytes() == start, "bad backward leaks nothing");
}

/* A chain of 100k ops: backward and release walk it without recursion.
 * Runs on a thread with a 256 KB stack, where recursing 100k deep could
 * not fit. */
static void *deep_chain(void *unused) {
    (void)unused;
    int64_t start = ds_mem_live_bytes();
    double v[2] = { 1.0, -2.0 };
    ds_tensor *x = leaf(2, v);
    ds_tensor *half = ds_tensor_full(0, NULL, DS_F64, DS_CPU_DEVICE, 1.0);
    ds_tensor *y = x;
    ds_tensor_retain(y);
    const int depth = 100000;
    for (int i = 0; i < depth; i++) {
        ds_tensor *n = (i & 1) ? ds_add(y, half) : ds_mul(y, half);
        if (!n) { check(0, "chain op %d: %s", i, ds_error_message()); break; }
        ds_tensor_release(y);
        y = n;
    }
    ds_tensor *loss = ds_sum(y, -1, NULL, false);
    ds_tensor_release(y);
    check(ds_backward(loss, NULL, true) == 0, "deep backward: %s", ds_error_message());
    check(x->grad && ds_tensor_get(x->grad, 0) == 1.0 && ds_tensor_get(x->grad, 1) == 1.0, "deep chain gradient is 1");
    ds_tensor_release(loss);      /* frees 100k nodes */
    ds_tensor_release(x);
    ds_tensor_release(half);
    check(ds_mem_live_bytes() == start, "deep chain freed (live %lld)", (long long)(ds_mem_live_bytes() - start));

    /* released without ever running backward, too */
    x = leaf(2, v);
    y = x;
    ds_tensor_retain(y);
    for (int i = 0; i < depth; i++) {
        ds_tensor *n = ds_unary(DS_UN_NEG, y, 0);
        ds_tensor_release(y);
        y = n;
    }
    ds_tensor_release(y);
    ds_tensor_release(x);
    check(ds_mem_live_bytes() == start, "unrun deep chain freed");
    return NULL;
}

static void test_deep_chain(void) {
    pthread_attr_t attr;
    pthread_t th;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10);
    check(pthread_create(&th, &attr, deep_chain, NULL) == 0, "start the small-stack thread");
    pthread_join(th, NULL);
    pthread_attr_destroy(&attr);
}

static ds_tensor *matrix(int64_t r, int64_t c, double v0) {
    int64_t shape[2] = { r, c };
    ds_tensor *t = ds_tensor_new(2, shape, DS_F64, DS_CPU_DEVICE);
    for (int64_t i = 0; i < r * c; i++) ds_tensor_set(t, i, v0 + 0.25 * (double)(i * 7 % 11));
    return t;
}

/* A caller that asks ds_linalg_linear_grads for dw alone, holding a bias
 * gradient of its own in gin[2]: dw must still be gc^T x2, and the given
 * gradient kept. */
static void test_linear_grads_given_bias(void) {
    int64_t rows = 3, in = 2, out = 4;
    ds_tensor *gc = matrix(rows, out, -1.0), *x2 = matrix(rows, in, 0.5), *w = matrix(out, in, 2.0);
    ds_tensor *given = ds_tensor_new(1, &out, DS_F64, DS_CPU_DEVICE);
    ds_tensor *gin[3] = { NULL, NULL, given };
    const bool want[3] = { false, true, false };
    check(ds_linalg_linear_grads("linear", gc, x2, w, want, 2, x2->shape, gin) == 0, "linear_grads: %s",
          ds_error_message());
    check(gin[0] == NULL && gin[2] == given, "only dw is made; the given bias gradient stays");
    for (int64_t o = 0; o < out; o++)
        for (int64_t i = 0; i < in; i++) {
            double want_dw = 0;
            for (int64_t r = 0; r < rows; r++) want_dw += ds_tensor_get(gc, r * out + o) * ds_tensor_get(x2, r * in + i);
            double got = gin[1] ? ds_tensor_get(gin[1], o * in + i) : NAN;
            check(fabs(got - want_dw) <= 1e-12, "dw[%lld,%lld] = %g, expected %g", (long long)o, (long long)i, got,
                  want_dw);
        }
    ds_tensor_release(gin[1]);
    ds_tensor_release(given);
    ds_tensor_release(gc);
    ds_tensor_release(x2);
    ds_tensor_release(w);
}

/* ---- GEMM epilogues through the dispatch table ---- */

/* A device in the CUDA slot with host memory and the CPU's kernels, whose
 * BLAS table offers every epilogue, counts the calls and refuses each (as
 * cuBLASLt refuses a layout it has no kernel for): linear and gelu_mlp
 * must ask the device's table, then fall back to gemm and the separate
 * kernels with the same results. */
enum { EP_BIAS, EP_BIAS_GRAD, EP_BIAS_GELU, EP_GELU_GRAD, EP_N };
static int epilogue_calls[EP_N];

static int refuse(int which) {
    epilogue_calls[which]++;
    return ds_kernel_fail("epilogue %d refused", which);
}

static int ep_bias(ds_kview c, ds_kview a, ds_kview b, ds_kview v) {
    (void)c, (void)a, (void)b, (void)v;
    return refuse(EP_BIAS);
}

static int ep_bias_grad(ds_kview c, ds_kview a, ds_kview b, ds_kview v) {
    (void)c, (void)a, (void)b, (void)v;
    return refuse(EP_BIAS_GRAD);
}

static int ep_bias_gelu(ds_kview c, ds_kview aux, ds_kview a, ds_kview b, ds_kview v) {
    (void)c, (void)aux, (void)a, (void)b, (void)v;
    return refuse(EP_BIAS_GELU);
}

static int ep_gelu_grad(ds_kview c, ds_kview aux, ds_kview a, ds_kview b) {
    (void)c, (void)aux, (void)a, (void)b;
    return refuse(EP_GELU_GRAD);
}

static int host_transfer(ds_kview dst, ds_device ddev, ds_kview src, ds_device sdev) {
    (void)ddev, (void)sdev;
    return ds_cpu_kernels.core->copy(dst, src);
}

static ds_kernels_blas counting_blas = { .gemm_bias = ep_bias, .gemm_bias_grad = ep_bias_grad,
                                         .gemm_bias_gelu = ep_bias_gelu, .gemm_gelu_grad = ep_gelu_grad };

static ds_tensor *filled(int nd, const int64_t *shape, ds_dtype dt, ds_device dev, double v0) {
    ds_tensor *t = ds_tensor_new(nd, shape, dt, dev);
    for (int64_t i = 0; i < ds_tensor_numel(t); i++) ds_tensor_set(t, i, v0 + 0.25 * (double)(i * 7 % 11));
    t->requires_grad = true;
    return t;
}

static void test_linear_epilogues(ds_device dev) {
    int64_t xs[2] = { 3, 2 }, ws[2] = { 4, 2 }, bs[1] = { 4 };
    ds_tensor *x = filled(2, xs, DS_F64, dev, -1.0), *w = filled(2, ws, DS_F64, dev, 0.5);
    ds_tensor *b = filled(1, bs, DS_F64, dev, 2.0);
    ds_tensor *y = ds_linear(x, w, b);
    ds_tensor *loss = y ? ds_sum(y, -1, NULL, false) : NULL;
    check(loss && ds_backward(loss, NULL, false) == 0, "linear on the counting device: %s", ds_error_message());
    check(epilogue_calls[EP_BIAS] == 1 && epilogue_calls[EP_BIAS_GRAD] == 1,
          "linear asked the table for its bias epilogues (%d forward, %d backward)", epilogue_calls[EP_BIAS],
          epilogue_calls[EP_BIAS_GRAD]);
    for (int r = 0; y && r < 3; r++)
        for (int o = 0; o < 4; o++) {
            double want = ds_tensor_get(b, o);
            for (int i = 0; i < 2; i++) want += ds_tensor_get(x, r * 2 + i) * ds_tensor_get(w, o * 2 + i);
            check(ds_tensor_get(y, r * 4 + o) == want, "y[%d,%d] = %g, expected %g", r, o, ds_tensor_get(y, r * 4 + o),
                  want);
        }
    for (int o = 0; b->grad && o < 4; o++)
        check(ds_tensor_get(b->grad, o) == 3.0, "db[%d] = %g, expected 3 (rows)", o, ds_tensor_get(b->grad, o));
    ds_tensor *all[5] = { x, w, b, y, loss };
    for (int k = 0; k < 5; k++) ds_tensor_release(all[k]);
}

static void test_mlp_epilogues(ds_device dev) {
    int64_t xs[2] = { 2, 8 }, w1s[2] = { 8, 8 }, b1s[1] = { 8 }, w2s[2] = { 4, 8 }, b2s[1] = { 4 };
    ds_tensor *t[5] = { filled(2, xs, DS_BF16, dev, -0.5), filled(2, w1s, DS_BF16, dev, 0.1),
                        filled(1, b1s, DS_BF16, dev, 0.0), filled(2, w2s, DS_BF16, dev, -0.2),
                        filled(1, b2s, DS_BF16, dev, 0.3) };
    ds_tensor *y = ds_gelu_mlp(t[0], t[1], t[2], t[3], t[4], 1);
    ds_tensor *loss = y ? ds_sum(y, -1, NULL, false) : NULL;
    check(loss && ds_backward(loss, NULL, false) == 0, "gelu_mlp on the counting device: %s", ds_error_message());
    check(epilogue_calls[EP_BIAS_GELU] == 1 && epilogue_calls[EP_GELU_GRAD] == 1,
          "bf16 gelu_mlp asked the table for its GELU epilogues (%d forward, %d backward)",
          epilogue_calls[EP_BIAS_GELU], epilogue_calls[EP_GELU_GRAD]);
    check(t[2]->grad && t[4]->grad, "gelu_mlp's bias gradients came out of the fallback");
    for (int k = 0; k < 5; k++) ds_tensor_release(t[k]);
    ds_tensor_release(y);
    ds_tensor_release(loss);
}

static void test_epilogue_dispatch(void) {
    ds_device dev = { DS_DEV_CUDA, 0 };
    const ds_backend *real = ds_backend_get(dev);    /* a real backend registers on this first ask */
    ds_backend saved = real ? *real : (ds_backend){ 0 };
    ds_kernels kernels = ds_cpu_kernels;
    counting_blas.gemm = ds_cpu_blas.gemm;
    kernels.blas = &counting_blas;
    ds_backend_register(DS_DEV_CUDA, &(ds_backend){ .kernels = &kernels, .allocator = &ds_cpu_allocator, .count = 1,
                                                    .transfer = host_transfer });
    test_linear_epilogues(dev);
    test_mlp_epilogues(dev);
    ds_backend_register(DS_DEV_CUDA, &saved);
}

int main(void) {
    test_philox();
    test_half();
    test_memory();
    test_autograd();
    test_bad_backward();
    test_deep_chain();
    test_linear_grads_given_bias();
    test_epilogue_dispatch();
    return check_summary("test_core");
}
