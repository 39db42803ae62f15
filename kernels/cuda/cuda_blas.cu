/* Batched GEMM on the GPU. f32, bf16 and f16 go to cuBLASLt with f32
 * compute (TF32 only when switched on), f64 to cuBLAS's strided batched
 * dgemm, which cuBLASLt lacks on many configurations. The view handling is
 * the CPU's (ds_gemm_layout.h): an operand with a unit stride in one matrix dim is
 * used in place (the other stride becomes the leading dimension, a unit row
 * stride a transpose flag), any other is compacted first; batch dims are
 * merged and folded into the matrices where memory allows. The largest
 * remaining batch dim of c runs as one strided batched call and the others
 * loop on the host; dims where c has stride 0 are summed by calls queued in
 * stream order, beta on the first and 1 after. cuBLAS is column-major, so
 * the row-major c = a b runs as c^T = b^T a^T. */
#include "cuda_common.cuh"
#include "cuda_blas.h"
#include "../ds_gemm_layout.h"
#include "../ds_fp8.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <limits.h>
#include <pthread.h>
#include <string.h>

#define BLAS_MAX_DEVICES 64
#define LT_MAX_WORKSPACE ((uint64_t)32 << 20)   /* what cuBLASLt asks for at most on Hopper */

static int tf32_on[2];

extern "C" void ds_cuda_set_tf32(ds_tf32_use use, int on) { tf32_on[use] = on != 0; }
extern "C" int ds_cuda_tf32(ds_tf32_use use) { return tf32_on[use]; }

/* ---- handles, one per device, made on first use ---- */

static cublasLtHandle_t lt_handles[BLAS_MAX_DEVICES];
static cublasHandle_t blas_handles[BLAS_MAX_DEVICES];

static int blas_ok(cublasStatus_t st, const char *call) {
    if (st == CUBLAS_STATUS_SUCCESS) return 0;
    return ds_kernel_fail("%s: %s", call, cublasGetStatusString(st));
}

static int device_index(int *dev) {
    DS_CUDA_CHECK(cudaGetDevice(dev));
    if (*dev < 0 || *dev >= BLAS_MAX_DEVICES)
        return ds_kernel_fail("gemm: device %d is beyond the %d supported", *dev, BLAS_MAX_DEVICES);
    return 0;
}

static int lt_handle(cublasLtHandle_t *h) {
    int dev;
    if (device_index(&dev)) return -1;
    if (!lt_handles[dev]) {
        cublasLtHandle_t made;
        if (blas_ok(cublasLtCreate(&made), "cublasLtCreate")) return -1;
        lt_handles[dev] = made;
    }
    *h = lt_handles[dev];
    return 0;
}

static int blas_handle(cublasHandle_t *h) {
    int dev;
    if (device_index(&dev)) return -1;
    if (!blas_handles[dev]) {
        cublasHandle_t made;
        if (blas_ok(cublasCreate(&made), "cublasCreate")) return -1;
        blas_handles[dev] = made;
    }
    if (blas_ok(cublasSetStream(blas_handles[dev], ds_cuda_stream()), "cublasSetStream")) return -1;
    *h = blas_handles[dev];
    return 0;
}

/* Replaces v by a contiguous device copy in *buf (scratch); batch dims that
 * repeat one matrix (stride 0) still repeat it instead of being copied. */
static int compact(ds_kview *v, void **buf) {
    ds_kview src, dst;
    int64_t n = ds_gemm_packed(v, &src, &dst);
    *buf = ds_cuda_scratch((size_t)n * ds_dtype_size(v->dtype));
    if (!*buf) return -1;
    dst.data = *buf;
    if (ds_cuda_core.copy(dst, src)) return -1;
    ds_gemm_use_packed(v, dst);
    return 0;
}

/* ---- k = 0: c = beta c, once per matrix of c ---- */

__global__ void scale_kernel(ds_kview c, int64_t n, double beta) {
    DS_CUDA_LOOP(i, n) {
        int64_t at = ds_cuda_offset(c, i);
        ds_store(c.dtype, c.data, at, beta == 0 ? 0.0 : beta * ds_load(c.dtype, c.data, at));
    }
}

static int scale_c(ds_kview c, double beta) {
    if (beta == 1) return 0;
    for (int d = 0; d < c.ndim - 2; d++)
        if (c.stride[d] == 0) c.shape[d] = 1;
    int64_t n = ds_kview_numel(&c);
    if (n == 0) return 0;
    scale_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(c, n, beta);
    return ds_cuda_launched("gemm scale_kernel");
}

/* ---- one product, laid out for BLAS ---- */

/* What cuBLASLt does on the way out of the product. */
typedef struct {
    cublasLtEpilogue_t kind;      /* CUBLASLT_EPILOGUE_DEFAULT for nothing */
    const void *bias;             /* the bias, or the bias gradient written; NULL for none */
    ds_kview aux;                 /* the GELU's input, written forward and read backward, in c's
                                   * layout; data NULL for none */
} lt_epilogue;

typedef struct {
    ds_dtype dtype;
    int64_t m, n, k;
    ds_gemm_layout la, lb, lc;
    double alpha;
    int bdim;                     /* batch dim run by one strided batched call, -1 for none */
    int64_t count;                /* its size */
    lt_epilogue ep;
} gemm_plan;

static cudaDataType_t cuda_type(ds_dtype t) {
    switch (t) {
    case DS_F64: return CUDA_R_64F;
    case DS_BF16: return CUDA_R_16BF;
    case DS_F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
    }
}

static int64_t batch_stride(const gemm_plan *p, const ds_kview *v) { return p->bdim >= 0 ? v->stride[p->bdim] : 0; }

/* The largest power of two, up to 256 bytes, dividing the address of every
 * matrix and column v presents: cuBLASLt's heuristic assumes 256 unless
 * told, and a view may start anywhere. */
/* The largest power of two up to 256 that divides bits. */
static uint32_t bits_align(uint64_t bits) {
    uint32_t a = 1;
    while (a < 256 && !(bits & a)) a <<= 1;
    return a;
}

static uint32_t align_of(const ds_kview *v, const ds_gemm_layout *l) {
    int64_t es = (int64_t)ds_dtype_size(v->dtype);
    uint64_t bits = (uint64_t)(uintptr_t)v->data | (uint64_t)(l->ld * es);
    for (int d = 0; d < v->ndim - 2; d++)
        if (v->shape[d] > 1) bits |= (uint64_t)(v->stride[d] * es);
    return bits_align(bits);
}

/* A cuBLASLt matmul set up once for every host-loop visit of a batch. */
typedef struct {
    cublasLtHandle_t h;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;      /* Lt's A (our b), B (our a), and C = D */
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulHeuristicResult_t algo;
    void *ws;
} lt_call;

static void lt_release(lt_call *L) {
    if (L->ws) ds_cuda_scratch_free(L->ws);
    if (L->pref) cublasLtMatmulPreferenceDestroy(L->pref);
    if (L->lc) cublasLtMatrixLayoutDestroy(L->lc);
    if (L->lb) cublasLtMatrixLayoutDestroy(L->lb);
    if (L->la) cublasLtMatrixLayoutDestroy(L->la);
    if (L->op) cublasLtMatmulDescDestroy(L->op);
}

/* Scratch for the chosen algorithm, per call. */
static int lt_workspace(lt_call *L) {
    if (L->algo.workspaceSize > 0 && !(L->ws = ds_cuda_scratch(L->algo.workspaceSize))) return -1;
    return 0;
}

static int lt_layout(cublasLtMatrixLayout_t *l, ds_dtype t, int64_t rows, int64_t cols, int64_t ld,
                     const gemm_plan *p, int64_t stride) {
    if (blas_ok(cublasLtMatrixLayoutCreate(l, cuda_type(t), (uint64_t)rows, (uint64_t)cols, ld),
                "cublasLtMatrixLayoutCreate"))
        return -1;
    if (p->bdim < 0) return 0;
    int32_t count = (int32_t)p->count;
    if (blas_ok(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count),
                "cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)"))
        return -1;
    return blas_ok(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                    sizeof stride),
                   "cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)");
}

static int lt_pref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, uint32_t value,
                   const char *name) {
    return blas_ok(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof value), name);
}

/* ---- the heuristic's choice, cached per distinct product: a training
 * step repeats the same few dozen shapes, and the query costs tens of
 * microseconds of host time each call. Entries live for the process. ---- */

#define LT_CACHE 1024

/* Everything the heuristic is asked about. Zeroed before filling, so that
 * memcmp sees no stray padding. */
typedef struct {
    int dev, tf32, ta, tb;
    int fp8;                      /* 1 + 2 a's format + b's for fp8 products, 0 for others */
    ds_dtype dtype;
    cublasLtEpilogue_t epilogue;
    int64_t m, n, k, lda, ldb, ldc, count, sa, sb, sc, ldaux;
    uint32_t aa, ab, ac, aaux, abias;
} lt_key;

static struct {
    pthread_mutex_t lock;
    int used;
    lt_key key[LT_CACHE];
    cublasLtMatmulHeuristicResult_t algo[LT_CACHE];
} lt_cache = { PTHREAD_MUTEX_INITIALIZER, 0, {}, {} };

/* The cached algorithm for key into *algo: 1, or 0 when not cached. */
static int lt_cache_get(const lt_key *key, cublasLtMatmulHeuristicResult_t *algo) {
    pthread_mutex_lock(&lt_cache.lock);
    int hit = 0;
    for (int i = 0; i < lt_cache.used && !hit; i++)
        if (memcmp(&lt_cache.key[i], key, sizeof *key) == 0) {
            *algo = lt_cache.algo[i];
            hit = 1;
        }
    pthread_mutex_unlock(&lt_cache.lock);
    return hit;
}

/* Past LT_CACHE distinct products the heuristic simply runs every call. */
static void lt_cache_put(const lt_key *key, const cublasLtMatmulHeuristicResult_t *algo) {
    pthread_mutex_lock(&lt_cache.lock);
    if (lt_cache.used < LT_CACHE) {
        lt_cache.key[lt_cache.used] = *key;
        lt_cache.algo[lt_cache.used++] = *algo;
    }
    pthread_mutex_unlock(&lt_cache.lock);
}

/* The heuristic's answer, found or cached: its workspace, or the error
 * when it had no algorithm. */
static int lt_found(lt_call *L, const gemm_plan *p, const ds_kview *a, const ds_kview *b, uint32_t ac) {
    if (L->algo.state != CUBLAS_STATUS_SUCCESS)
        return ds_kernel_fail("cublasLtMatmulAlgoGetHeuristic: no algorithm for a %lldx%lldx%lld product of %d-byte "
                              "elements (alignments %u, %u, %u bytes)", (long long)p->m, (long long)p->n,
                              (long long)p->k, (int)ds_dtype_size(p->dtype), align_of(a, &p->la),
                              align_of(b, &p->lb), ac);
    return lt_workspace(L);
}

static int lt_setup(lt_call *L, const gemm_plan *p, const ds_kview *c, const ds_kview *a, const ds_kview *b) {
    if (lt_handle(&L->h)) return -1;
    bool tf32 = p->dtype == DS_F32 && tf32_on[DS_TF32_MATMUL];
    cublasComputeType_t ct = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    if (blas_ok(cublasLtMatmulDescCreate(&L->op, ct, CUDA_R_32F), "cublasLtMatmulDescCreate")) return -1;
    cublasOperation_t ta = p->lb.trans ? CUBLAS_OP_T : CUBLAS_OP_N, tb = p->la.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (blas_ok(cublasLtMatmulDescSetAttribute(L->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta),
                "cublasLtMatmulDescSetAttribute(TRANSA)")
        || blas_ok(cublasLtMatmulDescSetAttribute(L->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb),
                   "cublasLtMatmulDescSetAttribute(TRANSB)"))
        return -1;
    const lt_epilogue *ep = &p->ep;
    /* the aux matrix in c's layout: its row stride is Lt's leading dimension of D^T */
    ds_gemm_layout laux = { false, ep->aux.data ? (int)ep->aux.stride[0] : 0 };
    if (ep->kind != CUBLASLT_EPILOGUE_DEFAULT) {
        if (blas_ok(cublasLtMatmulDescSetAttribute(L->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep->kind, sizeof ep->kind),
                    "cublasLtMatmulDescSetAttribute(EPILOGUE)"))
            return -1;
        if (ep->bias && blas_ok(cublasLtMatmulDescSetAttribute(L->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ep->bias,
                                                               sizeof ep->bias),
                                "cublasLtMatmulDescSetAttribute(BIAS_POINTER)"))
            return -1;
        /* the vector (bias, or the bias gradient written) in c's dtype, said
         * outright rather than left to the default's exceptions */
        int32_t bt = (int32_t)cuda_type(p->dtype);
        if (ep->bias && blas_ok(cublasLtMatmulDescSetAttribute(L->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt,
                                                               sizeof bt),
                                "cublasLtMatmulDescSetAttribute(BIAS_DATA_TYPE)"))
            return -1;
        /* the aux's dtype is left to its default, D's: set for these types it is refused */
        int64_t ld = laux.ld;
        if (ep->aux.data
            && (blas_ok(cublasLtMatmulDescSetAttribute(L->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                       &ep->aux.data, sizeof ep->aux.data),
                        "cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_POINTER)")
                || blas_ok(cublasLtMatmulDescSetAttribute(L->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld),
                           "cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_LD)")))
            return -1;
    }
    if (lt_layout(&L->la, p->dtype, p->lb.trans ? p->k : p->n, p->lb.trans ? p->n : p->k, p->lb.ld, p,
                  batch_stride(p, b))
        || lt_layout(&L->lb, p->dtype, p->la.trans ? p->m : p->k, p->la.trans ? p->k : p->m, p->la.ld, p,
                     batch_stride(p, a))
        || lt_layout(&L->lc, p->dtype, p->n, p->m, p->lc.ld, p, batch_stride(p, c)))
        return -1;
    uint32_t ac = align_of(c, &p->lc);
    lt_key key;
    memset(&key, 0, sizeof key);
    if (device_index(&key.dev)) return -1;
    key.tf32 = tf32_on[DS_TF32_MATMUL];
    key.ta = p->lb.trans;
    key.tb = p->la.trans;
    key.dtype = p->dtype;
    key.epilogue = ep->kind;
    key.m = p->m, key.n = p->n, key.k = p->k;
    key.lda = p->la.ld, key.ldb = p->lb.ld, key.ldc = p->lc.ld;
    key.count = p->bdim >= 0 ? p->count : 0;
    key.sa = batch_stride(p, a), key.sb = batch_stride(p, b), key.sc = batch_stride(p, c);
    key.aa = align_of(a, &p->la), key.ab = align_of(b, &p->lb), key.ac = ac;
    /* the heuristic reads the aux and bias pointers' alignments too */
    if (ep->aux.data) key.ldaux = laux.ld, key.aaux = align_of(&ep->aux, &laux);
    if (ep->bias) key.abias = bits_align((uint64_t)(uintptr_t)ep->bias);
    if (lt_cache_get(&key, &L->algo)) return lt_found(L, p, a, b, ac);
    if (blas_ok(cublasLtMatmulPreferenceCreate(&L->pref), "cublasLtMatmulPreferenceCreate")) return -1;
    uint64_t ws = LT_MAX_WORKSPACE;
    if (blas_ok(cublasLtMatmulPreferenceSetAttribute(L->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                     sizeof ws),
                "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)")
        || lt_pref(L->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_of(b, &p->lb),
                   "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_A_BYTES)")
        || lt_pref(L->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_of(a, &p->la),
                   "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_B_BYTES)")
        || lt_pref(L->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, ac,
                   "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_C_BYTES)")
        || lt_pref(L->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ac,
                   "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_D_BYTES)"))
        return -1;
    /* split-K partial sums of bf16/f16 products stay in f32, never in the output type */
    if (p->dtype != DS_F32
        && lt_pref(L->pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
                   "cublasLtMatmulPreferenceSetAttribute(REDUCTION_SCHEME_MASK)"))
        return -1;
    int found = 0;
    if (blas_ok(cublasLtMatmulAlgoGetHeuristic(L->h, L->op, L->la, L->lb, L->lc, L->lc, L->pref, 1, &L->algo,
                                               &found),
                "cublasLtMatmulAlgoGetHeuristic"))
        return -1;
    /* a product with no algorithm is cached too: its callers fall back at once */
    if (found < 1) L->algo.state = CUBLAS_STATUS_NOT_SUPPORTED;
    lt_cache_put(&key, &L->algo);
    return lt_found(L, p, a, b, ac);
}

static int lt_run(const lt_call *L, const gemm_plan *p, const void *A, const void *B, void *C, double beta) {
    float alpha32 = (float)p->alpha, beta32 = (float)beta;
    return blas_ok(cublasLtMatmul(L->h, L->op, &alpha32, B, L->la, A, L->lb, &beta32, C, L->lc, C, L->lc,
                                  &L->algo.algo, L->ws, L->algo.workspaceSize, ds_cuda_stream()),
                   "cublasLtMatmul");
}

static int dgemm_run(cublasHandle_t h, const gemm_plan *p, const ds_kview *c, const ds_kview *a, const ds_kview *b,
                     const void *A, const void *B, void *C, double beta) {
    cublasOperation_t ta = p->lb.trans ? CUBLAS_OP_T : CUBLAS_OP_N, tb = p->la.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    int count = p->bdim >= 0 ? (int)p->count : 1;
    return blas_ok(cublasDgemmStridedBatched(h, ta, tb, (int)p->n, (int)p->m, (int)p->k, &p->alpha,
                                             (const double *)B, (int)p->lb.ld, batch_stride(p, b),
                                             (const double *)A, (int)p->la.ld, batch_stride(p, a), &beta,
                                             (double *)C, (int)p->lc.ld, batch_stride(p, c), count),
                   "cublasDgemmStridedBatched");
}

/* Runs the coalesced, folded product: c's largest batch dim with a nonzero
 * stride in one call, every other batch index in a host loop. */
static int run_batch(ds_kview c, ds_kview a, ds_kview b, double alpha, double beta, const lt_epilogue &ep) {
    int nb = c.ndim - 2;
    gemm_plan p = { c.dtype, c.shape[nb], c.shape[nb + 1], a.shape[nb + 1], {}, {}, {}, alpha, -1, 1, ep };
    if (p.k == 0) return scale_c(c, beta);
    ds_gemm_mat_layout(&a, &p.la);
    ds_gemm_mat_layout(&b, &p.lb);
    ds_gemm_mat_layout(&c, &p.lc);
    for (int d = 0; d < nb; d++)
        if (c.stride[d] != 0 && c.shape[d] > 1 && c.shape[d] <= INT_MAX && (p.bdim < 0 || c.shape[d] > p.count)) {
            p.bdim = d;
            p.count = c.shape[d];
        }
    int64_t outer = 1;
    for (int d = 0; d < nb; d++)
        if (d != p.bdim) outer *= c.shape[d];
    lt_call L = {};
    cublasHandle_t dh = NULL;
    int rc = c.dtype == DS_F64 ? blas_handle(&dh) : lt_setup(&L, &p, &c, &a, &b);
    int64_t es = (int64_t)ds_dtype_size(c.dtype);
    for (int64_t o = 0; o < outer && rc == 0; o++) {
        int64_t rem = o, oa = 0, ob = 0, oc = 0;
        bool first = true;
        for (int d = nb - 1; d >= 0; d--) {
            if (d == p.bdim) continue;
            int64_t i = rem % c.shape[d];
            rem /= c.shape[d];
            oa += i * a.stride[d];
            ob += i * b.stride[d];
            oc += i * c.stride[d];
            if (c.stride[d] == 0 && i != 0) first = false;
        }
        const char *A = (const char *)a.data + oa * es, *B = (const char *)b.data + ob * es;
        char *C = (char *)c.data + oc * es;
        double be = first ? beta : 1.0;
        rc = c.dtype == DS_F64 ? dgemm_run(dh, &p, &c, &a, &b, A, B, C, be) : lt_run(&L, &p, A, B, C, be);
    }
    lt_release(&L);
    return rc;
}

/* Checks, puts c row-major, compacts operands BLAS cannot read, then runs. */
static int gemm_impl(ds_kview c, ds_kview a, ds_kview b, double alpha, double beta, const lt_epilogue &ep) {
    bool transposed;
    int rc = ds_gemm_prepare(&c, &a, &b, &transposed);
    if (rc) return rc < 0 ? -1 : 0;
    if (transposed && ep.kind != CUBLASLT_EPILOGUE_DEFAULT)
        return ds_kernel_fail("gemm epilogue: the output's matrices must be row-major");
    int64_t k = a.shape[a.ndim - 1];
    void *buf[2] = { NULL, NULL };
    if (ds_gemm_needs_copy(&a, k)) rc = compact(&a, &buf[0]);
    if (rc == 0 && ds_gemm_needs_copy(&b, k)) rc = compact(&b, &buf[1]);
    if (rc == 0) {
        ds_gemm_flatten(&c, &a, &b);
        rc = run_batch(c, a, b, alpha, beta, ep);
    }
    if (buf[0]) ds_cuda_scratch_free(buf[0]);
    if (buf[1]) ds_cuda_scratch_free(buf[1]);
    return rc;
}

static int cuda_gemm(ds_kview c, ds_kview a, ds_kview b, double alpha, double beta) {
    return gemm_impl(c, a, b, alpha, beta, lt_epilogue{ CUBLASLT_EPILOGUE_DEFAULT, NULL, {} });
}

/* What every epilogue needs: a float dtype but f64, no summed batch dims
 * of c, a nonzero inner dim, and a vector (bias, or the bias gradient, of n
 * elements; data NULL for none) of c's dtype, unit stride, on 16 bytes. */
static int epilogue_check(const ds_kview &c, const ds_kview &a, const ds_kview &vec, int64_t n) {
    if (c.dtype == DS_F64 || !ds_dtype_is_float(c.dtype))
        return ds_kernel_fail("gemm epilogue: needs f32, bf16 or f16, got a %d-byte dtype %d",
                              (int)ds_dtype_size(c.dtype), (int)c.dtype);
    if (c.ndim < 2 || a.ndim != c.ndim || a.shape[c.ndim - 1] == 0)
        return ds_kernel_fail("gemm epilogue: needs views of one ndim >= 2 and a nonzero inner dim");
    for (int d = 0; d < c.ndim - 2; d++)
        if (c.stride[d] == 0 && c.shape[d] > 1)
            return ds_kernel_fail("gemm epilogue: the output cannot sum over batch dim %d", d);
    if (vec.data && (vec.ndim != 1 || vec.shape[0] != n || vec.dtype != c.dtype || (n > 1 && vec.stride[0] != 1)))
        return ds_kernel_fail("gemm epilogue: the bias must be a unit-stride [%lld] vector of the output's dtype",
                              (long long)n);
    if ((uintptr_t)vec.data % 16)
        return ds_kernel_fail("gemm epilogue: the bias must start on 16 bytes (a view one element in does not)");
    return 0;
}

static int cuda_gemm_bias(ds_kview c, ds_kview a, ds_kview b, ds_kview bias) {
    if (epilogue_check(c, a, bias, c.shape[c.ndim > 0 ? c.ndim - 1 : 0])) return -1;
    cublasLtEpilogue_t e = bias.data ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    return gemm_impl(c, a, b, 1.0, 0.0, lt_epilogue{ e, bias.data, {} });
}

/* cuBLASLt runs the row-major c = a b as the column-major c^T = b^T a^T:
 * a is its B, and the sums of a's rows over k are BGRADB's, one per
 * column of its D (a row of c). */
static int cuda_gemm_bias_grad(ds_kview c, ds_kview a, ds_kview b, ds_kview grad) {
    if (!grad.data) return ds_kernel_fail("gemm bias gradient: no vector to write");
    if (epilogue_check(c, a, grad, c.shape[c.ndim > 1 ? c.ndim - 2 : 0])) return -1;
    if (c.ndim != 2) return ds_kernel_fail("gemm bias gradient: needs matrices, got %d dims", c.ndim);
    return gemm_impl(c, a, b, 1.0, 0.0, lt_epilogue{ CUBLASLT_EPILOGUE_BGRADB, grad.data, {} });
}

/* What the GELU epilogues add: nonempty matrices (an empty product runs
 * no kernel, which would leave the bias gradient unwritten), and aux
 * shaped and typed like c, row-major, with cuBLASLt's limits on it: a
 * leading dimension of a multiple of 8 elements, at least c's row, and
 * (as for the bias) a start on 16 bytes. */
static int aux_check(const ds_kview &c, const ds_kview &aux) {
    if (c.ndim != 2 || aux.ndim != 2 || c.shape[0] == 0 || c.shape[1] == 0)
        return ds_kernel_fail("gemm GELU epilogue: needs nonempty matrices, got %d and %d dims", c.ndim, aux.ndim);
    if (aux.dtype != c.dtype || aux.shape[0] != c.shape[0] || aux.shape[1] != c.shape[1])
        return ds_kernel_fail("gemm GELU epilogue: the GELU input must have the output's shape and dtype");
    if (aux.stride[1] != 1 || aux.stride[0] < aux.shape[1] || aux.stride[0] % 8 || aux.stride[0] > INT_MAX)
        return ds_kernel_fail("gemm GELU epilogue: the GELU input's rows must be unit-stride, %lld elements apart "
                              "is not a multiple of 8 of at least %lld", (long long)aux.stride[0],
                              (long long)aux.shape[1]);
    if ((uintptr_t)aux.data % 16)
        return ds_kernel_fail("gemm GELU epilogue: the GELU input must start on 16 bytes");
    return 0;
}

static int cuda_gemm_bias_gelu(ds_kview c, ds_kview aux, ds_kview a, ds_kview b, ds_kview bias) {
    if (epilogue_check(c, a, bias, c.shape[c.ndim > 0 ? c.ndim - 1 : 0]) || aux_check(c, aux)) return -1;
    cublasLtEpilogue_t e = bias.data ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    return gemm_impl(c, a, b, 1.0, 0.0, lt_epilogue{ e, bias.data, aux });
}

/* Not DGELU_BGRAD: on an H100 (cuBLASLt 13) that epilogue takes a generic
 * kernel at half DGELU's speed, more than the bias gradient costs in the
 * weight gradient's GEMM (BGRADB). */
static int cuda_gemm_gelu_grad(ds_kview c, ds_kview aux, ds_kview a, ds_kview b) {
    ds_kview none = {};
    if (epilogue_check(c, a, none, c.shape[c.ndim > 0 ? c.ndim - 1 : 0]) || aux_check(c, aux)) return -1;
    return gemm_impl(c, a, b, 1.0, 0.0, lt_epilogue{ CUBLASLT_EPILOGUE_DGELU, NULL, aux });
}

/* ---- fp8: c [m, n] = a [m, k] b [n, k]^T, a and b u8 codes row-major
 * (cuBLASLt's TN layout, the only one its fp8 kernels take), each scaled by
 * its meta's scale_inv on the device (A/B_SCALE_POINTER), f32 accumulation,
 * the bias in the epilogue. sm_89+, dims multiples of 16, operands and bias
 * on 16 bytes (their alignment told to the heuristic), not both e5m2:
 * anything else is refused for the caller's fallback. ---- */

/* The alignment every pointer of the product shares, for the heuristic. */
static uint32_t fp8_align(const ds_kview *c, const ds_kview *a, const ds_kview *b, const void *bias) {
    return bits_align((uint64_t)(uintptr_t)a->data | (uint64_t)(uintptr_t)b->data | (uint64_t)(uintptr_t)c->data
                      | (uint64_t)(uintptr_t)bias);
}

static int fp8_applies(const ds_kview *c, const ds_kview *a, const ds_kview *b, const void *bias, int af, int bf) {
    int dev, major, minor;
    DS_CUDA_CHECK(cudaGetDevice(&dev));
    DS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    DS_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    if (major * 10 + minor < 89) return ds_kernel_fail("fp8 GEMMs need sm_89 or later, this GPU is sm_%d%d", major, minor);
    int64_t m = a->shape[0], k = a->shape[1], n = b->shape[0];
    if (m == 0 || n == 0 || k == 0 || m % 16 || n % 16 || k % 16)
        return ds_kernel_fail("fp8 GEMMs take nonzero dims that are multiples of 16, got %lldx%lldx%lld", (long long)m,
                              (long long)n, (long long)k);
    if (af == DS_FP8_E5M2 && bf == DS_FP8_E5M2) return ds_kernel_fail("no fp8 GEMM takes two e5m2 operands");
    if (!ds_kview_is_contiguous(a) || !ds_kview_is_contiguous(b) || !ds_kview_is_contiguous(c)
        || fp8_align(c, a, b, bias) < 16)
        return ds_kernel_fail("fp8 GEMMs take contiguous operands and a bias on 16 bytes");
    return 0;
}

static cudaDataType_t fp8_type(int f) { return f == DS_FP8_E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

static int fp8_attr(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, const void *v, size_t n,
                    const char *name) {
    return blas_ok(cublasLtMatmulDescSetAttribute(op, attr, v, n), name);
}

static int fp8_setup(lt_call *L, const ds_kview *c, const ds_kview *a, const ds_kview *b, const float *sa,
                     const float *sb, int af, int bf, const void *bias) {
    int64_t m = a->shape[0], k = a->shape[1], n = b->shape[0];
    if (lt_handle(&L->h) || blas_ok(cublasLtMatmulDescCreate(&L->op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                                    "cublasLtMatmulDescCreate"))
        return -1;
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtEpilogue_t ep = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    int32_t bt = (int32_t)cuda_type(c->dtype);
    /* Lt's A is our b and its B our a, as for every product here (c^T = b a^T) */
    if (fp8_attr(L->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta, "cublasLtMatmulDescSetAttribute(TRANSA)")
        || fp8_attr(L->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb, "cublasLtMatmulDescSetAttribute(TRANSB)")
        || fp8_attr(L->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sb, sizeof sb,
                    "cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)")
        || fp8_attr(L->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sa, sizeof sa,
                    "cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)")
        || fp8_attr(L->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep, "cublasLtMatmulDescSetAttribute(EPILOGUE)")
        || (bias && (fp8_attr(L->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias,
                              "cublasLtMatmulDescSetAttribute(BIAS_POINTER)")
                     || fp8_attr(L->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt,
                                 "cublasLtMatmulDescSetAttribute(BIAS_DATA_TYPE)"))))
        return -1;
    if (blas_ok(cublasLtMatrixLayoutCreate(&L->la, fp8_type(bf), (uint64_t)k, (uint64_t)n, k),
                "cublasLtMatrixLayoutCreate")
        || blas_ok(cublasLtMatrixLayoutCreate(&L->lb, fp8_type(af), (uint64_t)k, (uint64_t)m, k),
                   "cublasLtMatrixLayoutCreate")
        || blas_ok(cublasLtMatrixLayoutCreate(&L->lc, cuda_type(c->dtype), (uint64_t)n, (uint64_t)m, n),
                   "cublasLtMatrixLayoutCreate"))
        return -1;
    lt_key key;
    memset(&key, 0, sizeof key);
    if (device_index(&key.dev)) return -1;
    key.fp8 = 1 + 2 * af + bf;
    key.dtype = c->dtype;
    key.epilogue = ep;
    key.m = m, key.n = n, key.k = k;
    uint32_t align = fp8_align(c, a, b, bias);
    key.aa = key.ab = key.ac = key.abias = align;
    if (lt_cache_get(&key, &L->algo)) {
        if (L->algo.state == CUBLAS_STATUS_SUCCESS) return lt_workspace(L);
        return ds_kernel_fail("cublasLtMatmulAlgoGetHeuristic: no fp8 algorithm for a %lldx%lldx%lld product",
                              (long long)m, (long long)n, (long long)k);
    }
    uint64_t ws = LT_MAX_WORKSPACE;
    int found = 0;
    if (blas_ok(cublasLtMatmulPreferenceCreate(&L->pref), "cublasLtMatmulPreferenceCreate")
        || blas_ok(cublasLtMatmulPreferenceSetAttribute(L->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                        sizeof ws),
                   "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)")
        || lt_pref(L->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align,
                   "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_A_BYTES)")
        || lt_pref(L->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align,
                   "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_B_BYTES)")
        || lt_pref(L->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align,
                   "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_C_BYTES)")
        || lt_pref(L->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align,
                   "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_D_BYTES)")
        || blas_ok(cublasLtMatmulAlgoGetHeuristic(L->h, L->op, L->la, L->lb, L->lc, L->lc, L->pref, 1, &L->algo,
                                                  &found),
                   "cublasLtMatmulAlgoGetHeuristic"))
        return -1;
    if (found < 1) L->algo.state = CUBLAS_STATUS_NOT_SUPPORTED;
    lt_cache_put(&key, &L->algo);
    if (found < 1)
        return ds_kernel_fail("cublasLtMatmulAlgoGetHeuristic: no fp8 algorithm for a %lldx%lldx%lld product",
                              (long long)m, (long long)n, (long long)k);
    return lt_workspace(L);
}

extern "C" int ds_cuda_gemm_fp8(ds_kview c, ds_kview a, ds_kview b, ds_kview a_meta, ds_kview b_meta, int af,
                                int bf, ds_kview bias) {
    if (fp8_applies(&c, &a, &b, bias.data, af, bf)) return -1;
    /* the dequantising factors: each meta's scale_inv, its second float */
    const float *sa = (const float *)a_meta.data + a_meta.stride[0], *sb = (const float *)b_meta.data + b_meta.stride[0];
    lt_call L;
    memset(&L, 0, sizeof L);
    float one = 1.0f, zero = 0.0f;
    int rc = fp8_setup(&L, &c, &a, &b, sa, sb, af, bf, bias.data);
    if (rc == 0)
        rc = blas_ok(cublasLtMatmul(L.h, L.op, &one, b.data, L.la, a.data, L.lb, &zero, c.data, L.lc, c.data, L.lc,
                                    &L.algo.algo, L.ws, L.algo.workspaceSize, ds_cuda_stream()),
                     "cublasLtMatmul");
    lt_release(&L);
    return rc;
}

extern "C" const ds_kernels_blas ds_cuda_blas = { cuda_gemm, cuda_gemm_bias, cuda_gemm_bias_grad, cuda_gemm_bias_gelu,
                                                   cuda_gemm_gelu_grad };
