#include "ds_ops.h"
#include "ds_cuda.h"
#include "ds_error.h"
#include "ds_fault.h"

#include <stdio.h>
#include <string.h>

/* A copy onto the CPU has waited for the source device, so it also
 * reports a fault that device's checks found since the last
 * (core/tensor/ds_fault.h). */
static int copy_kernel(ds_tensor *dst, ds_tensor *src, const char *op) {
    ds_device dd = ds_tensor_device(dst), sd = ds_tensor_device(src);
    if (!ds_device_equal(dd, sd)) {
        if (ds_device_transfer(op, ds_tensor_kview_w(dst, op), dd, ds_tensor_kview(src), sd)) return -1;
        if (dd.type != DS_DEV_CPU || !ds_fault_settle(sd)) return 0;
        char msg[640];
        snprintf(msg, sizeof msg, "%s", ds_error_message());
        return ds_fail(DS_ERR_ARG, "%s: %s", op, msg), -1;
    }
    if (ds_tensor_kernels(dst)->core->copy(ds_tensor_kview_w(dst, op), ds_tensor_kview(src)))
        return ds_fail(DS_ERR_STATE, "%s: %s", op, ds_kernel_error()), -1;
    return 0;
}

static int reshape_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    gin[0] = ds_reshape(g, n->next[0].ndim, n->next[0].shape);
    return gin[0] ? 0 : -1;
}

/* Fills the -1 entry and checks the element count. */
static int infer_shape(const char *op, ds_tensor *t, int ndim, const int64_t *in, int64_t *out) {
    int64_t known = 1;
    int infer = -1;
    bool wrapped = false;     /* sizes whose product overflows could wrap onto numel */
    char s[96];
    if (ndim > DS_MAX_DIMS) return ds_fail(DS_ERR_ARG, "%s: at most %d dims", op, DS_MAX_DIMS), -1;
    for (int i = 0; i < ndim; i++) {
        out[i] = in[i];
        if (in[i] == -1) {
            if (infer >= 0) return ds_fail(DS_ERR_ARG, "%s: only one dim can be -1", op), -1;
            infer = i;
        } else if (in[i] < 0) {
            return ds_fail(DS_ERR_ARG, "%s: invalid size %lld in dim %d", op, (long long)in[i], i + 1), -1;
        } else wrapped |= __builtin_mul_overflow(known, in[i], &known);
    }
    int64_t numel = ds_tensor_numel(t);
    if (infer >= 0 && known != 0 && numel % known == 0) out[infer] = numel / known;
    int64_t total = 1;
    for (int i = 0; i < ndim; i++) wrapped |= __builtin_mul_overflow(total, out[i], &total);
    for (int i = 0; i < ndim; i++) if (out[i] == 0) { total = 0; wrapped = false; }
    if (wrapped || total != numel || (infer >= 0 && known == 0)) {
        char want[96] = "[";
        for (int i = 0; i < ndim; i++)
            snprintf(want + strlen(want), sizeof want - strlen(want), i ? ",%lld" : "%lld", (long long)in[i]);
        strncat(want, "]", sizeof want - strlen(want) - 1);
        return ds_fail(DS_ERR_ARG, "%s: shape %s is invalid for a tensor of shape %s (%lld elements)",
                       op, want, ds_shape_str(t, s, sizeof s), (long long)numel), -1;
    }
    return 0;
}

/* Strides for viewing t as `shape` without a copy, as PyTorch's
 * computeStride does: each group of old dims that is contiguous in memory
 * may be split or merged freely. Returns false if a copy is needed. */
static bool view_strides(const ds_tensor *t, int ndim, const int64_t *shape, int64_t *stride) {
    int64_t numel = ds_tensor_numel(t);
    if (numel == 0 || t->ndim == 0) {
        int64_t s = 1;
        for (int i = ndim - 1; i >= 0; i--) { stride[i] = s; s *= shape[i] ? shape[i] : 1; }
        return true;
    }
    int view_d = ndim - 1;
    int64_t chunk = 1, tensor_numel = 1;
    int64_t base_stride = t->stride[t->ndim - 1];
    for (int d = t->ndim - 1; d >= 0; d--) {
        tensor_numel *= t->shape[d];
        if (d == 0 || (t->shape[d - 1] != 1 && t->stride[d - 1] != tensor_numel * base_stride)) {
            while (view_d >= 0 && (chunk < tensor_numel || shape[view_d] == 1)) {
                stride[view_d] = chunk * base_stride;
                chunk *= shape[view_d];
                view_d--;
            }
            if (chunk != tensor_numel) return false;
            if (d > 0) {
                base_stride = t->stride[d - 1];
                tensor_numel = 1;
                chunk = 1;
            }
        }
    }
    return view_d == -1;
}

static ds_tensor *view_impl(const char *op, ds_tensor *t, int ndim, const int64_t *in, bool may_copy) {
    int64_t shape[DS_MAX_DIMS], stride[DS_MAX_DIMS];
    if (infer_shape(op, t, ndim, in, shape)) return NULL;
    ds_tensor *out;
    if (view_strides(t, ndim, shape, stride)) {
        out = ds_tensor_view_of(t, ndim, shape, stride, t->offset);
    } else if (may_copy) {
        ds_tensor *c = ds_contiguous(t);
        out = c ? ds_view(c, ndim, shape) : NULL;
        ds_tensor_release(c);
        return out;   /* contiguous and view recorded the history */
    } else {
        char s[96];
        return ds_fail(DS_ERR_ARG, "%s: tensor of shape %s is not contiguous enough to view; use reshape",
                       op, ds_shape_str(t, s, sizeof s));
    }
    if (out) ds_autograd_record(op, reshape_backward, 1, &t, out);
    return out;
}

ds_tensor *ds_view(ds_tensor *t, int ndim, const int64_t *shape) {
    return view_impl("view", t, ndim, shape, false);
}

ds_tensor *ds_reshape(ds_tensor *t, int ndim, const int64_t *shape) {
    return view_impl("reshape", t, ndim, shape, true);
}

static int permute_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    int64_t inv[DS_MAX_DIMS];
    for (int i = 0; i < g->ndim; i++) inv[n->i[i]] = i;
    gin[0] = ds_permute(g, inv);
    return gin[0] ? 0 : -1;
}

ds_tensor *ds_permute(ds_tensor *t, const int64_t *perm) {
    int64_t shape[DS_MAX_DIMS], stride[DS_MAX_DIMS];
    bool used[DS_MAX_DIMS] = {0};
    for (int i = 0; i < t->ndim; i++) {
        int d = ds_tensor_dim(t, "permute", perm[i]);
        if (d < 0) return NULL;
        if (used[d]) return ds_fail(DS_ERR_ARG, "permute: dim %d repeated", d + 1);
        used[d] = true;
        shape[i] = t->shape[d];
        stride[i] = t->stride[d];
    }
    ds_tensor *out = ds_tensor_view_of(t, t->ndim, shape, stride, t->offset);
    ds_node *n = out ? ds_autograd_record("permute", permute_backward, 1, &t, out) : NULL;
    if (n)
        for (int i = 0; i < t->ndim; i++) n->i[i] = ds_tensor_dim(t, "permute", perm[i]);
    return out;
}

ds_tensor *ds_transpose(ds_tensor *t, int64_t d0, int64_t d1) {
    int a = ds_tensor_dim(t, "transpose", d0), b = a < 0 ? -1 : ds_tensor_dim(t, "transpose", d1);
    if (a < 0 || b < 0) return NULL;
    if (t->ndim == 0) { ds_tensor_retain(t); return t; }
    int64_t perm[DS_MAX_DIMS];
    for (int i = 0; i < t->ndim; i++) perm[i] = i;
    perm[a] = b;
    perm[b] = a;
    return ds_permute(t, perm);
}

static int narrow_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_edge *e = &n->next[0];
    ds_tensor *full = ds_tensor_full(e->ndim, e->shape, g->dtype, ds_tensor_device(g), 0);
    ds_tensor *slice = full ? ds_narrow(full, n->i[0], n->i[1], n->i[2]) : NULL;
    int rc = slice ? ds_copy_(slice, g) : -1;
    ds_tensor_release(slice);
    if (rc) { ds_tensor_release(full); return -1; }
    gin[0] = full;
    return 0;
}

ds_tensor *ds_narrow(ds_tensor *t, int64_t dim, int64_t start, int64_t length) {
    int d = ds_tensor_dim(t, "narrow", dim);
    if (d < 0) return NULL;
    if (t->ndim == 0) return ds_fail(DS_ERR_ARG, "narrow: cannot narrow a 0-dim tensor");
    int64_t size = t->shape[d], given = start;
    if (start < 0) start += size;
    if (start < 0 || start > size || length < 0 || length > size - start) {
        char s[96];
        return ds_fail(DS_ERR_ARG, "narrow: start %lld length %lld out of range for dim %d of shape %s",
                       ds_api_pos(given), (long long)length, d + 1, ds_shape_str(t, s, sizeof s));
    }
    int64_t shape[DS_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    shape[d] = length;
    ds_tensor *out = ds_tensor_view_of(t, t->ndim, shape, t->stride, t->offset + start * t->stride[d]);
    ds_node *n = out ? ds_autograd_record("narrow", narrow_backward, 1, &t, out) : NULL;
    if (n) { n->i[0] = d; n->i[1] = start; n->i[2] = length; }
    return out;
}

ds_tensor *ds_squeeze(ds_tensor *t, int64_t dim) {
    int d = ds_tensor_dim(t, "squeeze", dim);
    if (d < 0) return NULL;
    int64_t shape[DS_MAX_DIMS];
    int nd = 0;
    for (int i = 0; i < t->ndim; i++)
        if (i != d || t->shape[i] != 1) shape[nd++] = t->shape[i];
    return ds_reshape(t, nd, shape);
}

ds_tensor *ds_unsqueeze(ds_tensor *t, int64_t dim) {
    int64_t d = dim < 0 ? dim + t->ndim + 1 : dim;
    if (d < 0 || d > t->ndim || t->ndim >= DS_MAX_DIMS)
        return ds_fail(DS_ERR_ARG, "unsqueeze: dim %lld out of range for %d dims", ds_api_pos(dim), t->ndim);
    int64_t shape[DS_MAX_DIMS];
    for (int i = 0, j = 0; i <= t->ndim; i++) shape[i] = i == d ? 1 : t->shape[j++];
    return ds_reshape(t, t->ndim + 1, shape);
}

static int identity_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    (void)n;
    ds_tensor_retain(g);
    gin[0] = g;
    return 0;
}

ds_tensor *ds_clone(ds_tensor *t) {
    ds_tensor *out = ds_tensor_new_like(t);
    if (!out) return NULL;
    if (copy_kernel(out, t, "clone")) { ds_tensor_release(out); return NULL; }
    ds_autograd_record("clone", identity_backward, 1, &t, out);
    return out;
}

ds_tensor *ds_contiguous(ds_tensor *t) {
    if (ds_tensor_is_contiguous(t)) { ds_tensor_retain(t); return t; }
    return ds_clone(t);
}

static int cast_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    gin[0] = ds_to_dtype(g, n->next[0].dtype);
    return gin[0] ? 0 : -1;
}

ds_tensor *ds_to_dtype(ds_tensor *t, ds_dtype dtype) {
    if (t->dtype == dtype) { ds_tensor_retain(t); return t; }
    ds_tensor *out = ds_tensor_new(t->ndim, t->shape, dtype, ds_tensor_device(t));
    if (!out) return NULL;
    if (copy_kernel(out, t, "to")) { ds_tensor_release(out); return NULL; }
    if (ds_dtype_is_float(dtype) && ds_dtype_is_float(t->dtype))
        ds_autograd_record("to", cast_backward, 1, &t, out);
    return out;
}

static int to_device_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    gin[0] = ds_to_device(g, (ds_device){ (ds_device_type)n->i[0], (int)n->i[1] });
    return gin[0] ? 0 : -1;
}

ds_tensor *ds_to_device(ds_tensor *t, ds_device dev) {
    if (ds_device_equal(ds_tensor_device(t), dev)) { ds_tensor_retain(t); return t; }
    if (dev.type == DS_DEV_CUDA && ds_cuda_check_device("to", dev.index)) return NULL;
    ds_tensor *out = ds_tensor_new(t->ndim, t->shape, t->dtype, dev);
    if (!out) return NULL;
    if (copy_kernel(out, t, "to")) { ds_tensor_release(out); return NULL; }
    ds_node *n = ds_autograd_record("to", to_device_backward, 1, &t, out);
    if (n) {
        n->i[0] = ds_tensor_device(t).type;
        n->i[1] = ds_tensor_device(t).index;
    }
    return out;
}

ds_tensor *ds_detach(ds_tensor *t) {
    return ds_tensor_view_of(t, t->ndim, t->shape, t->stride, t->offset);
}

int ds_copy_(ds_tensor *dst, ds_tensor *src) {
    ds_tensor *e = ds_expand(src, dst->ndim, dst->shape);
    if (!e) return -1;
    int rc = copy_kernel(dst, e, "copy_");
    ds_tensor_release(e);
    return rc;
}

int ds_fill_(ds_tensor *dst, double v) {
    if (ds_tensor_kernels(dst)->core->fill(ds_tensor_kview_w(dst, "fill_"), v))
        return ds_fail(DS_ERR_STATE, "fill_: %s", ds_kernel_error()), -1;
    return 0;
}

ds_tensor *ds_new_in_order(const ds_tensor *g, const int64_t *order) {
    int64_t mem_shape[DS_MAX_DIMS], stride[DS_MAX_DIMS], step = 1;
    for (int k = g->ndim - 1; k >= 0; k--) {
        mem_shape[k] = g->shape[order[k]];
        stride[order[k]] = step;
        step *= g->shape[order[k]];
    }
    ds_tensor *mem = ds_tensor_new(g->ndim, mem_shape, g->dtype, ds_tensor_device(g));
    ds_tensor *t = mem ? ds_tensor_view_of(mem, g->ndim, g->shape, stride, 0) : NULL;
    ds_tensor_release(mem);
    return t;
}

void ds_dims_by_stride(const ds_tensor *x, int64_t *order) {
    for (int i = 0; i < x->ndim; i++) {
        int j = i;
        for (; j > 0 && x->stride[order[j - 1]] < x->stride[i]; j--) order[j] = order[j - 1];
        order[j] = i;
    }
}
