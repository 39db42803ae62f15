#include "ds_ops.h"
#include "ds_error.h"
#include "ds_elem.h"

#include <string.h>

static const char *const binary_names[DS_NBINARY] = {
    "add", "sub", "mul", "div", "pow", "maximum", "minimum",
    "eq", "ne", "lt", "le", "gt", "ge",
};

/* the in-place forms, as they are named to a user (ds_storage.modified_by) */
static const char *const inplace_names[DS_NBINARY] = {
    "add_", "sub_", "mul_", "div_", "pow_", "maximum_", "minimum_",
    "eq_", "ne_", "lt_", "le_", "gt_", "ge_",
};

static const char *const unary_names[DS_NUNARY] = {
    "neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "abs", "pow",
    "relu", "gelu", "gelu", "silu",
};

static int rank_of(ds_dtype t) {
    static const int rank[DS_NDTYPES] = {
        [DS_BOOL] = 0, [DS_U8] = 1, [DS_I32] = 2, [DS_I64] = 3,
        [DS_F16] = 4, [DS_BF16] = 4, [DS_F32] = 5, [DS_F64] = 6,
    };
    return rank[t];
}

ds_dtype ds_promote(ds_dtype a, ds_dtype b) {
    if (a == b) return a;
    if ((a == DS_BF16 && b == DS_F16) || (a == DS_F16 && b == DS_BF16)) return DS_F32;
    return rank_of(a) >= rank_of(b) ? a : b;
}

int ds_broadcast_shape(const char *op, const ds_tensor *a, const ds_tensor *b, int *ndim, int64_t *shape) {
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    for (int i = 0; i < nd; i++) {
        int ia = i - (nd - a->ndim), ib = i - (nd - b->ndim);
        int64_t sa = ia >= 0 ? a->shape[ia] : 1, sb = ib >= 0 ? b->shape[ib] : 1;
        if (sa != sb && sa != 1 && sb != 1) {
            char s1[96], s2[96];
            ds_fail(DS_ERR_ARG, "%s: shapes %s and %s do not broadcast (dim %d: %lld vs %lld)", op,
                    ds_shape_str(a, s1, sizeof s1), ds_shape_str(b, s2, sizeof s2), i + 1,
                    (long long)sa, (long long)sb);
            return -1;
        }
        shape[i] = sa == 1 ? sb : sa;
    }
    *ndim = nd;
    return 0;
}

ds_tensor *ds_expand(ds_tensor *t, int ndim, const int64_t *shape) {
    int64_t stride[DS_MAX_DIMS];
    int lead = ndim - t->ndim;
    char s[96];
    if (lead < 0) return ds_fail(DS_ERR_ARG, "expand: cannot expand %s to fewer dims", ds_shape_str(t, s, sizeof s));
    for (int i = 0; i < ndim; i++) {
        if (i < lead) { stride[i] = 0; continue; }
        int64_t have = t->shape[i - lead];
        if (have == shape[i]) stride[i] = t->stride[i - lead];
        else if (have == 1) stride[i] = 0;
        else return ds_fail(DS_ERR_ARG, "expand: size %lld of %s cannot become %lld in dim %d",
                            (long long)have, ds_shape_str(t, s, sizeof s), (long long)shape[i], i + 1);
    }
    return ds_tensor_view_of(t, ndim, shape, stride, t->offset);
}

ds_tensor *ds_scalar_like(const ds_tensor *t, double v) {
    return ds_tensor_full(0, NULL, t->dtype, ds_tensor_device(t), v);
}

static ds_tensor *kernel_failed(ds_tensor *out, const char *op) {
    ds_tensor_release(out);
    return ds_fail(DS_ERR_STATE, "%s: %s", op, ds_kernel_error());
}

/* The broadcast output of a binary op, with a and b expanded to it. */
static ds_tensor *binary_out(const char *name, ds_tensor *a, ds_tensor *b, ds_dtype dt,
                             ds_tensor **ea, ds_tensor **eb) {
    int nd;
    int64_t shape[DS_MAX_DIMS];
    if (ds_check_same_device(name, a, b) || ds_broadcast_shape(name, a, b, &nd, shape)) return NULL;
    ds_tensor *out = ds_tensor_new(nd, shape, dt, ds_tensor_device(a));
    if (!out) return NULL;
    *ea = ds_expand(a, nd, shape);
    *eb = ds_expand(b, nd, shape);
    if (!*ea || !*eb) {
        ds_tensor_release(*ea);
        ds_tensor_release(*eb);
        ds_tensor_release(out);
        return NULL;
    }
    return out;
}

/* d(a op b): the gradient for each side, before summing down broadcast
 * dims; add, sub and mul leave out a side that needs none (a constant
 * operand, as a rotary table), whose gradient would be dropped. */
static int binary_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_binary_op op = (ds_binary_op)n->i[0];
    ds_tensor *a = n->saved[0], *b = n->saved[1];
    ds_tensor *ga = NULL, *gb = NULL;
    bool want_a = ds_node_needs_grad(n, 0), want_b = ds_node_needs_grad(n, 1);
    switch (op) {
    case DS_BIN_ADD: ga = g; gb = g; ds_tensor_retain(g); ds_tensor_retain(g); break;
    case DS_BIN_SUB: ga = g; ds_tensor_retain(g); gb = want_b ? ds_unary(DS_UN_NEG, g, 0) : NULL; break;
    case DS_BIN_MUL: ga = want_a ? ds_mul(g, b) : NULL; gb = want_b ? ds_mul(g, a) : NULL; break;
    case DS_BIN_DIV: {
        ga = ds_div(g, b);
        ds_tensor *q = ga ? ds_div(ga, b) : NULL;       /* g / b^2 */
        ds_tensor *t = q ? ds_mul(q, a) : NULL;         /* g a / b^2 */
        gb = t ? ds_unary(DS_UN_NEG, t, 0) : NULL;
        ds_tensor_release(q);
        ds_tensor_release(t);
        break;
    }
    case DS_BIN_POW: {
        /* d/da a^b = b a^(b-1) = b y / a; d/db a^b = y log a */
        ds_tensor *y = n->saved[2];
        ds_tensor *one = ds_scalar_like(b, 1.0);
        ds_tensor *e = one ? ds_sub(b, one) : NULL;
        ds_tensor *p = e ? ds_binary(DS_BIN_POW, a, e) : NULL;
        ds_tensor *bp = p ? ds_mul(b, p) : NULL;
        ga = bp ? ds_mul(g, bp) : NULL;
        ds_tensor *la = ds_unary(DS_UN_LOG, a, 0);
        ds_tensor *yl = la ? ds_mul(y, la) : NULL;
        gb = yl ? ds_mul(g, yl) : NULL;
        ds_tensor_release(one); ds_tensor_release(e); ds_tensor_release(p);
        ds_tensor_release(bp); ds_tensor_release(la); ds_tensor_release(yl);
        break;
    }
    case DS_BIN_MAX: case DS_BIN_MIN: {
        /* the gradient goes to the side that won; ties send it to a */
        ds_tensor *mask = ds_binary(op == DS_BIN_MAX ? DS_BIN_GE : DS_BIN_LE, a, b);
        ds_tensor *zero = ds_scalar_like(g, 0);
        ga = mask && zero ? ds_where(mask, g, zero) : NULL;
        gb = mask && zero ? ds_where(mask, zero, g) : NULL;
        ds_tensor_release(mask);
        ds_tensor_release(zero);
        break;
    }
    default: return 0;   /* comparisons carry no gradient */
    }
    int rc = (want_a && !ga) || (want_b && !gb) ? -1 : 0;
    if (rc == 0 && want_a && !(gin[0] = ds_sum_to_shape(ga, n->next[0].ndim, n->next[0].shape))) rc = -1;
    if (rc == 0 && want_b && !(gin[1] = ds_sum_to_shape(gb, n->next[1].ndim, n->next[1].shape))) rc = -1;
    ds_tensor_release(ga);
    ds_tensor_release(gb);
    return rc;
}

ds_tensor *ds_binary(ds_binary_op op, ds_tensor *a, ds_tensor *b) {
    const char *name = binary_names[op];
    bool compare = op >= DS_BIN_EQ;
    ds_dtype compute = ds_promote(a->dtype, b->dtype);
    ds_tensor *ea, *eb;
    ds_tensor *out = binary_out(name, a, b, compare ? DS_BOOL : compute, &ea, &eb);
    if (!out) return NULL;
    int rc = ds_tensor_kernels(out)->elementwise->binary(op, ds_tensor_kview(out), ds_tensor_kview(ea),
                                                         ds_tensor_kview(eb));
    ds_tensor_release(ea);
    ds_tensor_release(eb);
    if (rc) return kernel_failed(out, name);
    if (compare) return out;
    ds_tensor *in[2] = { a, b };
    ds_node *n = ds_autograd_record(name, binary_backward, 2, in, out);
    if (n) {
        n->i[0] = op;
        if (op != DS_BIN_ADD && op != DS_BIN_SUB) {
            if (ds_node_save(n, 0, a) || ds_node_save(n, 1, b) || (op == DS_BIN_POW && ds_node_save(n, 2, out))) {
                ds_tensor_release(out);
                return NULL;
            }
        }
    }
    return out;
}

ds_tensor *ds_add(ds_tensor *a, ds_tensor *b) { return ds_binary(DS_BIN_ADD, a, b); }
ds_tensor *ds_sub(ds_tensor *a, ds_tensor *b) { return ds_binary(DS_BIN_SUB, a, b); }
ds_tensor *ds_mul(ds_tensor *a, ds_tensor *b) { return ds_binary(DS_BIN_MUL, a, b); }
ds_tensor *ds_div(ds_tensor *a, ds_tensor *b) { return ds_binary(DS_BIN_DIV, a, b); }

ds_tensor *ds_mul_scalar(ds_tensor *a, double s) {
    ds_tensor *k = ds_scalar_like(a, s);
    ds_tensor *out = k ? ds_mul(a, k) : NULL;
    ds_tensor_release(k);
    return out;
}

int ds_binary_(ds_binary_op op, ds_tensor *dst, ds_tensor *src) {
    if (ds_check_same_device(binary_names[op], dst, src)) return -1;
    ds_tensor *e = ds_expand(src, dst->ndim, dst->shape);
    if (!e) return -1;
    int rc = ds_tensor_kernels(dst)->elementwise->binary(op, ds_tensor_kview_w(dst, inplace_names[op]),
                                                         ds_tensor_kview(dst), ds_tensor_kview(e));
    ds_tensor_release(e);
    if (rc) ds_fail(DS_ERR_STATE, "%s_: %s", binary_names[op], ds_kernel_error());
    return rc;
}

int ds_add_(ds_tensor *dst, ds_tensor *src) { return ds_binary_(DS_BIN_ADD, dst, src); }

static int unary_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *x = n->saved[0], *y = n->saved[1];
    ds_tensor *dx = ds_tensor_new(x->ndim, x->shape, g->dtype, ds_tensor_device(g));
    if (!dx) return -1;
    if (ds_tensor_kernels(dx)->elementwise->unary_backward((ds_unary_op)n->i[0], ds_tensor_kview(dx),
            ds_tensor_kview(g), ds_tensor_kview(x), ds_tensor_kview(y), n->f[0])) {
        kernel_failed(dx, n->name);
        return -1;
    }
    gin[0] = dx;
    return 0;
}

ds_tensor *ds_unary(ds_unary_op op, ds_tensor *x, double param) {
    const char *name = unary_names[op];
    /* integer inputs to transcendental ops compute in f32, as in PyTorch */
    bool keeps_int = op == DS_UN_NEG || op == DS_UN_ABS || op == DS_UN_RELU;
    ds_dtype dt = ds_dtype_is_float(x->dtype) || keeps_int ? x->dtype : DS_F32;
    ds_tensor *out = ds_tensor_new(x->ndim, x->shape, dt, ds_tensor_device(x));
    if (!out) return NULL;
    if (ds_tensor_kernels(out)->elementwise->unary(op, ds_tensor_kview(out), ds_tensor_kview(x), param))
        return kernel_failed(out, name);
    ds_node *n = ds_autograd_record(name, unary_backward, 1, &x, out);
    if (n) {
        n->i[0] = op;
        n->f[0] = param;
        /* x again where the derivative reads x alone: the output goes when its users are done */
        if (ds_node_save(n, 0, x) || ds_node_save(n, 1, ds_unary_reads_out(op) ? out : x)) {
            ds_tensor_release(out);
            return NULL;
        }
    }
    return out;
}

static int where_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *cond = n->saved[0];
    ds_tensor *zero = ds_scalar_like(g, 0);
    ds_tensor *ga = zero ? ds_where(cond, g, zero) : NULL;
    ds_tensor *gb = zero ? ds_where(cond, zero, g) : NULL;
    ds_tensor_release(zero);
    if (ga) gin[1] = ds_sum_to_shape(ga, n->next[1].ndim, n->next[1].shape);
    if (gb) gin[2] = ds_sum_to_shape(gb, n->next[2].ndim, n->next[2].shape);
    ds_tensor_release(ga);
    ds_tensor_release(gb);
    return gin[1] && gin[2] ? 0 : -1;
}

ds_tensor *ds_where(ds_tensor *cond, ds_tensor *a, ds_tensor *b) {
    int nd1, nd;
    int64_t s1[DS_MAX_DIMS], shape[DS_MAX_DIMS];
    if (ds_check_same_device("where", cond, a) || ds_check_same_device("where", a, b)) return NULL;
    if (ds_broadcast_shape("where", a, b, &nd1, s1)) return NULL;
    ds_tensor tmp = { .ndim = nd1 };
    memcpy(tmp.shape, s1, sizeof s1);
    if (ds_broadcast_shape("where", cond, &tmp, &nd, shape)) return NULL;
    ds_tensor *out = ds_tensor_new(nd, shape, ds_promote(a->dtype, b->dtype), ds_tensor_device(a));
    ds_tensor *ec = out ? ds_expand(cond, nd, shape) : NULL;
    ds_tensor *ea = ec ? ds_expand(a, nd, shape) : NULL;
    ds_tensor *eb = ea ? ds_expand(b, nd, shape) : NULL;
    int rc = eb ? ds_tensor_kernels(out)->elementwise->where(ds_tensor_kview(out), ds_tensor_kview(ec),
                                                             ds_tensor_kview(ea), ds_tensor_kview(eb)) : -1;
    ds_tensor_release(ec);
    ds_tensor_release(ea);
    ds_tensor_release(eb);
    if (!eb) { ds_tensor_release(out); return NULL; }
    if (rc) return kernel_failed(out, "where");
    ds_tensor *in[3] = { cond, a, b };
    ds_node *n = ds_autograd_record("where", where_backward, 3, in, out);
    if (n && ds_node_save(n, 0, cond)) { ds_tensor_release(out); return NULL; }
    return out;
}
