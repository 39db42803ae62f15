/* Elementwise kernels on the CPU: an f32 loop the compiler vectorises for
 * the common case, and a load-as-double loop for every other dtype mix. */
#include "cpu_kernels.h"
#include "cpu_iter.h"
#include "../ds_elem.h"
#include "../ds_half.h"

static int all_f32(const ds_kview *const *v, int k) {
    for (int j = 0; j < k; j++)
        if (v[j]->dtype != DS_F32) return 0;
    return 1;
}

static int cpu_binary(ds_binary_op op, ds_kview out, ds_kview a, ds_kview b) {
    ds_kview *v[3] = { &out, &a, &b };
    cpu_coalesce(v, 3);
    int64_t n = ds_kview_numel(&out), cols = cpu_cols(&out), rows = cols ? n / cols : 0;
    int64_t so = cpu_col_stride(&out), sa = cpu_col_stride(&a), sb = cpu_col_stride(&b);
    int fast = all_f32((const ds_kview *const *)v, 3) && so == 1;
    #pragma omp parallel for schedule(static) if (n > CPU_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        int64_t oo = cpu_row_offset(&out, r), oa = cpu_row_offset(&a, r), ob = cpu_row_offset(&b, r);
        if (fast && sa == 1 && sb == 1) {
            float *o = (float *)out.data + oo;
            const float *x = (const float *)a.data + oa, *y = (const float *)b.data + ob;
            #pragma omp simd
            for (int64_t c = 0; c < cols; c++) o[c] = ds_binary_apply_f(op, x[c], y[c]);
        } else if (fast && sa == 1 && sb == 0) {
            float *o = (float *)out.data + oo;
            const float *x = (const float *)a.data + oa;
            float y = ((const float *)b.data)[ob];
            #pragma omp simd
            for (int64_t c = 0; c < cols; c++) o[c] = ds_binary_apply_f(op, x[c], y);
        } else {
            for (int64_t c = 0; c < cols; c++) {
                double x = ds_load(a.dtype, a.data, oa + c * sa), y = ds_load(b.dtype, b.data, ob + c * sb);
                ds_store(out.dtype, out.data, oo + c * so, ds_binary_apply(op, x, y));
            }
        }
    }
    return 0;
}

static int cpu_unary(ds_unary_op op, ds_kview out, ds_kview x, double param) {
    ds_kview *v[2] = { &out, &x };
    cpu_coalesce(v, 2);
    int64_t n = ds_kview_numel(&out), cols = cpu_cols(&out), rows = cols ? n / cols : 0;
    int64_t so = cpu_col_stride(&out), sx = cpu_col_stride(&x);
    int fast = out.dtype == DS_F32 && x.dtype == DS_F32 && so == 1 && sx == 1;
    float pf = (float)param;
    #pragma omp parallel for schedule(static) if (n > CPU_PARALLEL_MIN / 4)
    for (int64_t r = 0; r < rows; r++) {
        int64_t oo = cpu_row_offset(&out, r), ox = cpu_row_offset(&x, r);
        if (fast) {
            float *o = (float *)out.data + oo;
            const float *in = (const float *)x.data + ox;
            #pragma omp simd
            for (int64_t c = 0; c < cols; c++) o[c] = ds_unary_apply_f(op, in[c], pf);
        } else {
            for (int64_t c = 0; c < cols; c++)
                ds_store(out.dtype, out.data, oo + c * so,
                         ds_unary_apply(op, ds_load(x.dtype, x.data, ox + c * sx), param));
        }
    }
    return 0;
}

static int cpu_unary_backward(ds_unary_op op, ds_kview dx, ds_kview g, ds_kview x, ds_kview y, double param) {
    ds_kview *v[4] = { &dx, &g, &x, &y };
    cpu_coalesce(v, 4);
    int64_t n = ds_kview_numel(&dx), cols = cpu_cols(&dx), rows = cols ? n / cols : 0;
    int64_t sd = cpu_col_stride(&dx), sg = cpu_col_stride(&g), sx = cpu_col_stride(&x), sy = cpu_col_stride(&y);
    #pragma omp parallel for schedule(static) if (n > CPU_PARALLEL_MIN / 4)
    for (int64_t r = 0; r < rows; r++) {
        int64_t od = cpu_row_offset(&dx, r), og = cpu_row_offset(&g, r);
        int64_t ox = cpu_row_offset(&x, r), oy = cpu_row_offset(&y, r);
        for (int64_t c = 0; c < cols; c++) {
            double xv = ds_load(x.dtype, x.data, ox + c * sx);
            double yv = ds_load(y.dtype, y.data, oy + c * sy);
            double gv = ds_load(g.dtype, g.data, og + c * sg);
            ds_store(dx.dtype, dx.data, od + c * sd, gv * ds_unary_derivative(op, xv, yv, param));
        }
    }
    return 0;
}

static int cpu_where(ds_kview out, ds_kview cond, ds_kview a, ds_kview b) {
    ds_kview *v[4] = { &out, &cond, &a, &b };
    cpu_coalesce(v, 4);
    int64_t n = ds_kview_numel(&out), cols = cpu_cols(&out), rows = cols ? n / cols : 0;
    int64_t so = cpu_col_stride(&out), sc = cpu_col_stride(&cond);
    int64_t sa = cpu_col_stride(&a), sb = cpu_col_stride(&b);
    #pragma omp parallel for schedule(static) if (n > CPU_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        int64_t oo = cpu_row_offset(&out, r), oc = cpu_row_offset(&cond, r);
        int64_t oa = cpu_row_offset(&a, r), ob = cpu_row_offset(&b, r);
        for (int64_t c = 0; c < cols; c++) {
            double v2 = ds_load(cond.dtype, cond.data, oc + c * sc) != 0
                        ? ds_load(a.dtype, a.data, oa + c * sa) : ds_load(b.dtype, b.data, ob + c * sb);
            ds_store(out.dtype, out.data, oo + c * so, v2);
        }
    }
    return 0;
}

const ds_kernels_elementwise ds_cpu_elementwise = {
    cpu_binary, cpu_unary, cpu_unary_backward, cpu_where,
};
