/* What a kernel sees of a tensor: a typed, strided view over raw memory.
 * Kernels know nothing of storage, refcounts or autograd; core/ builds a
 * ds_kview from a ds_tensor and hands it down through the dispatch table. */
#ifndef DS_KVIEW_H
#define DS_KVIEW_H

#include <stdint.h>
#include <stddef.h>

#ifdef __CUDACC__
#define DS_HOSTDEV __host__ __device__ __forceinline__
#else
#define DS_HOSTDEV static inline
#endif

#define DS_MAX_DIMS 8

typedef enum {
    DS_F32, DS_F64, DS_BF16, DS_F16, DS_I32, DS_I64, DS_U8, DS_BOOL,
    DS_NDTYPES
} ds_dtype;

typedef struct {
    void *data;            /* points at element 0 of the view (offset applied) */
    ds_dtype dtype;
    int ndim;
    int64_t shape[DS_MAX_DIMS];
    int64_t stride[DS_MAX_DIMS];   /* in elements; 0 on broadcast dims */
} ds_kview;

DS_HOSTDEV size_t ds_dtype_size(ds_dtype t) {
    switch (t) {
    case DS_F64: case DS_I64: return 8;
    case DS_F32: case DS_I32: return 4;
    case DS_BF16: case DS_F16: return 2;
    default: return 1;
    }
}

DS_HOSTDEV int ds_dtype_is_float(ds_dtype t) {
    return t == DS_F32 || t == DS_F64 || t == DS_BF16 || t == DS_F16;
}

DS_HOSTDEV int64_t ds_kview_numel(const ds_kview *v) {
    int64_t n = 1;
    for (int i = 0; i < v->ndim; i++) n *= v->shape[i];
    return n;
}

DS_HOSTDEV int ds_kview_is_contiguous(const ds_kview *v) {
    int64_t expect = 1;
    for (int i = v->ndim - 1; i >= 0; i--) {
        if (v->shape[i] != 1 && v->stride[i] != expect) return 0;
        expect *= v->shape[i];
    }
    return 1;
}

/* v's shape over data of dtype dt, contiguous: the scratch a copy of v
 * fills. */
DS_HOSTDEV ds_kview ds_kview_dense(const ds_kview *v, void *data, ds_dtype dt) {
    ds_kview f = *v;
    f.data = data;
    f.dtype = dt;
    int64_t s = 1;
    for (int i = v->ndim - 1; i >= 0; i--) {
        f.stride[i] = s;
        s *= v->shape[i];
    }
    return f;
}

/* Element offset (in elements) of the i-th element in row-major order. */
DS_HOSTDEV int64_t ds_kview_offset(const ds_kview *v, int64_t i) {
    int64_t off = 0;
    for (int d = v->ndim - 1; d >= 0; d--) {
        int64_t s = v->shape[d];
        off += (i % s) * v->stride[d];
        i /= s;
    }
    return off;
}

#endif
