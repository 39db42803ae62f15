/* Rotary embeddings on the CPU: rows of the last dim spread over threads,
 * each element through ds_rope_elem. Built with -ffp-contract=off (CMakeLists):
 * a contracted multiply-add would round f64 differently from the composed
 * ops. */
#include "cpu_kernels.h"
#include "cpu_iter.h"
#include "../ds_elem.h"

int cpu_rope(ds_kview y, ds_kview x, ds_kview c, ds_kview s, bool backward) {
    int64_t numel = ds_kview_numel(&y), n = cpu_cols(&y), h = n / 2;
    if (numel == 0) return 0;
    int64_t rows = numel / n, sy = cpu_col_stride(&y), sx = cpu_col_stride(&x);
    int64_t sc = cpu_col_stride(&c), ss = cpu_col_stride(&s);
    #pragma omp parallel for schedule(static) if (numel > CPU_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        int64_t oy = cpu_row_offset(&y, r), ox = cpu_row_offset(&x, r);
        int64_t oc = cpu_row_offset(&c, r), os = cpu_row_offset(&s, r);
        for (int64_t i = 0; i < n; i++) {
            bool first = i < h;
            int64_t p = first ? i + h : i - h;
            double v = ds_load(x.dtype, x.data, ox + i * sx), vp = ds_load(x.dtype, x.data, ox + p * sx);
            double ci = ds_load(c.dtype, c.data, oc + i * sc);
            double si = ds_load(s.dtype, s.data, os + (backward ? p : i) * ss);
            double out = backward ? ds_rope_elem_backward(y.dtype, first, v, ci, vp, si)
                                  : ds_rope_elem(y.dtype, first, v, ci, vp, si);
            ds_store(y.dtype, y.data, oy + i * sy, out);
        }
    }
    return 0;
}
