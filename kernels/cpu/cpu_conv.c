/* 2-D convolution on the CPU. f32 and bf16 run oneDNN's convolution
 * primitives on the NCHW tensors in place; f16, and bf16 where oneDNN lacks
 * it, run the f32 primitives on widened copies; f64, which oneDNN does not
 * have, goes through im2col and dgemm. Pooling lives in cpu_pool.c. */
#include "cpu_kernels.h"
#include "cpu_dnnl.h"
#include "cpu_pool.h"

#include <cblas.h>
#include <stdbool.h>
#include <stdlib.h>

typedef enum { CONV_FWD, CONV_BWD_DATA, CONV_BWD_WEIGHT } conv_kind;

/* The four tensors of a convolution, whichever way it runs: forward reads
 * x, w, b and writes y; backward data reads y (dy) and w and writes x (dx);
 * backward weights reads x and y (dy) and writes w (dw) and b (db). A view
 * with NULL data is absent (no bias). */
typedef struct { ds_kview x, w, b, y; } conv_args;

static dnnl_status_t conv_mds(const conv_args *t, const ds_conv2d_params *p, dnnl_memory_desc_t *xmd,
                              dnnl_memory_desc_t *wmd, dnnl_memory_desc_t *bmd, dnnl_memory_desc_t *ymd) {
    dnnl_status_t st = cpu_dnnl_md(xmd, 4, t->x.shape, t->x.stride, t->x.dtype);
    if (st == dnnl_success) st = cpu_dnnl_md(ymd, 4, t->y.shape, t->y.stride, t->y.dtype);
    if (st == dnnl_success && t->b.data) st = cpu_dnnl_md(bmd, 1, t->b.shape, t->b.stride, t->b.dtype);
    if (st != dnnl_success) return st;
    if (p->groups == 1) return cpu_dnnl_md(wmd, 4, t->w.shape, t->w.stride, t->w.dtype);
    /* grouped weights [O, C/G, kh, kw] are the same bytes as oneDNN's [G, O/G, C/G, kh, kw] */
    const int64_t *s = t->w.stride;
    int64_t og = t->w.shape[0] / p->groups;
    int64_t dims[5] = { p->groups, og, t->w.shape[1], t->w.shape[2], t->w.shape[3] };
    int64_t strides[5] = { og * s[0], s[0], s[1], s[2], s[3] };
    return cpu_dnnl_md(wmd, 5, dims, strides, t->w.dtype);
}

static dnnl_status_t conv_dnnl(conv_kind kind, const conv_args *t, const ds_conv2d_params *p) {
    dnnl_engine_t eng = cpu_dnnl_engine();
    if (!eng) return dnnl_runtime_error;
    dnnl_memory_desc_t xmd, wmd, bmd, ymd;
    dnnl_status_t st = conv_mds(t, p, &xmd, &wmd, &bmd, &ymd);
    bool bias = t->b.data != NULL;
    dnnl_dims_t strides, dil, pl, pr;
    for (int i = 0; i < 2; i++) {
        int64_t ext = (t->w.shape[2 + i] - 1) * p->dilation[i] + 1;
        int64_t right = (t->y.shape[2 + i] - 1) * p->stride[i] + ext - t->x.shape[2 + i] - p->padding[i];
        strides[i] = p->stride[i];
        dil[i] = p->dilation[i] - 1;                 /* oneDNN counts the gaps */
        pl[i] = p->padding[i];
        pr[i] = right > 0 ? right : 0;               /* just what the last output reaches */
    }
    dnnl_convolution_desc_t fd, bd;
    dnnl_primitive_desc_t fpd = NULL, bpd = NULL;
    if (st == dnnl_success)
        st = dnnl_dilated_convolution_forward_desc_init(&fd, dnnl_forward_training, dnnl_convolution_direct, &xmd,
                                                        &wmd, bias ? &bmd : NULL, &ymd, strides, dil, pl, pr);
    if (st == dnnl_success) st = dnnl_primitive_desc_create(&fpd, &fd, NULL, eng, NULL);
    if (st == dnnl_success && kind == CONV_FWD) {
        cpu_dnnl_arg a[4] = {
            { DNNL_ARG_SRC, &xmd, t->x.data }, { DNNL_ARG_WEIGHTS, &wmd, t->w.data },
            { DNNL_ARG_DST, &ymd, t->y.data }, { DNNL_ARG_BIAS, &bmd, t->b.data },
        };
        st = cpu_dnnl_run(fpd, bias ? 4 : 3, a);
    } else if (st == dnnl_success && kind == CONV_BWD_DATA) {
        st = dnnl_dilated_convolution_backward_data_desc_init(&bd, dnnl_convolution_direct, &xmd, &wmd, &ymd,
                                                              strides, dil, pl, pr);
        if (st == dnnl_success) st = dnnl_primitive_desc_create(&bpd, &bd, NULL, eng, fpd);
        cpu_dnnl_arg a[3] = {
            { DNNL_ARG_DIFF_SRC, &xmd, t->x.data }, { DNNL_ARG_WEIGHTS, &wmd, t->w.data },
            { DNNL_ARG_DIFF_DST, &ymd, t->y.data },
        };
        if (st == dnnl_success) st = cpu_dnnl_run(bpd, 3, a);
    } else if (st == dnnl_success) {
        st = dnnl_dilated_convolution_backward_weights_desc_init(&bd, dnnl_convolution_direct, &xmd, &wmd,
                                                                 bias ? &bmd : NULL, &ymd, strides, dil, pl, pr);
        if (st == dnnl_success) st = dnnl_primitive_desc_create(&bpd, &bd, NULL, eng, fpd);
        cpu_dnnl_arg a[4] = {
            { DNNL_ARG_SRC, &xmd, t->x.data }, { DNNL_ARG_DIFF_WEIGHTS, &wmd, t->w.data },
            { DNNL_ARG_DIFF_DST, &ymd, t->y.data }, { DNNL_ARG_DIFF_BIAS, &bmd, t->b.data },
        };
        if (st == dnnl_success) st = cpu_dnnl_run(bpd, bias ? 4 : 3, a);
    }
    if (bpd) dnnl_primitive_desc_destroy(bpd);
    if (fpd) dnnl_primitive_desc_destroy(fpd);
    return st;
}

/* Runs the f32 primitives on f32 copies and rounds the results back. */
static int conv_widened(conv_kind kind, const conv_args *t, const ds_conv2d_params *p) {
    conv_args f = *t;
    ds_kview *wide[4] = { &f.x, &f.w, &f.b, &f.y };
    const ds_kview *orig[4] = { &t->x, &t->w, &t->b, &t->y };
    bool writes[4] = { kind == CONV_BWD_DATA, kind == CONV_BWD_WEIGHT, kind == CONV_BWD_WEIGHT, kind == CONV_FWD };
    int rc = 0;
    for (int i = 0; i < 4; i++) {
        if (!orig[i]->data) continue;
        wide[i]->dtype = DS_F32;
        wide[i]->data = malloc(sizeof(float) * (size_t)ds_kview_numel(orig[i]));
        if (!wide[i]->data) rc = ds_kernel_fail("conv2d: out of memory for f32 copies");
        else if (!writes[i]) rc = ds_cpu_core.copy(*wide[i], *orig[i]);
        if (rc) break;
    }
    if (rc == 0) {
        dnnl_status_t st = conv_dnnl(kind, &f, p);
        if (st != dnnl_success) rc = cpu_dnnl_fail("convolution", st);
    }
    for (int i = 0; i < 4; i++) {
        if (rc == 0 && orig[i]->data && writes[i]) rc = ds_cpu_core.copy(*orig[i], *wide[i]);
        if (orig[i]->data) free(wide[i]->data);
    }
    return rc;
}

/* ---- f64: im2col + dgemm, one sample and group at a time ---- */

typedef struct { int64_t N, C, H, W, O, kh, kw, OH, OW, G, Cg, Og, K, L; } conv_geom;

static conv_geom geom_of(const conv_args *t, const ds_conv2d_params *p) {
    conv_geom g;
    g.N = t->x.shape[0]; g.C = t->x.shape[1]; g.H = t->x.shape[2]; g.W = t->x.shape[3];
    g.O = t->w.shape[0]; g.kh = t->w.shape[2]; g.kw = t->w.shape[3];
    g.OH = t->y.shape[2]; g.OW = t->y.shape[3];
    g.G = p->groups; g.Cg = g.C / g.G; g.Og = g.O / g.G;
    g.K = g.Cg * g.kh * g.kw;          /* rows of the column matrix */
    g.L = g.OH * g.OW;                 /* its columns: output positions */
    return g;
}

/* Input pixel that kernel tap i (of dim d) sees at output o, or -1 in the padding. */
static int64_t tap(int64_t o, int64_t i, int d, int64_t size, const ds_conv2d_params *p) {
    int64_t at = o * p->stride[d] - p->padding[d] + i * p->dilation[d];
    return at >= 0 && at < size ? at : -1;
}

/* col [K, L] from the group's Cg input planes x; col2im adds it back. */
static void im2col(double *col, const double *x, const conv_geom *g, const ds_conv2d_params *p, bool back,
                   double *dx) {
    for (int64_t c = 0; c < g->Cg; c++)
        for (int64_t i = 0; i < g->kh; i++)
            for (int64_t j = 0; j < g->kw; j++) {
                double *row = col + ((c * g->kh + i) * g->kw + j) * g->L;
                for (int64_t oh = 0; oh < g->OH; oh++) {
                    int64_t h = tap(oh, i, 0, g->H, p);
                    for (int64_t ow = 0; ow < g->OW; ow++) {
                        int64_t w = tap(ow, j, 1, g->W, p);
                        bool in = h >= 0 && w >= 0;
                        if (back) { if (in) dx[(c * g->H + h) * g->W + w] += row[oh * g->OW + ow]; }
                        else row[oh * g->OW + ow] = in ? x[(c * g->H + h) * g->W + w] : 0.0;
                    }
                }
            }
}

static int conv_im2col(conv_kind kind, const conv_args *t, const ds_conv2d_params *p) {
    conv_geom g = geom_of(t, p);
    double *col = malloc(sizeof(double) * (size_t)(g.K * g.L));
    if (!col) return ds_kernel_fail("conv2d: out of memory for a %lldx%lld column matrix", (long long)g.K,
                                    (long long)g.L);
    double *x = t->x.data, *w = t->w.data, *b = t->b.data, *y = t->y.data;
    if (kind == CONV_BWD_DATA) ds_cpu_core.fill(t->x, 0);
    if (kind == CONV_BWD_WEIGHT) {
        ds_cpu_core.fill(t->w, 0);
        if (b) ds_cpu_core.fill(t->b, 0);
    }
    for (int64_t n = 0; n < g.N; n++)
        for (int64_t gi = 0; gi < g.G; gi++) {
            double *xg = x + (n * g.C + gi * g.Cg) * g.H * g.W;
            double *wg = w + gi * g.Og * g.K;
            double *yg = y + (n * g.O + gi * g.Og) * g.L;
            if (kind == CONV_FWD) {
                im2col(col, xg, &g, p, false, NULL);
                for (int64_t o = 0; o < g.Og; o++)
                    for (int64_t l = 0; l < g.L; l++) yg[o * g.L + l] = b ? b[gi * g.Og + o] : 0.0;
                cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)g.Og, (int)g.L, (int)g.K, 1.0, wg,
                            (int)g.K, col, (int)g.L, 1.0, yg, (int)g.L);
            } else if (kind == CONV_BWD_DATA) {
                cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)g.K, (int)g.L, (int)g.Og, 1.0, wg,
                            (int)g.K, yg, (int)g.L, 0.0, col, (int)g.L);
                im2col(col, NULL, &g, p, true, xg);
            } else {
                im2col(col, xg, &g, p, false, NULL);
                cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)g.Og, (int)g.K, (int)g.L, 1.0, yg,
                            (int)g.L, col, (int)g.L, 1.0, wg, (int)g.K);
                for (int64_t o = 0; b && o < g.Og; o++)
                    for (int64_t l = 0; l < g.L; l++) b[gi * g.Og + o] += yg[o * g.L + l];
            }
        }
    free(col);
    return 0;
}

static int conv_run(conv_kind kind, ds_kview x, ds_kview w, ds_kview b, ds_kview y, const ds_conv2d_params *p) {
    conv_args t = { x, w, b, y };
    if (x.dtype == DS_F64) return conv_im2col(kind, &t, p);
    if (x.dtype == DS_F32 || x.dtype == DS_BF16) {
        dnnl_status_t st = conv_dnnl(kind, &t, p);
        if (st == dnnl_success) return 0;
        if (st != dnnl_unimplemented || x.dtype == DS_F32) return cpu_dnnl_fail("convolution", st);
    }
    return conv_widened(kind, &t, p);
}

static int cpu_conv2d(ds_kview y, ds_kview x, ds_kview w, ds_kview bias, const ds_conv2d_params *p) {
    return conv_run(CONV_FWD, x, w, bias, y, p);
}

static int cpu_conv2d_backward_data(ds_kview dx, ds_kview dy, ds_kview w, const ds_conv2d_params *p) {
    ds_kview none = { 0 };
    return conv_run(CONV_BWD_DATA, dx, w, none, dy, p);
}

static int cpu_conv2d_backward_weight(ds_kview dw, ds_kview db, ds_kview dy, ds_kview x, const ds_conv2d_params *p) {
    return conv_run(CONV_BWD_WEIGHT, x, dw, db, dy, p);
}

const ds_kernels_conv ds_cpu_conv = {
    cpu_conv2d, cpu_conv2d_backward_data, cpu_conv2d_backward_weight,
    cpu_pool_max2d, cpu_pool_max2d_backward, cpu_pool_avg2d, cpu_pool_avg2d_backward,
};
