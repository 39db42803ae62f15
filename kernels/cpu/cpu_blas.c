/* Batched GEMM on the CPU. f32 and f64 go to OpenBLAS, bf16 and f16 to a
 * oneDNN matmul that accumulates in f32; where oneDNN has no implementation
 * for a type, each matrix is widened to f32 for OpenBLAS and rounded back.
 * Operands are used in place whenever one of their matrix strides is 1. */
#include "cpu_kernels.h"
#include "cpu_dnnl.h"
#include "../ds_gemm_layout.h"
#include "cpu_half.h"

#include <cblas.h>
#include <omp.h>
#include <stdbool.h>
#include <stdlib.h>

/* OpenBLAS runs GEMMs of up to 64^3 multiply-adds on one thread, so a batch
 * of such small ones is spread over OpenMP threads instead. */
#define BLAS_SMALL_MNK (64 * 64 * 64)

/* Widening or narrowing fewer elements than this stays on one thread. */
#define BLAS_CONVERT_MIN 32768

/* Replaces v by a contiguous copy in *buf; batch dims that repeat one
 * matrix (stride 0) still repeat it instead of being copied out. */
static int compact(ds_kview *v, void **buf) {
    ds_kview src, dst;
    int64_t n = ds_gemm_packed(v, &src, &dst);
    *buf = malloc((size_t)n * ds_dtype_size(v->dtype));
    if (!*buf) return ds_kernel_fail("gemm: out of memory for a %lld-element operand copy", (long long)n);
    dst.data = *buf;
    if (ds_cpu_core.copy(dst, src)) return -1;
    ds_gemm_use_packed(v, dst);
    return 0;
}

typedef struct {
    ds_dtype dtype;
    bool ta, tb, widen;
    int m, n, k, lda, ldb, ldc;
    double alpha, beta;
    dnnl_primitive_t prim[2];          /* oneDNN: with beta, and with beta 1 */
    dnnl_memory_desc_t md[3];
    float *wa, *wb, *wc;               /* widening: f32 copies of one GEMM's operands */
} gemm_plan;

/* rows x cols of a half matrix with row stride ld as a contiguous f32
 * one, and back: contiguous loops the compiler vectorizes, threaded when
 * big (the operand as stored: a transposed one stays transposed). */
static void widen(float *dst, ds_dtype t, const void *src, int rows, int cols, int ld) {
    const uint16_t *h = src;
    #pragma omp parallel for schedule(static) if ((int64_t)rows * cols > BLAS_CONVERT_MIN && !omp_in_parallel())
    for (int i = 0; i < rows; i++) cpu_half_to_f32(dst + (int64_t)i * cols, h + (int64_t)i * ld, cols, t);
}

static void narrow(void *dst, ds_dtype t, int ld, const float *src, int rows, int cols) {
    uint16_t *h = dst;
    #pragma omp parallel for schedule(static) if ((int64_t)rows * cols > BLAS_CONVERT_MIN && !omp_in_parallel())
    for (int i = 0; i < rows; i++) cpu_f32_to_half(h + (int64_t)i * ld, src + (int64_t)i * cols, cols, t);
}

/* rows x cols of C from the matching rows of A and columns of B. */
static void blas_part(const gemm_plan *p, int rows, int cols, const char *A, const char *B, char *C, double beta) {
    enum CBLAS_TRANSPOSE ta = p->ta ? CblasTrans : CblasNoTrans, tb = p->tb ? CblasTrans : CblasNoTrans;
    if (p->dtype == DS_F32)
        cblas_sgemm(CblasRowMajor, ta, tb, rows, cols, p->k, (float)p->alpha, (const float *)A, p->lda,
                    (const float *)B, p->ldb, (float)beta, (float *)C, p->ldc);
    else
        cblas_dgemm(CblasRowMajor, ta, tb, rows, cols, p->k, p->alpha, (const double *)A, p->lda,
                    (const double *)B, p->ldb, beta, (double *)C, p->ldc);
}

/* An f32/f64 GEMM through OpenBLAS. ds_threads.c keeps OpenBLAS on the
 * calling thread, so a big product is cut here into blocks of C's columns
 * (or rows, when C is taller than wide), one per OpenMP thread: GEMMs and
 * the other kernels then share one thread team. Inside a parallel region,
 * for small products, or when OpenBLAS threads itself, it runs whole. */
static void blas_gemm(const gemm_plan *p, const void *A, const void *B, void *C, double beta) {
    bool by_cols = p->n >= p->m;
    int64_t len = by_cols ? p->n : p->m, es = (int64_t)ds_dtype_size(p->dtype);
    int parts = omp_in_parallel() ? 1 : omp_get_max_threads();
    if (parts > len / 32) parts = (int)(len / 32);
    if (parts < 2 || (int64_t)p->m * p->n * p->k <= BLAS_SMALL_MNK || openblas_get_num_threads() > 1) {
        blas_part(p, p->m, p->n, A, B, C, beta);
        return;
    }
    int64_t per = ((len + parts - 1) / parts + 15) / 16 * 16;    /* whole SIMD blocks */
    #pragma omp parallel for schedule(static) num_threads(parts)
    for (int i = 0; i < parts; i++) {
        int64_t s = i * per, e = s + per < len ? s + per : len;
        if (s >= e) continue;
        if (by_cols)
            blas_part(p, p->m, (int)(e - s), A, (const char *)B + (p->tb ? s * p->ldb : s) * es,
                      (char *)C + s * es, beta);
        else
            blas_part(p, (int)(e - s), p->n, (const char *)A + (p->ta ? s : s * p->lda) * es, B,
                      (char *)C + s * p->ldc * es, beta);
    }
}

/* C = alpha A B + beta C for one matrix of the batch; later visits of an
 * accumulated C (first false) add with beta 1. */
static int gemm_one(const gemm_plan *p, const void *A, const void *B, void *C, bool first) {
    double beta = first ? p->beta : 1.0;
    if (p->k == 0) {        /* nothing to multiply: C = beta C, which BLAS libraries treat unevenly */
        if (beta == 1) return 0;
        for (int i = 0; i < p->m; i++)
            for (int j = 0; j < p->n; j++) {
                int64_t at = (int64_t)i * p->ldc + j;
                ds_store(p->dtype, C, at, beta == 0 ? 0.0 : beta * ds_load(p->dtype, C, at));
            }
        return 0;
    }
    if (p->dtype == DS_F32 || p->dtype == DS_F64) {
        blas_gemm(p, A, B, C, beta);
        return 0;
    }
    if (p->widen) {         /* f32 copies through the f32 route, OpenBLAS and its threads */
        int ar = p->ta ? p->k : p->m, ac = p->ta ? p->m : p->k, br = p->tb ? p->n : p->k, bc = p->tb ? p->k : p->n;
        gemm_plan f = *p;
        f.dtype = DS_F32;
        f.lda = ac;
        f.ldb = bc;
        f.ldc = p->n;
        widen(p->wa, p->dtype, A, ar, ac, p->lda);
        widen(p->wb, p->dtype, B, br, bc, p->ldb);
        if (beta != 0) widen(p->wc, p->dtype, C, p->m, p->n, p->ldc);
        blas_gemm(&f, p->wa, p->wb, p->wc, beta);
        narrow(C, p->dtype, p->ldc, p->wc, p->m, p->n);
        return 0;
    }
    cpu_dnnl_arg args[3] = {
        { DNNL_ARG_SRC, &p->md[0], (void *)A },
        { DNNL_ARG_WEIGHTS, &p->md[1], (void *)B },
        { DNNL_ARG_DST, &p->md[2], C },
    };
    dnnl_status_t st = cpu_dnnl_exec(p->prim[first || p->beta == 1 ? 0 : 1], 3, args);
    return st == dnnl_success ? 0 : cpu_dnnl_fail("matmul", st);
}

/* The oneDNN matmul for the plan's shapes: alpha as an output scale, beta
 * as a sum post-op (left out for beta 0, so garbage in C never leaks). */
static dnnl_status_t plan_dnnl(gemm_plan *p, bool accumulate) {
    int64_t ad[2] = { p->m, p->k }, bd[2] = { p->k, p->n }, cd[2] = { p->m, p->n };
    int64_t as[2] = { p->ta ? 1 : p->lda, p->ta ? p->lda : 1 };
    int64_t bs[2] = { p->tb ? 1 : p->ldb, p->tb ? p->ldb : 1 };
    int64_t cs[2] = { p->ldc, 1 };
    dnnl_status_t st = cpu_dnnl_md(&p->md[0], 2, ad, as, p->dtype);
    if (st == dnnl_success) st = cpu_dnnl_md(&p->md[1], 2, bd, bs, p->dtype);
    if (st == dnnl_success) st = cpu_dnnl_md(&p->md[2], 2, cd, cs, p->dtype);
    dnnl_matmul_desc_t desc;
    if (st == dnnl_success) st = dnnl_matmul_desc_init(&desc, &p->md[0], &p->md[1], NULL, &p->md[2]);
    int variants = accumulate && p->beta != 1 ? 2 : 1;
    for (int v = 0; v < variants && st == dnnl_success; v++) {
        double beta = v == 0 ? p->beta : 1.0;
        float alpha = (float)p->alpha;
        dnnl_primitive_attr_t attr = NULL;
        dnnl_post_ops_t ops = NULL;
        dnnl_primitive_desc_t pd = NULL;
        st = dnnl_primitive_attr_create(&attr);
        if (st == dnnl_success && alpha != 1) st = dnnl_primitive_attr_set_output_scales(attr, 1, 0, &alpha);
        if (st == dnnl_success && beta != 0) {
            st = dnnl_post_ops_create(&ops);
            if (st == dnnl_success) st = dnnl_post_ops_append_sum(ops, (float)beta);
            if (st == dnnl_success) st = dnnl_primitive_attr_set_post_ops(attr, ops);
        }
        if (st == dnnl_success) st = dnnl_primitive_desc_create(&pd, &desc, attr, cpu_dnnl_engine(), NULL);
        if (st == dnnl_success) st = dnnl_primitive_create(&p->prim[v], pd);
        if (pd) dnnl_primitive_desc_destroy(pd);
        if (ops) dnnl_post_ops_destroy(ops);
        if (attr) dnnl_primitive_attr_destroy(attr);
    }
    return st;
}

/* Plans bf16/f16: oneDNN where it has the type, f32 widening where not. */
static int plan_half(gemm_plan *p, bool accumulate) {
    dnnl_status_t st = cpu_dnnl_engine() ? plan_dnnl(p, accumulate) : dnnl_unimplemented;
    if (st == dnnl_success) return 0;
    if (st != dnnl_unimplemented) return cpu_dnnl_fail("matmul setup", st);
    for (int v = 0; v < 2; v++)
        if (p->prim[v]) { dnnl_primitive_destroy(p->prim[v]); p->prim[v] = NULL; }
    p->widen = true;
    p->wa = malloc(sizeof(float) * ((size_t)p->m * p->k + (size_t)p->k * p->n + (size_t)p->m * p->n));
    if (!p->wa) return ds_kernel_fail("gemm: out of memory for f32 copies");
    p->wb = p->wa + (size_t)p->m * p->k;
    p->wc = p->wb + (size_t)p->k * p->n;
    return 0;
}

static int64_t batch_offset(const ds_kview *v, int nb, int64_t i) {
    int64_t off = 0;
    for (int d = nb - 1; d >= 0; d--) {
        off += (i % v->shape[d]) * v->stride[d];
        i /= v->shape[d];
    }
    return off;
}

/* First visit of c's matrix for batch i: every summed (stride 0) index is 0. */
static bool first_visit(const ds_kview *c, int nb, int64_t i) {
    for (int d = nb - 1; d >= 0; d--) {
        if (c->stride[d] == 0 && i % c->shape[d] != 0) return false;
        i /= c->shape[d];
    }
    return true;
}

static int gemm_at(const gemm_plan *p, const ds_kview *c, const ds_kview *a, const ds_kview *b, int nb, int64_t i,
                   size_t es) {
    const char *A = (const char *)a->data + batch_offset(a, nb, i) * (int64_t)es;
    const char *B = (const char *)b->data + batch_offset(b, nb, i) * (int64_t)es;
    char *C = (char *)c->data + batch_offset(c, nb, i) * (int64_t)es;
    return gemm_one(p, A, B, C, first_visit(c, nb, i));
}

static int run_batch(ds_kview c, ds_kview a, ds_kview b, double alpha, double beta) {
    ds_gemm_layout la = { 0 }, lb = { 0 }, lc = { 0 };    /* a and b have none when k is 0 */
    ds_gemm_mat_layout(&a, &la);
    ds_gemm_mat_layout(&b, &lb);
    ds_gemm_mat_layout(&c, &lc);
    int nb = c.ndim - 2;
    gemm_plan p = {
        .dtype = c.dtype, .ta = la.trans, .tb = lb.trans,
        .m = (int)c.shape[nb], .n = (int)c.shape[nb + 1], .k = (int)a.shape[nb + 1],
        .lda = la.ld, .ldb = lb.ld, .ldc = lc.ld, .alpha = alpha, .beta = beta,
    };
    int64_t batch = 1;
    bool accumulate = false;
    for (int d = 0; d < nb; d++) {
        batch *= c.shape[d];
        if (c.stride[d] == 0) accumulate = true;
    }
    if ((p.dtype == DS_BF16 || p.dtype == DS_F16) && p.k > 0 && plan_half(&p, accumulate)) return -1;
    size_t es = ds_dtype_size(c.dtype);
    bool spread = !accumulate && batch > 1 && (p.dtype == DS_F32 || p.dtype == DS_F64)
                  && (int64_t)p.m * p.n * p.k <= BLAS_SMALL_MNK;
    int err = 0;
    if (spread) {
        #pragma omp parallel for schedule(static) reduction(|:err)
        for (int64_t i = 0; i < batch; i++) err |= gemm_at(&p, &c, &a, &b, nb, i, es) != 0;
    } else {       /* not even an inactive region: blas_gemm opens its own team */
        for (int64_t i = 0; i < batch && !err; i++) err = gemm_at(&p, &c, &a, &b, nb, i, es) != 0;
    }
    for (int v = 0; v < 2; v++)
        if (p.prim[v]) dnnl_primitive_destroy(p.prim[v]);
    free(p.wa);
    return err ? -1 : 0;
}

/* Checks, puts C row-major, compacts operands BLAS cannot read, then runs. */
static int cpu_gemm(ds_kview c, ds_kview a, ds_kview b, double alpha, double beta) {
    int rc = ds_gemm_prepare(&c, &a, &b, NULL);
    if (rc) return rc < 0 ? -1 : 0;
    int64_t k = a.shape[a.ndim - 1];
    void *buf[2] = { NULL, NULL };
    if (ds_gemm_needs_copy(&a, k)) rc = compact(&a, &buf[0]);
    if (rc == 0 && ds_gemm_needs_copy(&b, k)) rc = compact(&b, &buf[1]);
    if (rc == 0) {
        ds_gemm_flatten(&c, &a, &b);
        rc = run_batch(c, a, b, alpha, beta);
    }
    free(buf[0]);
    free(buf[1]);
    return rc;
}

/* c = a b + bias: the bias copied down c's rows, then the GEMM adds into
 * them, as a linear without the entry runs them; one call, as the GPU's
 * epilogue is one launch. */
static int cpu_gemm_bias(ds_kview c, ds_kview a, ds_kview b, ds_kview bias) {
    ds_kview rows = bias;
    rows.ndim = 2;
    rows.shape[0] = c.shape[0];
    rows.shape[1] = c.shape[1];
    rows.stride[0] = 0;
    rows.stride[1] = bias.stride[0];
    if (ds_cpu_core.copy(c, rows)) return -1;
    return cpu_gemm(c, a, b, 1.0, 1.0);
}

/* c = a b and grad = the row sums of a, a being a transposed row-major
 * gradient g [k, m]: grad sums g's columns with the reduce kernel a sum
 * over g's rows runs, so both gradients are a linear's without the entry. */
static int cpu_gemm_bias_grad(ds_kview c, ds_kview a, ds_kview b, ds_kview grad) {
    int64_t m = a.shape[0], k = a.shape[1];
    ds_kview g = a;
    if (a.ndim == 2) ds_gemm_transpose(&g);
    if (a.ndim != 2 || g.stride[1] != 1 || g.stride[0] != m)
        return ds_kernel_fail("gemm_bias_grad: the gradient is not a transposed row-major matrix");
    if (cpu_gemm(c, a, b, 1.0, 0.0)) return -1;
    return ds_cpu_reduce.reduce(DS_RED_SUM, grad, g, 1, k, m, 0);
}

/* The linear's epilogues as one call each; no GELU epilogues: MLPs run
 * gemm and the separate kernels */
const ds_kernels_blas ds_cpu_blas = { .gemm = cpu_gemm, .gemm_bias = cpu_gemm_bias,
                                      .gemm_bias_grad = cpu_gemm_bias_grad };
