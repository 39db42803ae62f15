#include "ds_ops.h"
#include "ds_error.h"
#include "ds_fault.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* bf16 and f16 sums (gradients of indexing, scatter_add) run in f32:
 * adding many rows in a 2-byte float would lose most of them. */
static ds_dtype accumulate_dtype(ds_dtype t) {
    return t == DS_BF16 || t == DS_F16 ? DS_F32 : t;
}

static int kernel_status(int rc, const char *op) {
    if (rc) ds_fail(DS_ERR_STATE, "%s: %s", op, ds_kernel_error());
    return rc ? -1 : 0;
}

static int check_device(const char *op, const char *name, ds_tensor *t, const char *base_name, ds_tensor *base) {
    if (ds_device_equal(ds_tensor_device(t), ds_tensor_device(base))) return 0;
    char d1[16], d2[16], s1[96], s2[96];
    ds_device_name(ds_tensor_device(t), d1, sizeof d1);
    ds_device_name(ds_tensor_device(base), d2, sizeof d2);
    ds_fail(DS_ERR_ARG, "%s: %s (shape %s) is on %s but %s (shape %s) is on %s", op, name,
            ds_shape_str(t, s1, sizeof s1), d1, base_name, ds_shape_str(base, s2, sizeof s2), d2);
    return -1;
}

/* What a failed index check names: kept by value, since on a GPU the
 * answer comes after the call has returned. */
typedef struct {
    const char *op, *idx_name, *x_name;      /* string literals */
    int64_t limit;
    int idx_ndim, x_ndim;
    int64_t idx_shape[DS_MAX_DIMS], x_shape[DS_MAX_DIMS];
} index_check;

static void describe_index_hit(char *buf, size_t n, const void *ctx, ds_index_hit hit) {
    const index_check *c = ctx;
    int64_t coord[DS_MAX_DIMS], pos = hit.pos;
    for (int i = c->idx_ndim - 1; i >= 0; i--) {
        coord[i] = pos % c->idx_shape[i] + 1;
        pos /= c->idx_shape[i];
    }
    char at[160], is[160], xs[160];
    ds_dims_str(c->idx_ndim, coord, at, sizeof at);
    ds_dims_str(c->idx_ndim, c->idx_shape, is, sizeof is);
    ds_dims_str(c->x_ndim, c->x_shape, xs, sizeof xs);
    snprintf(buf, n, "%s: %s value %lld at position (%s) of %s [%s] is out of range [0, %lld) for %s of "
             "shape [%s]", c->op, c->idx_name, (long long)hit.value, at, c->idx_name, is, (long long)c->limit,
             c->x_name, xs);
}

int ds_check_index(const char *op, ds_tensor *idx, const char *idx_name, ds_tensor *x, const char *x_name,
                   int64_t limit, const int64_t *skip) {
    char s1[96];
    if (idx->dtype != DS_I64 && idx->dtype != DS_I32) {
        ds_fail(DS_ERR_ARG, "%s: %s must be i64 or i32, got %s of shape %s", op, idx_name,
                ds_dtype_name(idx->dtype), ds_shape_str(idx, s1, sizeof s1));
        return -1;
    }
    if (check_device(op, idx_name, idx, x_name, x)) return -1;
    index_check c = { op, idx_name, x_name, limit, idx->ndim, x->ndim, { 0 }, { 0 } };
    memcpy(c.idx_shape, idx->shape, (size_t)idx->ndim * sizeof *idx->shape);
    memcpy(c.x_shape, x->shape, (size_t)x->ndim * sizeof *x->shape);
    ds_device dev = ds_tensor_device(idx);
    ds_index_hit *hit = ds_fault_open(dev, describe_index_hit, &c, sizeof c);
    if (!hit) return -1;
    if (kernel_status(ds_tensor_kernels(idx)->index->check_index(ds_tensor_kview(idx), limit, skip, hit), op)) {
        hit->pos = -1;            /* the device will not write it */
        return -1;
    }
    return dev.type == DS_DEV_CPU ? ds_fault_close(dev, hit) : 0;
}

/* x's slices along d picked by the 1-D idx, into a new tensor. */
static ds_tensor *index_select_raw(ds_tensor *x, int d, ds_tensor *idx, const char *op) {
    int64_t shape[DS_MAX_DIMS], outer = 1, inner = 1;
    for (int i = 0; i < x->ndim; i++) {
        shape[i] = x->shape[i];
        if (i < d) outer *= x->shape[i];
        else if (i > d) inner *= x->shape[i];
    }
    shape[d] = ds_tensor_numel(idx);
    ds_tensor *xc = ds_contiguous(x);
    ds_tensor *out = xc ? ds_tensor_new(x->ndim, shape, x->dtype, ds_tensor_device(x)) : NULL;
    if (out && kernel_status(ds_tensor_kernels(x)->index->index_select(ds_tensor_kview(out), ds_tensor_kview(xc),
                                                                       ds_tensor_kview(idx), outer, x->shape[d], inner), op)) {
        ds_tensor_release(out);
        out = NULL;
    }
    ds_tensor_release(xc);
    return out;
}

/* Zeros shaped like the edge's input with g's slices along d added at
 * idx: the gradient of index_select and embedding. */
static ds_tensor *index_add_raw(const ds_edge *e, int d, ds_tensor *idx, ds_tensor *g, const char *op) {
    int64_t outer = 1, inner = 1;
    for (int i = 0; i < e->ndim; i++) {
        if (i < d) outer *= e->shape[i];
        else if (i > d) inner *= e->shape[i];
    }
    ds_dtype acc = accumulate_dtype(e->dtype);
    ds_tensor *sum = ds_tensor_full(e->ndim, e->shape, acc, ds_tensor_device(g), 0);
    ds_tensor *gt = sum ? ds_to_dtype(g, acc) : NULL;
    ds_tensor *gc = gt ? ds_contiguous(gt) : NULL;
    int rc = gc ? kernel_status(ds_tensor_kernels(g)->index->index_add(ds_tensor_kview(sum), ds_tensor_kview(gc),
                                                                      ds_tensor_kview(idx), outer, e->shape[d], inner), op)
                : -1;
    ds_tensor_release(gt);
    ds_tensor_release(gc);
    if (rc) { ds_tensor_release(sum); return NULL; }
    if (acc == e->dtype) return sum;
    ds_tensor *out = ds_to_dtype(sum, e->dtype);
    ds_tensor_release(sum);
    return out;
}

static int embedding_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *ids = n->saved[0];     /* flattened */
    int64_t shape[2] = { ds_tensor_numel(ids), n->next[0].shape[1] };
    ds_tensor *rows = ds_reshape(g, 2, shape);
    gin[0] = rows ? index_add_raw(&n->next[0], 0, ids, rows, "embedding") : NULL;
    ds_tensor_release(rows);
    return gin[0] ? 0 : -1;
}

ds_tensor *ds_embedding(ds_tensor *weight, ds_tensor *ids) {
    char s1[96], s2[96];
    if (weight->ndim != 2)
        return ds_fail(DS_ERR_ARG, "embedding: weight must be 2-D [V, D], got shape %s (ids %s)",
                       ds_shape_str(weight, s1, sizeof s1), ds_shape_str(ids, s2, sizeof s2));
    if (ids->ndim >= DS_MAX_DIMS)
        return ds_fail(DS_ERR_ARG, "embedding: ids of shape %s leave no room for the embedding dim",
                       ds_shape_str(ids, s1, sizeof s1));
    if (ds_check_index("embedding", ids, "ids", weight, "weight", weight->shape[0], NULL)) return NULL;
    bool was = ds_set_grad_enabled(false);
    int64_t all = -1, shape[DS_MAX_DIMS];
    memcpy(shape, ids->shape, sizeof shape);
    shape[ids->ndim] = weight->shape[1];
    ds_tensor *flat = ds_reshape(ids, 1, &all);
    ds_tensor *rows = flat ? index_select_raw(weight, 0, flat, "embedding") : NULL;
    ds_tensor *out = rows ? ds_reshape(rows, ids->ndim + 1, shape) : NULL;
    ds_set_grad_enabled(was);
    ds_tensor_release(rows);
    ds_node *n = out ? ds_autograd_record("embedding", embedding_backward, 1, &weight, out) : NULL;
    if (n && ds_node_save(n, 0, flat)) {
        ds_tensor_release(out);
        out = NULL;
    }
    ds_tensor_release(flat);
    return out;
}

static int index_select_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    gin[0] = index_add_raw(&n->next[0], (int)n->i[0], n->saved[0], g, "index_select");
    return gin[0] ? 0 : -1;
}

ds_tensor *ds_index_select(ds_tensor *x, int64_t dim, ds_tensor *index) {
    char s1[96], s2[96];
    int d = ds_tensor_dim(x, "index_select", dim);
    if (d < 0) return NULL;
    if (x->ndim == 0) return ds_fail(DS_ERR_ARG, "index_select: x must have at least 1 dim, got a 0-dim tensor");
    if (index->ndim > 1)
        return ds_fail(DS_ERR_ARG, "index_select: index must be 1-D, got shape %s (x has shape %s)",
                       ds_shape_str(index, s1, sizeof s1), ds_shape_str(x, s2, sizeof s2));
    if (ds_check_index("index_select", index, "index", x, "x", x->shape[d], NULL)) return NULL;
    bool was = ds_set_grad_enabled(false);
    ds_tensor *out = index_select_raw(x, d, index, "index_select");
    ds_set_grad_enabled(was);
    ds_node *n = out ? ds_autograd_record("index_select", index_select_backward, 1, &x, out) : NULL;
    if (n) {
        n->i[0] = d;
        if (ds_node_save(n, 0, index)) { ds_tensor_release(out); return NULL; }
    }
    return out;
}

/* index must have x's dims and, outside d, no larger sizes; for
 * scatter_add also no larger sizes than src anywhere. */
static int check_fits(const char *op, ds_tensor *index, ds_tensor *x, int d, ds_tensor *src) {
    char s1[96], s2[96], s3[96];
    if (x->ndim == 0) {
        ds_fail(DS_ERR_ARG, "%s: x must have at least 1 dim, got a 0-dim tensor", op);
        return -1;
    }
    bool ok = index->ndim == x->ndim && (!src || src->ndim == x->ndim);
    for (int i = 0; ok && i < x->ndim; i++)
        if ((i != d && index->shape[i] > x->shape[i]) || (src && index->shape[i] > src->shape[i])) ok = false;
    if (ok) return 0;
    if (src)
        ds_fail(DS_ERR_ARG, "%s: index of shape %s must have as many dims as x %s and src %s, sizes no larger "
                "than src's, and no larger than x's outside the scattered dim", op, ds_shape_str(index, s1, sizeof s1),
                ds_shape_str(x, s2, sizeof s2), ds_shape_str(src, s3, sizeof s3));
    else
        ds_fail(DS_ERR_ARG, "%s: index of shape %s must have as many dims as x %s, and sizes no larger than x's "
                "outside the gathered dim", op, ds_shape_str(index, s1, sizeof s1), ds_shape_str(x, s2, sizeof s2));
    return -1;
}

/* out[p] = x[p with coordinate d replaced by idx[p]] for the positions p
 * of idx; out may be larger than idx (the rest is left alone). */
static int gather_into(ds_tensor *out, ds_tensor *x, int d, ds_tensor *idx, const char *op) {
    ds_kview ov = ds_tensor_kview(out);
    memcpy(ov.shape, idx->shape, sizeof ov.shape);
    return kernel_status(ds_tensor_kernels(x)->index->gather(ov, ds_tensor_kview(x), ds_tensor_kview(idx), d), op);
}

/* base (zeros when NULL) with src added at idx along d, in a new tensor
 * of the given geometry and dtype. */
static ds_tensor *scatter_add_raw(ds_tensor *base, int ndim, const int64_t *shape, ds_dtype dt, int d,
                                  ds_tensor *idx, ds_tensor *src, const char *op) {
    ds_dtype acc = accumulate_dtype(dt);
    ds_tensor *sum = base ? ds_tensor_new(ndim, shape, acc, ds_tensor_device(src))
                          : ds_tensor_full(ndim, shape, acc, ds_tensor_device(src), 0);
    int rc = sum ? 0 : -1;
    if (rc == 0 && base) rc = ds_copy_(sum, base);
    ds_tensor *s = rc == 0 ? ds_to_dtype(src, acc) : NULL;
    rc = s ? kernel_status(ds_tensor_kernels(src)->index->scatter_add(ds_tensor_kview(sum), ds_tensor_kview(s),
                                                                     ds_tensor_kview(idx), d), op)
           : -1;
    ds_tensor_release(s);
    if (rc) { ds_tensor_release(sum); return NULL; }
    if (acc == dt) return sum;
    ds_tensor *out = ds_to_dtype(sum, dt);
    ds_tensor_release(sum);
    return out;
}

static int gather_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    const ds_edge *e = &n->next[0];
    gin[0] = scatter_add_raw(NULL, e->ndim, e->shape, e->dtype, (int)n->i[0], n->saved[0], g, "gather");
    return gin[0] ? 0 : -1;
}

ds_tensor *ds_gather(ds_tensor *x, int64_t dim, ds_tensor *index) {
    int d = ds_tensor_dim(x, "gather", dim);
    if (d < 0 || check_fits("gather", index, x, d, NULL) ||
        ds_check_index("gather", index, "index", x, "x", x->shape[d], NULL)) return NULL;
    ds_tensor *out = ds_tensor_new(index->ndim, index->shape, x->dtype, ds_tensor_device(x));
    if (!out) return NULL;
    if (gather_into(out, x, d, index, "gather")) { ds_tensor_release(out); return NULL; }
    ds_node *n = ds_autograd_record("gather", gather_backward, 1, &x, out);
    if (n) {
        n->i[0] = d;
        if (ds_node_save(n, 0, index)) { ds_tensor_release(out); return NULL; }
    }
    return out;
}

/* x's gradient passes through; src's is g gathered at the index, zero
 * where src reaches past the index. */
static int scatter_add_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    const ds_edge *e = &n->next[1];
    ds_tensor *idx = n->saved[0];
    if (ds_node_needs_grad(n, 0)) { ds_tensor_retain(g); gin[0] = g; }
    if (!e->node && !e->leaf) return 0;
    bool covered = idx->ndim == e->ndim && memcmp(idx->shape, e->shape, sizeof(int64_t) * (size_t)e->ndim) == 0;
    gin[1] = covered ? ds_tensor_new(e->ndim, e->shape, g->dtype, ds_tensor_device(g))
                     : ds_tensor_full(e->ndim, e->shape, g->dtype, ds_tensor_device(g), 0);
    return gin[1] ? gather_into(gin[1], g, (int)n->i[0], idx, "scatter_add") : -1;
}

ds_tensor *ds_scatter_add(ds_tensor *x, int64_t dim, ds_tensor *index, ds_tensor *src) {
    char s1[96], s2[96];
    int d = ds_tensor_dim(x, "scatter_add", dim);
    if (d < 0) return NULL;
    if (src->dtype != x->dtype)
        return ds_fail(DS_ERR_ARG, "scatter_add: src is %s but x is %s (shapes %s and %s)", ds_dtype_name(src->dtype),
                       ds_dtype_name(x->dtype), ds_shape_str(src, s1, sizeof s1), ds_shape_str(x, s2, sizeof s2));
    if (check_device("scatter_add", "src", src, "x", x) || check_fits("scatter_add", index, x, d, src) ||
        ds_check_index("scatter_add", index, "index", x, "x", x->shape[d], NULL)) return NULL;
    bool was = ds_set_grad_enabled(false);
    ds_tensor *out = scatter_add_raw(x, x->ndim, x->shape, x->dtype, d, index, src, "scatter_add");
    ds_set_grad_enabled(was);
    ds_tensor *inputs[2] = { x, src };
    ds_node *n = out ? ds_autograd_record("scatter_add", scatter_add_backward, 2, inputs, out) : NULL;
    if (n) {
        n->i[0] = d;
        if (ds_node_save(n, 0, index)) { ds_tensor_release(out); return NULL; }
    }
    return out;
}

/* Each input that needs a gradient gets its slice of g, in its own dtype. */
static int cat_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    int d = (int)n->i[0];
    int64_t start = 0;
    for (int k = 0; k < n->n_inputs; k++) {
        const ds_edge *e = &n->next[k];
        if (e->node || e->leaf) {
            /* a view of g, as a transpose's gradient is: whoever needs it
             * contiguous copies it */
            ds_tensor *piece = ds_narrow(g, d, start, e->shape[d]);
            gin[k] = piece && piece->dtype != e->dtype ? ds_to_dtype(piece, e->dtype) : piece;
            if (gin[k] != piece) ds_tensor_release(piece);
            if (!gin[k]) return -1;
        }
        start += e->shape[d];
    }
    return 0;
}

/* A node has at most DS_NODE_MAX_INPUTS inputs, so a cat of more tensors
 * records a tree: inputs are grouped, each group's node is recorded on a
 * view of the slice of `out` the group filled, and those views are grouped
 * again until one node on `out` remains. The views cost no copies, every
 * input keeps its edge, and backward narrows g down the tree. */
static int record_cat(ds_tensor *out, int d, int n, ds_tensor *const *ts) {
    bool any = false;
    for (int k = 0; k < n; k++) any = any || ts[k]->requires_grad;
    if (!any || !ds_grad_enabled()) return 0;
    ds_tensor **cur = malloc(sizeof *cur * (size_t)n);
    int64_t *at = malloc(sizeof *at * (size_t)(n + 1));
    if (!cur || !at) {
        free(cur);
        free(at);
        ds_fail(DS_ERR_NOMEM, "cat: out of memory recording %d inputs", n);
        return -1;
    }
    at[0] = 0;
    for (int k = 0; k < n; k++) {        /* every level holds its own references */
        cur[k] = ts[k];
        ds_tensor_retain(cur[k]);
        at[k + 1] = at[k] + ts[k]->shape[d];
    }
    int count = n, rc = 0;
    while (count > DS_NODE_MAX_INPUTS && rc == 0) {
        int groups = 0;
        for (int lo = 0; lo < count; lo += DS_NODE_MAX_INPUTS, groups++) {
            int hi = lo + DS_NODE_MAX_INPUTS < count ? lo + DS_NODE_MAX_INPUTS : count;
            int64_t shape[DS_MAX_DIMS];
            memcpy(shape, out->shape, sizeof shape);
            shape[d] = at[hi] - at[lo];
            ds_tensor *p = ds_tensor_view_of(out, out->ndim, shape, out->stride, out->offset + at[lo] * out->stride[d]);
            if (p) {
                ds_node *node = ds_autograd_record("cat", cat_backward, hi - lo, cur + lo, p);
                if (node) node->i[0] = d;
            } else rc = -1;
            for (int k = lo; k < hi; k++) ds_tensor_release(cur[k]);
            cur[groups] = p;             /* groups <= lo: those slots are consumed */
            at[groups] = at[lo];
        }
        at[groups] = at[count];
        count = groups;
    }
    if (rc == 0) {
        ds_node *node = ds_autograd_record("cat", cat_backward, count, cur, out);
        if (node) node->i[0] = d;
    }
    for (int k = 0; k < count; k++) ds_tensor_release(cur[k]);
    free(cur);
    free(at);
    return rc;
}

ds_tensor *ds_cat(int n, ds_tensor *const *ts, int64_t dim) {
    char s1[96], s2[96], d1[16], d2[16];
    if (n < 1) return ds_fail(DS_ERR_ARG, "cat: needs at least one tensor");
    ds_tensor *a = ts[0];
    if (a->ndim == 0) return ds_fail(DS_ERR_ARG, "cat: tensor 1 of %d is 0-dim; only tensors with dims can be joined", n);
    int d = ds_tensor_dim(a, "cat", dim);
    if (d < 0) return NULL;
    int64_t shape[DS_MAX_DIMS];
    memcpy(shape, a->shape, sizeof shape);
    shape[d] = 0;
    ds_dtype dt = a->dtype;
    for (int k = 0; k < n; k++) {
        ds_tensor *t = ts[k];
        if (!ds_device_equal(ds_tensor_device(t), ds_tensor_device(a))) {
            ds_device_name(ds_tensor_device(t), d1, sizeof d1);
            ds_device_name(ds_tensor_device(a), d2, sizeof d2);
            return ds_fail(DS_ERR_ARG, "cat: tensor %d of %d (shape %s) is on %s but tensor 1 (shape %s) is on %s",
                           k + 1, n, ds_shape_str(t, s1, sizeof s1), d1, ds_shape_str(a, s2, sizeof s2), d2);
        }
        bool ok = t->ndim == a->ndim;
        for (int i = 0; ok && i < a->ndim; i++) ok = i == d || t->shape[i] == a->shape[i];
        if (!ok)
            return ds_fail(DS_ERR_ARG, "cat: tensor %d of %d has shape %s but tensor 1 has shape %s; sizes must match "
                           "except in the joined dim", k + 1, n, ds_shape_str(t, s1, sizeof s1), ds_shape_str(a, s2, sizeof s2));
        shape[d] += t->shape[d];
        dt = ds_promote(dt, t->dtype);
    }
    ds_tensor *out = ds_tensor_new(a->ndim, shape, dt, ds_tensor_device(a));
    if (!out) return NULL;
    /* each input is copied (and cast) straight into its slice of out */
    ds_kview slice = ds_tensor_kview(out);
    for (int k = 0; k < n; k++) {
        slice.shape[d] = ts[k]->shape[d];
        if (kernel_status(ds_tensor_kernels(out)->core->copy(slice, ds_tensor_kview(ts[k])), "cat")) {
            ds_tensor_release(out);
            return NULL;
        }
        slice.data = (char *)slice.data + ts[k]->shape[d] * out->stride[d] * (int64_t)ds_dtype_size(dt);
    }
    if (record_cat(out, d, n, ts)) { ds_tensor_release(out); return NULL; }
    return out;
}

ds_tensor *ds_stack(int n, ds_tensor *const *ts, int64_t dim) {
    char s1[96], s2[96];
    if (n < 1) return ds_fail(DS_ERR_ARG, "stack: needs at least one tensor");
    int nd = ts[0]->ndim;
    int64_t d = dim < 0 ? dim + nd + 1 : dim;
    if (d < 0 || d > nd || nd >= DS_MAX_DIMS)
        return ds_fail(DS_ERR_ARG, "stack: dim %lld out of range for tensors of shape %s", ds_api_pos(dim),
                       ds_shape_str(ts[0], s1, sizeof s1));
    for (int k = 1; k < n; k++)
        if (!ds_tensor_same_shape(ts[k], ts[0]))
            return ds_fail(DS_ERR_ARG, "stack: tensor %d of %d has shape %s but tensor 1 has shape %s; all must match",
                           k + 1, n, ds_shape_str(ts[k], s1, sizeof s1), ds_shape_str(ts[0], s2, sizeof s2));
    ds_tensor **us = calloc((size_t)n, sizeof *us);
    if (!us) return ds_fail(DS_ERR_NOMEM, "stack: out of memory for %d tensors", n);
    bool ok = true;
    for (int k = 0; k < n && ok; k++) ok = (us[k] = ds_unsqueeze(ts[k], d)) != NULL;
    ds_tensor *out = ok ? ds_cat(n, us, d) : NULL;
    for (int k = 0; k < n; k++) ds_tensor_release(us[k]);
    free(us);
    return out;
}

/* Slice k of the repeats in g viewed as [..., n, rep, ...] */
static ds_tensor *repeat_slice(ds_tensor *split, int d, int64_t k) {
    ds_tensor *piece = ds_narrow(split, d + 1, k, 1), *one = piece ? ds_squeeze(piece, d + 1) : NULL;
    ds_tensor_release(piece);
    return one;
}

/* Each slice's rep gradients summed in order, each sum rounded as an add
 * rounds it (the add kernel, into the input's layout): what autograd sums
 * for a cat of rep views of one tensor. */
static int repeat_interleave_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    int d = (int)n->f[0], nd = n->next[0].ndim;
    int64_t rep = (int64_t)n->f[1], shape[DS_MAX_DIMS];
    for (int i = 0, j = 0; i < nd; i++) {
        shape[j++] = n->next[0].shape[i];
        if (i == d) shape[j++] = rep;
    }
    ds_tensor *split = ds_reshape(g, nd + 1, shape), *first = split ? repeat_slice(split, d, 0) : NULL;
    ds_tensor *acc = first && rep > 1 ? ds_new_in_order(first, n->i) : first;
    int rc = acc ? 0 : -1;
    for (int64_t k = 1; rc == 0 && k < rep; k++) {
        ds_tensor *one = repeat_slice(split, d, k);
        rc = one ? ds_tensor_kernels(acc)->elementwise->binary(DS_BIN_ADD, ds_tensor_kview_w(acc, "add"),
                                                                 ds_tensor_kview(k == 1 ? first : acc),
                                                                 ds_tensor_kview(one)) : -1;
        if (one && rc) ds_fail(DS_ERR_STATE, "repeat_interleave: %s", ds_kernel_error());
        ds_tensor_release(one);
    }
    if (acc != first) ds_tensor_release(first);
    ds_tensor_release(split);
    if (rc) { ds_tensor_release(acc); return -1; }
    gin[0] = acc;
    return 0;
}

ds_tensor *ds_repeat_interleave(ds_tensor *x, int64_t rep, int64_t dim) {
    int d = ds_tensor_dim(x, "repeat_interleave", dim), nd = x->ndim;
    if (d < 0) return NULL;
    if (rep < 1) return ds_fail(DS_ERR_ARG, "repeat_interleave: repeats must be at least 1, got %lld", (long long)rep);
    if (nd >= DS_MAX_DIMS)
        return ds_fail(DS_ERR_ARG, "repeat_interleave: an input of %d dims has no room for the repeats", nd);
    /* the result's dims multiplied, each taken as at least 1 (an empty input's wide view has them all) */
    int64_t most = rep;
    for (int i = 0; i < nd; i++)
        if (__builtin_mul_overflow(most, x->shape[i] > 1 ? x->shape[i] : 1, &most)) {
            char buf[64];
            return ds_fail(DS_ERR_ARG, "repeat_interleave: %s repeated %lld times has more elements than a tensor holds",
                           ds_shape_str(x, buf, sizeof buf), (long long)rep);
        }
    /* x with a dim of rep after d, stride 0: one copy makes it the result */
    int64_t shape[DS_MAX_DIMS], stride[DS_MAX_DIMS], out_shape[DS_MAX_DIMS];
    for (int i = 0, j = 0; i < nd; i++) {
        out_shape[i] = x->shape[i] * (i == d ? rep : 1);
        shape[j] = x->shape[i];
        stride[j++] = x->stride[i];
        if (i == d) { shape[j] = rep; stride[j++] = 0; }
    }
    bool prev = ds_set_grad_enabled(false);
    ds_tensor *wide = ds_tensor_view_of(x, nd + 1, shape, stride, x->offset);
    ds_tensor *copy = wide ? ds_tensor_new(nd + 1, shape, x->dtype, ds_tensor_device(x)) : NULL;
    ds_tensor *out = copy && ds_copy_(copy, wide) == 0 ? ds_reshape(copy, nd, out_shape) : NULL;
    ds_set_grad_enabled(prev);
    ds_tensor_release(wide);
    ds_tensor_release(copy);
    ds_node *n = out ? ds_autograd_record("repeat_interleave", repeat_interleave_backward, 1, &x, out) : NULL;
    if (n) {
        n->f[0] = d;
        n->f[1] = (double)rep;
        ds_dims_by_stride(x, n->i);
    }
    return out;
}

int64_t ds_split_sizes(const ds_tensor *t, int64_t dim, int64_t split_size, int64_t *sizes) {
    char s[96];
    int d = ds_tensor_dim(t, "split", dim);
    if (d < 0) return -1;
    if (t->ndim == 0) return ds_fail(DS_ERR_ARG, "split: cannot split a 0-dim tensor"), -1;
    int64_t len = t->shape[d];
    if (split_size < 0 || (split_size == 0 && len > 0))
        return ds_fail(DS_ERR_ARG, "split: split size %lld must be positive for shape %s", (long long)split_size,
                       ds_shape_str(t, s, sizeof s)), -1;
    int64_t n = len == 0 ? 1 : (len + split_size - 1) / split_size;
    for (int64_t k = 0; sizes && k < n; k++) sizes[k] = k < n - 1 ? split_size : len - split_size * (n - 1);
    return n;
}

int64_t ds_chunk_sizes(const ds_tensor *t, int64_t dim, int64_t chunks, int64_t *sizes) {
    char s[96];
    if (chunks < 1)
        return ds_fail(DS_ERR_ARG, "chunk: chunks must be >= 1, got %lld (shape %s)", (long long)chunks,
                       ds_shape_str(t, s, sizeof s)), -1;
    int d = ds_tensor_dim(t, "chunk", dim);
    if (d < 0) return -1;
    if (t->ndim == 0) return ds_fail(DS_ERR_ARG, "chunk: cannot chunk a 0-dim tensor"), -1;
    int64_t len = t->shape[d];
    if (len == 0) {      /* as PyTorch: `chunks` empty pieces */
        for (int64_t k = 0; sizes && k < chunks; k++) sizes[k] = 0;
        return chunks;
    }
    return ds_split_sizes(t, d, (len + chunks - 1) / chunks, sizes);
}

int ds_split(ds_tensor *t, int64_t dim, int64_t n, const int64_t *sizes, ds_tensor **out) {
    char s[96];
    int d = ds_tensor_dim(t, "split", dim);
    if (d < 0) return -1;
    if (t->ndim == 0) return ds_fail(DS_ERR_ARG, "split: cannot split a 0-dim tensor"), -1;
    int64_t total = 0;
    for (int64_t k = 0; k < n; k++) {
        if (sizes[k] < 0)
            return ds_fail(DS_ERR_ARG, "split: size %lld of piece %lld is negative (shape %s)", (long long)sizes[k],
                           (long long)k + 1, ds_shape_str(t, s, sizeof s)), -1;
        total += sizes[k];
    }
    if (total != t->shape[d])
        return ds_fail(DS_ERR_ARG, "split: sizes add up to %lld but the split dim has size %lld in shape %s",
                       (long long)total, (long long)t->shape[d], ds_shape_str(t, s, sizeof s)), -1;
    int64_t start = 0;
    for (int64_t k = 0; k < n; k++) {
        out[k] = ds_narrow(t, d, start, sizes[k]);
        if (!out[k]) {
            while (k > 0) ds_tensor_release(out[--k]);
            return -1;
        }
        start += sizes[k];
    }
    return 0;
}
