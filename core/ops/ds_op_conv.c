#include "ds_ops.h"
#include "ds_error.h"

/* Output length of a window sliding over `in` (PyTorch's floor mode), or
 * 0 when the padded input is shorter than the dilated window. */
static int64_t out_len(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dil) {
    int64_t room = in + 2 * pad - dil * (k - 1) - 1;
    return room < 0 ? 0 : room / stride + 1;
}

static int check_same(const char *op, const ds_tensor *a, const ds_tensor *b) {
    return ds_check_same_device(op, a, b) || ds_check_same_dtype(op, a, b) ? -1 : 0;
}

static int check_input(const char *op, const ds_tensor *x) {
    char s[96];
    if (x->ndim != 4) {
        ds_fail(DS_ERR_ARG, "%s: expected an input [N,C,H,W], got %s", op, ds_shape_str(x, s, sizeof s));
        return -1;
    }
    if (!ds_dtype_is_float(x->dtype)) {
        ds_fail(DS_ERR_ARG, "%s: needs a floating point input, got %s", op, ds_dtype_name(x->dtype));
        return -1;
    }
    if (x->shape[2] == 0 || x->shape[3] == 0) {      /* a window would then see padding only */
        ds_fail(DS_ERR_ARG, "%s: input %s has an empty spatial dim", op, ds_shape_str(x, s, sizeof s));
        return -1;
    }
    return 0;
}


/* A contiguous copy (or t itself) without autograd history. */
static ds_tensor *plain(ds_tensor *t) {
    bool was = ds_set_grad_enabled(false);
    ds_tensor *c = ds_contiguous(t);
    ds_set_grad_enabled(was);
    return c;
}

static ds_tensor *grad_input(ds_tensor *g, ds_dtype dt) {
    return g->dtype == dt ? ds_contiguous(g) : ds_to_dtype(g, dt);
}

static ds_tensor *kernel_failed(const char *op, ds_tensor *out) {
    ds_tensor_release(out);
    return ds_fail(DS_ERR_STATE, "%s: %s", op, ds_kernel_error());
}

static ds_kview no_view(void) {
    ds_kview v = { 0 };
    return v;
}

/* ---- conv2d ---- */

static void conv_params_save(ds_node *n, const ds_conv2d_params *p) {
    for (int i = 0; i < 2; i++) {
        n->i[i] = p->stride[i];
        n->i[2 + i] = p->padding[i];
        n->i[4 + i] = p->dilation[i];
    }
    n->i[6] = p->groups;
}

static ds_conv2d_params conv_params_load(const ds_node *n) {
    ds_conv2d_params p = { .groups = n->i[6] };
    for (int i = 0; i < 2; i++) {
        p.stride[i] = n->i[i];
        p.padding[i] = n->i[2 + i];
        p.dilation[i] = n->i[4 + i];
    }
    return p;
}

static int conv_kernel_rc(int rc) {
    if (rc) ds_fail(DS_ERR_STATE, "conv2d: %s", ds_kernel_error());
    return rc ? -1 : 0;
}

/* dx by backward data, dw and db together by backward weights (db alone as
 * a sum when w needs none); an empty batch gives zero weight gradients. */
static int conv2d_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *x = n->saved[0], *w = n->saved[1];
    ds_conv2d_params p = conv_params_load(n);
    const ds_kernels_conv *k = ds_tensor_kernels(x)->conv;
    bool empty = x->shape[0] == 0;
    ds_device dev = ds_tensor_device(w);
    int64_t o = w->shape[0];
    ds_tensor *gc = grad_input(g, x->dtype);
    if (!gc) return -1;
    int rc = 0;
    if (ds_node_needs_grad(n, 0)) {
        gin[0] = ds_tensor_new_like(x);
        if (!gin[0]) rc = -1;
        else if (!empty)
            rc = conv_kernel_rc(k->conv2d_backward_data(ds_tensor_kview(gin[0]), ds_tensor_kview(gc),
                                                        ds_tensor_kview(w), &p));
    }
    if (rc == 0 && ds_node_needs_grad(n, 1)) {
        gin[1] = empty ? ds_tensor_full(4, w->shape, w->dtype, dev, 0) : ds_tensor_new_like(w);
        if (ds_node_needs_grad(n, 2))
            gin[2] = empty ? ds_tensor_full(1, &o, w->dtype, dev, 0) : ds_tensor_new(1, &o, w->dtype, dev);
        if (!gin[1] || (ds_node_needs_grad(n, 2) && !gin[2])) rc = -1;
        else if (!empty)
            rc = conv_kernel_rc(k->conv2d_backward_weight(ds_tensor_kview(gin[1]),
                                                          gin[2] ? ds_tensor_kview(gin[2]) : no_view(),
                                                          ds_tensor_kview(gc), ds_tensor_kview(x), &p));
    } else if (rc == 0 && ds_node_needs_grad(n, 2)) {
        int64_t dims[3] = { 0, 2, 3 };
        gin[2] = ds_sum(gc, 3, dims, false);
        if (!gin[2]) rc = -1;
    }
    ds_tensor_release(gc);
    return rc;
}

static int conv_check(ds_tensor *x, ds_tensor *w, ds_tensor *bias, const ds_conv2d_params *p, int64_t *yshape) {
    char s1[96], s2[96];
    if (check_input("conv2d", x) || check_same("conv2d", x, w) || (bias && check_same("conv2d", x, bias))) return -1;
    if (w->ndim != 4 || w->shape[2] < 1 || w->shape[3] < 1 || w->shape[1] < 1) {
        ds_fail(DS_ERR_ARG, "conv2d: expected a weight [O,C/groups,kh,kw] with no empty dim but O, got %s",
                ds_shape_str(w, s1, sizeof s1));
        return -1;
    }
    for (int i = 0; i < 2; i++)
        if (p->stride[i] < 1 || p->dilation[i] < 1 || p->padding[i] < 0 || p->groups < 1) {
            ds_fail(DS_ERR_ARG, "conv2d: stride %lldx%lld, dilation %lldx%lld and groups %lld must be >= 1, "
                    "padding %lldx%lld >= 0", (long long)p->stride[0], (long long)p->stride[1],
                    (long long)p->dilation[0], (long long)p->dilation[1], (long long)p->groups,
                    (long long)p->padding[0], (long long)p->padding[1]);
            return -1;
        }
    int64_t C = x->shape[1], O = w->shape[0];
    if (w->shape[1] * p->groups != C) {
        ds_fail(DS_ERR_ARG, "conv2d: input %s has %lld channels, weight %s with groups=%lld takes %lld",
                ds_shape_str(x, s1, sizeof s1), (long long)C, ds_shape_str(w, s2, sizeof s2), (long long)p->groups,
                (long long)(w->shape[1] * p->groups));
        return -1;
    }
    if (O % p->groups != 0) {
        ds_fail(DS_ERR_ARG, "conv2d: weight %s has %lld output channels, not a multiple of groups=%lld",
                ds_shape_str(w, s1, sizeof s1), (long long)O, (long long)p->groups);
        return -1;
    }
    if (bias && (bias->ndim != 1 || bias->shape[0] != O)) {
        ds_fail(DS_ERR_ARG, "conv2d: bias %s does not match weight %s (expected [%lld])",
                ds_shape_str(bias, s1, sizeof s1), ds_shape_str(w, s2, sizeof s2), (long long)O);
        return -1;
    }
    yshape[0] = x->shape[0];
    yshape[1] = O;
    for (int i = 0; i < 2; i++) {
        yshape[2 + i] = out_len(x->shape[2 + i], w->shape[2 + i], p->stride[i], p->padding[i], p->dilation[i]);
        if (yshape[2 + i] == 0) {
            ds_fail(DS_ERR_ARG,
                    "conv2d: input %s with padding %lldx%lld is smaller than the kernel %s dilated by %lldx%lld",
                    ds_shape_str(x, s1, sizeof s1), (long long)p->padding[0], (long long)p->padding[1],
                    ds_shape_str(w, s2, sizeof s2), (long long)p->dilation[0], (long long)p->dilation[1]);
            return -1;
        }
    }
    return 0;
}

ds_tensor *ds_conv2d(ds_tensor *x, ds_tensor *w, ds_tensor *bias, const ds_conv2d_params *p) {
    int64_t yshape[4];
    if (conv_check(x, w, bias, p, yshape)) return NULL;
    ds_tensor *xc = plain(x), *wc = plain(w), *bc = bias ? plain(bias) : NULL;
    ds_tensor *y = xc && wc && (bc || !bias) ? ds_tensor_new(4, yshape, x->dtype, ds_tensor_device(x)) : NULL;
    if (y && yshape[0] > 0
        && ds_tensor_kernels(y)->conv->conv2d(ds_tensor_kview(y), ds_tensor_kview(xc), ds_tensor_kview(wc),
                                              bc ? ds_tensor_kview(bc) : no_view(), p))
        y = kernel_failed("conv2d", y);
    ds_tensor *in[3] = { x, w, bias };
    ds_node *n = y ? ds_autograd_record("conv2d", conv2d_backward, 3, in, y) : NULL;
    if (n) {
        conv_params_save(n, p);
        if (ds_node_save(n, 0, xc) || ds_node_save(n, 1, wc)) { ds_tensor_release(y); y = NULL; }
    }
    ds_tensor_release(xc);
    ds_tensor_release(wc);
    ds_tensor_release(bc);
    return y;
}

/* ---- pooling ---- */

static void pool_params_save(ds_node *n, const ds_pool2d_params *p) {
    for (int i = 0; i < 2; i++) {
        n->i[i] = p->kernel[i];
        n->i[2 + i] = p->stride[i];
        n->i[4 + i] = p->padding[i];
    }
    n->i[6] = p->count_include_pad;
}

static ds_pool2d_params pool_params_load(const ds_node *n) {
    ds_pool2d_params p = { .count_include_pad = (int)n->i[6] };
    for (int i = 0; i < 2; i++) {
        p.kernel[i] = n->i[i];
        p.stride[i] = n->i[2 + i];
        p.padding[i] = n->i[4 + i];
    }
    return p;
}

static int pool_check(const char *op, ds_tensor *x, const ds_pool2d_params *p, int64_t *yshape) {
    char s[96];
    if (check_input(op, x)) return -1;
    for (int i = 0; i < 2; i++) {
        if (p->kernel[i] < 1 || p->stride[i] < 1 || p->padding[i] < 0) {
            ds_fail(DS_ERR_ARG, "%s: kernel %lldx%lld and stride %lldx%lld must be >= 1, padding %lldx%lld >= 0", op,
                    (long long)p->kernel[0], (long long)p->kernel[1], (long long)p->stride[0],
                    (long long)p->stride[1], (long long)p->padding[0], (long long)p->padding[1]);
            return -1;
        }
        if (2 * p->padding[i] > p->kernel[i]) {
            ds_fail(DS_ERR_ARG, "%s: padding %lld is more than half the kernel %lld", op, (long long)p->padding[i],
                    (long long)p->kernel[i]);
            return -1;
        }
        yshape[2 + i] = out_len(x->shape[2 + i], p->kernel[i], p->stride[i], p->padding[i], 1);
        if (yshape[2 + i] == 0) {
            ds_fail(DS_ERR_ARG, "%s: input %s with padding %lldx%lld is smaller than the kernel %lldx%lld", op,
                    ds_shape_str(x, s, sizeof s), (long long)p->padding[0], (long long)p->padding[1],
                    (long long)p->kernel[0], (long long)p->kernel[1]);
            return -1;
        }
    }
    yshape[0] = x->shape[0];
    yshape[1] = x->shape[1];
    return 0;
}

static int max_pool2d_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *idx = n->saved[0];
    ds_tensor *gc = grad_input(g, n->next[0].dtype);
    ds_tensor *dx = gc ? ds_tensor_new(n->next[0].ndim, n->next[0].shape, gc->dtype, ds_tensor_device(gc)) : NULL;
    if (dx && ds_tensor_kernels(dx)->conv->max_pool2d_backward(ds_tensor_kview(dx), ds_tensor_kview(gc),
                                                               ds_tensor_kview(idx)))
        dx = kernel_failed("max_pool2d", dx);
    ds_tensor_release(gc);
    gin[0] = dx;
    return dx ? 0 : -1;
}

ds_tensor *ds_max_pool2d(ds_tensor *x, const ds_pool2d_params *p) {
    int64_t yshape[4];
    if (pool_check("max_pool2d", x, p, yshape)) return NULL;
    bool track = ds_grad_enabled() && x->requires_grad;
    ds_tensor *xc = plain(x);
    ds_tensor *y = xc ? ds_tensor_new(4, yshape, x->dtype, ds_tensor_device(x)) : NULL;
    ds_tensor *idx = y && track ? ds_tensor_new(4, yshape, DS_I64, ds_tensor_device(x)) : NULL;
    if (y && track && !idx) { ds_tensor_release(y); y = NULL; }
    if (y && ds_tensor_kernels(y)->conv->max_pool2d(ds_tensor_kview(y), idx ? ds_tensor_kview(idx) : no_view(),
                                                    ds_tensor_kview(xc), p))
        y = kernel_failed("max_pool2d", y);
    ds_node *n = y ? ds_autograd_record("max_pool2d", max_pool2d_backward, 1, &x, y) : NULL;
    if (n && ds_node_save(n, 0, idx)) { ds_tensor_release(y); y = NULL; }
    ds_tensor_release(idx);
    ds_tensor_release(xc);
    return y;
}

static int avg_pool2d_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_pool2d_params p = pool_params_load(n);
    ds_tensor *gc = grad_input(g, n->next[0].dtype);
    ds_tensor *dx = gc ? ds_tensor_new(n->next[0].ndim, n->next[0].shape, gc->dtype, ds_tensor_device(gc)) : NULL;
    if (dx && ds_tensor_kernels(dx)->conv->avg_pool2d_backward(ds_tensor_kview(dx), ds_tensor_kview(gc), &p))
        dx = kernel_failed("avg_pool2d", dx);
    ds_tensor_release(gc);
    gin[0] = dx;
    return dx ? 0 : -1;
}

ds_tensor *ds_avg_pool2d(ds_tensor *x, const ds_pool2d_params *p) {
    int64_t yshape[4];
    if (pool_check("avg_pool2d", x, p, yshape)) return NULL;
    ds_tensor *xc = plain(x);
    ds_tensor *y = xc ? ds_tensor_new(4, yshape, x->dtype, ds_tensor_device(x)) : NULL;
    if (y && ds_tensor_kernels(y)->conv->avg_pool2d(ds_tensor_kview(y), ds_tensor_kview(xc), p))
        y = kernel_failed("avg_pool2d", y);
    ds_node *n = y ? ds_autograd_record("avg_pool2d", avg_pool2d_backward, 1, &x, y) : NULL;
    if (n) pool_params_save(n, p);
    ds_tensor_release(xc);
    return y;
}
