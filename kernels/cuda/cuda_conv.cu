/* 2-D convolution and pooling on the GPU. Convolutions run cuDNN's legacy
 * convolution API (kept in cudnn_cnn.h for v9) on the NCHW views: f32 (TF32
 * only when switched on), bf16 and f16 computing in f32, f64 in double.
 * Algorithms come from cuDNN's heuristics (Get..._v7), deterministic ones
 * first, each tried with workspace from the caching allocator until one
 * runs. The batch is cut into pieces when a tensor would pass cuDNN's 2^31
 * element limit. Bias add and bias gradient are plain kernels, as is
 * pooling, which repeats cpu_pool.c (same windows, NaN handling, divisors
 * and flat h*W+w indices) so both devices agree exactly. */
#include "cuda_common.cuh"
#include "cuda_blas.h"
#include "../ds_pool.h"

#include <cudnn.h>
#include <limits.h>
#include <math.h>

#define CONV_MAX_DEVICES 64
#define CONV_MAX_ALGOS 16

typedef enum { CONV_FWD, CONV_BWD_DATA, CONV_BWD_WEIGHT } conv_kind;

static const char *const conv_call_name[3] = {
    "cudnnConvolutionForward", "cudnnConvolutionBackwardData", "cudnnConvolutionBackwardFilter",
};

/* ---- cuDNN handles and descriptors ---- */

static cudnnHandle_t handles[CONV_MAX_DEVICES];

static int dnn_ok(cudnnStatus_t st, const char *call) {
    if (st == CUDNN_STATUS_SUCCESS) return 0;
    return ds_kernel_fail("%s: %s", call, cudnnGetErrorString(st));
}

static int dnn_handle(cudnnHandle_t *h) {
    int dev;
    DS_CUDA_CHECK(cudaGetDevice(&dev));
    if (dev < 0 || dev >= CONV_MAX_DEVICES)
        return ds_kernel_fail("conv2d: device %d is beyond the %d supported", dev, CONV_MAX_DEVICES);
    if (!handles[dev]) {
        cudnnHandle_t made;
        if (dnn_ok(cudnnCreate(&made), "cudnnCreate")) return -1;
        handles[dev] = made;
    }
    if (dnn_ok(cudnnSetStream(handles[dev], ds_cuda_stream()), "cudnnSetStream")) return -1;
    *h = handles[dev];
    return 0;
}

static cudnnDataType_t dnn_type(ds_dtype t) {
    switch (t) {
    case DS_F64: return CUDNN_DATA_DOUBLE;
    case DS_BF16: return CUDNN_DATA_BFLOAT16;
    case DS_F16: return CUDNN_DATA_HALF;
    default: return CUDNN_DATA_FLOAT;
    }
}

typedef struct {
    cudnnHandle_t h;
    cudnnTensorDescriptor_t x, y;
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv;
} conv_desc;

static void conv_desc_release(conv_desc *d) {
    if (d->conv) cudnnDestroyConvolutionDescriptor(d->conv);
    if (d->w) cudnnDestroyFilterDescriptor(d->w);
    if (d->y) cudnnDestroyTensorDescriptor(d->y);
    if (d->x) cudnnDestroyTensorDescriptor(d->x);
}

/* n samples of the NCHW view v (strides checked to fit an int before). */
static int tensor_desc(cudnnTensorDescriptor_t d, const ds_kview *v, int64_t n) {
    return dnn_ok(cudnnSetTensor4dDescriptorEx(d, dnn_type(v->dtype), (int)n, (int)v->shape[1], (int)v->shape[2],
                                               (int)v->shape[3], (int)v->stride[0], (int)v->stride[1],
                                               (int)v->stride[2], (int)v->stride[3]),
                  "cudnnSetTensor4dDescriptorEx");
}

static int conv_setup(conv_desc *d, const ds_kview *x, const ds_kview *w, const ds_kview *y, int64_t n,
                      const ds_conv2d_params *p) {
    if (dnn_handle(&d->h)) return -1;
    if (dnn_ok(cudnnCreateTensorDescriptor(&d->x), "cudnnCreateTensorDescriptor")
        || dnn_ok(cudnnCreateTensorDescriptor(&d->y), "cudnnCreateTensorDescriptor")
        || dnn_ok(cudnnCreateFilterDescriptor(&d->w), "cudnnCreateFilterDescriptor")
        || dnn_ok(cudnnCreateConvolutionDescriptor(&d->conv), "cudnnCreateConvolutionDescriptor"))
        return -1;
    if (tensor_desc(d->x, x, n) || tensor_desc(d->y, y, n)) return -1;
    if (dnn_ok(cudnnSetFilter4dDescriptor(d->w, dnn_type(w->dtype), CUDNN_TENSOR_NCHW, (int)w->shape[0],
                                          (int)w->shape[1], (int)w->shape[2], (int)w->shape[3]),
               "cudnnSetFilter4dDescriptor"))
        return -1;
    bool f64 = x->dtype == DS_F64;
    if (dnn_ok(cudnnSetConvolution2dDescriptor(d->conv, (int)p->padding[0], (int)p->padding[1], (int)p->stride[0],
                                               (int)p->stride[1], (int)p->dilation[0], (int)p->dilation[1],
                                               CUDNN_CROSS_CORRELATION, f64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT),
               "cudnnSetConvolution2dDescriptor")
        || dnn_ok(cudnnSetConvolutionGroupCount(d->conv, (int)p->groups), "cudnnSetConvolutionGroupCount"))
        return -1;
    /* f32 stays on FMA kernels unless TF32 is on; bf16/f16 want tensor cores */
    cudnnMathType_t math = x->dtype == DS_F32 ? (ds_cuda_tf32(DS_TF32_CONV) ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH)
                           : f64 ? CUDNN_DEFAULT_MATH : CUDNN_TENSOR_OP_MATH;
    return dnn_ok(cudnnSetConvolutionMathType(d->conv, math), "cudnnSetConvolutionMathType");
}

/* ---- algorithms ---- */

typedef struct { int algo; cudnnStatus_t status; cudnnDeterminism_t det; } algo_perf;

static int list_algos(conv_kind kind, const conv_desc *d, algo_perf *out, int *count) {
    int got = 0;
    if (kind == CONV_FWD) {
        cudnnConvolutionFwdAlgoPerf_t r[CONV_MAX_ALGOS];
        if (dnn_ok(cudnnGetConvolutionForwardAlgorithm_v7(d->h, d->x, d->w, d->conv, d->y, CONV_MAX_ALGOS, &got, r),
                   "cudnnGetConvolutionForwardAlgorithm_v7"))
            return -1;
        for (int i = 0; i < got; i++) out[i] = { (int)r[i].algo, r[i].status, r[i].determinism };
    } else if (kind == CONV_BWD_DATA) {
        cudnnConvolutionBwdDataAlgoPerf_t r[CONV_MAX_ALGOS];
        if (dnn_ok(cudnnGetConvolutionBackwardDataAlgorithm_v7(d->h, d->w, d->y, d->conv, d->x, CONV_MAX_ALGOS, &got,
                                                               r),
                   "cudnnGetConvolutionBackwardDataAlgorithm_v7"))
            return -1;
        for (int i = 0; i < got; i++) out[i] = { (int)r[i].algo, r[i].status, r[i].determinism };
    } else {
        cudnnConvolutionBwdFilterAlgoPerf_t r[CONV_MAX_ALGOS];
        if (dnn_ok(cudnnGetConvolutionBackwardFilterAlgorithm_v7(d->h, d->x, d->y, d->conv, d->w, CONV_MAX_ALGOS,
                                                                 &got, r),
                   "cudnnGetConvolutionBackwardFilterAlgorithm_v7"))
            return -1;
        for (int i = 0; i < got; i++) out[i] = { (int)r[i].algo, r[i].status, r[i].determinism };
    }
    *count = got;
    return 0;
}

static cudnnStatus_t workspace_of(conv_kind kind, const conv_desc *d, int algo, size_t *size) {
    if (kind == CONV_FWD)
        return cudnnGetConvolutionForwardWorkspaceSize(d->h, d->x, d->w, d->conv, d->y,
                                                       (cudnnConvolutionFwdAlgo_t)algo, size);
    if (kind == CONV_BWD_DATA)
        return cudnnGetConvolutionBackwardDataWorkspaceSize(d->h, d->w, d->y, d->conv, d->x,
                                                            (cudnnConvolutionBwdDataAlgo_t)algo, size);
    return cudnnGetConvolutionBackwardFilterWorkspaceSize(d->h, d->x, d->y, d->conv, d->w,
                                                          (cudnnConvolutionBwdFilterAlgo_t)algo, size);
}

/* Device pointers of one call: x, w, y (dx, dw, dy where they are gradients). */
typedef struct { void *x, *w, *y; } conv_ptrs;

static cudnnStatus_t conv_call(conv_kind kind, const conv_desc *d, int algo, void *ws, size_t wsize,
                               const void *one, const void *beta, const conv_ptrs *t) {
    if (kind == CONV_FWD)
        return cudnnConvolutionForward(d->h, one, d->x, t->x, d->w, t->w, d->conv, (cudnnConvolutionFwdAlgo_t)algo,
                                       ws, wsize, beta, d->y, t->y);
    if (kind == CONV_BWD_DATA)
        return cudnnConvolutionBackwardData(d->h, one, d->w, t->w, d->y, t->y, d->conv,
                                            (cudnnConvolutionBwdDataAlgo_t)algo, ws, wsize, beta, d->x, t->x);
    return cudnnConvolutionBackwardFilter(d->h, one, d->x, t->x, d->y, t->y, d->conv,
                                          (cudnnConvolutionBwdFilterAlgo_t)algo, ws, wsize, beta, d->w, t->w);
}

static bool not_supported(cudnnStatus_t st) { return st / 1000 == CUDNN_STATUS_NOT_SUPPORTED / 1000; }

/* Runs the first algorithm that works: deterministic ones first, an
 * algorithm cuDNN turns down (not supported, no workspace) is skipped. */
static int conv_once(conv_kind kind, const conv_desc *d, const conv_ptrs *t, bool accumulate, bool f64) {
    algo_perf algos[CONV_MAX_ALGOS];
    int count = 0;
    if (list_algos(kind, d, algos, &count)) return -1;
    float one32 = 1.0f, beta32 = accumulate ? 1.0f : 0.0f;
    double one64 = 1.0, beta64 = accumulate ? 1.0 : 0.0;
    const void *one = f64 ? (const void *)&one64 : (const void *)&one32;
    const void *beta = f64 ? (const void *)&beta64 : (const void *)&beta32;
    cudnnStatus_t last = CUDNN_STATUS_NOT_SUPPORTED;
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < count; i++) {
            const algo_perf *a = &algos[i];
            if (a->status != CUDNN_STATUS_SUCCESS || (a->det == CUDNN_DETERMINISTIC) != (pass == 0)) continue;
            size_t wsize = 0;
            cudnnStatus_t st = workspace_of(kind, d, a->algo, &wsize);
            if (st != CUDNN_STATUS_SUCCESS) { last = st; continue; }
            void *ws = wsize ? ds_cuda_scratch(wsize) : NULL;
            if (wsize && !ws) continue;          /* a smaller workspace may still fit */
            st = conv_call(kind, d, a->algo, ws, wsize, one, beta, t);
            if (ws) ds_cuda_scratch_free(ws);
            if (st == CUDNN_STATUS_SUCCESS) return 0;
            if (!not_supported(st)) return dnn_ok(st, conv_call_name[kind]);
            last = st;
        }
    return ds_kernel_fail("%s: no algorithm ran (%d offered, last: %s)", conv_call_name[kind], count,
                          cudnnGetErrorString(last));
}

static bool fits_int(const ds_kview *v) {
    for (int i = 0; i < v->ndim; i++)
        if (v->shape[i] > INT_MAX || v->stride[i] > INT_MAX || v->stride[i] < 0) return false;
    return true;
}

/* The whole batch in pieces of at most 2^31 - 1 elements per tensor;
 * backward weights adds every piece after the first. */
static int conv_run(conv_kind kind, ds_kview x, ds_kview w, ds_kview y, const ds_conv2d_params *p) {
    int64_t N = x.shape[0];
    int64_t per = x.shape[1] * x.shape[2] * x.shape[3], yper = y.shape[1] * y.shape[2] * y.shape[3];
    if (yper > per) per = yper;
    if (x.stride[0] > per) per = x.stride[0];
    if (y.stride[0] > per) per = y.stride[0];
    if (!fits_int(&x) || !fits_int(&w) || !fits_int(&y) || per > INT_MAX || ds_kview_numel(&w) > INT_MAX
        || p->groups > INT_MAX)
        return ds_kernel_fail("conv2d: a sample or the weight passes cuDNN's limit of 2^31 elements");
    for (int i = 0; i < 2; i++)
        if (p->stride[i] > INT_MAX || p->padding[i] > INT_MAX || p->dilation[i] > INT_MAX)
            return ds_kernel_fail("conv2d: stride, padding and dilation must fit in 32 bits");
    if (!ds_kview_is_contiguous(&w)) return ds_kernel_fail("conv2d: cuDNN needs a contiguous weight");
    int64_t piece = INT_MAX / (per > 0 ? per : 1);
    if (piece > N) piece = N;
    size_t es = ds_dtype_size(x.dtype);
    int rc = 0;
    for (int64_t n0 = 0; n0 < N && rc == 0; n0 += piece) {
        int64_t n = N - n0 < piece ? N - n0 : piece;
        conv_desc d = {};
        conv_ptrs t = { (char *)x.data + n0 * x.stride[0] * (int64_t)es, w.data,
                        (char *)y.data + n0 * y.stride[0] * (int64_t)es };
        rc = conv_setup(&d, &x, &w, &y, n, p);
        if (rc == 0) rc = conv_once(kind, &d, &t, kind == CONV_BWD_WEIGHT && n0 > 0, x.dtype == DS_F64);
        conv_desc_release(&d);
    }
    return rc;
}

/* ---- bias ---- */

/* y[n,o,h,w] += b[o] */
__global__ void bias_add_kernel(ds_kview y, ds_kview b, int64_t total) {
    int64_t O = y.shape[1], H = y.shape[2], W = y.shape[3];
    DS_CUDA_LOOP(i, total) {
        int64_t w = i % W, h = i / W % H, o = i / (W * H) % O, n = i / (W * H * O);
        int64_t at = n * y.stride[0] + o * y.stride[1] + h * y.stride[2] + w * y.stride[3];
        ds_store(y.dtype, y.data, at, ds_load(y.dtype, y.data, at) + ds_load(b.dtype, b.data, o * b.stride[0]));
    }
}

#define BIAS_THREADS 256

/* db[o] = sum of dy[:, o] over batch and plane: one block per channel, a
 * fixed-order tree in double, so the result does not depend on timing. */
__global__ void bias_grad_kernel(ds_kview db, ds_kview dy) {
    __shared__ double part[BIAS_THREADS];
    int64_t N = dy.shape[0], O = dy.shape[1], H = dy.shape[2], W = dy.shape[3], L = N * H * W;
    for (int64_t o = blockIdx.x; o < O; o += gridDim.x) {
        double s = 0;
        for (int64_t i = threadIdx.x; i < L; i += blockDim.x) {
            int64_t w = i % W, h = i / W % H, n = i / (W * H);
            s += ds_load(dy.dtype, dy.data, n * dy.stride[0] + o * dy.stride[1] + h * dy.stride[2] + w * dy.stride[3]);
        }
        part[threadIdx.x] = s;
        __syncthreads();
        for (int half = BIAS_THREADS / 2; half > 0; half /= 2) {
            if ((int)threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
            __syncthreads();
        }
        if (threadIdx.x == 0) ds_store(db.dtype, db.data, o * db.stride[0], part[0]);
        __syncthreads();
    }
}

static int bias_add(ds_kview y, ds_kview b) {
    int64_t total = ds_kview_numel(&y);
    if (total == 0) return 0;
    bias_add_kernel<<<ds_cuda_blocks(total, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(y, b, total);
    return ds_cuda_launched("conv2d bias_add_kernel");
}

static int bias_grad(ds_kview db, ds_kview dy) {
    int64_t O = dy.shape[1];
    if (O == 0) return 0;
    unsigned blocks = (unsigned)(O < DS_CUDA_MAX_BLOCKS ? O : DS_CUDA_MAX_BLOCKS);
    bias_grad_kernel<<<blocks, BIAS_THREADS, 0, ds_cuda_stream()>>>(db, dy);
    return ds_cuda_launched("conv2d bias_grad_kernel");
}

/* Zeroes a view whose elements fill [data, data + numel) (contiguous). */
static int zero_fill(ds_kview v) {
    int64_t n = ds_kview_numel(&v);
    if (n == 0) return 0;
    if (!ds_kview_is_contiguous(&v)) return ds_kernel_fail("conv2d: the gradient must be contiguous");
    DS_CUDA_CHECK(cudaMemsetAsync(v.data, 0, (size_t)n * ds_dtype_size(v.dtype), ds_cuda_stream()));
    return 0;
}

/* ---- convolution entry points ---- */

static int cuda_conv2d(ds_kview y, ds_kview x, ds_kview w, ds_kview bias, const ds_conv2d_params *p) {
    if (ds_kview_numel(&y) == 0) return 0;
    if (conv_run(CONV_FWD, x, w, y, p)) return -1;
    return bias.data ? bias_add(y, bias) : 0;
}

static int cuda_conv2d_backward_data(ds_kview dx, ds_kview dy, ds_kview w, const ds_conv2d_params *p) {
    if (ds_kview_numel(&dx) == 0) return 0;
    if (w.shape[0] == 0) return zero_fill(dx);        /* no output channels: nothing flows back */
    return conv_run(CONV_BWD_DATA, dx, w, dy, p);
}

static int cuda_conv2d_backward_weight(ds_kview dw, ds_kview db, ds_kview dy, ds_kview x,
                                       const ds_conv2d_params *p) {
    if (dw.shape[0] == 0) return 0;
    if (x.shape[0] == 0) {
        if (zero_fill(dw)) return -1;
        return db.data ? zero_fill(db) : 0;
    }
    if (conv_run(CONV_BWD_WEIGHT, x, dw, dy, p)) return -1;
    return db.data ? bias_grad(db, dy) : 0;
}

/* ---- pooling: the CPU's windows (ds_pool.h), element for element ---- */

__global__ void max_pool_kernel(ds_kview y, int64_t *idx, ds_kview x, ds_pool_geom g, ds_pool2d_params p) {
    DS_CUDA_LOOP(o, g.planes * g.OH * g.OW) {
        int64_t ow = o % g.OW, oh = o / g.OW % g.OH, in = o / (g.OW * g.OH) * g.H * g.W;
        ds_pool_max_at(&y, idx, o, &x, in, &g, &p, oh, ow);
    }
}

/* One thread per plane walks its outputs in order, as the CPU does:
 * overlapping windows add into one input without atomics, in the same
 * order and rounding as cpu_pool_max2d_backward. */
__global__ void max_pool_backward_kernel(ds_kview dx, ds_kview dy, const int64_t *idx, ds_pool_geom g) {
    DS_CUDA_LOOP(pl, g.planes) ds_pool_max_backward_plane(&dx, &dy, idx, &g, pl);
}

__global__ void avg_pool_kernel(ds_kview y, ds_kview x, ds_pool_geom g, ds_pool2d_params p) {
    DS_CUDA_LOOP(o, g.planes * g.OH * g.OW) {
        int64_t ow = o % g.OW, oh = o / g.OW % g.OH, in = o / (g.OW * g.OH) * g.H * g.W;
        ds_pool_avg_at(&y, o, &x, in, &g, &p, oh, ow);
    }
}

/* First output index along one dim whose window [o s - pad, o s - pad + k)
 * covers input position i; the last is (i + pad) / s. */
__device__ int64_t first_window(int64_t i, int64_t k, int64_t s, int64_t pad) {
    int64_t past = i + pad - k;        /* windows starting at or before this miss i */
    return past < 0 ? 0 : past / s + 1;
}

/* Each input element gathers dy / divisor from the windows covering it:
 * no atomics, every element written once. */
__global__ void avg_pool_backward_kernel(ds_kview dx, ds_kview dy, ds_pool_geom g, ds_pool2d_params p) {
    DS_CUDA_LOOP(i, g.planes * g.H * g.W) {
        int64_t w = i % g.W, h = i / g.W % g.H, pl = i / (g.W * g.H), out = pl * g.OH * g.OW;
        int64_t oh0 = first_window(h, p.kernel[0], p.stride[0], p.padding[0]);
        int64_t ow0 = first_window(w, p.kernel[1], p.stride[1], p.padding[1]);
        int64_t oh1 = (h + p.padding[0]) / p.stride[0], ow1 = (w + p.padding[1]) / p.stride[1];
        if (oh1 > g.OH - 1) oh1 = g.OH - 1;
        if (ow1 > g.OW - 1) ow1 = g.OW - 1;
        double s = 0;
        for (int64_t oh = oh0; oh <= oh1; oh++)
            for (int64_t ow = ow0; ow <= ow1; ow++) {
                ds_pool_avg_window a = ds_pool_avg_window_of(&g, &p, oh, ow);
                s += ds_load(dy.dtype, dy.data, out + oh * g.OW + ow) / a.div;
            }
        ds_store(dx.dtype, dx.data, i, s);
    }
}

static int pool_args_ok(const char *op, const ds_kview *a, const ds_kview *b) {
    if (!ds_kview_is_contiguous(a) || !ds_kview_is_contiguous(b))
        return ds_kernel_fail("%s: needs contiguous NCHW tensors", op);
    return 0;
}

static int cuda_max_pool2d(ds_kview y, ds_kview indices, ds_kview x, const ds_pool2d_params *p) {
    if (pool_args_ok("max_pool2d", &y, &x) || (indices.data && pool_args_ok("max_pool2d", &indices, &y))) return -1;
    ds_pool_geom g = ds_pool_geom_of(&x, &y);
    int64_t n = g.planes * g.OH * g.OW;
    if (n == 0) return 0;
    max_pool_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        y, (int64_t *)indices.data, x, g, *p);
    return ds_cuda_launched("max_pool_kernel");
}

static int cuda_max_pool2d_backward(ds_kview dx, ds_kview dy, ds_kview indices) {
    if (pool_args_ok("max_pool2d backward", &dx, &dy) || pool_args_ok("max_pool2d backward", &indices, &dy))
        return -1;
    if (zero_fill(dx)) return -1;
    ds_pool_geom g = ds_pool_geom_of(&dx, &dy);
    if (g.planes == 0 || g.OH * g.OW == 0) return 0;
    max_pool_backward_kernel<<<ds_cuda_blocks(g.planes, 128), 128, 0, ds_cuda_stream()>>>(
        dx, dy, (const int64_t *)indices.data, g);
    return ds_cuda_launched("max_pool_backward_kernel");
}

static int cuda_avg_pool2d(ds_kview y, ds_kview x, const ds_pool2d_params *p) {
    if (pool_args_ok("avg_pool2d", &y, &x)) return -1;
    ds_pool_geom g = ds_pool_geom_of(&x, &y);
    int64_t n = g.planes * g.OH * g.OW;
    if (n == 0) return 0;
    avg_pool_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(y, x, g, *p);
    return ds_cuda_launched("avg_pool_kernel");
}

static int cuda_avg_pool2d_backward(ds_kview dx, ds_kview dy, const ds_pool2d_params *p) {
    if (pool_args_ok("avg_pool2d backward", &dx, &dy)) return -1;
    ds_pool_geom g = ds_pool_geom_of(&dx, &dy);
    int64_t n = g.planes * g.H * g.W;
    if (n == 0) return 0;
    avg_pool_backward_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        dx, dy, g, *p);
    return ds_cuda_launched("avg_pool_backward_kernel");
}

extern "C" const ds_kernels_conv ds_cuda_conv = {
    cuda_conv2d, cuda_conv2d_backward_data, cuda_conv2d_backward_weight,
    cuda_max_pool2d, cuda_max_pool2d_backward, cuda_avg_pool2d, cuda_avg_pool2d_backward,
};
