#include "ds_tensor.h"
#include "ds_autograd.h"
#include "ds_error.h"
#include "ds_half.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const dtype_names[DS_NDTYPES] = {
    "f32", "f64", "bf16", "f16", "i32", "i64", "u8", "bool"
};

const char *ds_dtype_name(ds_dtype t) { return dtype_names[t]; }

int ds_dtype_parse(const char *name) {
    static const struct { const char *alias; ds_dtype t; } aliases[] = {
        {"float32", DS_F32}, {"float", DS_F32}, {"float64", DS_F64}, {"double", DS_F64},
        {"bfloat16", DS_BF16}, {"float16", DS_F16}, {"half", DS_F16},
        {"int32", DS_I32}, {"int", DS_I32}, {"int64", DS_I64}, {"long", DS_I64},
        {"uint8", DS_U8}, {"byte", DS_U8},
    };
    for (int i = 0; i < DS_NDTYPES; i++)
        if (strcmp(name, dtype_names[i]) == 0) return i;
    for (size_t i = 0; i < sizeof aliases / sizeof *aliases; i++)
        if (strcmp(name, aliases[i].alias) == 0) return aliases[i].t;
    return -1;
}

static ds_tensor *tensor_alloc(void) {
    ds_tensor *t = calloc(1, sizeof *t);
    if (!t) return ds_fail(DS_ERR_NOMEM, "out of memory for a tensor header");
    atomic_init(&t->refcount, 1);
    return t;
}

static bool shape_ok(int ndim, const int64_t *shape) {
    if (ndim < 0 || ndim > DS_MAX_DIMS) {
        ds_fail(DS_ERR_ARG, "tensors have at most %d dims, got %d", DS_MAX_DIMS, ndim);
        return false;
    }
    int64_t n = 1;
    bool huge = false, empty = false;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) {
            ds_fail(DS_ERR_ARG, "negative size %lld in dim %d", (long long)shape[i], i + 1);
            return false;
        }
        huge |= __builtin_mul_overflow(n, shape[i], &n);
        empty |= shape[i] == 0;
    }
    /* the byte count of any dtype must fit, or sizes wrap to a small buffer */
    if (!empty && (huge || n > INT64_MAX / 8)) {
        char s[200] = "";
        for (int i = 0; i < ndim; i++)
            snprintf(s + strlen(s), sizeof s - strlen(s), i ? ",%lld" : "%lld", (long long)shape[i]);
        ds_fail(DS_ERR_ARG, "tensor of shape [%s] is too large (more than 2^60 elements)", s);
        return false;
    }
    return true;
}

/* A contiguous tensor on storage from new_storage (ds_storage_new or
 * ds_storage_new_staging). */
static ds_tensor *tensor_new(int ndim, const int64_t *shape, ds_dtype dtype, ds_device dev,
                             ds_storage *(*new_storage)(size_t, ds_device, ds_mem_category)) {
    if (!shape_ok(ndim, shape)) return NULL;
    ds_tensor *t = tensor_alloc();
    if (!t) return NULL;
    t->dtype = dtype;
    t->ndim = ndim;
    int64_t n = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        t->shape[i] = shape[i];
        t->stride[i] = n;
        n *= shape[i];
    }
    t->storage = new_storage((size_t)n * ds_dtype_size(dtype), dev, DS_MEM_OTHER);
    if (!t->storage) { free(t); return NULL; }
    return t;
}

ds_tensor *ds_tensor_new(int ndim, const int64_t *shape, ds_dtype dtype, ds_device dev) {
    return tensor_new(ndim, shape, dtype, dev, ds_storage_new);
}

ds_tensor *ds_tensor_new_staging(int ndim, const int64_t *shape, ds_dtype dtype, ds_device dev) {
    return tensor_new(ndim, shape, dtype, dev, ds_storage_new_staging);
}

ds_tensor *ds_tensor_new_like(const ds_tensor *t) {
    return ds_tensor_new(t->ndim, t->shape, t->dtype, ds_tensor_device(t));
}

ds_tensor *ds_tensor_full(int ndim, const int64_t *shape, ds_dtype dtype, ds_device dev, double v) {
    ds_tensor *t = ds_tensor_new(ndim, shape, dtype, dev);
    if (t && ds_tensor_kernels(t)->core->fill(ds_tensor_kview(t), v) != 0) {
        ds_tensor_release(t);
        return ds_fail(DS_ERR_STATE, "fill: %s", ds_kernel_error());
    }
    return t;
}

ds_tensor *ds_tensor_view_of(const ds_tensor *src, int ndim, const int64_t *shape,
                             const int64_t *stride, int64_t offset) {
    if (!shape_ok(ndim, shape)) return NULL;
    ds_tensor *t = tensor_alloc();
    if (!t) return NULL;
    t->dtype = src->dtype;
    t->ndim = ndim;
    memcpy(t->shape, shape, sizeof(int64_t) * (size_t)ndim);
    memcpy(t->stride, stride, sizeof(int64_t) * (size_t)ndim);
    t->offset = offset;
    t->storage = src->storage;
    ds_storage_retain(t->storage);
    return t;
}

/* t's bytes are in use outside tensor ops: swapping its storage would free
 * them under their user. -1 with the error naming op, else 0. */
static int check_unpinned(const ds_tensor *t, const char *op) {
    if (atomic_load(&t->storage->pins) == 0) return 0;
    char s[96];
    const char *who = atomic_load_explicit(&t->storage->pinned_by, memory_order_relaxed);
    return ds_fail(DS_ERR_STATE, "%s: the %s %s tensor's data is in use by %s; it would be freed under it", op,
                   ds_dtype_name(t->dtype), ds_shape_str(t, s, sizeof s), who ? who : "a transfer"), -1;
}

int ds_tensor_reseat(ds_tensor *t, ds_storage *s, int64_t offset) {
    int64_t n = ds_tensor_numel(t);
    if (check_unpinned(t, "reseat")) return -1;
    size_t esize = ds_dtype_size(t->dtype);
    if (!ds_device_equal(s->device, ds_tensor_device(t)))
        return ds_fail(DS_ERR_ARG, "reseat: the new storage is on another device"), -1;
    if (offset < 0 || (size_t)(offset + n) * esize > s->nbytes)
        return ds_fail(DS_ERR_ARG, "reseat: %lld elements at offset %lld do not fit in %zu bytes", (long long)n,
                       (long long)offset, s->nbytes), -1;
    ds_kview dst = ds_tensor_kview(t);
    dst.data = (char *)s->data + offset * (int64_t)esize;
    int64_t stride = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        dst.stride[i] = stride;
        stride *= t->shape[i];
    }
    if (ds_tensor_kernels(t)->core->copy(dst, ds_tensor_kview(t)) != 0)
        return ds_fail(DS_ERR_STATE, "reseat: %s", ds_kernel_error()), -1;
    ds_storage_retain(s);
    ds_storage_release(t->storage);
    t->storage = s;
    t->offset = offset;
    memcpy(t->stride, dst.stride, sizeof t->stride);
    return 0;
}

bool ds_tensor_is_released(const ds_tensor *t) {
    return t->storage->nbytes == 0 && ds_tensor_numel(t) > 0;
}

static void set_contiguous_strides(ds_tensor *t) {
    int64_t stride = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        t->stride[i] = stride;
        stride *= t->shape[i];
    }
}

int ds_tensor_release_data(ds_tensor *t) {
    if (t->grad_fn) return ds_fail(DS_ERR_ARG, "release_data: only a leaf's data can be released"), -1;
    if (check_unpinned(t, "release_data")) return -1;
    ds_storage *s = ds_storage_new_empty(ds_tensor_device(t), t->storage->category);
    if (!s) return -1;
    ds_storage_release(t->storage);
    t->storage = s;
    t->offset = 0;
    set_contiguous_strides(t);
    return 0;
}

int ds_tensor_set_data(ds_tensor *t, const ds_tensor *src) {
    char s1[96], s2[96];
    if (t->grad_fn) return ds_fail(DS_ERR_ARG, "set_data: only a leaf's data can be replaced"), -1;
    if (check_unpinned(t, "set_data")) return -1;
    if (src->dtype != t->dtype || ds_tensor_numel(src) != ds_tensor_numel(t) || !ds_tensor_is_contiguous(src) ||
        !ds_device_equal(ds_tensor_device(src), ds_tensor_device(t)) || ds_tensor_is_released(src))
        return ds_fail(DS_ERR_ARG, "set_data: %s %s needs a contiguous %s tensor of as many elements on its "
                       "device, got %s %s", ds_dtype_name(t->dtype), ds_shape_str(t, s1, sizeof s1),
                       ds_dtype_name(t->dtype), ds_dtype_name(src->dtype), ds_shape_str(src, s2, sizeof s2)), -1;
    ds_storage_retain(src->storage);
    ds_storage_release(t->storage);
    t->storage = src->storage;
    t->offset = src->offset;
    set_contiguous_strides(t);
    return 0;
}

void ds_tensor_retain(ds_tensor *t) { atomic_fetch_add(&t->refcount, 1); }

void ds_tensor_release(ds_tensor *t) {
    if (!t || atomic_fetch_sub(&t->refcount, 1) != 1) return;
    ds_tensor_release(t->grad);
    ds_node_release(t->grad_fn);
    ds_storage_release(t->storage);
    free(t);
}

int64_t ds_tensor_numel(const ds_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

bool ds_tensor_is_contiguous(const ds_tensor *t) {
    ds_kview v = ds_tensor_kview(t);
    return ds_kview_is_contiguous(&v);
}

ds_device ds_tensor_device(const ds_tensor *t) { return t->storage->device; }

void *ds_tensor_data(const ds_tensor *t) {
    return (char *)t->storage->data + t->offset * (int64_t)ds_dtype_size(t->dtype);
}

ds_kview ds_tensor_kview(const ds_tensor *t) {
    ds_kview v;
    v.data = ds_tensor_data(t);
    v.dtype = t->dtype;
    v.ndim = t->ndim;
    memcpy(v.shape, t->shape, sizeof v.shape);
    memcpy(v.stride, t->stride, sizeof v.stride);
    return v;
}

ds_kview ds_tensor_kview_w(ds_tensor *t, const char *op) {
    ds_storage_bump_version(t->storage, op);
    return ds_tensor_kview(t);
}

void *ds_tensor_data_w(ds_tensor *t, const char *op) {
    ds_storage_bump_version(t->storage, op);
    return ds_tensor_data(t);
}

/* Every kernel call passes here, so counting here counts a step's kernels
 * on any device (a GPU's launches, give or take a kernel that launches two). */
static uint64_t kernel_calls;

const ds_kernels *ds_tensor_kernels(const ds_tensor *t) {
    __atomic_fetch_add(&kernel_calls, 1, __ATOMIC_RELAXED);
    return ds_backend_get(t->storage->device)->kernels;
}

uint64_t ds_kernel_calls(void) { return __atomic_load_n(&kernel_calls, __ATOMIC_RELAXED); }

const ds_kernels *ds_tensor_kernel_table(const ds_tensor *t) { return ds_backend_get(t->storage->device)->kernels; }

const char *ds_dims_str(int ndim, const int64_t *dims, char *buf, size_t n) {
    size_t used = 0;
    if (n) buf[0] = 0;
    for (int i = 0; i < ndim && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, i ? ",%lld" : "%lld", (long long)dims[i]);
    return buf;
}

const char *ds_shape_str(const ds_tensor *t, char *buf, size_t n) {
    char dims[192];
    snprintf(buf, n, "[%s]", ds_dims_str(t->ndim, t->shape, dims, sizeof dims));
    return buf;
}

bool ds_tensor_same_shape(const ds_tensor *a, const ds_tensor *b) {
    if (a->ndim != b->ndim) return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return false;
    return true;
}

int ds_tensor_dim(const ds_tensor *t, const char *op, int64_t dim) {
    int64_t nd = t->ndim ? t->ndim : 1;
    int64_t d = dim < 0 ? dim + nd : dim;
    if (d < 0 || d >= nd) {
        char s[96];
        ds_fail(DS_ERR_ARG, "%s: dim %lld out of range for shape %s", op, ds_api_pos(dim),
                ds_shape_str(t, s, sizeof s));
        return -1;
    }
    return (int)d;
}

long long ds_api_pos(int64_t i) { return i >= 0 ? (long long)i + 1 : (long long)i; }

/* One element of a view as a 0-dim view (for a copy off or onto a GPU). */
static ds_kview element_view(const ds_tensor *t, int64_t i) {
    ds_kview v = ds_tensor_kview(t);
    v.data = (char *)v.data + ds_kview_offset(&v, i) * (int64_t)ds_dtype_size(t->dtype);
    v.ndim = 0;
    return v;
}

double ds_tensor_get(const ds_tensor *t, int64_t i) {
    ds_kview v = ds_tensor_kview(t);
    if (ds_tensor_device(t).type != DS_DEV_CPU) {
        double out = NAN;
        ds_kview h = { &out, DS_F64, 0, { 0 }, { 0 } };
        ds_device_transfer("get", h, DS_CPU_DEVICE, element_view(t, i), ds_tensor_device(t));
        return out;
    }
    return ds_load(t->dtype, v.data, ds_kview_offset(&v, i));
}

void ds_tensor_set(ds_tensor *t, int64_t i, double value) {
    ds_kview v = ds_tensor_kview(t);
    if (ds_tensor_device(t).type != DS_DEV_CPU) {
        ds_kview h = { &value, DS_F64, 0, { 0 }, { 0 } };
        ds_device_transfer("set", element_view(t, i), ds_tensor_device(t), h, DS_CPU_DEVICE);
        return;
    }
    ds_store(t->dtype, v.data, ds_kview_offset(&v, i), value);
}

void ds_tensor_set_category(ds_tensor *t, ds_mem_category cat) {
    ds_storage_set_category(t->storage, cat);
}

int ds_check_same_device(const char *op, const ds_tensor *a, const ds_tensor *b) {
    if (!b || ds_device_equal(ds_tensor_device(a), ds_tensor_device(b))) return 0;
    char da[16], db[16];
    ds_device_name(ds_tensor_device(a), da, sizeof da);
    ds_device_name(ds_tensor_device(b), db, sizeof db);
    ds_fail(DS_ERR_ARG, "%s: tensors on different devices (%s and %s)", op, da, db);
    return -1;
}

int ds_check_same_dtype(const char *op, const ds_tensor *a, const ds_tensor *b) {
    if (!b || a->dtype == b->dtype) return 0;
    ds_fail(DS_ERR_ARG, "%s: dtypes %s and %s differ", op, ds_dtype_name(a->dtype), ds_dtype_name(b->dtype));
    return -1;
}
