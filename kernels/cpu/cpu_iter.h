/* Walking strided views on the CPU: views of one shape are coalesced into
 * as few dims as their strides allow, then visited a row (last dim) at a
 * time, rows spread over OpenMP threads. */
#ifndef CPU_ITER_H
#define CPU_ITER_H

#include "../ds_kview.h"

/* Elementwise work below this many elements stays on one thread: the fork
 * costs more than it saves. */
#define CPU_PARALLEL_MIN 32768

/* Drops size-1 dims and merges dims that are contiguous in every view;
 * all views must share one shape. */
static inline void cpu_coalesce(ds_kview **v, int k) {
    int nd = v[0]->ndim, out = 0;
    for (int d = 0; d < nd; d++) {
        if (v[0]->shape[d] == 1) continue;
        if (out > 0) {
            int merge = 1;
            for (int j = 0; j < k; j++)
                if (v[j]->stride[out - 1] != v[j]->stride[d] * v[j]->shape[d]) merge = 0;
            if (merge) {
                for (int j = 0; j < k; j++) {
                    v[j]->shape[out - 1] *= v[j]->shape[d];
                    v[j]->stride[out - 1] = v[j]->stride[d];
                }
                continue;
            }
        }
        for (int j = 0; j < k; j++) {
            v[j]->shape[out] = v[j]->shape[d];
            v[j]->stride[out] = v[j]->stride[d];
        }
        out++;
    }
    for (int j = 0; j < k; j++) v[j]->ndim = out;
}

static inline int64_t cpu_cols(const ds_kview *v) { return v->ndim ? v->shape[v->ndim - 1] : 1; }
static inline int64_t cpu_col_stride(const ds_kview *v) { return v->ndim ? v->stride[v->ndim - 1] : 0; }

/* Offset of the first element of row r (rows range over all dims but the last). */
static inline int64_t cpu_row_offset(const ds_kview *v, int64_t r) {
    int64_t off = 0;
    for (int d = v->ndim - 2; d >= 0; d--) {
        off += (r % v->shape[d]) * v->stride[d];
        r /= v->shape[d];
    }
    return off;
}

#endif
