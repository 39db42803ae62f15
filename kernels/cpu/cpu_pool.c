/* Max and average pooling over contiguous NCHW planes, one plane per
 * OpenMP task. Memory-bound, so one loop serves every float dtype through
 * ds_load/ds_store; max pooling keeps PyTorch's flat h*W+w indices, which
 * backward scatters through and a CUDA kernel can produce identically. */
#include "cpu_pool.h"
#include "cpu_kernels.h"
#include "cpu_iter.h"
#include "../ds_half.h"

#include <math.h>

typedef struct { int64_t planes, H, W, OH, OW; } pool_geom;

static pool_geom geom_of(ds_kview x, ds_kview y) {
    pool_geom g = { x.shape[0] * x.shape[1], x.shape[2], x.shape[3], y.shape[2], y.shape[3] };
    return g;
}

int cpu_pool_max2d(ds_kview y, ds_kview indices, ds_kview x, const ds_pool2d_params *p) {
    pool_geom g = geom_of(x, y);
    int64_t *idx = indices.data;
    int64_t kh = p->kernel[0], kw = p->kernel[1], sh = p->stride[0], sw = p->stride[1];
    int64_t ph = p->padding[0], pw = p->padding[1];
    #pragma omp parallel for schedule(static) if (g.planes * g.OH * g.OW * kh * kw > CPU_PARALLEL_MIN)
    for (int64_t pl = 0; pl < g.planes; pl++) {
        int64_t in = pl * g.H * g.W, out = pl * g.OH * g.OW;
        for (int64_t oh = 0; oh < g.OH; oh++)
            for (int64_t ow = 0; ow < g.OW; ow++) {
                int64_t h0 = oh * sh - ph, w0 = ow * sw - pw;
                int64_t hs = h0 < 0 ? 0 : h0, ws = w0 < 0 ? 0 : w0;
                int64_t he = h0 + kh < g.H ? h0 + kh : g.H, we = w0 + kw < g.W ? w0 + kw : g.W;
                double best = -INFINITY;
                int64_t at = hs * g.W + ws;
                for (int64_t h = hs; h < he; h++)
                    for (int64_t w = ws; w < we; w++) {
                        int64_t i = h * g.W + w;
                        double v = ds_load(x.dtype, x.data, in + i);
                        if (v > best || isnan(v)) { best = v; at = i; }   /* NaN wins, as in PyTorch */
                    }
                int64_t o = out + oh * g.OW + ow;
                ds_store(y.dtype, y.data, o, best);
                if (idx) idx[o] = at;
            }
    }
    return 0;
}

int cpu_pool_max2d_backward(ds_kview dx, ds_kview dy, ds_kview indices) {
    pool_geom g = geom_of(dx, dy);
    const int64_t *idx = indices.data;
    ds_cpu_core.fill(dx, 0);
    #pragma omp parallel for schedule(static) if (g.planes * g.OH * g.OW > CPU_PARALLEL_MIN)
    for (int64_t pl = 0; pl < g.planes; pl++) {
        int64_t in = pl * g.H * g.W, out = pl * g.OH * g.OW;
        for (int64_t o = out; o < out + g.OH * g.OW; o++) {
            int64_t at = in + idx[o];
            ds_store(dx.dtype, dx.data, at, ds_load(dx.dtype, dx.data, at) + ds_load(dy.dtype, dy.data, o));
        }
    }
    return 0;
}

/* One window of average pooling, clipped to the input, with its divisor:
 * counting padding uses the window as it lies over the padded input. */
typedef struct { int64_t hs, he, ws, we; double div; } avg_window;

static avg_window window_of(const pool_geom *g, const ds_pool2d_params *p, int64_t oh, int64_t ow) {
    avg_window a;
    int64_t h0 = oh * p->stride[0] - p->padding[0], w0 = ow * p->stride[1] - p->padding[1];
    int64_t h1 = h0 + p->kernel[0], w1 = w0 + p->kernel[1];
    if (h1 > g->H + p->padding[0]) h1 = g->H + p->padding[0];
    if (w1 > g->W + p->padding[1]) w1 = g->W + p->padding[1];
    int64_t padded = (h1 - h0) * (w1 - w0);
    a.hs = h0 < 0 ? 0 : h0;
    a.ws = w0 < 0 ? 0 : w0;
    a.he = h1 < g->H ? h1 : g->H;
    a.we = w1 < g->W ? w1 : g->W;
    a.div = (double)(p->count_include_pad ? padded : (a.he - a.hs) * (a.we - a.ws));
    return a;
}

int cpu_pool_avg2d(ds_kview y, ds_kview x, const ds_pool2d_params *p) {
    pool_geom g = geom_of(x, y);
    int64_t work = g.planes * g.OH * g.OW * p->kernel[0] * p->kernel[1];
    #pragma omp parallel for schedule(static) if (work > CPU_PARALLEL_MIN)
    for (int64_t pl = 0; pl < g.planes; pl++) {
        int64_t in = pl * g.H * g.W, out = pl * g.OH * g.OW;
        for (int64_t oh = 0; oh < g.OH; oh++)
            for (int64_t ow = 0; ow < g.OW; ow++) {
                avg_window a = window_of(&g, p, oh, ow);
                double s = 0;
                for (int64_t h = a.hs; h < a.he; h++)
                    for (int64_t w = a.ws; w < a.we; w++) s += ds_load(x.dtype, x.data, in + h * g.W + w);
                ds_store(y.dtype, y.data, out + oh * g.OW + ow, s / a.div);
            }
    }
    return 0;
}

int cpu_pool_avg2d_backward(ds_kview dx, ds_kview dy, const ds_pool2d_params *p) {
    pool_geom g = geom_of(dx, dy);
    ds_cpu_core.fill(dx, 0);
    int64_t work = g.planes * g.OH * g.OW * p->kernel[0] * p->kernel[1];
    #pragma omp parallel for schedule(static) if (work > CPU_PARALLEL_MIN)
    for (int64_t pl = 0; pl < g.planes; pl++) {
        int64_t in = pl * g.H * g.W, out = pl * g.OH * g.OW;
        for (int64_t oh = 0; oh < g.OH; oh++)
            for (int64_t ow = 0; ow < g.OW; ow++) {
                avg_window a = window_of(&g, p, oh, ow);
                double share = ds_load(dy.dtype, dy.data, out + oh * g.OW + ow) / a.div;
                for (int64_t h = a.hs; h < a.he; h++)
                    for (int64_t w = a.ws; w < a.we; w++) {
                        int64_t at = in + h * g.W + w;
                        ds_store(dx.dtype, dx.data, at, ds_load(dx.dtype, dx.data, at) + share);
                    }
            }
    }
    return 0;
}
