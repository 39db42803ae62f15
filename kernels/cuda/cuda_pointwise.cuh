/* Helpers of the pointwise CUDA families (elementwise, reduce, index, nn,
 * optim): finding element i of a coalesced view without divisions where
 * it is flat, loading any dtype in the compute type, and block-wide
 * reductions whose tree is fixed by blockDim, so results repeat bit for
 * bit from run to run. */
#ifndef CUDA_POINTWISE_CUH
#define CUDA_POINTWISE_CUH

#include "cuda_common.cuh"

#include <math.h>

/* How element i of a coalesced view is found: at i * step for step 1
 * (contiguous) or 0 (one value, or a value broadcast everywhere), through
 * the view's strides for -1. */
static inline int64_t pw_step(const ds_kview &v) {
    if (v.ndim == 0) return 0;
    return v.ndim == 1 && (v.stride[0] == 0 || v.stride[0] == 1) ? v.stride[0] : -1;
}

__device__ __forceinline__ int64_t pw_at(const ds_kview &v, int64_t step, int64_t i) {
    return step >= 0 ? i * step : ds_cuda_offset(v, i);
}

/* Element i (an offset) of any dtype, in the compute type T. */
template <typename T> __device__ __forceinline__ T pw_load(const ds_kview &v, int64_t i) {
    return (T)ds_load(v.dtype, v.data, i);
}

/* The exp of the rows: CUDA's expf for f32 (2 ulp, a few instructions;
 * the CPU's ds_expf, 1 ulp, is a polynomial of some twenty, which left
 * bf16 softmax rows bound by it at 75% of the copy rate on an H100), exp
 * for f64. */
__device__ __forceinline__ float pw_exp(float x) { return expf(x); }
__device__ __forceinline__ double pw_exp(double x) { return exp(x); }

/* Rows are computed in f64 when a tensor is f64, else in f32. */
static inline bool pw_any_f64(const ds_kview *const *v, int k) {
    for (int i = 0; i < k; i++)
        if (v[i]->dtype == DS_F64) return true;
    return false;
}

/* Threads for a block that owns one row of n: a power of two in [32, 512]. */
static inline int pw_row_threads(int64_t n) {
    int t = 32;
    while (t < 512 && t < n) t *= 2;
    return t;
}

struct pw_sum { template <typename T> __device__ T operator()(T a, T b) const { return a + b; } };
/* fmax skips NaN, as the CPU's `x > m ? x : m` scans do */
struct pw_max { template <typename T> __device__ T operator()(T a, T b) const { return fmax(a, b); } };

/* Butterfly over the warp: every lane ends with the same value, since
 * each level combines the same two partials (op is commutative). */
template <typename T, typename Op> __device__ __forceinline__ T pw_warp_reduce(T v, Op op) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* op over the whole (1-D, multiple of 32 threads) block; every thread gets
 * the result. Every thread of the block must call it. */
template <typename T, typename Op> __device__ T pw_block_reduce(T v, Op op, T identity) {
    __shared__ T part[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = pw_warp_reduce(v, op);
    __syncthreads();                  /* readers of the previous call are done */
    if (lane == 0) part[warp] = v;
    __syncthreads();
    return pw_warp_reduce(lane < nwarps ? part[lane] : identity, op);
}

template <typename T> __device__ __forceinline__ T pw_block_sum(T v) { return pw_block_reduce(v, pw_sum(), (T)0); }
template <typename T> __device__ __forceinline__ T pw_block_max(T v) {
    return pw_block_reduce(v, pw_max(), (T)-INFINITY);
}

/* ---- the float fast paths: f32, bf16 and f16 data computed in f32, read
 * and written 8 elements at a time (one 16-byte word of bf16/f16, two of
 * f32). Rounding to bf16/f16 is ds_store's, bit for bit. ---- */

#define PW_VEC 8

static inline bool pw_is_f32ish(ds_dtype t) { return t == DS_F32 || t == DS_BF16 || t == DS_F16; }

/* p can be read in 16-byte words */
static inline bool pw_aligned(const void *p) { return ((uintptr_t)p & 15) == 0; }

__device__ __forceinline__ float pw_loadf(ds_dtype t, const void *p, int64_t i) {
    if (t == DS_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return t == DS_BF16 ? ds_bf16_to_f32(h) : ds_f16_to_f32(h);
}

__device__ __forceinline__ void pw_storef(ds_dtype t, void *p, int64_t i, float v) {
    if (t == DS_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = t == DS_BF16 ? ds_f32_to_bf16(v) : ds_f32_to_f16(v);
}

/* Elements i..i+7 into x; element i must sit on 16 bytes. */
__device__ __forceinline__ void pw_load8(ds_dtype t, const void *p, int64_t i, float *x) {
    if (t == DS_F32) {
        const float4 *q = (const float4 *)((const float *)p + i);
        float4 a = q[0], b = q[1];
        x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
        x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
        return;
    }
    uint4 w = *(const uint4 *)((const uint16_t *)p + i);
    const uint16_t *h = (const uint16_t *)&w;
    /* the dtype test outside the loops: one per word, never both conversions per element */
    if (t == DS_BF16)
        for (int k = 0; k < PW_VEC; k++) x[k] = ds_bf16_to_f32(h[k]);
    else
        for (int k = 0; k < PW_VEC; k++) x[k] = ds_f16_to_f32(h[k]);
}

__device__ __forceinline__ void pw_store8(ds_dtype t, void *p, int64_t i, const float *x) {
    if (t == DS_F32) {
        float4 *q = (float4 *)((float *)p + i);
        q[0] = make_float4(x[0], x[1], x[2], x[3]);
        q[1] = make_float4(x[4], x[5], x[6], x[7]);
        return;
    }
    uint4 w = {0u, 0u, 0u, 0u};   /* every lane is written below; gcc cannot see it through h */
    uint16_t *h = (uint16_t *)&w;
    if (t == DS_BF16)
        for (int k = 0; k < PW_VEC; k++) h[k] = ds_f32_to_bf16(x[k]);
    else
        for (int k = 0; k < PW_VEC; k++) h[k] = ds_f32_to_f16(x[k]);
    *(uint4 *)((uint16_t *)p + i) = w;
}

/* Elements of dtype t from p to the next 16-byte boundary: where a row
 * that may start anywhere begins its 8-at-a-time part. */
__device__ __forceinline__ int64_t pw_head(ds_dtype t, const void *p, int64_t i) {
    size_t es = t == DS_F32 ? 4 : 2;
    return (int64_t)((16 - ((uintptr_t)p + (uintptr_t)i * es) % 16) % 16 / es);
}

/* How the fast paths find element i of a coalesced input: at i (0), at
 * i % mod (a row of mod values repeated over rows, as a bias [C] added to
 * [N, C]; mod 1: one value everywhere), or not at all (-1: strided). */
static inline int64_t pw_fast_mod(const ds_kview &v) {
    if (ds_kview_is_contiguous(&v)) return 0;
    if (v.ndim == 1 && v.stride[0] == 0) return 1;
    if (v.ndim == 2 && v.stride[0] == 0 && v.stride[1] == 1) return v.shape[1];
    return -1;
}

/* Whether a contiguous out and inputs in[0..k) take the float fast path:
 * every dtype f32, bf16 or f16, every input found by pw_fast_mod (into
 * mod[]). *vec: all of them can be read 8 at a time as well. */
static inline bool pw_fast(const ds_kview &out, const ds_kview *const *in, int k, int64_t *mod, bool *vec) {
    if (!pw_is_f32ish(out.dtype) || !ds_kview_is_contiguous(&out)) return false;
    *vec = pw_aligned(out.data);
    for (int i = 0; i < k; i++) {
        mod[i] = pw_fast_mod(*in[i]);
        if (!pw_is_f32ish(in[i]->dtype) || mod[i] < 0) return false;
        if (mod[i] != 1 && (mod[i] % PW_VEC != 0 || !pw_aligned(in[i]->data))) *vec = false;
    }
    return true;
}

/* Words of 8 a fast kernel's thread moves per input in one pass, every
 * load issued before any use: 64 bytes of a 16-bit output's inputs, as of
 * f32's (bf16 adds ran at three quarters of the copy rate with 32). */
#define PW_WORDS_F32 2
#define PW_WORDS_16 4

/* Blocks for a fast kernel over n elements: one thread per chunk when vec. */
static inline unsigned pw_fast_blocks(int64_t n, bool vec, int chunk) {
    return ds_cuda_blocks(vec ? (n + chunk - 1) / chunk : n, DS_CUDA_THREADS);
}

__device__ __forceinline__ int64_t pw_mod_at(int64_t mod, int64_t i) { return mod ? i % mod : i; }

/* Element i of a fast-path input of dtype t, and elements i..i+7 (i a multiple of 8). */
__device__ __forceinline__ float pw_fetch(const ds_kview &v, ds_dtype t, int64_t mod, int64_t i) {
    return pw_loadf(t, v.data, pw_mod_at(mod, i));
}

__device__ __forceinline__ void pw_fetch8(const ds_kview &v, ds_dtype t, int64_t mod, int64_t i, float *x) {
    if (mod == 1) {
        float c = pw_loadf(t, v.data, 0);
        for (int k = 0; k < PW_VEC; k++) x[k] = c;
    } else {
        pw_load8(t, v.data, pw_mod_at(mod, i), x);
    }
}

/* The K inputs of a fast kernel and how each is found. */
template <int K> struct pw_inputs {
    ds_kview v[K];
    int64_t mod[K];
};

/* The dtype of a view in a kernel built for DT: DT itself where every view
 * has it (the dtype tests of the loads and stores then fold away at
 * compile time), the view's own where DT is -1. */
template <int DT> __device__ __forceinline__ ds_dtype pw_dt(ds_dtype t) { return DT < 0 ? t : (ds_dtype)DT; }

/* out[i] = f(inputs at i) in f32: a chunk of 8 WORDS elements a thread
 * while vec, then the tail (or everything) one by one. f maps the K input
 * values to one. */
template <int K, int DT, int WORDS, typename F>
static __global__ void __launch_bounds__(DS_CUDA_THREADS)
pw_fast_kernel(F f, ds_kview out, pw_inputs<K> in, int64_t n, bool vec) {
    const int chunk = PW_VEC * WORDS;
    ds_dtype to = pw_dt<DT>(out.dtype), ti[K];
    for (int j = 0; j < K; j++) ti[j] = pw_dt<DT>(in.v[j].dtype);
    int64_t nv = vec ? n / chunk : 0;
    DS_CUDA_LOOP(c, nv) {
        float x[K][chunk], y[chunk], a[K];
#pragma unroll
        for (int j = 0; j < K; j++)
#pragma unroll
            for (int w = 0; w < WORDS; w++)
                pw_fetch8(in.v[j], ti[j], in.mod[j], c * chunk + w * PW_VEC, x[j] + w * PW_VEC);
#pragma unroll
        for (int k = 0; k < chunk; k++) {
            for (int j = 0; j < K; j++) a[j] = x[j][k];
            y[k] = f(a);
        }
#pragma unroll
        for (int w = 0; w < WORDS; w++) pw_store8(to, out.data, c * chunk + w * PW_VEC, y + w * PW_VEC);
    }
    DS_CUDA_LOOP(t, n - nv * chunk) {
        int64_t i = nv * chunk + t;
        float a[K];
        for (int j = 0; j < K; j++) a[j] = pw_fetch(in.v[j], ti[j], in.mod[j], i);
        pw_storef(to, out.data, i, f(a));
    }
}

#ifndef DS_WARP_EMULATOR      /* launches: CUDA's own */
template <int K, int DT, int WORDS, typename F>
static int pw_fast_launch(F f, const ds_kview &out, const pw_inputs<K> &p, int64_t n, bool vec, const char *name) {
    pw_fast_kernel<K, DT, WORDS, F><<<pw_fast_blocks(n, vec, PW_VEC * WORDS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        f, out, p, n, vec);
    return ds_cuda_launched(name);
}

/* Runs f over out's n elements when pw_fast takes out and in[0..K): 1
 * when launched (*rc: 0 or -1 as the launch went), 0 for the caller's
 * strided path. One dtype throughout gets a kernel built for it. WORDS16:
 * words per input for 16-bit outputs; a functor that switches over many
 * ops takes 2, as 4 copies of every op per element slowed bf16 GELU
 * threefold. */
template <int K, int WORDS16 = PW_WORDS_16, typename F>
static int pw_fast_try(F f, const ds_kview &out, const ds_kview *const *in, int64_t n, const char *name, int *rc) {
    pw_inputs<K> p;
    bool vec;
    if (!pw_fast(out, in, K, p.mod, &vec)) return 0;
    bool same = true;
    for (int j = 0; j < K; j++) {
        p.v[j] = *in[j];
        same = same && in[j]->dtype == out.dtype;
    }
    if (same && out.dtype == DS_F32) *rc = pw_fast_launch<K, DS_F32, PW_WORDS_F32>(f, out, p, n, vec, name);
    else if (same && out.dtype == DS_BF16) *rc = pw_fast_launch<K, DS_BF16, WORDS16>(f, out, p, n, vec, name);
    else if (same) *rc = pw_fast_launch<K, DS_F16, WORDS16>(f, out, p, n, vec, name);
    else if (out.dtype == DS_F32) *rc = pw_fast_launch<K, -1, PW_WORDS_F32>(f, out, p, n, vec, name);
    else *rc = pw_fast_launch<K, -1, WORDS16>(f, out, p, n, vec, name);
    return 1;
}
#endif

/* Index values are i64 or i32. */
__device__ __forceinline__ int64_t pw_index(const ds_kview &idx, int64_t off) {
    return idx.dtype == DS_I64 ? ((const int64_t *)idx.data)[off] : ((const int32_t *)idx.data)[off];
}

#endif
