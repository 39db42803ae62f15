/* Fused nn row ops on the GPU. A block owns a row (grid-stride over rows),
 * its threads stride over the row's elements and combine with
 * pw_block_reduce, so every result is deterministic. The math is that of
 * ds_rows.h, spread over the block: rows compute in f64 when a tensor is
 * f64, else in f32 (the CPU takes f64 for bf16/f16 rows: within f32
 * rounding of each other), with CUDA's expf as the f32 exp. Weight and bias
 * gradients sum over rows in two deterministic stages: partial sums per
 * chunk of rows, then the chunks in order; inside the dx kernel on the
 * warp path for rows up to 1024 (cuda_norm.cuh), else in two kernels after. Dropout draws the CPU's Philox
 * stream, so its masks are identical. */
#include "cuda_norm.cuh"
#include "../ds_elem.h"
#include "../ds_rows.h"

static unsigned row_blocks(int64_t rows) { return ds_cuda_blocks(rows, 1); }

/* ---- softmax and log_softmax over the middle axis of [outer, n, inner] ---- */

template <typename T>
static __global__ void softmax_kernel(ds_kview y, ds_kview x, int64_t rows, int64_t n, int64_t inner, int as_log) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int64_t base = r / inner * n * inner + r % inner;
        T m = -INFINITY, s = 0;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m = fmax(m, pw_load<T>(x, base + j * inner));
        m = pw_block_max(m);
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += pw_exp(pw_load<T>(x, base + j * inner) - m);
        s = pw_block_sum(s);
        T shift = m + log(s), inv = (T)1 / s;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            T v = pw_load<T>(x, base + j * inner);
            ds_store(y.dtype, y.data, base + j * inner, as_log ? v - shift : pw_exp(v - m) * inv);
        }
    }
}

/* The float path for contiguous rows of n <= 32 * 8 * W values, n a
 * multiple of 8 (attention's rows of 1024 scores): a warp per row, the
 * row read once into registers, 16 bytes a load, and softmax_kernel<float>'s
 * math over 32 lanes. */
#define ROW_MAX_WORDS 4

/* Word w of a lane's part of a row: elements j..j+7, present when j < n. */
__device__ __forceinline__ int64_t row_word(int w, int lane) { return (int64_t)(w * 32 + lane) * PW_VEC; }

template <int W>
static __global__ void __launch_bounds__(32 * ROW_WARPS)
softmax_warp_kernel(ds_kview y, ds_kview x, int64_t rows, int64_t n, int as_log) {
    int lane = threadIdx.x & 31;
    ROW_WARP_LOOP(r, rows) {
        int64_t base = r * n;
        float v[W][PW_VEC], m = -INFINITY, s = 0;
#pragma unroll
        for (int w = 0; w < W; w++) {
            if (row_word(w, lane) >= n) continue;
            pw_load8(x.dtype, x.data, base + row_word(w, lane), v[w]);
            for (int k = 0; k < PW_VEC; k++) m = fmax(m, v[w][k]);
        }
        m = pw_warp_reduce(m, pw_max());
        /* softmax keeps each exp for the output: one exp per element
         * (two made the bf16 rows bound by the polynomial) */
#pragma unroll
        for (int w = 0; w < W; w++)
            if (row_word(w, lane) < n)
                for (int k = 0; k < PW_VEC; k++) {
                    float e = pw_exp(v[w][k] - m);
                    s += e;
                    if (!as_log) v[w][k] = e;
                }
        s = pw_warp_reduce(s, pw_sum());
        float shift = m + logf(s), inv = 1.0f / s;
#pragma unroll
        for (int w = 0; w < W; w++) {
            if (row_word(w, lane) >= n) continue;
            for (int k = 0; k < PW_VEC; k++) v[w][k] = as_log ? v[w][k] - shift : v[w][k] * inv;
            pw_store8(y.dtype, y.data, base + row_word(w, lane), v[w]);
        }
    }
}

/* Words per lane for rows of n on the warp path, or 0 when the views
 * (given as v[0..k)) or n do not take it. */
static int row_words(int64_t n, int64_t inner, const ds_kview *const *v, int k) {
    if (inner != 1 || n % PW_VEC || n > 32 * PW_VEC * ROW_MAX_WORDS) return 0;
    for (int i = 0; i < k; i++)
        if (!pw_is_f32ish(v[i]->dtype) || !pw_aligned(v[i]->data)) return 0;
    return (int)((n + 32 * PW_VEC - 1) / (32 * PW_VEC));
}

static unsigned row_warp_blocks(int64_t rows) { return ds_cuda_blocks(rows, ROW_WARPS); }

static int cuda_softmax(ds_kview y, ds_kview x, int64_t outer, int64_t n, int64_t inner, int as_log) {
    int64_t rows = outer * inner;
    if (rows == 0 || n == 0) return 0;
    const ds_kview *v[2] = { &y, &x };
    if (int w = row_words(n, inner, v, 2)) {
        static void (*const kernel[ROW_MAX_WORDS])(ds_kview, ds_kview, int64_t, int64_t, int) = {
            softmax_warp_kernel<1>, softmax_warp_kernel<2>, softmax_warp_kernel<3>, softmax_warp_kernel<4>,
        };
        kernel[w - 1]<<<row_warp_blocks(rows), 32 * ROW_WARPS, 0, ds_cuda_stream()>>>(y, x, rows, n, as_log);
        return ds_cuda_launched("softmax_warp_kernel");
    }
    int th = pw_row_threads(n);
    if (pw_any_f64(v, 2))
        softmax_kernel<double><<<row_blocks(rows), th, 0, ds_cuda_stream()>>>(y, x, rows, n, inner, as_log);
    else
        softmax_kernel<float><<<row_blocks(rows), th, 0, ds_cuda_stream()>>>(y, x, rows, n, inner, as_log);
    return ds_cuda_launched("softmax_kernel");
}

/* softmax: dx = y (g - sum g y); log_softmax: dx = g - exp(y) sum g */
template <typename T>
static __global__ void softmax_backward_kernel(ds_kview dx, ds_kview g, ds_kview y, int64_t rows, int64_t n,
                                               int64_t inner, int as_log) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int64_t base = r / inner * n * inner + r % inner;
        T s = 0;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            int64_t i = base + j * inner;
            s += as_log ? pw_load<T>(g, i) : pw_load<T>(g, i) * pw_load<T>(y, i);
        }
        s = pw_block_sum(s);
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            int64_t i = base + j * inner;
            T gv = pw_load<T>(g, i), yv = pw_load<T>(y, i);
            ds_store(dx.dtype, dx.data, i, as_log ? gv - pw_exp(yv) * s : yv * (gv - s));
        }
    }
}

/* The same rows as softmax_warp_kernel, g and y read once into registers. */
template <int W>
static __global__ void __launch_bounds__(32 * ROW_WARPS)
softmax_backward_warp_kernel(ds_kview dx, ds_kview g, ds_kview y, int64_t rows, int64_t n, int as_log) {
    int lane = threadIdx.x & 31;
    ROW_WARP_LOOP(r, rows) {
        int64_t base = r * n;
        float gv[W][PW_VEC], yv[W][PW_VEC], s = 0;
#pragma unroll
        for (int w = 0; w < W; w++) {
            if (row_word(w, lane) >= n) continue;
            pw_load8(g.dtype, g.data, base + row_word(w, lane), gv[w]);
            pw_load8(y.dtype, y.data, base + row_word(w, lane), yv[w]);
            for (int k = 0; k < PW_VEC; k++) s += as_log ? gv[w][k] : gv[w][k] * yv[w][k];
        }
        s = pw_warp_reduce(s, pw_sum());
#pragma unroll
        for (int w = 0; w < W; w++) {
            if (row_word(w, lane) >= n) continue;
            for (int k = 0; k < PW_VEC; k++)
                gv[w][k] = as_log ? gv[w][k] - pw_exp(yv[w][k]) * s : yv[w][k] * (gv[w][k] - s);
            pw_store8(dx.dtype, dx.data, base + row_word(w, lane), gv[w]);
        }
    }
}

static int cuda_softmax_backward(ds_kview dx, ds_kview g, ds_kview y, int64_t outer, int64_t n, int64_t inner,
                                 int as_log) {
    int64_t rows = outer * inner;
    if (rows == 0 || n == 0) return 0;
    const ds_kview *v[3] = { &dx, &g, &y };
    if (int w = row_words(n, inner, v, 3)) {
        static void (*const kernel[ROW_MAX_WORDS])(ds_kview, ds_kview, ds_kview, int64_t, int64_t, int) = {
            softmax_backward_warp_kernel<1>, softmax_backward_warp_kernel<2>, softmax_backward_warp_kernel<3>,
            softmax_backward_warp_kernel<4>,
        };
        kernel[w - 1]<<<row_warp_blocks(rows), 32 * ROW_WARPS, 0, ds_cuda_stream()>>>(dx, g, y, rows, n, as_log);
        return ds_cuda_launched("softmax_backward_warp_kernel");
    }
    int th = pw_row_threads(n);
    if (pw_any_f64(v, 3))
        softmax_backward_kernel<double><<<row_blocks(rows), th, 0, ds_cuda_stream()>>>(dx, g, y, rows, n, inner,
                                                                                      as_log);
    else
        softmax_backward_kernel<float><<<row_blocks(rows), th, 0, ds_cuda_stream()>>>(dx, g, y, rows, n, inner,
                                                                                     as_log);
    return ds_cuda_launched("softmax_backward_kernel");
}

/* ---- cross-entropy with label smoothing eps over C classes ---- */

/* True when row r's target t counts: not ignored and, since a GPU's
 * range check is read back later (core/tensor/ds_fault.h), in [0, C). */
__device__ __forceinline__ bool ce_counts(int64_t t, int64_t C, int64_t ignore) {
    return t != ignore && t >= 0 && t < C;
}

/* True (with the row's loss and lse set to 0) when row r's target does
 * not count. */
__device__ __forceinline__ bool ce_skipped(const ds_kview &loss, const ds_kview &lse, int64_t r, int64_t t, int64_t C,
                                           int64_t ignore) {
    if (ce_counts(t, C, ignore)) return false;
    if (threadIdx.x == 0) {
        ds_store(loss.dtype, loss.data, r, 0);
        ds_store(lse.dtype, lse.data, r, 0);
    }
    return true;
}

/* loss = lse - (1 - eps) x[t] - eps/C sum_j x[j]; 0 (and lse 0) when
 * ignored. Rows are ld apart, of which the first C are classes. f64 data. */
static __global__ void ce_f64_kernel(ds_kview loss, ds_kview lse, ds_kview logits, ds_kview target, int64_t rows,
                                     int64_t C, int64_t ld, int64_t ignore, double eps) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int64_t t = pw_index(target, r), base = r * ld;
        if (ce_skipped(loss, lse, r, t, C, ignore)) continue;
        double m = -INFINITY, sx = 0, s = 0;
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
            double v = pw_load<double>(logits, base + j);
            m = fmax(m, v);
            sx += v;
        }
        m = pw_block_max(m);
        sx = pw_block_sum(sx);
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) s += exp(pw_load<double>(logits, base + j) - m);
        s = pw_block_sum(s);
        if (threadIdx.x == 0) {
            double l = m + log(s);
            ds_store(lse.dtype, lse.data, r, l);
            ds_store(loss.dtype, loss.data, r, l - (1 - eps) * pw_load<double>(logits, base + t) - eps / (double)C * sx);
        }
    }
}

/* Folds v into a running max m and sum s of exp(x - m): one pass over the
 * row (online softmax). -inf adds nothing; NaN reaches the sum. */
__device__ __forceinline__ void lse_add(float &m, float &s, float v) {
    if (v > m) {
        s = s * pw_exp(m - v) + 1.0f;
        m = v;
    } else if (v != -INFINITY) {
        s += pw_exp(v - m);
    }
}

/* The same for 8 logits at once: one rescale of s for their max, then an
 * exp each against it (a branch per 8 logits, not per logit). */
__device__ __forceinline__ void lse_add8(float &m, float &s, const float x[PW_VEC]) {
    float top = x[0];
#pragma unroll
    for (int k = 1; k < PW_VEC; k++) top = fmaxf(top, x[k]);
    if (top > m) {
        s = m == -INFINITY ? 0.0f : s * pw_exp(m - top);
        m = top;
    }
    if (m == -INFINITY) return;
#pragma unroll
    for (int k = 0; k < PW_VEC; k++) s += x[k] == m ? 1.0f : pw_exp(x[k] - m);   /* an inf max counts once, not NaN */
}

/* f32, bf16 and f16 logits in place, in one read: the same loss in f32,
 * 8 logits a load from each row's first 16-byte boundary, the few before
 * it and after the last one by one (rows of an odd vocab start anywhere). */
static __global__ void ce_f32_kernel(ds_kview loss, ds_kview lse, ds_kview logits, ds_kview target, int64_t rows,
                                     int64_t C, int64_t ld, int64_t ignore, float eps) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int64_t t = pw_index(target, r), base = r * ld;
        if (ce_skipped(loss, lse, r, t, C, ignore)) continue;
        int64_t h = min(pw_head(logits.dtype, logits.data, base), C), cv = h + (C - h) / PW_VEC * PW_VEC;
        float m = -INFINITY, s = 0, sx = 0, x[PW_VEC];
        for (int64_t j = h + threadIdx.x * PW_VEC; j < cv; j += blockDim.x * PW_VEC) {
            pw_load8(logits.dtype, logits.data, base + j, x);
            lse_add8(m, s, x);
            for (int k = 0; k < PW_VEC; k++) sx += x[k];
        }
        for (int64_t q = threadIdx.x; q < h + C - cv; q += blockDim.x) {
            float v = pw_loadf(logits.dtype, logits.data, base + (q < h ? q : cv + q - h));
            lse_add(m, s, v);
            sx += v;
        }
        float M = pw_block_max(m);
        s = pw_block_sum(m == -INFINITY ? 0.0f : s * pw_exp(m - M));
        sx = pw_block_sum(sx);
        if (threadIdx.x == 0) {
            float l = M + logf(s);
            ds_store(lse.dtype, lse.data, r, l);
            ds_store(loss.dtype, loss.data, r,
                     l - (1.0f - eps) * pw_loadf(logits.dtype, logits.data, base + t) - eps / (float)C * sx);
        }
    }
}

static int cuda_cross_entropy(ds_kview loss, ds_kview lse, ds_kview logits, ds_kview target, int64_t rows, int64_t C,
                              int64_t ld, int64_t ignore_index, double smoothing) {
    if (target.dtype != DS_I64 && target.dtype != DS_I32)
        return ds_kernel_fail("target must hold i64 or i32 class ids");
    if (rows == 0) return 0;
    const ds_kview *v[3] = { &loss, &lse, &logits };
    if (pw_any_f64(v, 3)) {
        ce_f64_kernel<<<row_blocks(rows), pw_row_threads(C), 0, ds_cuda_stream()>>>(loss, lse, logits, target, rows,
                                                                                    C, ld, ignore_index, smoothing);
        return ds_cuda_launched("ce_f64_kernel");
    }
    ce_f32_kernel<<<row_blocks(rows), pw_row_threads(C / PW_VEC), 0, ds_cuda_stream()>>>(
        loss, lse, logits, target, rows, C, ld, ignore_index, (float)smoothing);
    return ds_cuda_launched("ce_f32_kernel");
}

/* dx = s (softmax(x) - eps/C) - s (1 - eps) onehot(t), s = dloss[r]; one
 * thread per logit, 0 on the rows that do not count and past C. f64 data. */
static __global__ void ce_backward_f64_kernel(ds_kview dlogits, ds_kview dloss, ds_kview logits, ds_kview lse,
                                              ds_kview target, int64_t rows, int64_t C, int64_t ld, int64_t ignore,
                                              double eps, int64_t dstride) {
    DS_CUDA_LOOP(e, rows * ld) {
        int64_t r = e / ld, j = e % ld, t = pw_index(target, r);
        double v = 0;
        if (ce_counts(t, C, ignore) && j < C) {
            double s = ds_load(dloss.dtype, dloss.data, r * dstride);
            v = s * (exp(pw_load<double>(logits, e) - pw_load<double>(lse, r)) - eps / (double)C);
            if (j == t) v -= s * (1 - eps);
        }
        ds_store(dlogits.dtype, dlogits.data, e, v);
    }
}

/* Column j's gradient from its logit x, in the f32 kernel's terms. */
__device__ __forceinline__ float ce_grad(float x, int64_t j, int64_t C, int64_t t, float s, float l, float off,
                                         float hit) {
    if (j >= C) return 0;
    float v = s * (pw_exp(x - l) - off);
    return j == t ? v - hit : v;
}

/* The same in f32, a block per row: one read of the logits, one write of
 * dlogits in their dtype, 8 a thread access from the rows' first 16-byte
 * boundary when vec (the two tensors equally far from one). */
static __global__ void ce_backward_f32_kernel(ds_kview dlogits, ds_kview dloss, ds_kview logits, ds_kview lse,
                                              ds_kview target, int64_t rows, int64_t C, int64_t ld, int64_t ignore,
                                              float eps, int64_t dstride, bool vec) {
    float off = eps / (float)C;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int64_t t = pw_index(target, r), base = r * ld, c = ce_counts(t, C, ignore) ? C : 0;   /* c: the columns with a gradient */
        int64_t h = vec ? min(pw_head(dlogits.dtype, dlogits.data, base), ld) : ld, lv = h + (ld - h) / PW_VEC * PW_VEC;
        float s = c ? (float)ds_load(dloss.dtype, dloss.data, r * dstride) : 0.0f;
        float l = c ? pw_loadf(lse.dtype, lse.data, r) : 0.0f, hit = s * (1.0f - eps), x[PW_VEC] = {};
        for (int64_t j = h + threadIdx.x * PW_VEC; j < lv; j += blockDim.x * PW_VEC) {
            if (j < c) pw_load8(logits.dtype, logits.data, base + j, x);
            for (int k = 0; k < PW_VEC; k++) x[k] = ce_grad(x[k], j + k, c, t, s, l, off, hit);
            pw_store8(dlogits.dtype, dlogits.data, base + j, x);
        }
        for (int64_t q = threadIdx.x; q < h + ld - lv; q += blockDim.x) {
            int64_t j = q < h ? q : lv + q - h;
            float v = j < c ? pw_loadf(logits.dtype, logits.data, base + j) : 0.0f;
            pw_storef(dlogits.dtype, dlogits.data, base + j, ce_grad(v, j, c, t, s, l, off, hit));
        }
    }
}

static int cuda_cross_entropy_backward(ds_kview dlogits, ds_kview dloss, ds_kview logits, ds_kview lse,
                                       ds_kview target, int64_t rows, int64_t C, int64_t ld, int64_t ignore_index,
                                       double smoothing) {
    int64_t n = rows * ld, ds = dloss.ndim ? dloss.stride[0] : 0;
    if (n == 0) return 0;
    const ds_kview *v[3] = { &dlogits, &logits, &lse };
    if (pw_any_f64(v, 3)) {
        ce_backward_f64_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
            dlogits, dloss, logits, lse, target, rows, C, ld, ignore_index, smoothing, ds);
        return ds_cuda_launched("ce_backward_f64_kernel");
    }
    bool vec = logits.dtype == dlogits.dtype && ((uintptr_t)logits.data - (uintptr_t)dlogits.data) % 16 == 0;
    ce_backward_f32_kernel<<<row_blocks(rows), pw_row_threads(vec ? ld / PW_VEC : ld), 0, ds_cuda_stream()>>>(
        dlogits, dloss, logits, lse, target, rows, C, ld, ignore_index, (float)smoothing, ds, vec);
    return ds_cuda_launched("ce_backward_f32_kernel");
}

/* ---- layer norm and RMS norm, one kernel each way: RMS norm is layer
 * norm with the mean fixed at 0 and no bias (`centered` off) ---- */

/* Whether rows of n go through the warp kernels: n a multiple of 8 and
 * every view given f32, bf16 or f16 on 16 bytes. */
static bool norm_vec(int64_t n, const ds_kview *const *v, int k) {
    if (n % PW_VEC) return false;
    for (int i = 0; i < k; i++)
        if (v[i]->data && (!pw_is_f32ish(v[i]->dtype) || !pw_aligned(v[i]->data))) return false;
    return true;
}

static int norm_forward(ds_kview y, ds_kview mean, ds_kview rstd, ds_kview x, ds_kview w, ds_kview b, ds_kview res,
                        ds_kview sum, int64_t rows, int64_t n, double eps) {
    if (rows == 0) return 0;
    const ds_kview *v[8] = { &y, &mean, &rstd, &x, &res, &sum, &w, &b };
    int th = pw_row_threads(n);
    bool centered = mean.data != NULL;
    if (norm_vec(n, v, 8)) {
        norm_warp_kernel<<<row_warp_blocks(rows), 32 * ROW_WARPS, 0, ds_cuda_stream()>>>(
            y, mean, rstd, x, w, b, res, sum, rows, n, (float)eps, centered);
        return ds_cuda_launched("norm_warp_kernel");
    }
    if (pw_any_f64(v, 6))
        norm_kernel<double><<<row_blocks(rows), th, 0, ds_cuda_stream()>>>(y, mean, rstd, x, w, b, res, sum, rows, n,
                                                                           eps, centered);
    else
        norm_kernel<float><<<row_blocks(rows), th, 0, ds_cuda_stream()>>>(y, mean, rstd, x, w, b, res, sum, rows, n,
                                                                          (float)eps, centered);
    return ds_cuda_launched("norm_kernel");
}

#define PARAM_COLS 32
#define PARAM_ROWS 8

/* Column col of the PARAM_ROWS rows of partials in sw, sb (rows ld apart),
 * summed in order, into pw[at] and pb[at]. */
template <typename T>
__device__ __forceinline__ void param_fold(T *pw, T *pb, const T *sw, const T *sb, int ld, int col, int64_t at) {
    T s = 0, t = 0;
    for (int k = 0; k < PARAM_ROWS; k++) {
        s += sw[k * ld + col];
        t += sb[k * ld + col];
    }
    pw[at] = s;
    if (pb) pb[at] = t;
}

/* Stage 1 of dw = sum_r g xh and db = sum_r g: block (cb, chunk) sums the
 * rows of its chunk for 32 columns into pw[chunk][j], pb[chunk][j]. */
template <typename T>
static __global__ void param_partial_kernel(T *pw, T *pb, ds_kview g, ds_kview x, ds_kview mean, ds_kview rstd,
                                            int64_t rows, int64_t n, int64_t chunk) {
    __shared__ T sw[PARAM_ROWS][PARAM_COLS], sb[PARAM_ROWS][PARAM_COLS];
    int tx = threadIdx.x, ty = threadIdx.y;
    int64_t r0 = blockIdx.y * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
    for (int64_t cb = blockIdx.x; cb * PARAM_COLS < n; cb += gridDim.x) {
        int64_t j = cb * PARAM_COLS + tx;
        T aw = 0, ab = 0;
        for (int64_t r = r0 + ty; j < n && r < r1; r += PARAM_ROWS) {
            T gv = pw_load<T>(g, r * n + j);
            T xh = (pw_load<T>(x, r * n + j) - (mean.data ? pw_load<T>(mean, r) : (T)0)) * pw_load<T>(rstd, r);
            aw += gv * xh;
            ab += gv;
        }
        sw[ty][tx] = aw;
        sb[ty][tx] = ab;
        __syncthreads();
        if (ty == 0 && j < n) param_fold(pw, pb, &sw[0][0], &sb[0][0], PARAM_COLS, tx, blockIdx.y * n + j);
        __syncthreads();
    }
}

/* The same for f32/bf16/f16 rows of a multiple of 8 on 16 bytes (the
 * warp kernels' rows): a thread takes 8 columns with 16-byte loads, a
 * block 256 columns, each column of a chunk summed in the order above. */
static __global__ void param_partial_vec_kernel(float *pw, float *pb, ds_kview g, ds_kview x, ds_kview mean,
                                                ds_kview rstd, int64_t rows, int64_t n, int64_t chunk) {
    __shared__ float sw[PARAM_ROWS][PARAM_COLS * PW_VEC], sb[PARAM_ROWS][PARAM_COLS * PW_VEC];
    int tx = threadIdx.x, ty = threadIdx.y, t = ty * PARAM_COLS + tx;
    int64_t r0 = blockIdx.y * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
    for (int64_t cb = blockIdx.x; cb * PARAM_COLS * PW_VEC < n; cb += gridDim.x) {
        int64_t j = (cb * PARAM_COLS + tx) * PW_VEC;
        float aw[PW_VEC] = {}, ab[PW_VEC] = {}, gv[PW_VEC], xv[PW_VEC];
        for (int64_t r = r0 + ty; j < n && r < r1; r += PARAM_ROWS) {
            pw_load8(g.dtype, g.data, r * n + j, gv);
            pw_load8(x.dtype, x.data, r * n + j, xv);
            float m = mean.data ? pw_loadf(mean.dtype, mean.data, r) : 0.0f, rs = pw_loadf(rstd.dtype, rstd.data, r);
            for (int k = 0; k < PW_VEC; k++) {
                aw[k] += gv[k] * ((xv[k] - m) * rs);
                ab[k] += gv[k];
            }
        }
        for (int k = 0; k < PW_VEC; k++) {
            sw[ty][tx * PW_VEC + k] = aw[k];
            sb[ty][tx * PW_VEC + k] = ab[k];
        }
        __syncthreads();
        int64_t jc = cb * PARAM_COLS * PW_VEC + t;     /* thread t sums column t of the block's 256 */
        if (jc < n) param_fold(pw, pb, &sw[0][0], &sb[0][0], PARAM_COLS * PW_VEC, t, blockIdx.y * n + jc);
        __syncthreads();
    }
}

/* Stage 2: lane ty of column j sums chunks ty, ty + 8, ... in order, then
 * the 8 lanes in order: a fixed tree, with 8 times the threads of one
 * per column. */
template <typename T>
static __global__ void param_sum_kernel(ds_kview dw, ds_kview db, const T *pw, const T *pb, int64_t chunks,
                                        int64_t n) {
    __shared__ T sw[PARAM_ROWS][PARAM_COLS], sb[PARAM_ROWS][PARAM_COLS];
    int tx = threadIdx.x, ty = threadIdx.y;
    for (int64_t cb = blockIdx.x; cb * PARAM_COLS < n; cb += gridDim.x) {
        int64_t j = cb * PARAM_COLS + tx;
        T s = 0, t = 0;
        for (int64_t c = ty; j < n && c < chunks; c += PARAM_ROWS) {
            s += pw[c * n + j];
            if (pb) t += pb[c * n + j];
        }
        sw[ty][tx] = s;
        sb[ty][tx] = t;
        __syncthreads();
        if (ty == 0 && j < n) {
            for (int k = 1; k < PARAM_ROWS; k++) {
                s += sw[k][tx];
                t += sb[k][tx];
            }
            if (dw.data) ds_store(dw.dtype, dw.data, j, s);
            if (db.data) ds_store(db.dtype, db.data, j, t);
        }
        __syncthreads();
    }
}

/* vec: the rows suit param_partial_vec_kernel (f32 only) */
template <typename T>
static int param_grads(ds_kview dw, ds_kview db, ds_kview g, ds_kview x, ds_kview mean, ds_kview rstd, int64_t rows,
                       int64_t n, bool vec) {
    /* at most 1024 chunks of at least `least` rows (one chunk when rows is 0);
     * the vec kernel's blocks span 8 times the columns, so 4 times the chunks */
    int64_t least = vec ? 64 : 256, chunk = rows / 1024 + 1 > least ? rows / 1024 + 1 : least;
    int64_t chunks = rows > 0 ? (rows + chunk - 1) / chunk : 1;
    size_t part = (size_t)(chunks * n);
    T *pw = (T *)ds_cuda_scratch((db.data ? 2 : 1) * part * sizeof(T));
    if (!pw) return -1;
    T *pb = db.data ? pw + part : NULL;
    dim3 block(PARAM_COLS, PARAM_ROWS);
    if (vec) {
        dim3 grid(ds_cuda_blocks(n, PARAM_COLS * PW_VEC), (unsigned)chunks);
        param_partial_vec_kernel<<<grid, block, 0, ds_cuda_stream()>>>((float *)pw, (float *)pb, g, x, mean, rstd,
                                                                       rows, n, chunk);
    } else {
        dim3 grid(ds_cuda_blocks(n, PARAM_COLS), (unsigned)chunks);
        param_partial_kernel<T><<<grid, block, 0, ds_cuda_stream()>>>(pw, pb, g, x, mean, rstd, rows, n, chunk);
    }
    int rc = ds_cuda_launched("param_partial_kernel");
    if (rc == 0) {
        param_sum_kernel<T><<<ds_cuda_blocks(n, PARAM_COLS), block, 0, ds_cuda_stream()>>>(dw, db, pw, pb, chunks, n);
        rc = ds_cuda_launched("param_sum_kernel");
    }
    ds_cuda_scratch_free(pw);
    return rc;
}

#define NORM_PARAM_WORDS 4

typedef void (*norm_params_fn)(ds_kview, ds_kview, ds_kview, ds_kview, ds_kview, ds_kview, ds_kview, ds_kview,
                               ds_kview, float *, unsigned *, int64_t, int64_t);

/* dx, dw and db in one kernel on the warp path, for rows of at most
 * 256 NORM_PARAM_WORDS: 1 when taken (*rc 0 or -1 as it went), else 0. */
static int norm_backward_fused(ds_kview dx, ds_kview dw, ds_kview db, ds_kview g, ds_kview x, ds_kview w,
                               ds_kview mean, ds_kview rstd, ds_kview gres, int64_t rows, int64_t n, int *rc) {
    static const norm_params_fn kernels[NORM_PARAM_WORDS] = {
        norm_backward_params_kernel<1>, norm_backward_params_kernel<2>, norm_backward_params_kernel<3>,
        norm_backward_params_kernel<4>,
    };
    int64_t words = (n + 32 * PW_VEC - 1) / (32 * PW_VEC);
    if (words > NORM_PARAM_WORDS) return 0;
    unsigned grid = row_warp_blocks(rows) < NORM_PARAM_BLOCKS ? row_warp_blocks(rows) : NORM_PARAM_BLOCKS;
    size_t part = (size_t)grid * 2 * (size_t)n * sizeof(float);
    unsigned char *s = (unsigned char *)ds_cuda_scratch(part + sizeof(unsigned));
    if (!s) return *rc = -1, 1;
    unsigned *done = (unsigned *)(s + part);
    *rc = ds_cuda_ok(cudaMemsetAsync(done, 0, sizeof *done, ds_cuda_stream()), "cudaMemsetAsync");
    if (*rc == 0) {
        kernels[words - 1]<<<grid, 32 * ROW_WARPS, norm_params_smem(n), ds_cuda_stream()>>>(
            dx, dw, db, g, x, w, mean, rstd, gres, (float *)s, done, rows, n);
        *rc = ds_cuda_launched("norm_backward_params_kernel");
    }
    ds_cuda_scratch_free(s);
    return 1;
}

static int norm_backward(ds_kview dx, ds_kview dw, ds_kview db, ds_kview g, ds_kview x, ds_kview w, ds_kview mean,
                         ds_kview rstd, ds_kview gres, int64_t rows, int64_t n) {
    if (n == 0) return 0;
    const ds_kview *v[7] = { &dx, &g, &x, &mean, &rstd, &gres, &w };
    bool f64 = pw_any_f64(v, 6), vec = norm_vec(n, v, 7);
    int rc;
    if (rows > 0 && vec && (dw.data || db.data) && norm_backward_fused(dx, dw, db, g, x, w, mean, rstd, gres, rows, n,
                                                                       &rc))
        return rc;
    if (rows > 0 && vec) {
        norm_backward_warp_kernel<<<row_warp_blocks(rows), 32 * ROW_WARPS, 0, ds_cuda_stream()>>>(
            dx, g, x, w, mean, rstd, gres, rows, n);
        if (ds_cuda_launched("norm_backward_warp_kernel")) return -1;
    } else if (rows > 0) {
        int th = pw_row_threads(n);
        if (f64)
            norm_backward_kernel<double><<<row_blocks(rows), th, 0, ds_cuda_stream()>>>(dx, g, x, w, mean, rstd,
                                                                                        gres, rows, n);
        else
            norm_backward_kernel<float><<<row_blocks(rows), th, 0, ds_cuda_stream()>>>(dx, g, x, w, mean, rstd,
                                                                                       gres, rows, n);
        if (ds_cuda_launched("norm_backward_kernel")) return -1;
    }
    if (!dw.data && !db.data) return 0;
    return f64 ? param_grads<double>(dw, db, g, x, mean, rstd, rows, n, false)
               : param_grads<float>(dw, db, g, x, mean, rstd, rows, n, vec);
}

static const ds_kview no_view = { NULL, DS_F32, 0, { 0 }, { 0 } };

static int cuda_rms_norm(ds_kview y, ds_kview rstd, ds_kview x, ds_kview w, ds_kview res, ds_kview sum, int64_t rows,
                         int64_t n, double eps) {
    return norm_forward(y, no_view, rstd, x, w, no_view, res, sum, rows, n, eps);
}

static int cuda_rms_norm_backward(ds_kview dx, ds_kview dw, ds_kview g, ds_kview x, ds_kview w, ds_kview rstd,
                                  ds_kview gres, int64_t rows, int64_t n) {
    return norm_backward(dx, dw, no_view, g, x, w, no_view, rstd, gres, rows, n);
}

/* ---- rotary embedding: a thread an element, through ds_rope_elem ---- */

static __global__ void rope_kernel(ds_kview y, ds_kview x, ds_kview c, ds_kview s, int64_t numel, int64_t n,
                                   bool backward) {
    DS_CUDA_LOOP(i, numel) {
        int64_t j = i % n, h = n / 2;
        bool first = j < h;
        int64_t p = first ? i + h : i - h;
        double v = ds_load(x.dtype, x.data, ds_cuda_offset(x, i)), vp = ds_load(x.dtype, x.data, ds_cuda_offset(x, p));
        double ci = ds_load(c.dtype, c.data, ds_cuda_offset(c, i));
        double si = ds_load(s.dtype, s.data, ds_cuda_offset(s, backward ? p : i));
        double out = backward ? ds_rope_elem_backward(y.dtype, first, v, ci, vp, si)
                              : ds_rope_elem(y.dtype, first, v, ci, vp, si);
        ds_store(y.dtype, y.data, ds_cuda_offset(y, i), out);
    }
}

static int cuda_rope(ds_kview y, ds_kview x, ds_kview c, ds_kview s, bool backward) {
    int64_t numel = ds_kview_numel(&y);
    if (numel == 0) return 0;
    rope_kernel<<<ds_cuda_blocks(numel, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        y, x, c, s, numel, y.shape[y.ndim - 1], backward);
    return ds_cuda_launched("rope_kernel");
}

/* ---- dropout: thread b draws Philox block offset + b, the keep bits of
 * elements 4b..4b+3, exactly as the CPU ---- */

static __global__ void dropout_kernel(ds_kview y, ds_kview x, uint64_t seed, uint64_t offset, float q, double scale,
                                      int64_t n) {
    bool f32 = x.dtype == DS_F32 && y.dtype == DS_F32;
    float sf = (float)scale;
    DS_CUDA_LOOP(b, (n + 3) / 4) ds_dropout_block(&y, &x, seed, offset, b, n, q, scale, sf, f32);
}

static int cuda_dropout(ds_kview y, ds_kview x, uint64_t seed, uint64_t offset, double p) {
    int64_t n = ds_kview_numel(&x);
    if (n == 0) return 0;
    double scale = p < 1 ? 1.0 / (1.0 - p) : 0.0;
    dropout_kernel<<<ds_cuda_blocks((n + 3) / 4, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        y, x, seed, offset, (float)(1.0 - p), scale, n);
    return ds_cuda_launched("dropout_kernel");
}

extern "C" const ds_kernels_nn ds_cuda_nn = {
    cuda_softmax, cuda_softmax_backward, cuda_cross_entropy, cuda_cross_entropy_backward,
    norm_forward, norm_backward, cuda_rms_norm, cuda_rms_norm_backward, cuda_rope, cuda_dropout,
};
