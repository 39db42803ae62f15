/* Reductions over the middle axis of [outer, n, inner] on the GPU. A block
 * owns up to 32 neighbouring outputs (lanes along inner, so loads are
 * coalesced) and splits each line among its rows of threads, which then
 * merge in a fixed tree; a few long lines are also cut among blocks whose
 * states are merged in order after. Deterministic, no atomics.
 * Accumulation is in f32 for f32/bf16/f16 and in f64 for f64 and integers
 * (the CPU uses f64 throughout; results agree within f32 rounding). */
#include "cuda_pointwise.cuh"

/* The running state of one line: sum (a), extreme value (a) and its index
 * (i, -1 while empty), or Welford's count (i), mean (a) and m2 (b). */
template <typename T> struct red_state { T a, b; int64_t i; };

/* How NORM accumulates, decided once on the host from p. */
enum { NORM_MAX, NORM_SQ, NORM_ABS, NORM_NONZERO, NORM_POW };

template <typename T> __device__ red_state<T> red_init(ds_reduce_op op) {
    red_state<T> s = { 0, 0, 0 };
    if (op == DS_RED_MAX || op == DS_RED_MIN || op == DS_RED_ARGMAX || op == DS_RED_ARGMIN) s.i = -1;
    return s;
}

/* Does (v, j) replace (best, at)? NaN wins and stays, as it stops the
 * CPU's scan; equal values keep the lower index. */
template <typename T> __device__ bool red_better(bool want_max, T v, int64_t j, T best, int64_t at) {
    bool vn = v != v, bn = best != best;
    if (vn || bn) return vn && (!bn || j < at);
    if (v == best) return j < at;
    return want_max ? v > best : v < best;
}

template <typename T>
__device__ red_state<T> red_push(ds_reduce_op op, int mode, T p, red_state<T> s, T v, int64_t j) {
    switch (op) {
    case DS_RED_SUM: case DS_RED_MEAN: s.a += v; break;
    case DS_RED_VAR: {
        s.i++;
        T delta = v - s.a;
        s.a += delta / (T)s.i;
        s.b += delta * (v - s.a);
        break;
    }
    case DS_RED_NORM:
        v = fabs(v);
        if (mode == NORM_MAX) s.a = v > s.a ? v : s.a;
        else s.a += mode == NORM_SQ ? v * v : mode == NORM_ABS ? v : mode == NORM_NONZERO ? (T)(v != 0) : pow(v, p);
        break;
    default:
        if (s.i < 0 || red_better(op == DS_RED_MAX || op == DS_RED_ARGMAX, v, j, s.a, s.i)) { s.a = v; s.i = j; }
        break;
    }
    return s;
}

template <typename T> __device__ red_state<T> red_merge(ds_reduce_op op, int mode, red_state<T> x, red_state<T> y) {
    switch (op) {
    case DS_RED_SUM: case DS_RED_MEAN: x.a += y.a; return x;
    case DS_RED_VAR: {
        /* Chan et al.'s pairwise update of Welford states */
        if (y.i == 0) return x;
        if (x.i == 0) return y;
        T n = (T)(x.i + y.i), delta = y.a - x.a;
        x.a += delta * ((T)y.i / n);
        x.b += y.b + delta * delta * ((T)x.i * (T)y.i / n);
        x.i += y.i;
        return x;
    }
    case DS_RED_NORM:
        if (mode == NORM_MAX) x.a = y.a > x.a ? y.a : x.a;
        else x.a += y.a;
        return x;
    default:
        if (y.i < 0) return x;
        if (x.i < 0 || red_better(op == DS_RED_MAX || op == DS_RED_ARGMAX, y.a, y.i, x.a, x.i)) return y;
        return x;
    }
}

template <typename T> __device__ double red_finish(ds_reduce_op op, int mode, double p, red_state<T> s, int64_t n) {
    switch (op) {
    case DS_RED_SUM: return s.a;
    case DS_RED_MEAN: return (double)s.a / (double)n;
    case DS_RED_ARGMAX: case DS_RED_ARGMIN: return (double)s.i;
    case DS_RED_VAR: {
        double dof = (double)n - p;
        return dof > 0 ? (double)s.b / dof : NAN;
    }
    case DS_RED_NORM:
        if (mode == NORM_SQ) return sqrt((double)s.a);
        return mode == NORM_POW ? pow((double)s.a, 1.0 / p) : (double)s.a;
    default: return s.a;
    }
}

#define RED_THREADS 256
/* Lines split among blocks aim at about this many blocks in all. */
#define RED_TARGET_BLOCKS 1024

/* Block (bx, by): lane tx takes output column k, the by rows of threads
 * split their part of the line (j = j0 + ty, j0 + ty + by, ...) and merge
 * over ty at the end. With splits > 1 each line is cut into that many
 * parts, one block each, whose states go to part[(o inner + k) splits + s]
 * for reduce_merge_kernel; with 1 the block writes out directly. */
template <typename T>
static __global__ void reduce_kernel(ds_reduce_op op, int mode, double p, ds_kview out, ds_kview x, int64_t outer,
                                     int64_t n, int64_t inner, int64_t splits, red_state<T> *part) {
    __shared__ red_state<T> sh[RED_THREADS];
    int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x, t = ty * bx + tx;
    int64_t kblocks = (inner + bx - 1) / bx, len = (n + splits - 1) / splits;
    for (int64_t blk = blockIdx.x; blk < outer * kblocks * splits; blk += gridDim.x) {
        int64_t sp = blk % splits, o = blk / splits / kblocks, k = blk / splits % kblocks * bx + tx;
        int64_t j0 = sp * len, j1 = j0 + len < n ? j0 + len : n;
        red_state<T> s = red_init<T>(op);
        if (k < inner)
            for (int64_t j = j0 + ty; j < j1; j += blockDim.y)
                s = red_push(op, mode, (T)p, s, pw_load<T>(x, (o * n + j) * inner + k), j);
        sh[t] = s;
        __syncthreads();
        for (int h = blockDim.y / 2; h > 0; h >>= 1) {
            if (ty < h) sh[t] = red_merge(op, mode, sh[t], sh[t + h * bx]);
            __syncthreads();
        }
        if (ty == 0 && k < inner) {
            if (part) part[(o * inner + k) * splits + sp] = sh[tx];
            else ds_store(out.dtype, out.data, o * inner + k, red_finish(op, mode, p, sh[tx], n));
        }
        __syncthreads();                 /* sh is refilled for the next outputs */
    }
}

/* SUM and MEAN of f32/bf16/f16 lines whose inner is a multiple of 8 on
 * 16 bytes (a bias gradient: the column sums of [rows, C]): as
 * reduce_kernel with 32 lanes of 8 neighbouring outputs each, read with
 * 16-byte loads; the rows of threads merge in order, thread t finishing
 * output t of the block's 256. */
template <typename T>
static __global__ void sum_vec_kernel(ds_reduce_op op, ds_kview out, ds_kview x, int64_t outer, int64_t n,
                                      int64_t inner, int64_t splits, red_state<T> *part) {
    __shared__ T sh[RED_THREADS / 32][32 * PW_VEC];
    int tx = threadIdx.x, ty = threadIdx.y, t = ty * 32 + tx, span = 32 * PW_VEC;
    int64_t kblocks = (inner + span - 1) / span, len = (n + splits - 1) / splits;
    for (int64_t blk = blockIdx.x; blk < outer * kblocks * splits; blk += gridDim.x) {
        int64_t sp = blk % splits, o = blk / splits / kblocks, k0 = blk / splits % kblocks * span, k = k0 + tx * PW_VEC;
        int64_t j0 = sp * len, j1 = j0 + len < n ? j0 + len : n;
        T acc[PW_VEC] = {};
        float v[PW_VEC];
        for (int64_t j = j0 + ty; k < inner && j < j1; j += blockDim.y) {
            pw_load8(x.dtype, x.data, (o * n + j) * inner + k, v);
            for (int q = 0; q < PW_VEC; q++) acc[q] += v[q];
        }
        for (int q = 0; q < PW_VEC; q++) sh[ty][tx * PW_VEC + q] = acc[q];
        __syncthreads();
        if (k0 + t < inner) {
            red_state<T> st = { 0, 0, 0 };
            for (int r = 0; r < (int)blockDim.y; r++) st.a += sh[r][t];
            int64_t i = o * inner + k0 + t;
            if (part) part[i * splits + sp] = st;
            else ds_store(out.dtype, out.data, i, red_finish(op, 0, 0.0, st, n));
        }
        __syncthreads();                 /* sh is refilled for the next outputs */
    }
}

/* One thread per output merges its line's parts in order. */
template <typename T>
static __global__ void reduce_merge_kernel(ds_reduce_op op, int mode, double p, ds_kview out, int64_t total, int64_t n,
                                           int64_t splits, const red_state<T> *part) {
    DS_CUDA_LOOP(i, total) {
        red_state<T> s = part[i * splits];
        for (int64_t sp = 1; sp < splits; sp++) s = red_merge(op, mode, s, part[i * splits + sp]);
        ds_store(out.dtype, out.data, i, red_finish(op, mode, p, s, n));
    }
}

static int pow2_at_least(int64_t n, int cap) {
    int t = 1;
    while (t < cap && t < n) t *= 2;
    return t;
}

/* vec: sum_vec_kernel takes the lines (32 lanes of 8 outputs, 8 rows) */
template <typename T>
static int reduce_launch(ds_reduce_op op, int mode, double p, ds_kview out, ds_kview x, int64_t outer, int64_t n,
                         int64_t inner, bool vec) {
    int bx = vec ? 32 : pow2_at_least(inner, 32), by = vec ? RED_THREADS / 32 : pow2_at_least(n, RED_THREADS / bx);
    int64_t span = vec ? 32 * PW_VEC : bx, blocks = outer * ((inner + span - 1) / span);
    /* few long lines: split them so the whole GPU works, each thread still
     * taking at least 16 elements of its part */
    int64_t splits = RED_TARGET_BLOCKS / blocks < n / (16 * by) ? RED_TARGET_BLOCKS / blocks : n / (16 * by);
    if (splits < 1) splits = 1;
    red_state<T> *part = NULL;
    if (splits > 1) {
        part = (red_state<T> *)ds_cuda_scratch((size_t)(outer * inner * splits) * sizeof *part);
        if (!part) return -1;
    }
    dim3 block((unsigned)bx, (unsigned)by);
    if (vec)
        sum_vec_kernel<T><<<ds_cuda_blocks(blocks * splits, 1), block, 0, ds_cuda_stream()>>>(op, out, x, outer, n,
                                                                                              inner, splits, part);
    else
        reduce_kernel<T><<<ds_cuda_blocks(blocks * splits, 1), block, 0, ds_cuda_stream()>>>(op, mode, p, out, x,
                                                                                             outer, n, inner, splits,
                                                                                             part);
    int rc = ds_cuda_launched("reduce_kernel");
    if (rc == 0 && part) {
        reduce_merge_kernel<T><<<ds_cuda_blocks(outer * inner, DS_CUDA_THREADS), DS_CUDA_THREADS, 0,
                                 ds_cuda_stream()>>>(op, mode, p, out, outer * inner, n, splits, part);
        rc = ds_cuda_launched("reduce_merge_kernel");
    }
    if (part) ds_cuda_scratch_free(part);
    return rc;
}

static int cuda_reduce(ds_reduce_op op, ds_kview out, ds_kview x, int64_t outer, int64_t n, int64_t inner,
                       double param) {
    if (n == 0 && (op != DS_RED_SUM && op != DS_RED_NORM))
        return ds_kernel_fail("cannot reduce an empty dimension");
    if (outer * inner == 0) return 0;
    int mode = isinf(param) ? NORM_MAX : param == 2 ? NORM_SQ : param == 1 ? NORM_ABS
             : param == 0 ? NORM_NONZERO : NORM_POW;
    if (pw_is_f32ish(x.dtype)) {
        bool vec = (op == DS_RED_SUM || op == DS_RED_MEAN) && inner % PW_VEC == 0 && pw_aligned(x.data);
        return reduce_launch<float>(op, mode, param, out, x, outer, n, inner, vec);
    }
    return reduce_launch<double>(op, mode, param, out, x, outer, n, inner, false);
}

/* sum_squares: each block's partial (sum of squares, non-finite count) in
 * a fixed tree, then one block adds the partials in order into acc:
 * deterministic, and nothing comes back to the host. */
#define SQ_THREADS 256
#define SQ_MAX_BLOCKS 1024

__device__ __forceinline__ void add_square(double *sq, double *bad, float v) {
    *sq += (double)v * v;
    *bad += !isfinite(v);
}

/* x is read 16 bytes a load when it sits on 16 bytes (four times the bytes
 * in flight of one float a load), the tail one by one. */
__global__ void sum_squares_kernel(const float *x, int64_t n, double2 *part) {
    __shared__ double s_sq[SQ_THREADS], s_bad[SQ_THREADS];
    double sq = 0, bad = 0;
    int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    int64_t n4 = ((uintptr_t)x & 15) == 0 ? n / 4 : 0;
    for (int64_t i = first; i < n4; i += stride) {
        float4 v = ((const float4 *)x)[i];
        add_square(&sq, &bad, v.x);
        add_square(&sq, &bad, v.y);
        add_square(&sq, &bad, v.z);
        add_square(&sq, &bad, v.w);
    }
    for (int64_t i = n4 * 4 + first; i < n; i += stride) add_square(&sq, &bad, x[i]);
    s_sq[threadIdx.x] = sq;
    s_bad[threadIdx.x] = bad;
    __syncthreads();
    for (int s = SQ_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            s_sq[threadIdx.x] += s_sq[threadIdx.x + s];
            s_bad[threadIdx.x] += s_bad[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) part[blockIdx.x] = make_double2(s_sq[0], s_bad[0]);
}

__global__ void sum_squares_merge_kernel(const double2 *part, int nparts, double *acc) {
    double sq = 0, bad = 0;
    for (int i = 0; i < nparts; i++) {
        sq += part[i].x;
        bad += part[i].y;
    }
    acc[0] += sq;
    acc[1] += bad;
}

static int cuda_sum_squares(ds_kview acc, ds_kview x) {
    if (x.dtype != DS_F32 || !ds_kview_is_contiguous(&x) || acc.dtype != DS_F64)
        return ds_kernel_fail("sum_squares: needs contiguous f32 values and an f64 accumulator");
    int64_t n = ds_kview_numel(&x);
    if (n == 0) return 0;
    int blocks = (int)ds_cuda_blocks(n, SQ_THREADS);
    if (blocks > SQ_MAX_BLOCKS) blocks = SQ_MAX_BLOCKS;
    double2 *part = (double2 *)ds_cuda_scratch((size_t)blocks * sizeof *part);
    if (!part) return -1;
    sum_squares_kernel<<<blocks, SQ_THREADS, 0, ds_cuda_stream()>>>((const float *)x.data, n, part);
    int rc = ds_cuda_launched("sum_squares_kernel");
    if (rc == 0) {
        sum_squares_merge_kernel<<<1, 1, 0, ds_cuda_stream()>>>(part, blocks, (double *)acc.data);
        rc = ds_cuda_launched("sum_squares_merge_kernel");
    }
    ds_cuda_scratch_free(part);
    return rc;
}

extern "C" const ds_kernels_reduce ds_cuda_reduce = { cuda_reduce, cuda_sum_squares };
