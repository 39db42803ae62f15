/* Reductions over the middle axis of [outer, n, inner], accumulated in
 * double so long f32 sums keep their digits. */
#include "cpu_kernels.h"
#include "cpu_iter.h"
#include "../ds_half.h"

#include <math.h>
#include <stdlib.h>

/* One output element: op over x[base + j*step] for j < n. */
static double reduce_line(ds_reduce_op op, const ds_kview *x, int64_t base, int64_t n, int64_t step,
                          double param) {
    const void *d = x->data;
    ds_dtype t = x->dtype;
    switch (op) {
    case DS_RED_SUM: case DS_RED_MEAN: {
        double s = 0;
        const uint16_t *h = (const uint16_t *)d + base;       /* bf16, f16: the values ds_load gives */
        if (t == DS_F32 && step == 1) {
            const float *f = (const float *)d + base;
            for (int64_t j = 0; j < n; j++) s += f[j];
        } else if (t == DS_BF16) {
            for (int64_t j = 0; j < n; j++) s += ds_bf16_to_f32(h[j * step]);
        } else if (t == DS_F16) {
            for (int64_t j = 0; j < n; j++) s += ds_f16_to_f32(h[j * step]);
        } else {
            for (int64_t j = 0; j < n; j++) s += ds_load(t, d, base + j * step);
        }
        return op == DS_RED_MEAN ? s / (double)n : s;
    }
    case DS_RED_MAX: case DS_RED_MIN: case DS_RED_ARGMAX: case DS_RED_ARGMIN: {
        int want_max = op == DS_RED_MAX || op == DS_RED_ARGMAX;
        double best = ds_load(t, d, base);
        int64_t at = 0;
        for (int64_t j = 1; j < n && best == best; j++) {    /* NaN wins and stops the scan */
            double v = ds_load(t, d, base + j * step);
            if (v != v || (want_max ? v > best : v < best)) { best = v; at = j; }
        }
        return op == DS_RED_MAX || op == DS_RED_MIN ? best : (double)at;
    }
    case DS_RED_VAR: {
        /* Welford: stable where the mean is large against the spread */
        double mean = 0, m2 = 0;
        for (int64_t j = 0; j < n; j++) {
            double v = ds_load(t, d, base + j * step), delta = v - mean;
            mean += delta / (double)(j + 1);
            m2 += delta * (v - mean);
        }
        double dof = (double)n - param;
        return dof > 0 ? m2 / dof : NAN;
    }
    case DS_RED_NORM: {
        double s = 0;
        for (int64_t j = 0; j < n; j++) {
            double v = fabs(ds_load(t, d, base + j * step));
            if (isinf(param)) s = v > s ? v : s;
            else if (param == 2) s += v * v;
            else if (param == 1) s += v;
            else if (param == 0) s += v != 0;
            else s += pow(v, param);
        }
        if (isinf(param) || param == 1 || param == 0) return s;
        return param == 2 ? sqrt(s) : pow(s, 1.0 / param);
    }
    default: return 0;
    }
}

/* Columns per work item of the column sums. */
#define REDUCE_COLS 256

/* acc[k] += x[off + j*inner + k] for rows j < n, columns [k0, k1): f32,
 * bf16 or f16, each value as ds_load gives it, in reduce_line's order. */
static void add_rows(double *acc, const ds_kview *x, int64_t off, int64_t n, int64_t inner, int64_t k0, int64_t k1) {
    const float *f = (const float *)x->data + off;
    const uint16_t *h = (const uint16_t *)x->data + off;
    for (int64_t j = 0; j < n; j++) {
        if (x->dtype == DS_F32)
            for (int64_t k = k0; k < k1; k++) acc[k] += f[j * inner + k];
        else if (x->dtype == DS_BF16)
            for (int64_t k = k0; k < k1; k++) acc[k] += ds_bf16_to_f32(h[j * inner + k]);
        else
            for (int64_t k = k0; k < k1; k++) acc[k] += ds_f16_to_f32(h[j * inner + k]);
    }
}

static int cpu_reduce(ds_reduce_op op, ds_kview out, ds_kview x, int64_t outer, int64_t n, int64_t inner,
                      double param) {
    if (n == 0 && (op != DS_RED_SUM && op != DS_RED_NORM))
        return ds_kernel_fail("cannot reduce an empty dimension");
    int64_t total = outer * inner;
    bool floats = x.dtype == DS_F32 || x.dtype == DS_BF16 || x.dtype == DS_F16;
    if (inner > 1 && (op == DS_RED_SUM || op == DS_RED_MEAN) && floats) {
        /* column sums: walk rows in memory order, one accumulator per column;
         * threads share blocks of columns, so a bias gradient (outer 1)
         * is not left to one thread */
        double *sums = calloc((size_t)total, sizeof *sums);
        if (!sums) return ds_kernel_fail("out of memory for %lld accumulators", (long long)total);
        int64_t blocks = (inner + REDUCE_COLS - 1) / REDUCE_COLS;
        #pragma omp parallel for schedule(static) if (total * n > CPU_PARALLEL_MIN)
        for (int64_t t = 0; t < outer * blocks; t++) {
            int64_t o = t / blocks, k0 = t % blocks * REDUCE_COLS;
            int64_t k1 = k0 + REDUCE_COLS < inner ? k0 + REDUCE_COLS : inner;
            double *acc = sums + o * inner;
            add_rows(acc, &x, o * n * inner, n, inner, k0, k1);
            for (int64_t k = k0; k < k1; k++)
                ds_store(out.dtype, out.data, o * inner + k, op == DS_RED_MEAN ? acc[k] / (double)n : acc[k]);
        }
        free(sums);
        return 0;
    }
    #pragma omp parallel for schedule(static) if (total * n > CPU_PARALLEL_MIN)
    for (int64_t i = 0; i < total; i++) {
        int64_t o = i / inner, k = i % inner;
        ds_store(out.dtype, out.data, i, reduce_line(op, &x, o * n * inner + k, n, inner, param));
    }
    return 0;
}

static int cpu_sum_squares(ds_kview acc, ds_kview x) {
    if (x.dtype != DS_F32 || !ds_kview_is_contiguous(&x) || acc.dtype != DS_F64)
        return ds_kernel_fail("sum_squares: needs contiguous f32 values and an f64 accumulator");
    const float *f = x.data;
    int64_t n = ds_kview_numel(&x);
    double sq = 0, bad = 0;
    #pragma omp parallel for schedule(static) reduction(+ : sq, bad) if (n > CPU_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        float v = f[i];
        sq += (double)v * v;
        bad += !isfinite(v);
    }
    double *a = acc.data;
    a[0] += sq;
    a[1] += bad;
    return 0;
}

const ds_kernels_reduce ds_cpu_reduce = { cpu_reduce, cpu_sum_squares };
