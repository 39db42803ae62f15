/* Indexing kernels on the CPU: copies through an index, and scatter-adds
 * split so that no two threads ever write the same element. Index values
 * were range-checked by core before any of these run. */
#include "cpu_kernels.h"
#include "cpu_iter.h"
#include "../ds_half.h"

#include <string.h>

/* Columns per work item of index_add: 64 floats are four cache lines. */
#define INDEX_ADD_BLOCK 64

static inline int64_t load_index(const ds_kview *idx, int64_t off) {
    return idx->dtype == DS_I64 ? ((const int64_t *)idx->data)[off] : ((const int32_t *)idx->data)[off];
}

/* One element of any dtype, moved as raw bytes. */
static inline void copy_elem(void *dst, int64_t di, const void *src, int64_t si, size_t es) {
    switch (es) {
    case 8: ((uint64_t *)dst)[di] = ((const uint64_t *)src)[si]; break;
    case 4: ((uint32_t *)dst)[di] = ((const uint32_t *)src)[si]; break;
    case 2: ((uint16_t *)dst)[di] = ((const uint16_t *)src)[si]; break;
    default: ((uint8_t *)dst)[di] = ((const uint8_t *)src)[si]; break;
    }
}

/* dst[di] += src[si], both of dtype t; exact for integers. */
static inline void add_elem(ds_dtype t, void *dst, int64_t di, const void *src, int64_t si) {
    switch (t) {
    case DS_F32: ((float *)dst)[di] += ((const float *)src)[si]; break;
    case DS_F64: ((double *)dst)[di] += ((const double *)src)[si]; break;
    case DS_I64: ((int64_t *)dst)[di] += ((const int64_t *)src)[si]; break;
    case DS_I32: ((int32_t *)dst)[di] += ((const int32_t *)src)[si]; break;
    default: ds_store(t, dst, di, ds_load(t, dst, di) + ds_load(t, src, si)); break;
    }
}

static int cpu_check_index(ds_kview idx, int64_t limit, const int64_t *skip, ds_index_hit *hit) {
    if (idx.dtype != DS_I64 && idx.dtype != DS_I32) return ds_kernel_fail("indices must be i64 or i32");
    int64_t n = ds_kview_numel(&idx), first = n, let = skip ? *skip : 0;
    int contig = ds_kview_is_contiguous(&idx);
    #pragma omp parallel for schedule(static) reduction(min:first) if (n > CPU_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        int64_t v = load_index(&idx, contig ? i : ds_kview_offset(&idx, i));
        if ((v < 0 || v >= limit) && !(skip && v == let) && i < first) first = i;
    }
    hit->pos = first < n ? first : -1;
    hit->value = first < n ? load_index(&idx, ds_kview_offset(&idx, first)) : 0;
    return 0;
}

static int cpu_index_select(ds_kview out, ds_kview x, ds_kview idx, int64_t outer, int64_t n, int64_t inner) {
    int64_t m = ds_kview_numel(&idx), is = idx.ndim ? idx.stride[0] : 0;
    size_t es = ds_dtype_size(x.dtype), row = (size_t)inner * es;
    #pragma omp parallel for collapse(2) schedule(static) if (outer * m * inner > CPU_PARALLEL_MIN)
    for (int64_t o = 0; o < outer; o++)
        for (int64_t j = 0; j < m; j++) {
            int64_t r = load_index(&idx, j * is);
            memcpy((char *)out.data + (size_t)((o * m + j) * inner) * es,
                   (const char *)x.data + (size_t)((o * n + r) * inner) * es, row);
        }
    return 0;
}

/* A work item is one outer slice and one block of columns and walks every
 * index in order, so duplicate indices never race and each sum has a fixed
 * order: results do not depend on the thread count. */
static int cpu_index_add(ds_kview dst, ds_kview src, ds_kview idx, int64_t outer, int64_t n, int64_t inner) {
    int64_t m = ds_kview_numel(&idx), is = idx.ndim ? idx.stride[0] : 0;
    int64_t blocks = (inner + INDEX_ADD_BLOCK - 1) / INDEX_ADD_BLOCK;
    #pragma omp parallel for collapse(2) schedule(static) if (outer * m * inner > CPU_PARALLEL_MIN)
    for (int64_t o = 0; o < outer; o++)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t k0 = b * INDEX_ADD_BLOCK;
            int64_t k1 = k0 + INDEX_ADD_BLOCK < inner ? k0 + INDEX_ADD_BLOCK : inner;
            for (int64_t j = 0; j < m; j++) {
                int64_t d = (o * n + load_index(&idx, j * is)) * inner, s = (o * m + j) * inner;
                if (dst.dtype == DS_F32) {
                    float *dp = (float *)dst.data + d;
                    const float *sp = (const float *)src.data + s;
                    #pragma omp simd
                    for (int64_t k = k0; k < k1; k++) dp[k] += sp[k];
                } else {
                    for (int64_t k = k0; k < k1; k++) add_elem(dst.dtype, dst.data, d + k, src.data, s + k);
                }
            }
        }
    return 0;
}

static int cpu_gather(ds_kview out, ds_kview x, ds_kview idx, int dim) {
    int nd = idx.ndim, last = nd - 1;
    int64_t n = ds_kview_numel(&idx);
    if (n == 0) return 0;
    int64_t cols = idx.shape[last], rows = n / cols;
    size_t es = ds_dtype_size(x.dtype);
    #pragma omp parallel for schedule(static) if (n > CPU_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        int64_t ox = 0, oi = 0, oo = 0, rem = r;
        for (int d = nd - 2; d >= 0; d--) {
            int64_t c = rem % idx.shape[d];
            rem /= idx.shape[d];
            oi += c * idx.stride[d];
            oo += c * out.stride[d];
            if (d != dim) ox += c * x.stride[d];
        }
        for (int64_t c = 0; c < cols; c++) {
            int64_t v = load_index(&idx, oi + c * idx.stride[last]);
            int64_t xo = ox + v * x.stride[dim] + (dim == last ? 0 : c * x.stride[last]);
            copy_elem(out.data, oo + c * out.stride[last], x.data, xo, es);
        }
    }
    return 0;
}

/* Positions of idx that differ outside dim land in different elements of
 * dst, so each thread takes whole lines along dim: no races, fixed order. */
static int cpu_scatter_add(ds_kview dst, ds_kview src, ds_kview idx, int dim) {
    int nd = idx.ndim;
    int64_t n = ds_kview_numel(&idx);
    if (n == 0) return 0;
    int64_t len = idx.shape[dim], lines = n / len;
    #pragma omp parallel for schedule(static) if (n > CPU_PARALLEL_MIN)
    for (int64_t l = 0; l < lines; l++) {
        int64_t od = 0, os = 0, oi = 0, rem = l;
        for (int d = nd - 1; d >= 0; d--) {
            if (d == dim) continue;
            int64_t c = rem % idx.shape[d];
            rem /= idx.shape[d];
            od += c * dst.stride[d];
            os += c * src.stride[d];
            oi += c * idx.stride[d];
        }
        for (int64_t i = 0; i < len; i++) {
            int64_t v = load_index(&idx, oi + i * idx.stride[dim]);
            add_elem(dst.dtype, dst.data, od + v * dst.stride[dim], src.data, os + i * src.stride[dim]);
        }
    }
    return 0;
}

const ds_kernels_index ds_cpu_index = {
    cpu_check_index, cpu_index_select, cpu_index_add, cpu_gather, cpu_scatter_add,
};
