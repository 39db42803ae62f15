#include "ds_ops.h"
#include "ds_error.h"

#include <math.h>
#include <string.h>

static const char *const reduce_names[DS_NREDUCE] = {
    "sum", "mean", "max", "min", "argmax", "argmin", "var", "norm",
};

/* Which dims are reduced, as a mask; false with the error set on bad dims. */
static bool reduced_mask(const char *op, ds_tensor *t, int ndims, const int64_t *dims, bool *mask) {
    memset(mask, 0, sizeof(bool) * DS_MAX_DIMS);
    if (ndims < 0 || !dims) {
        for (int i = 0; i < t->ndim; i++) mask[i] = true;
        return true;
    }
    for (int k = 0; k < ndims; k++) {
        int d = ds_tensor_dim(t, op, dims[k]);
        if (d < 0) return false;
        if (t->ndim && mask[d]) { ds_fail(DS_ERR_ARG, "%s: dim %d listed twice", op, d + 1); return false; }
        if (t->ndim) mask[d] = true;
    }
    return true;
}

static ds_dtype result_dtype(ds_reduce_op op, ds_dtype in) {
    if (op == DS_RED_ARGMAX || op == DS_RED_ARGMIN) return DS_I64;
    if (op == DS_RED_MAX || op == DS_RED_MIN) return in;
    if (ds_dtype_is_float(in)) return in;
    return op == DS_RED_SUM ? DS_I64 : DS_F32;
}

/* Runs the kernel: the reduced dims are brought together (a permute and a
 * copy only when they are not already one block) and read as [outer,n,inner]. */
static ds_tensor *reduce_raw(ds_reduce_op op, ds_tensor *t, const bool *mask, bool keepdim, double param) {
    int first = -1, last = -1;
    bool block = true;
    for (int i = 0; i < t->ndim; i++)
        if (mask[i]) { if (first < 0) first = i; else if (last != i - 1) block = false; last = i; }
    int64_t perm[DS_MAX_DIMS], outer = 1, n = 1, inner = 1;
    ds_tensor *src;
    if (block) {
        src = ds_contiguous(t);
        for (int i = 0; i < t->ndim; i++) {
            if (mask[i]) n *= t->shape[i];
            else if (first < 0 || i < first) outer *= t->shape[i];
            else inner *= t->shape[i];
        }
    } else {
        int k = 0;
        for (int i = 0; i < t->ndim; i++) if (!mask[i]) { perm[k++] = i; outer *= t->shape[i]; }
        for (int i = 0; i < t->ndim; i++) if (mask[i]) { perm[k++] = i; n *= t->shape[i]; }
        ds_tensor *p = ds_permute(t, perm);
        src = p ? ds_contiguous(p) : NULL;
        ds_tensor_release(p);
    }
    if (!src) return NULL;
    int64_t shape[DS_MAX_DIMS];
    int nd = 0;
    for (int i = 0; i < t->ndim; i++)
        if (!mask[i]) shape[nd++] = t->shape[i];
        else if (keepdim) shape[nd++] = 1;
    ds_tensor *out = ds_tensor_new(nd, shape, result_dtype(op, t->dtype), ds_tensor_device(t));
    if (out && ds_tensor_kernels(t)->reduce->reduce(op, ds_tensor_kview(out), ds_tensor_kview(src),
                                                    outer, n, inner, param)) {
        char s[96];
        ds_fail(DS_ERR_ARG, "%s: %s (shape %s)", reduce_names[op], ds_kernel_error(), ds_shape_str(t, s, sizeof s));
        ds_tensor_release(out);
        out = NULL;
    }
    ds_tensor_release(src);
    return out;
}

/* g (and the saved output) reshaped with the reduced dims kept as 1, then
 * broadcast back over the input. */
static ds_tensor *unreduce(ds_node *n, ds_tensor *g) {
    const ds_edge *e = &n->next[0];
    int64_t shape[DS_MAX_DIMS];
    for (int i = 0; i < e->ndim; i++) shape[i] = (n->i[0] >> i) & 1 ? 1 : e->shape[i];
    ds_tensor *k = ds_reshape(g, e->ndim, shape);
    ds_tensor *x = k ? ds_expand(k, e->ndim, e->shape) : NULL;
    ds_tensor_release(k);
    return x;
}

static int64_t reduced_count(ds_node *n) {
    int64_t c = 1;
    for (int i = 0; i < n->next[0].ndim; i++)
        if ((n->i[0] >> i) & 1) c *= n->next[0].shape[i];
    return c;
}

static int reduce_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_reduce_op op = (ds_reduce_op)n->i[1];
    ds_tensor *x = n->saved[0], *y = n->saved[1];
    ds_tensor *ge = unreduce(n, g), *r = NULL;
    if (!ge) return -1;
    double count = (double)reduced_count(n);
    switch (op) {
    case DS_RED_SUM: r = ds_contiguous(ge); break;
    case DS_RED_MEAN: r = ds_mul_scalar(ge, 1.0 / count); break;
    case DS_RED_MAX: case DS_RED_MIN: {
        /* ties share the gradient evenly, as amax/amin do */
        ds_tensor *ye = unreduce(n, y);
        ds_tensor *hit = ye ? ds_binary(DS_BIN_EQ, x, ye) : NULL;
        ds_tensor *hf = hit ? ds_to_dtype(hit, g->dtype) : NULL;
        int64_t all[DS_MAX_DIMS];
        int k = 0;
        for (int i = 0; i < x->ndim; i++) if ((n->i[0] >> i) & 1) all[k++] = i;
        ds_tensor *cnt = hf ? ds_sum(hf, k, all, true) : NULL;
        ds_tensor *share = cnt ? ds_div(hf, cnt) : NULL;
        r = share ? ds_mul(ge, share) : NULL;
        ds_tensor_release(ye); ds_tensor_release(hit); ds_tensor_release(hf);
        ds_tensor_release(cnt); ds_tensor_release(share);
        break;
    }
    case DS_RED_VAR: {
        /* d var / dx = 2 (x - mean) / (count - correction) */
        int64_t all[DS_MAX_DIMS];
        int k = 0;
        for (int i = 0; i < x->ndim; i++) if ((n->i[0] >> i) & 1) all[k++] = i;
        ds_tensor *mu = ds_mean(x, k, all, true);
        ds_tensor *c = mu ? ds_sub(x, mu) : NULL;
        ds_tensor *s = c ? ds_mul_scalar(c, 2.0 / (count - n->f[0])) : NULL;
        r = s ? ds_mul(ge, s) : NULL;
        ds_tensor_release(mu); ds_tensor_release(c); ds_tensor_release(s);
        break;
    }
    case DS_RED_NORM: {
        /* d ||x||_p / dx = sign(x) |x|^(p-1) / ||x||^(p-1) */
        double p = n->f[0];
        ds_tensor *ye = unreduce(n, y);
        ds_tensor *ax = ds_unary(DS_UN_ABS, x, 0);
        ds_tensor *num = NULL, *den = NULL;
        if (ye && ax) {
            if (p == 2) { num = ds_clone(x); den = ds_contiguous(ye); }
            else if (p == 1) { num = ds_div(x, ax); den = ds_scalar_like(x, 1); }
            else {
                ds_tensor *pw = ds_unary(DS_UN_POW_SCALAR, ax, p - 1);
                ds_tensor *sg = pw ? ds_div(x, ax) : NULL;
                num = sg ? ds_mul(sg, pw) : NULL;
                den = ds_unary(DS_UN_POW_SCALAR, ye, p - 1);
                ds_tensor_release(pw); ds_tensor_release(sg);
            }
        }
        ds_tensor *q = num && den ? ds_div(num, den) : NULL;
        ds_tensor *zero = q ? ds_scalar_like(q, 0) : NULL;
        ds_tensor *isnan = q ? ds_binary(DS_BIN_NE, q, q) : NULL;   /* 0/0 at x = 0: subgradient 0 */
        ds_tensor *safe = isnan && zero ? ds_where(isnan, zero, q) : NULL;
        r = safe ? ds_mul(ge, safe) : NULL;
        ds_tensor_release(ye); ds_tensor_release(ax); ds_tensor_release(num); ds_tensor_release(den);
        ds_tensor_release(q); ds_tensor_release(zero); ds_tensor_release(isnan); ds_tensor_release(safe);
        break;
    }
    default: break;
    }
    ds_tensor_release(ge);
    gin[0] = r;
    return r ? 0 : -1;
}

ds_tensor *ds_reduce(ds_reduce_op op, ds_tensor *t, int ndims, const int64_t *dims, bool keepdim, double param) {
    bool mask[DS_MAX_DIMS];
    if (!reduced_mask(reduce_names[op], t, ndims, dims, mask)) return NULL;
    if ((op == DS_RED_VAR || op == DS_RED_NORM || op == DS_RED_MEAN) && !ds_dtype_is_float(t->dtype)) {
        return ds_fail(DS_ERR_ARG, "%s: needs a floating point tensor, got %s", reduce_names[op],
                       ds_dtype_name(t->dtype));
    }
    ds_tensor *out = reduce_raw(op, t, mask, keepdim, param);
    if (!out || op == DS_RED_ARGMAX || op == DS_RED_ARGMIN) return out;
    ds_node *n = ds_autograd_record(reduce_names[op], reduce_backward, 1, &t, out);
    if (n) {
        for (int i = 0; i < t->ndim; i++) if (mask[i]) n->i[0] |= (int64_t)1 << i;
        n->i[1] = op;
        n->f[0] = param;
        if (op != DS_RED_SUM && op != DS_RED_MEAN && (ds_node_save(n, 0, t) || ds_node_save(n, 1, out))) {
            ds_tensor_release(out);
            return NULL;
        }
    }
    return out;
}

ds_tensor *ds_sum(ds_tensor *t, int nd, const int64_t *dims, bool keep) { return ds_reduce(DS_RED_SUM, t, nd, dims, keep, 0); }
ds_tensor *ds_mean(ds_tensor *t, int nd, const int64_t *dims, bool keep) { return ds_reduce(DS_RED_MEAN, t, nd, dims, keep, 0); }
ds_tensor *ds_amax(ds_tensor *t, int nd, const int64_t *dims, bool keep) { return ds_reduce(DS_RED_MAX, t, nd, dims, keep, 0); }

ds_tensor *ds_var(ds_tensor *t, int nd, const int64_t *dims, double correction, bool keep) {
    return ds_reduce(DS_RED_VAR, t, nd, dims, keep, correction);
}

ds_tensor *ds_norm(ds_tensor *t, double p, int nd, const int64_t *dims, bool keep) {
    return ds_reduce(DS_RED_NORM, t, nd, dims, keep, p);
}
