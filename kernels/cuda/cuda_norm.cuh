/* The norm kernels of cuda_nn.cu (layer norm, RMS norm with the mean
 * fixed at 0 and no bias: `centered` off), plain CUDA over the pointwise
 * helpers, so tests/test_norm.cc runs them on the CPU: a block per row
 * (norm_kernel, any dtype) or a warp per row (f32/bf16/f16 rows of a
 * multiple of 8 on 16 bytes). */
#ifndef CUDA_NORM_CUH
#define CUDA_NORM_CUH

#include "cuda_pointwise.cuh"

#define ROW_WARPS 8

/* for (r over [0, rows)), a warp per row, spread over the whole grid */
#define ROW_WARP_LOOP(r, rows) \
    for (int64_t r = (int64_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5); r < (int64_t)(rows); \
         r += (int64_t)gridDim.x * ROW_WARPS)

/* y = (x - mean) rstd w + b, rstd = 1/sqrt(mean((x - mean)^2) + eps);
 * mean.data is NULL for RMS norm. With res.data, x + res goes to sum
 * first and the row is read back from there, rounded as stored: each
 * thread reads only the values it wrote. */
template <typename T>
static __global__ void norm_kernel(ds_kview y, ds_kview mean, ds_kview rstd, ds_kview x, ds_kview w, ds_kview b,
                                   ds_kview res, ds_kview sum, int64_t rows, int64_t n, T eps, bool centered) {
    ds_kview in = x;
    if (res.data) x = sum;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int64_t base = r * n;
        T m = 0, v = 0;
        for (int64_t j = threadIdx.x; res.data && j < n; j += blockDim.x)
            ds_store(sum.dtype, sum.data, base + j, pw_load<T>(in, base + j) + pw_load<T>(res, base + j));
        if (centered) {
            for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m += pw_load<T>(x, base + j);
            m = pw_block_sum(m) / (T)n;
        }
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            T d = pw_load<T>(x, base + j) - m;
            v += d * d;
        }
        T rs = (T)1 / sqrt(pw_block_sum(v) / (T)n + eps);
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            T o = (pw_load<T>(x, base + j) - m) * rs * (w.data ? pw_load<T>(w, j) : (T)1);
            if (centered) o += b.data ? pw_load<T>(b, j) : (T)0;
            ds_store(y.dtype, y.data, base + j, o);
        }
        if (threadIdx.x == 0) {
            if (centered) ds_store(mean.dtype, mean.data, r, m);
            ds_store(rstd.dtype, rstd.data, r, rs);
        }
    }
}

/* The f32 path for rows of a multiple of 8 values: a warp per row, 8
 * values a load, the same math as norm_kernel<float> over 32 lanes. Rows
 * of GPT-2 (768) are 3 loads a lane, with no block-wide barriers. */
__device__ __forceinline__ void norm_load8(const ds_kview &v, int64_t i, float *x, float absent) {
    if (v.data) pw_load8(v.dtype, v.data, i, x);
    else for (int k = 0; k < PW_VEC; k++) x[k] = absent;
}

static __global__ void norm_warp_kernel(ds_kview y, ds_kview mean, ds_kview rstd, ds_kview x, ds_kview w, ds_kview b,
                                        ds_kview res, ds_kview sum, int64_t rows, int64_t n, float eps,
                                        bool centered) {
    int lane = threadIdx.x & 31;
    ds_kview in = x;
    if (res.data) x = sum;
    ROW_WARP_LOOP(r, rows) {
        int64_t base = r * n;
        float m = 0, v = 0, xv[PW_VEC], wv[PW_VEC], bv[PW_VEC];
        for (int64_t j = lane * PW_VEC; res.data && j < n; j += 32 * PW_VEC) {
            pw_load8(in.dtype, in.data, base + j, xv);
            pw_load8(res.dtype, res.data, base + j, wv);
            for (int k = 0; k < PW_VEC; k++) xv[k] += wv[k];
            pw_store8(sum.dtype, sum.data, base + j, xv);
        }
        if (centered) {
            for (int64_t j = lane * PW_VEC; j < n; j += 32 * PW_VEC) {
                pw_load8(x.dtype, x.data, base + j, xv);
                for (int k = 0; k < PW_VEC; k++) m += xv[k];
            }
            m = pw_warp_reduce(m, pw_sum()) / (float)n;
        }
        for (int64_t j = lane * PW_VEC; j < n; j += 32 * PW_VEC) {
            pw_load8(x.dtype, x.data, base + j, xv);
            for (int k = 0; k < PW_VEC; k++) v += (xv[k] - m) * (xv[k] - m);
        }
        float rs = 1.0f / sqrtf(pw_warp_reduce(v, pw_sum()) / (float)n + eps);
        for (int64_t j = lane * PW_VEC; j < n; j += 32 * PW_VEC) {
            pw_load8(x.dtype, x.data, base + j, xv);
            norm_load8(w, j, wv, 1.0f);
            norm_load8(b, j, bv, 0.0f);
            for (int k = 0; k < PW_VEC; k++) xv[k] = (xv[k] - m) * rs * wv[k] + bv[k];
            pw_store8(y.dtype, y.data, base + j, xv);
        }
        if (lane == 0) {
            if (centered) pw_storef(mean.dtype, mean.data, r, m);
            pw_storef(rstd.dtype, rstd.data, r, rs);
        }
    }
}

/* With xh = (x - mean) rstd: dx = rstd (w g - mean(w g) - xh mean(w g xh));
 * RMS norm drops the mean(w g) term. gres.data: dx += gres. */
template <typename T>
static __global__ void norm_backward_kernel(ds_kview dx, ds_kview g, ds_kview x, ds_kview w, ds_kview mean,
                                            ds_kview rstd, ds_kview gres, int64_t rows, int64_t n) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int64_t base = r * n;
        T m = mean.data ? pw_load<T>(mean, r) : (T)0, rs = pw_load<T>(rstd, r), a = 0, c = 0;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            T wg = (w.data ? pw_load<T>(w, j) : (T)1) * pw_load<T>(g, base + j);
            a += wg;
            c += wg * (pw_load<T>(x, base + j) - m) * rs;
        }
        a = mean.data ? pw_block_sum(a) / (T)n : (T)0;
        c = pw_block_sum(c) / (T)n;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            T xh = (pw_load<T>(x, base + j) - m) * rs;
            T wg = (w.data ? pw_load<T>(w, j) : (T)1) * pw_load<T>(g, base + j);
            T o = (wg - a - xh * c) * rs;
            if (gres.data) o += pw_load<T>(gres, base + j);
            ds_store(dx.dtype, dx.data, base + j, o);
        }
    }
}

/* Row r's dx (gres added where given) over a warp, as norm_warp_kernel.
 * W > 0: the row is at most 256 W long, and each lane adds its g xh and g
 * into aw[v] and ab[v] for word v of its part of the row (elements
 * (32 v + lane) 8 ...; constant indices, so they stay in registers). */
template <int W>
__device__ __forceinline__ void norm_backward_row(ds_kview dx, ds_kview g, ds_kview x, ds_kview w, ds_kview mean,
                                                  ds_kview rstd, ds_kview gres, int64_t r, int64_t n,
                                                  float (*aw)[PW_VEC], float (*ab)[PW_VEC]) {
    int lane = threadIdx.x & 31;
    int64_t base = r * n;
    float m = mean.data ? pw_loadf(mean.dtype, mean.data, r) : 0.0f, rs = pw_loadf(rstd.dtype, rstd.data, r);
    float a = 0, c = 0, gv[PW_VEC], xv[PW_VEC], wv[PW_VEC];
    for (int64_t j = lane * PW_VEC; j < n; j += 32 * PW_VEC) {
        pw_load8(g.dtype, g.data, base + j, gv);
        pw_load8(x.dtype, x.data, base + j, xv);
        norm_load8(w, j, wv, 1.0f);
        for (int k = 0; k < PW_VEC; k++) {
            float wg = wv[k] * gv[k];
            a += wg;
            c += wg * (xv[k] - m) * rs;
        }
    }
    a = mean.data ? pw_warp_reduce(a, pw_sum()) / (float)n : 0.0f;
    c = pw_warp_reduce(c, pw_sum()) / (float)n;
    auto word = [&](int64_t j, float *pw, float *pb) {
        pw_load8(g.dtype, g.data, base + j, gv);
        pw_load8(x.dtype, x.data, base + j, xv);
        norm_load8(w, j, wv, 1.0f);
        for (int k = 0; k < PW_VEC; k++) {
            float xh = (xv[k] - m) * rs;
            if (W > 0) {
                pw[k] += gv[k] * xh;
                pb[k] += gv[k];
            }
            xv[k] = (wv[k] * gv[k] - a - xh * c) * rs;
        }
        norm_load8(gres, base + j, gv, 0.0f);
        for (int k = 0; k < PW_VEC; k++) xv[k] += gv[k];
        pw_store8(dx.dtype, dx.data, base + j, xv);
    };
    if (W == 0) {
        for (int64_t j = lane * PW_VEC; j < n; j += 32 * PW_VEC) word(j, nullptr, nullptr);
    } else {
#pragma unroll
        for (int v = 0; v < W; v++) {
            int64_t j = (int64_t)(v * 32 + lane) * PW_VEC;
            if (j < n) word(j, aw[v], ab[v]);
        }
    }
}

/* The same over a warp per row, as norm_warp_kernel. */
static __global__ void norm_backward_warp_kernel(ds_kview dx, ds_kview g, ds_kview x, ds_kview w, ds_kview mean,
                                                 ds_kview rstd, ds_kview gres, int64_t rows, int64_t n) {
    ROW_WARP_LOOP(r, rows) norm_backward_row<0>(dx, g, x, w, mean, rstd, gres, r, n, nullptr, nullptr);
}

/* Blocks of norm_backward_params_kernel at most: each sums rows / this of
 * the rows' weight and bias gradients, the last block these partials. */
#define NORM_PARAM_BLOCKS 256

/* Shared memory norm_backward_params_kernel takes for rows of n. */
static inline size_t norm_params_smem(int64_t n) { return (size_t)(ROW_WARPS * n) * sizeof(float) + 16; }

/* norm_backward_warp_kernel with the weight and bias gradients in the same
 * kernel, for rows of at most 256 W: each lane sums g xh and g over its
 * warp's rows in registers, the block's warps are summed in order through
 * shared memory into part[block] (dw, then db, n each), and the last block
 * to finish sums the blocks' partials in order: the same sums on every
 * run. *done counts finished blocks; it must be 0 at launch. */
template <int W>
static __global__ void __launch_bounds__(32 * ROW_WARPS)
norm_backward_params_kernel(ds_kview dx, ds_kview dw, ds_kview db, ds_kview g, ds_kview x, ds_kview w, ds_kview mean,
                            ds_kview rstd, ds_kview gres, float *part, unsigned *done, int64_t rows, int64_t n) {
    extern __shared__ __align__(16) unsigned char smem[];
    float *red = (float *)smem;                  /* [ROW_WARPS][n] */
    unsigned *last = (unsigned *)(red + ROW_WARPS * n);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float aw[W][PW_VEC] = {}, ab[W][PW_VEC] = {};
    ROW_WARP_LOOP(r, rows) norm_backward_row<W>(dx, g, x, w, mean, rstd, gres, r, n, aw, ab);
    for (int t = 0; t < 2; t++) {
        for (int v = 0; v < W; v++) {
            int64_t j = (int64_t)(v * 32 + lane) * PW_VEC;
            for (int k = 0; j < n && k < PW_VEC; k++) red[warp * n + j + k] = t ? ab[v][k] : aw[v][k];
        }
        __syncthreads();
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            float s = 0;
            for (int v = 0; v < ROW_WARPS; v++) s += red[v * n + j];
            part[(2 * (int64_t)blockIdx.x + t) * n + j] = s;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        __threadfence();                         /* this block's partials before its count */
        *last = atomicAdd(done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!*last) return;
    __threadfence();
    /* 4 columns a thread (n is a multiple of 8), the blocks' partials read
     * from L2 (__ldcg: not a line this SM may hold), many loads in flight
     * and the sums still in block order */
    for (int64_t j = 4 * threadIdx.x; j < 2 * n; j += 4 * blockDim.x) {
        int t = j >= n;
        int64_t col = j - t * n;
        float s[4] = {};
#pragma unroll 8
        for (unsigned b = 0; b < gridDim.x; b++) {
            float4 v = __ldcg((const float4 *)(part + (2 * (int64_t)b + t) * n + col));
            s[0] += v.x;
            s[1] += v.y;
            s[2] += v.z;
            s[3] += v.w;
        }
        const ds_kview &out = t ? db : dw;
        for (int k = 0; out.data && k < 4; k++) pw_storef(out.dtype, out.data, col + k, s[k]);
    }
}

#endif
