/* Fused nn row ops on the CPU, rows spread over OpenMP threads. All-f32
 * contiguous rows run the vectorised f32 row functions of ds_rows.h in
 * place; every other case gathers a row into a per-thread double buffer,
 * runs the f64 row function and stores the result back in its dtype. */
#include "cpu_kernels.h"
#include "cpu_iter.h"
#include "../ds_rows.h"

#include <omp.h>
#include <stdlib.h>

/* per_thread doubles for every thread a parallel region may use */
static double *scratch(int64_t per_thread) {
    size_t n = (size_t)omp_get_max_threads() * (size_t)(per_thread > 0 ? per_thread : 1);
    double *p = calloc(n, sizeof *p);
    if (!p) ds_kernel_fail("out of memory for %zu scratch values", n);
    return p;
}

static double *thread_buf(double *base, int64_t per_thread) {
    return base + (int64_t)omp_get_thread_num() * per_thread;
}

static void load_row(double *dst, const ds_kview *v, int64_t base, int64_t n, int64_t step) {
    for (int64_t j = 0; j < n; j++) dst[j] = ds_load(v->dtype, v->data, base + j * step);
}

static void store_row(const ds_kview *v, int64_t base, int64_t n, int64_t step, const double *src) {
    for (int64_t j = 0; j < n; j++) ds_store(v->dtype, v->data, base + j * step, src[j]);
}

/* A parameter row (weight, bias) of n values: its own data when it is
 * f32, else an f32 copy, or `fill` everywhere when absent. */
static const float *param_f(const ds_kview *p, int64_t n, float fill, float **owned) {
    *owned = NULL;
    if (p->data && p->dtype == DS_F32) return (const float *)p->data;
    float *c = malloc((size_t)(n > 0 ? n : 1) * sizeof *c);
    if (!c) { ds_kernel_fail("out of memory for a row of %lld", (long long)n); return NULL; }
    for (int64_t j = 0; j < n; j++) c[j] = p->data ? (float)ds_load(p->dtype, p->data, j) : fill;
    *owned = c;
    return c;
}

static double *param_d(const ds_kview *p, int64_t n, double fill) {
    double *c = malloc((size_t)(n > 0 ? n : 1) * sizeof *c);
    if (!c) { ds_kernel_fail("out of memory for a row of %lld", (long long)n); return NULL; }
    for (int64_t j = 0; j < n; j++) c[j] = p->data ? ds_load(p->dtype, p->data, j) : fill;
    return c;
}

static int all_f32(const ds_kview *const *v, int k) {
    for (int j = 0; j < k; j++)
        if (v[j]->dtype != DS_F32) return 0;
    return 1;
}

/* ---- softmax ---- */

static int cpu_softmax(ds_kview y, ds_kview x, int64_t outer, int64_t n, int64_t inner, int as_log) {
    int64_t rows = outer * inner;
    if (rows == 0 || n == 0) return 0;
    if (x.dtype == DS_F32 && y.dtype == DS_F32 && inner == 1) {
        const float *xf = (const float *)x.data;
        float *yf = (float *)y.data;
        #pragma omp parallel for schedule(static) if (rows * n > CPU_PARALLEL_MIN)
        for (int64_t r = 0; r < rows; r++) {
            if (as_log) ds_row_log_softmax_f(yf + r * n, xf + r * n, n);
            else ds_row_softmax_f(yf + r * n, xf + r * n, n);
        }
        return 0;
    }
    double *buf = scratch(2 * n);
    if (!buf) return -1;
    #pragma omp parallel for schedule(static) if (rows * n > CPU_PARALLEL_MIN / 4)
    for (int64_t r = 0; r < rows; r++) {
        double *in = thread_buf(buf, 2 * n), *out = in + n;
        int64_t base = (r / inner) * n * inner + r % inner;
        load_row(in, &x, base, n, inner);
        if (as_log) ds_row_log_softmax_d(out, in, n);
        else ds_row_softmax_d(out, in, n);
        store_row(&y, base, n, inner, out);
    }
    free(buf);
    return 0;
}

static int cpu_softmax_backward(ds_kview dx, ds_kview g, ds_kview y, int64_t outer, int64_t n, int64_t inner,
                                int as_log) {
    int64_t rows = outer * inner;
    if (rows == 0 || n == 0) return 0;
    const ds_kview *v[3] = { &dx, &g, &y };
    if (all_f32(v, 3) && inner == 1) {
        float *d = (float *)dx.data;
        const float *gf = (const float *)g.data, *yf = (const float *)y.data;
        #pragma omp parallel for schedule(static) if (rows * n > CPU_PARALLEL_MIN)
        for (int64_t r = 0; r < rows; r++) {
            if (as_log) ds_row_log_softmax_backward_f(d + r * n, gf + r * n, yf + r * n, n);
            else ds_row_softmax_backward_f(d + r * n, gf + r * n, yf + r * n, n);
        }
        return 0;
    }
    double *buf = scratch(3 * n);
    if (!buf) return -1;
    #pragma omp parallel for schedule(static) if (rows * n > CPU_PARALLEL_MIN / 4)
    for (int64_t r = 0; r < rows; r++) {
        double *gd = thread_buf(buf, 3 * n), *yd = gd + n, *out = yd + n;
        int64_t base = (r / inner) * n * inner + r % inner;
        load_row(gd, &g, base, n, inner);
        load_row(yd, &y, base, n, inner);
        if (as_log) ds_row_log_softmax_backward_d(out, gd, yd, n);
        else ds_row_softmax_backward_d(out, gd, yd, n);
        store_row(&dx, base, n, inner, out);
    }
    free(buf);
    return 0;
}

/* ---- cross-entropy ---- */

/* targets are contiguous: row r's class id is element r */
static int64_t target_at(const ds_kview *t, int64_t r) {
    return t->dtype == DS_I64 ? ((const int64_t *)t->data)[r] : ((const int32_t *)t->data)[r];
}

static int cpu_cross_entropy(ds_kview loss, ds_kview lse, ds_kview logits, ds_kview target, int64_t rows, int64_t C,
                             int64_t ld, int64_t ignore_index, double smoothing) {
    if (target.dtype != DS_I64 && target.dtype != DS_I32)
        return ds_kernel_fail("target must hold i64 or i32 class ids");
    const ds_kview *v[3] = { &loss, &lse, &logits };
    if (all_f32(v, 3)) {
        const float *x = (const float *)logits.data;
        float *lf = (float *)loss.data, *sf = (float *)lse.data, eps = (float)smoothing;
        #pragma omp parallel for schedule(static) if (rows * C > CPU_PARALLEL_MIN)
        for (int64_t r = 0; r < rows; r++) {
            int64_t t = target_at(&target, r);
            if (t == ignore_index) { lf[r] = 0; sf[r] = 0; continue; }
            float sum, l = ds_row_lse_f(x + r * ld, C, &sum);
            sf[r] = l;
            lf[r] = l - (1.0f - eps) * x[r * ld + t] - eps / (float)C * sum;
        }
        return 0;
    }
    double *buf = scratch(C);
    if (!buf) return -1;
    #pragma omp parallel for schedule(static) if (rows * C > CPU_PARALLEL_MIN / 4)
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = target_at(&target, r);
        if (t == ignore_index) {
            ds_store(loss.dtype, loss.data, r, 0);
            ds_store(lse.dtype, lse.data, r, 0);
            continue;
        }
        double *row = thread_buf(buf, C), sum;
        load_row(row, &logits, r * ld, C, 1);
        double l = ds_row_lse_d(row, C, &sum);
        ds_store(lse.dtype, lse.data, r, l);
        ds_store(loss.dtype, loss.data, r, l - (1.0 - smoothing) * row[t] - smoothing / (double)C * sum);
    }
    free(buf);
    return 0;
}

static int cpu_cross_entropy_backward(ds_kview dlogits, ds_kview dloss, ds_kview logits, ds_kview lse,
                                      ds_kview target, int64_t rows, int64_t C, int64_t ld, int64_t ignore_index,
                                      double smoothing) {
    int64_t ds = dloss.ndim ? dloss.stride[0] : 0;
    const ds_kview *v[3] = { &dlogits, &logits, &lse };
    if (all_f32(v, 3)) {
        const float *x = (const float *)logits.data, *sf = (const float *)lse.data;
        float *d = (float *)dlogits.data;
        #pragma omp parallel for schedule(static) if (rows * C > CPU_PARALLEL_MIN)
        for (int64_t r = 0; r < rows; r++) {
            int64_t t = target_at(&target, r);
            for (int64_t j = t == ignore_index ? 0 : C; j < ld; j++) d[r * ld + j] = 0;
            if (t == ignore_index) continue;
            float s = (float)ds_load(dloss.dtype, dloss.data, r * ds);
            ds_row_ce_backward_f(d + r * ld, x + r * ld, C, t, sf[r], s, (float)smoothing);
        }
        return 0;
    }
    double *buf = scratch(2 * ld);
    if (!buf) return -1;
    #pragma omp parallel for schedule(static) if (rows * C > CPU_PARALLEL_MIN / 4)
    for (int64_t r = 0; r < rows; r++) {
        double *row = thread_buf(buf, 2 * ld), *out = row + ld;
        int64_t t = target_at(&target, r);
        for (int64_t j = t == ignore_index ? 0 : C; j < ld; j++) out[j] = 0;
        if (t != ignore_index) {
            load_row(row, &logits, r * ld, C, 1);
            double s = ds_load(dloss.dtype, dloss.data, r * ds);
            ds_row_ce_backward_d(out, row, C, t, ds_load(lse.dtype, lse.data, r), s, smoothing);
        }
        store_row(&dlogits, r * ld, ld, 1, out);
    }
    free(buf);
    return 0;
}

/* ---- layer norm and RMS norm ----
 * Weight and bias gradients sum over rows: each thread accumulates its
 * rows into its own slice of a buffer, and the slices are summed after. */

static void store_param_grad(const ds_kview *dst, const double *acc, int64_t n, int64_t slice, int nt) {
    for (int64_t j = 0; j < n; j++) {
        double s = 0;
        for (int k = 0; k < nt; k++) s += acc[k * slice + j];
        ds_store(dst->dtype, dst->data, j, s);
    }
}

/* dst += src over count values: a residual and its gradient, summed in
 * f32 unless dst is f64, as the elementwise add sums them */
static void add_into(const ds_kview *dst, const ds_kview *a, const ds_kview *src, int64_t count) {
    bool f64 = dst->dtype == DS_F64;
    #pragma omp parallel for schedule(static) if (count > CPU_PARALLEL_MIN)
    for (int64_t i = 0; i < count; i++) {
        double u = ds_load(a->dtype, a->data, i), v = ds_load(src->dtype, src->data, i);
        ds_store(dst->dtype, dst->data, i, f64 ? u + v : (double)((float)u + (float)v));
    }
}

static int cpu_layer_norm(ds_kview y, ds_kview mean, ds_kview rstd, ds_kview x, ds_kview w, ds_kview b,
                          ds_kview res, ds_kview sum, int64_t rows, int64_t n, double eps) {
    if (rows == 0) return 0;
    if (res.data) {
        add_into(&sum, &x, &res, rows * n);
        x = sum;
    }
    const ds_kview *v[4] = { &y, &mean, &rstd, &x };
    if (all_f32(v, 4)) {
        float *ow, *ob;
        const float *wf = param_f(&w, n, 1.0f, &ow), *bf = wf ? param_f(&b, n, 0.0f, &ob) : NULL;
        if (!bf) { free(ow); return -1; }
        const float *xf = (const float *)x.data;
        float *yf = (float *)y.data, *mf = (float *)mean.data, *rf = (float *)rstd.data;
        #pragma omp parallel for schedule(static) if (rows * n > CPU_PARALLEL_MIN)
        for (int64_t r = 0; r < rows; r++)
            ds_row_layer_norm_f(yf + r * n, mf + r, rf + r, xf + r * n, wf, bf, n, (float)eps);
        free(ow);
        free(ob);
        return 0;
    }
    double *wd = param_d(&w, n, 1.0), *bd = wd ? param_d(&b, n, 0.0) : NULL;
    double *buf = bd ? scratch(2 * n) : NULL;
    if (!buf) { free(wd); free(bd); return -1; }
    #pragma omp parallel for schedule(static) if (rows * n > CPU_PARALLEL_MIN / 4)
    for (int64_t r = 0; r < rows; r++) {
        double *in = thread_buf(buf, 2 * n), *out = in + n, m, rs;
        load_row(in, &x, r * n, n, 1);
        ds_row_layer_norm_d(out, &m, &rs, in, wd, bd, n, eps);
        store_row(&y, r * n, n, 1, out);
        ds_store(mean.dtype, mean.data, r, m);
        ds_store(rstd.dtype, rstd.data, r, rs);
    }
    free(buf);
    free(wd);
    free(bd);
    return 0;
}

static int layer_norm_backward_f32(ds_kview dx, ds_kview dw, ds_kview db, ds_kview g, ds_kview x, ds_kview w,
                                   ds_kview mean, ds_kview rstd, int64_t rows, int64_t n) {
    int nt = omp_get_max_threads();
    float *ow, *acc = calloc((size_t)nt * 2 * (size_t)(n > 0 ? n : 1), sizeof *acc);
    if (!acc) return ds_kernel_fail("out of memory for weight gradients");
    const float *wf = param_f(&w, n, 1.0f, &ow);
    if (!wf) { free(acc); return -1; }
    const float *gf = (const float *)g.data, *xf = (const float *)x.data;
    const float *mf = (const float *)mean.data, *rf = (const float *)rstd.data;
    float *d = (float *)dx.data;
    #pragma omp parallel for schedule(static) if (rows * n > CPU_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float *dwt = acc + (int64_t)omp_get_thread_num() * 2 * n;
        ds_row_layer_norm_backward_f(d + r * n, dwt, dwt + n, gf + r * n, xf + r * n, wf, n, mf[r], rf[r]);
    }
    for (int64_t j = 0; j < n && (dw.data || db.data); j++) {
        double sw = 0, sb = 0;
        for (int k = 0; k < nt; k++) { sw += acc[k * 2 * n + j]; sb += acc[k * 2 * n + n + j]; }
        if (dw.data) ds_store(dw.dtype, dw.data, j, sw);
        if (db.data) ds_store(db.dtype, db.data, j, sb);
    }
    free(acc);
    free(ow);
    return 0;
}

static int layer_norm_backward(ds_kview dx, ds_kview dw, ds_kview db, ds_kview g, ds_kview x, ds_kview w,
                               ds_kview mean, ds_kview rstd, int64_t rows, int64_t n) {
    const ds_kview *v[5] = { &dx, &g, &x, &mean, &rstd };
    if (all_f32(v, 5)) return layer_norm_backward_f32(dx, dw, db, g, x, w, mean, rstd, rows, n);
    int nt = omp_get_max_threads();
    int64_t per = 5 * n;       /* x, g, dx rows, then dw and db accumulators */
    double *wd = param_d(&w, n, 1.0), *buf = wd ? scratch(per) : NULL;
    if (!buf) { free(wd); return -1; }
    #pragma omp parallel for schedule(static) if (rows * n > CPU_PARALLEL_MIN / 4)
    for (int64_t r = 0; r < rows; r++) {
        double *xd = thread_buf(buf, per), *gd = xd + n, *out = gd + n, *acc = out + n;
        load_row(xd, &x, r * n, n, 1);
        load_row(gd, &g, r * n, n, 1);
        ds_row_layer_norm_backward_d(out, acc, acc + n, gd, xd, wd, n, ds_load(mean.dtype, mean.data, r),
                                     ds_load(rstd.dtype, rstd.data, r));
        store_row(&dx, r * n, n, 1, out);
    }
    if (dw.data) store_param_grad(&dw, buf + 3 * n, n, per, nt);
    if (db.data) store_param_grad(&db, buf + 4 * n, n, per, nt);
    free(buf);
    free(wd);
    return 0;
}

static int cpu_layer_norm_backward(ds_kview dx, ds_kview dw, ds_kview db, ds_kview g, ds_kview x, ds_kview w,
                                   ds_kview mean, ds_kview rstd, ds_kview gres, int64_t rows, int64_t n) {
    int rc = layer_norm_backward(dx, dw, db, g, x, w, mean, rstd, rows, n);
    if (rc == 0 && gres.data) add_into(&dx, &dx, &gres, rows * n);
    return rc;
}

static int cpu_rms_norm(ds_kview y, ds_kview rstd, ds_kview x, ds_kview w, ds_kview res, ds_kview sum, int64_t rows,
                        int64_t n, double eps) {
    if (rows == 0) return 0;
    if (res.data) {
        add_into(&sum, &x, &res, rows * n);
        x = sum;
    }
    const ds_kview *v[3] = { &y, &rstd, &x };
    if (all_f32(v, 3)) {
        float *ow;
        const float *wf = param_f(&w, n, 1.0f, &ow);
        if (!wf) return -1;
        const float *xf = (const float *)x.data;
        float *yf = (float *)y.data, *rf = (float *)rstd.data;
        #pragma omp parallel for schedule(static) if (rows * n > CPU_PARALLEL_MIN)
        for (int64_t r = 0; r < rows; r++) ds_row_rms_norm_f(yf + r * n, rf + r, xf + r * n, wf, n, (float)eps);
        free(ow);
        return 0;
    }
    double *wd = param_d(&w, n, 1.0), *buf = wd ? scratch(2 * n) : NULL;
    if (!buf) { free(wd); return -1; }
    #pragma omp parallel for schedule(static) if (rows * n > CPU_PARALLEL_MIN / 4)
    for (int64_t r = 0; r < rows; r++) {
        double *in = thread_buf(buf, 2 * n), *out = in + n, rs;
        load_row(in, &x, r * n, n, 1);
        ds_row_rms_norm_d(out, &rs, in, wd, n, eps);
        store_row(&y, r * n, n, 1, out);
        ds_store(rstd.dtype, rstd.data, r, rs);
    }
    free(buf);
    free(wd);
    return 0;
}

static int rms_norm_backward(ds_kview dx, ds_kview dw, ds_kview g, ds_kview x, ds_kview w, ds_kview rstd,
                             int64_t rows, int64_t n) {
    int nt = omp_get_max_threads();
    const ds_kview *v[4] = { &dx, &g, &x, &rstd };
    if (all_f32(v, 4)) {
        float *ow, *acc = calloc((size_t)nt * (size_t)(n > 0 ? n : 1), sizeof *acc);
        if (!acc) return ds_kernel_fail("out of memory for weight gradients");
        const float *wf = param_f(&w, n, 1.0f, &ow);
        if (!wf) { free(acc); return -1; }
        const float *gf = (const float *)g.data, *xf = (const float *)x.data, *rf = (const float *)rstd.data;
        float *d = (float *)dx.data;
        #pragma omp parallel for schedule(static) if (rows * n > CPU_PARALLEL_MIN)
        for (int64_t r = 0; r < rows; r++)
            ds_row_rms_norm_backward_f(d + r * n, acc + (int64_t)omp_get_thread_num() * n, gf + r * n,
                                       xf + r * n, wf, n, rf[r]);
        for (int64_t j = 0; j < n && dw.data; j++) {
            double s = 0;
            for (int k = 0; k < nt; k++) s += acc[k * n + j];
            ds_store(dw.dtype, dw.data, j, s);
        }
        free(acc);
        free(ow);
        return 0;
    }
    int64_t per = 4 * n;       /* x, g, dx rows, then the dw accumulator */
    double *wd = param_d(&w, n, 1.0), *buf = wd ? scratch(per) : NULL;
    if (!buf) { free(wd); return -1; }
    #pragma omp parallel for schedule(static) if (rows * n > CPU_PARALLEL_MIN / 4)
    for (int64_t r = 0; r < rows; r++) {
        double *xd = thread_buf(buf, per), *gd = xd + n, *out = gd + n;
        load_row(xd, &x, r * n, n, 1);
        load_row(gd, &g, r * n, n, 1);
        ds_row_rms_norm_backward_d(out, out + n, gd, xd, wd, n, ds_load(rstd.dtype, rstd.data, r));
        store_row(&dx, r * n, n, 1, out);
    }
    if (dw.data) store_param_grad(&dw, buf + 3 * n, n, per, nt);
    free(buf);
    free(wd);
    return 0;
}

static int cpu_rms_norm_backward(ds_kview dx, ds_kview dw, ds_kview g, ds_kview x, ds_kview w, ds_kview rstd,
                                 ds_kview gres, int64_t rows, int64_t n) {
    int rc = rms_norm_backward(dx, dw, g, x, w, rstd, rows, n);
    if (rc == 0 && gres.data) add_into(&dx, &dx, &gres, rows * n);
    return rc;
}

/* ---- dropout: Philox block b gives the keep bits of elements 4b..4b+3 ---- */

static int cpu_dropout(ds_kview y, ds_kview x, uint64_t seed, uint64_t offset, double p) {
    int64_t n = ds_kview_numel(&x), blocks = (n + 3) / 4;
    float q = (float)(1.0 - p);
    double scale = p < 1 ? 1.0 / (1.0 - p) : 0.0;
    int fast = x.dtype == DS_F32 && y.dtype == DS_F32;
    float sf = (float)scale;
    #pragma omp parallel for schedule(static) if (n > CPU_PARALLEL_MIN / 4)
    for (int64_t b = 0; b < blocks; b++) ds_dropout_block(&y, &x, seed, offset, b, n, q, scale, sf, fast);
    return 0;
}

const ds_kernels_nn ds_cpu_nn = {
    cpu_softmax, cpu_softmax_backward, cpu_cross_entropy, cpu_cross_entropy_backward,
    cpu_layer_norm, cpu_layer_norm_backward, cpu_rms_norm, cpu_rms_norm_backward, cpu_rope, cpu_dropout,
};
