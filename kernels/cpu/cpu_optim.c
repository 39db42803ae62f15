/* Fused optimizer steps on the CPU: one pass over flat f32 buffers per
 * parameter group, in loops compiled once per instruction set (AVX-512,
 * AVX2, and SSE2 that every x86-64 has; the widest the CPU has is picked
 * at first use), cut into chunks that threads share once a buffer is large
 * enough to pay for the fork. */
#include "cpu_kernels.h"
#include "cpu_iter.h"
#include "../ds_optim_elem.h"

#include <string.h>

#define CPU_OPTIM_CHUNK 16384
#define CPU_OPTIM_BLOCK 1024      /* scaled gradients that stay in L1 */

typedef struct optim_ctx optim_ctx;

/* One kind's update of [lo, hi), g[i - lo] being element i's gradient. */
typedef void (*update_fn)(const optim_ctx *x, const float *g, int64_t lo, int64_t hi);

/* The buffers the update reads and writes, and its f32 hyperparameters. */
struct optim_ctx {
    float *p, *m, *v;
    const float *g;
    float grad_scale;
    update_fn update;
    uint16_t *shadow;           /* the 16-bit copy of p, or NULL */
    ds_dtype shadow_dtype;
    float lr, wd, beta1, beta2, eps, a, b, c;
    int flag1, flag2;
};

/* One instruction set's loops (cpu_optim_loops.h). */
typedef struct {
    const char *isa;
    void (*scale)(float *out, const float *g, float f, int64_t n);
    void (*shadow)(uint16_t *s, const float *p, ds_dtype t, int64_t n);
    update_fn sgd, adam, adagrad, lion;
} optim_loops;

#define CPU_OPTIM_QUOTE(isa) #isa
#define CPU_OPTIM_STR(isa) CPU_OPTIM_QUOTE(isa)
#define CPU_OPTIM_ISA sse2
#include "cpu_optim_loops.h"
#undef CPU_OPTIM_ISA
/* Each wider set's loops under its target: gcc's pragma, clang's attribute. */
#if defined(__x86_64__) && defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#define CPU_OPTIM_ISA avx2
#include "cpu_optim_loops.h"
#undef CPU_OPTIM_ISA
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx2"))), apply_to = function)
#define CPU_OPTIM_ISA avx512
#include "cpu_optim_loops.h"
#undef CPU_OPTIM_ISA
#pragma clang attribute pop
#elif defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2")
#define CPU_OPTIM_ISA avx2
#include "cpu_optim_loops.h"
#undef CPU_OPTIM_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,prefer-vector-width=512")
#define CPU_OPTIM_ISA avx512
#include "cpu_optim_loops.h"
#undef CPU_OPTIM_ISA
#pragma GCC pop_options
#endif

/* The variants, widest first, each with whether this CPU runs it. */
static bool cpu_has(const optim_loops *l) {
#if defined(__x86_64__)
    if (l == &loops_avx512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
    if (l == &loops_avx2) return __builtin_cpu_supports("avx2");
#endif
    return true;
}

static const optim_loops *const all_loops[] = {
#if defined(__x86_64__)
    &loops_avx512, &loops_avx2,
#endif
    &loops_sse2,
};
#define N_LOOPS (int)(sizeof all_loops / sizeof all_loops[0])

static const optim_loops *_Atomic chosen;

static const optim_loops *loops(void) {
    const optim_loops *l = chosen;
    if (l) return l;
    for (int k = 0; k < N_LOOPS && !l; k++)
        if (cpu_has(all_loops[k])) l = all_loops[k];
    chosen = l;
    return l;
}

const char *ds_cpu_optim_isa(void) { return loops()->isa; }

int ds_cpu_optim_use(const char *isa) {
    for (int k = 0; k < N_LOOPS; k++) {
        if (strcmp(all_loops[k]->isa, isa) != 0) continue;
        if (!cpu_has(all_loops[k])) return ds_kernel_fail("cpu optimizer: this CPU has no %s", isa);
        chosen = all_loops[k];
        return 0;
    }
    return ds_kernel_fail("cpu optimizer: unknown instruction set \"%s\" (avx512, avx2 or sse2)", isa);
}

typedef void (*chunk_fn)(const optim_ctx *x, int64_t lo, int64_t hi);

/* fn over [lo, hi): directly when small, else chunks spread over threads */
static void run_chunks(chunk_fn fn, const optim_ctx *x, int64_t lo, int64_t hi) {
    int64_t n = hi - lo;
    if (n <= CPU_PARALLEL_MIN) {
        fn(x, lo, hi);
        return;
    }
    int64_t chunks = (n + CPU_OPTIM_CHUNK - 1) / CPU_OPTIM_CHUNK;
    #pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < chunks; k++) {
        int64_t a = lo + k * CPU_OPTIM_CHUNK;
        fn(x, a, a + CPU_OPTIM_CHUNK < hi ? a + CPU_OPTIM_CHUNK : hi);
    }
}

/* x->update over [lo, hi) a block at a time. The gradients are scaled in
 * a pass of their own, so each product is rounded to f32 as a separate
 * scaling pass rounds it; the updated parameters go into their 16-bit copy
 * while in L1. */
static void update_chunk(const optim_ctx *x, int64_t lo, int64_t hi) {
    const optim_loops *l = loops();
    float scaled[CPU_OPTIM_BLOCK];
    for (int64_t a = lo; a < hi; a += CPU_OPTIM_BLOCK) {
        int64_t b = a + CPU_OPTIM_BLOCK < hi ? a + CPU_OPTIM_BLOCK : hi;
        const float *g = x->g + a;
        if (x->grad_scale != 1.0f) {
            l->scale(scaled, g, x->grad_scale, b - a);
            g = scaled;
        }
        x->update(x, g, a, b);
        if (x->shadow) l->shadow(x->shadow + a, x->p + a, x->shadow_dtype, b - a);
    }
}

/* Checks the buffers (bufs[0] is p) and the 16-bit copy, then updates. */
static int run_update(const char *op, optim_ctx *x, const ds_kview *bufs, int k, ds_kview shadow) {
    int64_t n = ds_kview_numel(&bufs[0]);
    if (ds_optim_check_buffers(op, bufs, k) || ds_optim_check_shadow(op, shadow, n)) return -1;
    x->shadow = shadow.data;
    x->shadow_dtype = shadow.dtype;
    run_chunks(update_chunk, x, 0, n);
    return 0;
}

/* ---- SGD ---- */

static int cpu_sgd(ds_kview p, ds_kview g, ds_kview buf, ds_kview shadow, const ds_sgd_params *h) {
    ds_kview v[3] = { p, g, buf };
    optim_ctx x = { .p = p.data, .m = buf.data, .g = g.data, .grad_scale = (float)h->grad_scale,
                    .update = loops()->sgd, .lr = (float)h->lr, .wd = (float)h->weight_decay,
                    .a = (float)h->momentum, .b = (float)h->dampening, .flag1 = h->nesterov, .flag2 = h->first };
    return run_update("sgd", &x, v, 3, shadow);
}

/* ---- Adam, AdamW ---- */

static int cpu_adam(ds_kview p, ds_kview g, ds_kview m, ds_kview v, ds_kview shadow, const ds_adam_params *h) {
    ds_kview b[4] = { p, g, m, v };
    optim_ctx x = { .p = p.data, .m = m.data, .v = v.data, .g = g.data, .grad_scale = (float)h->grad_scale,
                    .update = loops()->adam, .beta1 = (float)h->beta1, .beta2 = (float)h->beta2,
                    .eps = (float)h->eps, .wd = (float)h->weight_decay, .a = (float)h->decay,
                    .b = (float)h->step_size, .c = (float)h->sqrt_bc2, .flag1 = h->decoupled };
    return run_update("adam", &x, b, 4, shadow);
}

/* ---- Adagrad ---- */

static int cpu_adagrad(ds_kview p, ds_kview g, ds_kview sum, ds_kview shadow, const ds_adagrad_params *h) {
    ds_kview b[3] = { p, g, sum };
    optim_ctx x = { .p = p.data, .m = sum.data, .g = g.data, .grad_scale = (float)h->grad_scale,
                    .update = loops()->adagrad, .lr = (float)h->clr, .eps = (float)h->eps,
                    .wd = (float)h->weight_decay };
    return run_update("adagrad", &x, b, 3, shadow);
}

/* ---- Lamb: moments and each piece's norms, then the scaled update ---- */

/* Updates the moments over [lo, hi) and adds |p|^2 and |u|^2 into w2, u2. */
static void lamb_norms_chunk(const optim_ctx *x, int64_t lo, int64_t hi, double *w2, double *u2) {
    float *restrict p = x->p, *restrict m = x->m, *restrict v = x->v;
    const float *restrict g = x->g;
    float b1 = x->beta1, b2 = x->beta2, eps = x->eps, wd = x->wd, scale = x->a;
    int inside = x->flag1;
    double w = 0, u = 0;
    #pragma omp simd reduction(+:w, u)
    for (int64_t i = lo; i < hi; i++) {
        ds_lamb_moments(&m[i], &v[i], g[i], b1, b2, scale);
        float up = ds_lamb_update(p[i], m[i], v[i], eps, wd, inside);
        w += (double)p[i] * p[i];
        u += (double)up * up;
    }
    *w2 += w;
    *u2 += u;
}

/* x->lr carries step_size * trust ratio for this piece */
static void lamb_apply_chunk(const optim_ctx *x, int64_t lo, int64_t hi) {
    float *restrict p = x->p;
    const float *restrict m = x->m, *restrict v = x->v;
    float rate = x->lr, eps = x->eps, wd = x->wd;
    int inside = x->flag1;
    #pragma omp simd
    for (int64_t i = lo; i < hi; i++) p[i] -= rate * ds_lamb_update(p[i], m[i], v[i], eps, wd, inside);
}

static int cpu_lamb_norms(ds_kview p, ds_kview g, ds_kview m, ds_kview v, const int64_t *seg, int nseg,
                          double *w_sq, double *u_sq, const ds_lamb_params *h) {
    ds_kview b[4] = { p, g, m, v };
    if (ds_optim_check_buffers("lamb_norms", b, 4) ||
        ds_lamb_check_segments("lamb_norms", seg, nseg, ds_kview_numel(&p)))
        return -1;
    optim_ctx x = { .p = p.data, .m = m.data, .v = v.data, .g = g.data, .beta1 = (float)h->beta1,
                    .beta2 = (float)h->beta2, .eps = (float)h->eps, .wd = (float)h->weight_decay,
                    .a = (float)h->grad_scale, .flag1 = h->eps_inside_sqrt };
    for (int k = 0; k < nseg; k++) {
        int64_t lo = seg[k], hi = seg[k + 1], n = hi - lo;
        double w2 = 0, u2 = 0;
        if (n <= CPU_PARALLEL_MIN) {
            lamb_norms_chunk(&x, lo, hi, &w2, &u2);
        } else {
            int64_t chunks = (n + CPU_OPTIM_CHUNK - 1) / CPU_OPTIM_CHUNK;
            #pragma omp parallel for schedule(static) reduction(+:w2, u2)
            for (int64_t c = 0; c < chunks; c++) {
                int64_t a = lo + c * CPU_OPTIM_CHUNK;
                lamb_norms_chunk(&x, a, a + CPU_OPTIM_CHUNK < hi ? a + CPU_OPTIM_CHUNK : hi, &w2, &u2);
            }
        }
        w_sq[k] = w2;
        u_sq[k] = u2;
    }
    return 0;
}

static int cpu_lamb_apply(ds_kview p, ds_kview m, ds_kview v, const int64_t *seg, int nseg, const double *coeff,
                          const ds_lamb_params *h) {
    ds_kview b[3] = { p, m, v };
    if (ds_optim_check_buffers("lamb_apply", b, 3) ||
        ds_lamb_check_segments("lamb_apply", seg, nseg, ds_kview_numel(&p)))
        return -1;
    optim_ctx x = { .p = p.data, .m = m.data, .v = v.data, .eps = (float)h->eps, .wd = (float)h->weight_decay,
                    .flag1 = h->eps_inside_sqrt };
    for (int k = 0; k < nseg; k++) {
        x.lr = (float)(h->step_size * coeff[k]);
        run_chunks(lamb_apply_chunk, &x, seg[k], seg[k + 1]);
    }
    return 0;
}

/* ---- Lion ---- */

static int cpu_lion(ds_kview p, ds_kview g, ds_kview m, ds_kview shadow, const ds_lion_params *h) {
    ds_kview b[3] = { p, g, m };
    optim_ctx x = { .p = p.data, .m = m.data, .g = g.data, .grad_scale = (float)h->grad_scale,
                    .update = loops()->lion, .lr = (float)h->lr, .beta1 = (float)h->beta1, .beta2 = (float)h->beta2,
                    .a = (float)h->decay };
    return run_update("lion", &x, b, 3, shadow);
}

/* ---- the 1-bit optimizers ---- */

static int cpu_onebit_pack(ds_kview x, ds_kview err, ds_kview bits, double scale) {
    if (ds_onebit_check("onebit_pack", x, err, bits)) return -1;
    const float *xs = x.data;
    float *e = err.data, sc = (float)scale;
    uint8_t *b = bits.data;
    int64_t nb = ds_kview_numel(&bits);
    #pragma omp parallel for schedule(static) if (nb * 8 > CPU_PARALLEL_MIN)
    for (int64_t i = 0; i < nb; i++) b[i] = ds_onebit_pack8(xs + 8 * i, e + 8 * i, sc);
    return 0;
}

static int cpu_onebit_unpack(ds_kview out, ds_kview bits, double scale, int accumulate) {
    ds_kview none = { 0 };
    if (ds_onebit_check("onebit_unpack", out, none, bits)) return -1;
    float *o = out.data, sc = (float)scale;
    const uint8_t *b = bits.data;
    int64_t n = ds_kview_numel(&out);
    #pragma omp parallel for schedule(static) if (n > CPU_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        float s = ds_onebit_unpack1(b[i / 8], (int)(i % 8), sc);
        o[i] = accumulate ? o[i] + s : s;
    }
    return 0;
}

static int cpu_onebit_update(ds_onebit_op op, ds_kview p, ds_kview g, ds_kview m, ds_kview v, ds_kview acc,
                             const ds_onebit_params *h) {
    ds_kview b[5] = { p, m, v, g, acc };
    if (ds_optim_check_buffers("onebit_update", b, 5)) return -1;
    float *pp = p.data, *mm = m.data, *aa = acc.data;
    const float *gg = g.data, *vv = v.data;
    float b1 = (float)h->beta1, eps = (float)h->eps, lr = (float)h->lr, wd = (float)h->weight_decay,
          lrs = (float)h->lrs;
    int64_t n = ds_kview_numel(&p);
    #pragma omp parallel for schedule(static) if (n > CPU_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++)
        ds_onebit_elem(op, &pp[i], gg ? &gg[i] : NULL, &mm[i], &vv[i], aa ? &aa[i] : NULL, b1, eps, lr, wd, lrs);
    return 0;
}

const ds_kernels_optim ds_cpu_optim = {
    .sgd = cpu_sgd,
    .adam = cpu_adam,
    .adagrad = cpu_adagrad,
    .lamb_norms = cpu_lamb_norms,
    .lamb_apply = cpu_lamb_apply,
    .lion = cpu_lion,
    .onebit_pack = cpu_onebit_pack,
    .onebit_unpack = cpu_onebit_unpack,
    .onebit_update = cpu_onebit_update,
};
