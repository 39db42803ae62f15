/* Flash-style attention on the GPU; the Tq x Tk scores never exist in
 * memory. Every kernel walks 32-key tiles of K and V staged in shared
 * memory, one key per lane, with query rows spread over the warps of a
 * block; element loads go through ds_load, so any dtype and any strides
 * work. f32, bf16 and f16 compute in f32 (the CPU's ds_expf), f64 in
 * double. Calls the tensor-core kernels take (cuda_attention_mma.h) go
 * there instead: bf16 and f16, and f32 in TF32 under allow_tf32's matmul
 * switch (PyTorch's meaning: f32 may be rounded to TF32 on the way into
 * tensor cores), in 3xTF32 (about f32's accuracy) with it off. f32 whose
 * tiles do not fit the device's shared memory stays here.
 * Forward: a block owns bq query rows; per tile each warp scores its rows
 * (lane j: q . k_j), updates the row's running max and sum (online
 * softmax) and rescales the row's output accumulator; it writes the output
 * and the log-sum-exp.
 * Backward (FlashAttention-2, deterministic, no atomics): delta_i =
 * dO_i . O_i first; then one kernel per key tile rebuilds P and dS =
 * P (dP - delta) for query chunks from q, k and lse and accumulates that
 * tile's dK and dV, each accumulator element owned by one thread; another
 * kernel per query block does the same walk for dQ. */
#include "cuda_common.cuh"
#include "cuda_attention_mma.h"
#include "cuda_blas.h"
#include "../ds_attention.h"

#include <math.h>

#define ATT_WARPS 4
#define ATT_THREADS (ATT_WARPS * 32)
#define ATT_BK 32                  /* keys per tile: one per lane */
#define ATT_BQ 32                  /* query rows per forward / dQ block, fewer when shared memory is short */
#define ATT_QC 16                  /* query rows per chunk of the dK/dV kernel, likewise */
#define ATT_MAX_BLOCKS (1 << 20)   /* blocks loop over tasks past this */

typedef struct {
    int64_t B, H, Tq, Tk, D, Dv;
    int64_t rows;          /* query rows per block (forward, dQ) or per chunk (dK/dV) */
    int causal;
} attn_geom;

__device__ __forceinline__ float ax_exp(float x) { return ds_expf(x); }
__device__ __forceinline__ double ax_exp(double x) { return exp(x); }
__device__ __forceinline__ float ax_log(float x) { return logf(x); }
__device__ __forceinline__ double ax_log(double x) { return log(x); }

template <typename A> __device__ __forceinline__ A warp_max(A v) {
    for (int o = 16; o > 0; o /= 2) {
        A t = __shfl_xor_sync(0xffffffffu, v, o);
        v = t > v ? t : v;
    }
    return v;
}

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Element offset of row t of head (b, h) in a [B,H,T,*] or [B,H,T] view. */
__device__ __forceinline__ int64_t row_at(const ds_kview &x, int64_t b, int64_t h, int64_t t) {
    return b * x.stride[0] + h * x.stride[1] + t * x.stride[2];
}

/* Rows [t0, t0+n) of x[b,h] times mul into dst (rows of ld); rows n up to
 * `rows` are zero. The whole block cooperates. */
template <typename A>
__device__ void load_rows(A *dst, int64_t ld, int64_t rows, const ds_kview &x, int64_t b, int64_t h, int64_t t0,
                          int64_t n, A mul) {
    int64_t cols = x.shape[3];
    for (int64_t e = threadIdx.x; e < rows * cols; e += blockDim.x) {
        int64_t r = e / cols, c = e % cols;
        dst[r * ld + c] = r < n ? mul * (A)ds_load(x.dtype, x.data, row_at(x, b, h, t0 + r) + c * x.stride[3]) : (A)0;
    }
}

template <typename A> __device__ __forceinline__ A dot(const A *x, const A *y, int64_t n) {
    A s = 0;
    for (int64_t c = 0; c < n; c++) s += x[c] * y[c];
    return s;
}

/* Keys of the tile at j0 (nk of them) that query row i sees. */
__device__ __forceinline__ int64_t tile_keys(int64_t i, int64_t j0, int64_t nk, const attn_geom &g) {
    int64_t m = ds_attn_keys_visible(i, g.Tk, g.causal) - j0;
    return m < 0 ? 0 : m > nk ? nk : m;
}

/* ---- forward ---- */

/* Shared memory: K tile [BK][D+1] (odd rows: lanes reading their own key
 * hit distinct banks), V tile [BK][Dv], scaled queries [bq][D], output
 * accumulators [bq][Dv], running max and sum [bq], probabilities [warps][BK]. */
static int64_t forward_elems(const attn_geom &g, int64_t bq) {
    return ATT_BK * (g.D + 1) + ATT_BK * g.Dv + bq * (g.D + g.Dv + 2) + ATT_WARPS * ATT_BK;
}

template <typename A>
__global__ void __launch_bounds__(ATT_THREADS)
attn_forward_kernel(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, attn_geom g, A scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    int64_t D = g.D, Dv = g.Dv, bq = g.rows;
    A *ks = (A *)smem, *vs = ks + ATT_BK * (D + 1), *qs = vs + ATT_BK * Dv, *acc = qs + bq * D;
    A *mx = acc + bq * Dv, *sum = mx + bq, *pw = sum + bq + (threadIdx.x / 32) * ATT_BK;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int64_t heads = g.B * g.H, nblk = (g.Tq + bq - 1) / bq;
    for (int64_t t = blockIdx.x; t < heads * nblk; t += gridDim.x) {
        /* the last query blocks of a causal head see the most keys: they go first */
        int64_t blk = g.causal ? nblk - 1 - t / heads : t / heads, bh = t % heads;
        int64_t b = bh / g.H, h = bh % g.H, i0 = blk * bq, nq = g.Tq - i0 < bq ? g.Tq - i0 : bq;
        __syncthreads();                        /* the previous task is done with shared memory */
        load_rows(qs, D, bq, q, b, h, i0, nq, scale);     /* scaled once: S = (scale q) k^T */
        for (int64_t e = threadIdx.x; e < bq * Dv; e += blockDim.x) acc[e] = 0;
        for (int64_t r = threadIdx.x; r < bq; r += blockDim.x) { mx[r] = -INFINITY; sum[r] = 0; }
        int64_t kend = ds_attn_keys_visible(i0 + nq - 1, g.Tk, g.causal);
        for (int64_t j0 = 0; j0 < kend; j0 += ATT_BK) {
            int64_t nk = kend - j0 < ATT_BK ? kend - j0 : ATT_BK;
            __syncthreads();                    /* every warp is done with the previous tile */
            load_rows(ks, D + 1, (int64_t)ATT_BK, k, b, h, j0, nk, (A)1);
            load_rows(vs, Dv, (int64_t)ATT_BK, v, b, h, j0, nk, (A)1);
            __syncthreads();
            for (int64_t r = warp; r < nq; r += ATT_WARPS) {
                int64_t m = tile_keys(i0 + r, j0, nk, g);
                if (m == 0) continue;
                A s = lane < m ? dot(qs + r * D, ks + lane * (D + 1), D) : (A)-INFINITY;
                A old = mx[r], bm = warp_max(s), nm = old > bm ? old : bm;
                A alpha = ax_exp(old - nm);      /* 0 on the first tile: old is -inf */
                A p = lane < m ? ax_exp(s - nm) : (A)0;
                A ts = warp_sum(p);
                pw[lane] = p;
                __syncwarp();
                A *ar = acc + r * Dv;
                for (int64_t c = lane; c < Dv; c += 32) {
                    A o = ar[c] * alpha;
                    for (int64_t j = 0; j < m; j++) o += pw[j] * vs[j * Dv + c];
                    ar[c] = o;
                }
                __syncwarp();                   /* all lanes have read mx[r] and pw */
                if (lane == 0) {
                    mx[r] = nm;
                    sum[r] = sum[r] * alpha + ts;
                }
            }
        }
        __syncthreads();
        for (int64_t r = warp; r < nq; r += ATT_WARPS) {
            A inv = (A)1 / sum[r];
            int64_t base = row_at(out, b, h, i0 + r);
            for (int64_t c = lane; c < Dv; c += 32)
                ds_store(out.dtype, out.data, base + c * out.stride[3], (double)(acc[r * Dv + c] * inv));
            if (lane == 0) ((A *)lse.data)[row_at(lse, b, h, i0 + r)] = mx[r] + ax_log(sum[r]);
        }
    }
}

/* ---- backward ---- */

/* delta[(b H + h) Tq + i] = dO_i . O_i, a warp per row. */
template <typename A>
__global__ void attn_delta_kernel(A *delta, ds_kview dout, ds_kview out, attn_geom g) {
    int64_t warps = (int64_t)gridDim.x * blockDim.x / 32, rows = g.B * g.H * g.Tq;
    int lane = threadIdx.x % 32;
    for (int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < rows; r += warps) {
        int64_t b = r / (g.H * g.Tq), h = r / g.Tq % g.H, i = r % g.Tq;
        int64_t od = row_at(dout, b, h, i), oo = row_at(out, b, h, i);
        A s = 0;
        for (int64_t c = lane; c < g.Dv; c += 32)
            s += (A)ds_load(dout.dtype, dout.data, od + c * dout.stride[3])
                 * (A)ds_load(out.dtype, out.data, oo + c * out.stride[3]);
        s = warp_sum(s);
        if (lane == 0) delta[r] = s;
    }
}

/* Shared memory: K and V tiles [BK][D+1], [BK][Dv+1]; dK and dV
 * accumulators [BK][D], [BK][Dv]; a chunk of qc scaled query rows and
 * their dO rows; P and dS of the chunk [qc][BK]; its lse and delta. */
static int64_t kv_elems(const attn_geom &g, int64_t qc) {
    return ATT_BK * (2 * g.D + 2 * g.Dv + 2) + qc * (g.D + g.Dv + 2 * ATT_BK + 2);
}

template <typename A>
__global__ void __launch_bounds__(ATT_THREADS)
attn_dkdv_kernel(ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k, ds_kview v, ds_kview lse,
                 const A *delta, attn_geom g, A scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    int64_t D = g.D, Dv = g.Dv, qc = g.rows;
    A *ks = (A *)smem, *vs = ks + ATT_BK * (D + 1), *dka = vs + ATT_BK * (Dv + 1), *dva = dka + ATT_BK * D;
    A *qs = dva + ATT_BK * Dv, *gs = qs + qc * D, *ps = gs + qc * Dv, *dss = ps + qc * ATT_BK;
    A *lrow = dss + qc * ATT_BK, *drow = lrow + qc;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int64_t heads = g.B * g.H, nkb = (g.Tk + ATT_BK - 1) / ATT_BK;
    for (int64_t t = blockIdx.x; t < heads * nkb; t += gridDim.x) {
        int64_t bh = t % heads, b = bh / g.H, h = bh % g.H, j0 = t / heads * ATT_BK;
        int64_t nk = g.Tk - j0 < ATT_BK ? g.Tk - j0 : ATT_BK;
        __syncthreads();
        load_rows(ks, D + 1, (int64_t)ATT_BK, k, b, h, j0, nk, (A)1);
        load_rows(vs, Dv + 1, (int64_t)ATT_BK, v, b, h, j0, nk, (A)1);
        for (int64_t e = threadIdx.x; e < ATT_BK * (D + Dv); e += blockDim.x) dka[e] = 0;   /* dka, dva adjoin */
        /* causal rows before the tile see none of it */
        for (int64_t ic = g.causal ? j0 : 0; ic < g.Tq; ic += qc) {
            int64_t nr = g.Tq - ic < qc ? g.Tq - ic : qc;
            __syncthreads();                    /* the previous chunk is consumed */
            load_rows(qs, D, qc, q, b, h, ic, nr, scale);
            load_rows(gs, Dv, qc, dout, b, h, ic, nr, (A)1);
            for (int64_t r = threadIdx.x; r < nr; r += blockDim.x) {
                lrow[r] = ((const A *)lse.data)[row_at(lse, b, h, ic + r)];
                drow[r] = delta[bh * g.Tq + ic + r];
            }
            __syncthreads();
            for (int64_t r = warp; r < nr; r += ATT_WARPS) {
                int64_t m = tile_keys(ic + r, j0, nk, g);
                A p = 0, ds = 0;
                if (lane < m) {
                    p = ax_exp(dot(qs + r * D, ks + lane * (D + 1), D) - lrow[r]);
                    ds = p * (dot(gs + r * Dv, vs + lane * (Dv + 1), Dv) - drow[r]);    /* P (dP - delta) */
                }
                ps[r * ATT_BK + lane] = p;
                dss[r * ATT_BK + lane] = ds;
            }
            __syncthreads();
            for (int64_t e = threadIdx.x; e < ATT_BK * Dv; e += blockDim.x) {   /* dV += P^T dO */
                int64_t j = e / Dv, c = e % Dv;
                A s = 0;
                for (int64_t r = 0; r < nr; r++) s += ps[r * ATT_BK + j] * gs[r * Dv + c];
                dva[e] += s;
            }
            for (int64_t e = threadIdx.x; e < ATT_BK * D; e += blockDim.x) {    /* dK += dS^T (scale Q) */
                int64_t j = e / D, c = e % D;
                A s = 0;
                for (int64_t r = 0; r < nr; r++) s += dss[r * ATT_BK + j] * qs[r * D + c];
                dka[e] += s;
            }
        }
        __syncthreads();
        for (int64_t e = threadIdx.x; e < nk * D; e += blockDim.x) {
            int64_t j = e / D, c = e % D;
            ds_store(dk.dtype, dk.data, row_at(dk, b, h, j0 + j) + c * dk.stride[3], (double)dka[e]);
        }
        for (int64_t e = threadIdx.x; e < nk * Dv; e += blockDim.x) {
            int64_t j = e / Dv, c = e % Dv;
            ds_store(dv.dtype, dv.data, row_at(dv, b, h, j0 + j) + c * dv.stride[3], (double)dva[e]);
        }
    }
}

/* Shared memory: K and V tiles [BK][D+1], [BK][Dv+1]; bq scaled query
 * rows, their dO rows and dQ accumulators; lse and delta [bq]; dS
 * [warps][BK]. */
static int64_t dq_elems(const attn_geom &g, int64_t bq) {
    return ATT_BK * (g.D + g.Dv + 2) + bq * (2 * g.D + g.Dv + 2) + ATT_WARPS * ATT_BK;
}

template <typename A>
__global__ void __launch_bounds__(ATT_THREADS)
attn_dq_kernel(ds_kview dq, ds_kview dout, ds_kview q, ds_kview k, ds_kview v, ds_kview lse, const A *delta,
               attn_geom g, A scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    int64_t D = g.D, Dv = g.Dv, bq = g.rows;
    A *ks = (A *)smem, *vs = ks + ATT_BK * (D + 1), *qs = vs + ATT_BK * (Dv + 1), *gs = qs + bq * D;
    A *acc = gs + bq * Dv, *lrow = acc + bq * D, *drow = lrow + bq, *pw = drow + bq + (threadIdx.x / 32) * ATT_BK;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int64_t heads = g.B * g.H, nblk = (g.Tq + bq - 1) / bq;
    for (int64_t t = blockIdx.x; t < heads * nblk; t += gridDim.x) {
        int64_t blk = g.causal ? nblk - 1 - t / heads : t / heads, bh = t % heads;
        int64_t b = bh / g.H, h = bh % g.H, i0 = blk * bq, nq = g.Tq - i0 < bq ? g.Tq - i0 : bq;
        __syncthreads();
        load_rows(qs, D, bq, q, b, h, i0, nq, scale);
        load_rows(gs, Dv, bq, dout, b, h, i0, nq, (A)1);
        for (int64_t e = threadIdx.x; e < bq * D; e += blockDim.x) acc[e] = 0;
        for (int64_t r = threadIdx.x; r < nq; r += blockDim.x) {
            lrow[r] = ((const A *)lse.data)[row_at(lse, b, h, i0 + r)];
            drow[r] = delta[bh * g.Tq + i0 + r];
        }
        int64_t kend = ds_attn_keys_visible(i0 + nq - 1, g.Tk, g.causal);
        for (int64_t j0 = 0; j0 < kend; j0 += ATT_BK) {
            int64_t nk = kend - j0 < ATT_BK ? kend - j0 : ATT_BK;
            __syncthreads();
            load_rows(ks, D + 1, (int64_t)ATT_BK, k, b, h, j0, nk, (A)1);
            load_rows(vs, Dv + 1, (int64_t)ATT_BK, v, b, h, j0, nk, (A)1);
            __syncthreads();
            for (int64_t r = warp; r < nq; r += ATT_WARPS) {
                int64_t m = tile_keys(i0 + r, j0, nk, g);
                if (m == 0) continue;
                A ds = 0;
                if (lane < m) {
                    A p = ax_exp(dot(qs + r * D, ks + lane * (D + 1), D) - lrow[r]);
                    ds = p * (dot(gs + r * Dv, vs + lane * (Dv + 1), Dv) - drow[r]);
                }
                pw[lane] = ds;
                __syncwarp();
                A *ar = acc + r * D;
                for (int64_t c = lane; c < D; c += 32) {     /* dQ / scale += dS K */
                    A o = ar[c];
                    for (int64_t j = 0; j < m; j++) o += pw[j] * ks[j * (D + 1) + c];
                    ar[c] = o;
                }
                __syncwarp();                   /* pw is read before the next row overwrites it */
            }
        }
        __syncthreads();
        for (int64_t r = warp; r < nq; r += ATT_WARPS) {
            int64_t base = row_at(dq, b, h, i0 + r);
            for (int64_t c = lane; c < D; c += 32)
                ds_store(dq.dtype, dq.data, base + c * dq.stride[3], (double)(scale * acc[r * D + c]));
        }
    }
}

/* ---- launches ---- */

/* The largest row count from `want` down to 1 whose shared memory fits the
 * device; opts the kernel in above the default 48 KiB. */
template <typename K>
static int fit_rows(K kernel, int64_t (*elems)(const attn_geom &, int64_t), const attn_geom &g, size_t es,
                    int64_t want, int64_t *rows, size_t *bytes) {
    int dev, limit;
    DS_CUDA_CHECK(cudaGetDevice(&dev));
    DS_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    int64_t r = want;
    while (r > 1 && (size_t)elems(g, r) * es > (size_t)limit) r /= 2;
    *rows = r;
    *bytes = (size_t)elems(g, r) * es;
    if (*bytes > (size_t)limit)
        return ds_kernel_fail("attention: head dims %lld and %lld need %zu bytes of shared memory, the device has %d",
                              (long long)g.D, (long long)g.Dv, *bytes, limit);
    if (*bytes > 48 * 1024)
        DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)*bytes));
    return 0;
}

static unsigned grid_of(int64_t tasks) { return (unsigned)(tasks < ATT_MAX_BLOCKS ? tasks : ATT_MAX_BLOCKS); }

static attn_geom geom_of(const ds_kview &q, const ds_kview &k, const ds_kview &v, int causal) {
    attn_geom g = { q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3], 0, causal };
    return g;
}

static int check_views(const ds_kview &lse, const ds_kview &q, const ds_kview &k, const ds_kview &v) {
    if (q.ndim != 4 || k.ndim != 4 || v.ndim != 4 || lse.ndim != 3)
        return ds_kernel_fail("attention: needs q, k, v [B,H,T,D] and lse [B,H,Tq]");
    if (k.dtype != q.dtype || v.dtype != q.dtype || !ds_dtype_is_float(q.dtype))
        return ds_kernel_fail("attention: q, k, v need one float dtype");
    if (lse.dtype != (q.dtype == DS_F64 ? DS_F64 : DS_F32))
        return ds_kernel_fail("attention: lse must be f64 for f64 inputs, else f32");
    return 0;
}

template <typename A>
static int forward_run(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, double scale, int causal) {
    attn_geom g = geom_of(q, k, v, causal);
    size_t bytes;
    if (fit_rows(attn_forward_kernel<A>, forward_elems, g, sizeof(A), ATT_BQ, &g.rows, &bytes)) return -1;
    int64_t tasks = g.B * g.H * ((g.Tq + g.rows - 1) / g.rows);
    attn_forward_kernel<A><<<grid_of(tasks), ATT_THREADS, bytes, ds_cuda_stream()>>>(out, lse, q, k, v, g, (A)scale);
    return ds_cuda_launched("attn_forward_kernel");
}

template <typename A>
static int backward_run(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k, ds_kview v,
                        ds_kview out, ds_kview lse, double scale, int causal) {
    attn_geom g = geom_of(q, k, v, causal);
    int64_t rows = g.B * g.H * g.Tq;
    A *delta = rows > 0 ? (A *)ds_cuda_scratch(sizeof(A) * (size_t)rows) : NULL;
    if (rows > 0 && !delta) return -1;
    int rc = 0;
    if (rows > 0) {
        attn_delta_kernel<A><<<ds_cuda_blocks(rows * 32, ATT_THREADS), ATT_THREADS, 0, ds_cuda_stream()>>>(
            delta, dout, out, g);
        rc = ds_cuda_launched("attn_delta_kernel");
    }
    attn_geom gk = g, gq = g;
    size_t kbytes = 0, qbytes = 0;
    if (rc == 0) rc = fit_rows(attn_dkdv_kernel<A>, kv_elems, g, sizeof(A), ATT_QC, &gk.rows, &kbytes);
    if (rc == 0) rc = fit_rows(attn_dq_kernel<A>, dq_elems, g, sizeof(A), ATT_BQ, &gq.rows, &qbytes);
    int64_t ktasks = g.B * g.H * ((g.Tk + ATT_BK - 1) / ATT_BK);
    int64_t qtasks = rc == 0 ? g.B * g.H * ((g.Tq + gq.rows - 1) / gq.rows) : 0;
    if (rc == 0 && ktasks > 0) {
        attn_dkdv_kernel<A><<<grid_of(ktasks), ATT_THREADS, kbytes, ds_cuda_stream()>>>(
            dk, dv, dout, q, k, v, lse, delta, gk, (A)scale);
        rc = ds_cuda_launched("attn_dkdv_kernel");
    }
    if (rc == 0 && qtasks > 0) {
        attn_dq_kernel<A><<<grid_of(qtasks), ATT_THREADS, qbytes, ds_cuda_stream()>>>(
            dq, dout, q, k, v, lse, delta, gq, (A)scale);
        rc = ds_cuda_launched("attn_dq_kernel");
    }
    if (delta) ds_cuda_scratch_free(delta);
    return rc;
}

/* f32 on tensor cores in TF32 only where the matmul switch allows it. */
static bool tf32_allowed(void) { return ds_cuda_tf32(DS_TF32_MATMUL) != 0; }

static int cuda_attention_forward(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, double scale,
                                  int causal) {
    if (check_views(lse, q, k, v)) return -1;
    if (k.shape[2] == 0 && q.shape[2] > 0) return ds_kernel_fail("no keys to attend to");
    if (q.shape[0] * q.shape[1] * q.shape[2] == 0) return 0;
    ds_kview views[4] = { q, k, v, out };
    if (ds_cuda_attention_mma_fits(views, 4))
        return ds_cuda_attention_mma_forward(out, lse, q, k, v, scale, causal, tf32_allowed());
    if (k.shape[1] != q.shape[1])
        return ds_kernel_fail("attention: k and v with fewer heads than q need the tensor-core kernels");
    return q.dtype == DS_F64 ? forward_run<double>(out, lse, q, k, v, scale, causal)
                             : forward_run<float>(out, lse, q, k, v, scale, causal);
}

/* Grouped k and v (fewer heads than q) run only on the tensor-core
 * kernels, whose forward took them; a dout those cannot read is copied
 * into contiguous scratch for them. */
static int grouped_backward(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k,
                            ds_kview v, ds_kview out, ds_kview lse, double scale, int causal) {
    void *scratch = ds_cuda_scratch(ds_kview_numel(&dout) * ds_dtype_size(dout.dtype));
    if (!scratch) return -1;
    ds_kview c = ds_kview_dense(&dout, scratch, dout.dtype);
    ds_kview views[8] = { q, k, v, out, dq, dk, dv, c };
    int rc = ds_cuda_core.copy(c, dout);
    if (rc == 0 && !ds_cuda_attention_mma_fits(views, 8))
        rc = ds_kernel_fail("attention: k and v with fewer heads than q need the tensor-core kernels");
    if (rc == 0) rc = ds_cuda_attention_mma_backward(dq, dk, dv, c, q, k, v, out, lse, scale, causal, tf32_allowed());
    ds_cuda_scratch_free(scratch);
    return rc;
}

static int cuda_attention_backward(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k,
                                   ds_kview v, ds_kview out, ds_kview lse, double scale, int causal) {
    if (check_views(lse, q, k, v)) return -1;
    ds_kview views[8] = { q, k, v, out, dq, dk, dv, dout };
    bool fits = ds_cuda_attention_mma_fits(views, 8);
    if (q.shape[0] * q.shape[1] * q.shape[2] > 0 && fits)
        return ds_cuda_attention_mma_backward(dq, dk, dv, dout, q, k, v, out, lse, scale, causal, tf32_allowed());
    if (q.shape[0] * q.shape[1] * q.shape[2] > 0 && k.shape[1] != q.shape[1])
        return grouped_backward(dq, dk, dv, dout, q, k, v, out, lse, scale, causal);
    return q.dtype == DS_F64 ? backward_run<double>(dq, dk, dv, dout, q, k, v, out, lse, scale, causal)
                             : backward_run<float>(dq, dk, dv, dout, q, k, v, out, lse, scale, causal);
}

static bool cuda_attention_full_rate(ds_kview q, ds_kview k, ds_kview v) {
    ds_kview views[3] = { q, k, v };
    return ds_cuda_attention_mma_fits(views, 3);
}

/* k and v with fewer heads than q: the tensor-core kernels (mma.sync and
 * wgmma alike) take them wherever they take the call; for the scalar
 * kernels core repeats them. */
static bool cuda_attention_grouped(ds_kview q, ds_kview k, ds_kview v) { return cuda_attention_full_rate(q, k, v); }

extern "C" const ds_kernels_attention ds_cuda_attention = { cuda_attention_full_rate, cuda_attention_grouped,
                                                            cuda_attention_forward, cuda_attention_backward };
