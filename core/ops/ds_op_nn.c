#include "ds_ops.h"
#include "ds_error.h"

#include <float.h>
#include <math.h>
#include <string.h>

int ds_nn_reduction_parse(const char *name) {
    if (strcmp(name, "none") == 0) return DS_NN_NONE;
    if (strcmp(name, "mean") == 0) return DS_NN_MEAN;
    if (strcmp(name, "sum") == 0) return DS_NN_SUM;
    return -1;
}

static ds_tensor *kernel_failed(ds_tensor *out, const char *op) {
    ds_tensor_release(out);
    return ds_fail(DS_ERR_ARG, "%s: %s", op, ds_kernel_error());
}

/* Internal copies carry no history: the op records its own node. */
static ds_tensor *contiguous_nograd(ds_tensor *t) {
    bool prev = ds_set_grad_enabled(false);
    ds_tensor *c = ds_contiguous(t);
    ds_set_grad_enabled(prev);
    return c;
}

/* Statistics (lse, mean, rstd) keep f64 for f64 data, f32 for the rest. */
static ds_dtype stat_dtype(ds_dtype t) { return t == DS_F64 ? DS_F64 : DS_F32; }

static int need_float(const char *op, const char *what, const ds_tensor *t) {
    if (ds_dtype_is_float(t->dtype)) return 0;
    ds_fail(DS_ERR_ARG, "%s: %s must be a floating point tensor, got %s", op, what, ds_dtype_name(t->dtype));
    return -1;
}


/* ---- softmax, log_softmax ---- */

static int softmax_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *y = n->saved[0];
    ds_tensor *gc = ds_contiguous(g);
    ds_tensor *dx = gc ? ds_tensor_new(y->ndim, y->shape, y->dtype, ds_tensor_device(y)) : NULL;
    if (!dx) { ds_tensor_release(gc); return -1; }
    int rc = ds_tensor_kernels(y)->nn->softmax_backward(ds_tensor_kview(dx), ds_tensor_kview(gc), ds_tensor_kview(y),
                                                         n->i[0], n->i[1], n->i[2], (int)n->i[3]);
    ds_tensor_release(gc);
    if (rc) { kernel_failed(dx, n->name); return -1; }
    gin[0] = dx;
    return 0;
}

static ds_tensor *softmax_op(ds_tensor *x, int64_t dim, int as_log) {
    const char *name = as_log ? "log_softmax" : "softmax";
    if (need_float(name, "input", x)) return NULL;
    int d = ds_tensor_dim(x, name, dim);
    if (d < 0) return NULL;
    int64_t outer = 1, n = x->ndim ? x->shape[d] : 1, inner = 1;
    for (int i = 0; i < x->ndim; i++) {
        if (i < d) outer *= x->shape[i];
        else if (i > d) inner *= x->shape[i];
    }
    ds_tensor *xc = contiguous_nograd(x);
    ds_tensor *out = xc ? ds_tensor_new(x->ndim, x->shape, x->dtype, ds_tensor_device(x)) : NULL;
    if (!out) { ds_tensor_release(xc); return NULL; }
    int rc = ds_tensor_kernels(x)->nn->softmax(ds_tensor_kview(out), ds_tensor_kview(xc), outer, n, inner, as_log);
    ds_tensor_release(xc);
    if (rc) return kernel_failed(out, name);
    ds_node *node = ds_autograd_record(name, softmax_backward, 1, &x, out);
    if (node) {
        node->i[0] = outer;
        node->i[1] = n;
        node->i[2] = inner;
        node->i[3] = as_log;
        if (ds_node_save(node, 0, out)) { ds_tensor_release(out); return NULL; }
    }
    return out;
}

ds_tensor *ds_softmax(ds_tensor *x, int64_t dim) { return softmax_op(x, dim, 0); }
ds_tensor *ds_log_softmax(ds_tensor *x, int64_t dim) { return softmax_op(x, dim, 1); }

/* ---- cross-entropy ---- */

enum { CE_LOGITS, CE_LSE, CE_TARGET, CE_COUNT };

/* A mean's gradient: g over the rows that counted, worked out on the
 * device in count's dtype. */
static ds_tensor *mean_grad(ds_tensor *g, ds_tensor *count) {
    ds_tensor *gs = ds_to_dtype(g, count->dtype);
    ds_tensor *out = gs ? ds_div(gs, count) : NULL;
    ds_tensor_release(gs);
    return out;
}

static int cross_entropy_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *logits = n->saved[CE_LOGITS], *lse = n->saved[CE_LSE], *target = n->saved[CE_TARGET];
    ds_tensor *count = n->saved[CE_COUNT];
    int64_t rows = n->i[1], C = n->i[2], ld = logits->shape[logits->ndim - 1];
    ds_tensor *gc = count ? mean_grad(g, count) : ds_contiguous(g);
    ds_tensor *dl = gc ? ds_tensor_new(logits->ndim, logits->shape, logits->dtype, ds_tensor_device(logits)) : NULL;
    if (!dl) { ds_tensor_release(gc); return -1; }
    /* the loss gradient as one value per row: a reduced loss repeats its one value */
    ds_kview gv = ds_tensor_kview(gc);
    gv.ndim = 1;
    gv.shape[0] = rows;
    gv.stride[0] = n->i[3] == DS_NN_NONE ? 1 : 0;
    int rc = ds_tensor_kernels(logits)->nn->cross_entropy_backward(ds_tensor_kview(dl), gv, ds_tensor_kview(logits),
                                                                    ds_tensor_kview(lse), ds_tensor_kview(target),
                                                                    rows, C, ld, n->i[0], n->f[0]);
    ds_tensor_release(gc);
    if (rc) { kernel_failed(dl, "cross_entropy"); return -1; }
    gin[0] = dl;
    return 0;
}

static int check_cross_entropy(ds_tensor *logits, ds_tensor *target, double smoothing, int64_t classes) {
    char s1[96], s2[96];
    if (need_float("cross_entropy", "logits", logits) || ds_check_same_device("cross_entropy", logits, target)) return -1;
    if (target->dtype != DS_I64 && target->dtype != DS_I32) {
        ds_fail(DS_ERR_ARG, "cross_entropy: target must hold i64 or i32 class ids, got %s",
                ds_dtype_name(target->dtype));
        return -1;
    }
    if (logits->ndim == 0) {
        ds_fail(DS_ERR_ARG, "cross_entropy: logits need a class dim (the last), got shape []");
        return -1;
    }
    bool ok = target->ndim == logits->ndim - 1;
    for (int i = 0; ok && i < target->ndim; i++) ok = target->shape[i] == logits->shape[i];
    if (!ok) {
        ds_fail(DS_ERR_ARG, "cross_entropy: logits %s and target %s do not match: target must be logits' shape "
                "without the last (class) dim", ds_shape_str(logits, s1, sizeof s1), ds_shape_str(target, s2, sizeof s2));
        return -1;
    }
    if (!(smoothing >= 0 && smoothing <= 1)) {
        ds_fail(DS_ERR_ARG, "cross_entropy: label_smoothing must be in [0, 1], got %g", smoothing);
        return -1;
    }
    int64_t C = logits->shape[logits->ndim - 1];
    if (classes < 0 || classes > C) {
        ds_fail(DS_ERR_ARG, "cross_entropy: classes must be in [1, %lld] (the class dim of logits %s) or 0 for all, got %lld",
                (long long)C, ds_shape_str(logits, s1, sizeof s1), (long long)classes);
        return -1;
    }
    return 0;
}

/* The rows whose target is not ignore_index, as a 0-dim tensor of dtype
 * on target's device: no read back, so a step never waits for it. The
 * comparison is in i64, as the kernels': an i32 target never equals an
 * ignore_index past i32's range. */
static ds_tensor *counted_rows(ds_tensor *target, int64_t ignore_index, ds_dtype dtype) {
    ds_tensor *ig = ds_tensor_full(0, NULL, DS_I64, ds_tensor_device(target), (double)ignore_index);
    ds_tensor *kept = ig ? ds_binary(DS_BIN_NE, target, ig) : NULL;
    ds_tensor *n = kept ? ds_sum(kept, -1, NULL, false) : NULL;
    ds_tensor *out = n ? ds_to_dtype(n, dtype) : NULL;
    ds_tensor_release(ig);
    ds_tensor_release(kept);
    ds_tensor_release(n);
    return out;
}

/* The per-row losses reduced as asked (a mean over count), in dtype. */
static ds_tensor *reduce_loss(ds_tensor *loss, ds_tensor *target, ds_dtype dtype, ds_nn_reduction red,
                              ds_tensor *count) {
    ds_tensor *r;
    if (red == DS_NN_NONE) {
        r = ds_reshape(loss, target->ndim, target->shape);
    } else {
        ds_tensor *s = ds_sum(loss, -1, NULL, false);
        r = s && red == DS_NN_MEAN ? ds_div(s, count) : s;
        if (r != s) ds_tensor_release(s);
    }
    ds_tensor *out = r ? ds_to_dtype(r, dtype) : NULL;
    ds_tensor_release(r);
    return out;
}

ds_tensor *ds_cross_entropy(ds_tensor *logits, ds_tensor *target, int64_t ignore_index, double smoothing,
                            int64_t classes, ds_nn_reduction red) {
    if (check_cross_entropy(logits, target, smoothing, classes)) return NULL;
    int64_t ld = logits->shape[logits->ndim - 1], C = classes ? classes : ld;
    if (ds_check_index("cross_entropy", target, "target", logits, "logits", C, &ignore_index)) return NULL;
    int64_t rows = ds_tensor_numel(target);
    ds_device dev = ds_tensor_device(logits);
    ds_dtype st = stat_dtype(logits->dtype);
    bool prev = ds_set_grad_enabled(false);
    ds_tensor *lc = ds_contiguous(logits), *tc = ds_contiguous(target);
    ds_tensor *loss = ds_tensor_new(1, &rows, st, dev), *lse = ds_tensor_new(1, &rows, st, dev);
    ds_tensor *count = red == DS_NN_MEAN && tc ? counted_rows(tc, ignore_index, st) : NULL;
    ds_tensor *out = NULL;
    if (lc && tc && loss && lse && (count || red != DS_NN_MEAN)) {
        if (ds_tensor_kernels(logits)->nn->cross_entropy(ds_tensor_kview(loss), ds_tensor_kview(lse),
                                                         ds_tensor_kview(lc), ds_tensor_kview(tc), rows, C, ld,
                                                         ignore_index, smoothing))
            ds_fail(DS_ERR_ARG, "cross_entropy: %s", ds_kernel_error());
        else out = reduce_loss(loss, target, red == DS_NN_NONE ? logits->dtype : st, red, count);
    }
    ds_set_grad_enabled(prev);
    ds_tensor_release(loss);
    ds_node *n = out ? ds_autograd_record("cross_entropy", cross_entropy_backward, 1, &logits, out) : NULL;
    if (n) {
        n->i[0] = ignore_index;
        n->i[1] = rows;
        n->i[2] = C;
        n->i[3] = red;
        n->f[0] = smoothing;
        if (ds_node_save(n, CE_LOGITS, lc) || ds_node_save(n, CE_LSE, lse) || ds_node_save(n, CE_TARGET, tc) ||
            (count && ds_node_save(n, CE_COUNT, count))) {
            ds_tensor_release(out);
            out = NULL;
        }
    }
    ds_tensor_release(lc);
    ds_tensor_release(tc);
    ds_tensor_release(lse);
    ds_tensor_release(count);
    return out;
}

/* ---- mean squared error: composed, its gradient comes from sub and mul ---- */

/* t itself, or (a reduced loss over bf16/f16) t widened to f32. */
static ds_tensor *loss_operand(ds_tensor *t, ds_nn_reduction red) {
    if (red != DS_NN_NONE && stat_dtype(t->dtype) != t->dtype) return ds_to_dtype(t, DS_F32);
    ds_tensor_retain(t);
    return t;
}

ds_tensor *ds_mse_loss(ds_tensor *input, ds_tensor *target, ds_nn_reduction red) {
    int nd;
    int64_t shape[DS_MAX_DIMS];
    if (need_float("mse_loss", "input", input) || need_float("mse_loss", "target", target) ||
        ds_check_same_device("mse_loss", input, target) || ds_broadcast_shape("mse_loss", input, target, &nd, shape))
        return NULL;
    ds_tensor *a = loss_operand(input, red), *b = a ? loss_operand(target, red) : NULL;
    ds_tensor *d = b ? ds_sub(a, b) : NULL;
    ds_tensor_release(a);
    ds_tensor_release(b);
    ds_tensor *sq = d ? ds_mul(d, d) : NULL;
    ds_tensor_release(d);
    if (!sq || red == DS_NN_NONE) return sq;
    ds_tensor *out = red == DS_NN_MEAN ? ds_mean(sq, -1, NULL, false) : ds_sum(sq, -1, NULL, false);
    ds_tensor_release(sq);
    return out;
}

/* ---- layer norm, RMS norm ---- */

/* Checks x against the normalised dims and a parameter shaped like them;
 * sets rows and n (elements per row). */
static int norm_shape(const char *op, ds_tensor *x, int norm_ndim, ds_tensor *p, const char *what, int64_t *rows,
                      int64_t *n) {
    char s1[96], s2[96];
    if (need_float(op, "input", x)) return -1;
    if (norm_ndim < 1 || norm_ndim > x->ndim) {
        ds_fail(DS_ERR_ARG, "%s: cannot normalise the last %d dims of an input of shape %s", op, norm_ndim,
                ds_shape_str(x, s1, sizeof s1));
        return -1;
    }
    int lead = x->ndim - norm_ndim;
    *n = 1;
    *rows = 1;
    for (int i = 0; i < x->ndim; i++) *(i < lead ? rows : n) *= x->shape[i];
    if (!p) return 0;
    if (need_float(op, what, p) || ds_check_same_device(op, x, p)) return -1;
    bool ok = p->ndim == norm_ndim;
    for (int i = 0; ok && i < norm_ndim; i++) ok = p->shape[i] == x->shape[lead + i];
    if (!ok) {
        ds_fail(DS_ERR_ARG, "%s: %s of shape %s does not match the last dims of input %s", op, what,
                ds_shape_str(p, s1, sizeof s1), ds_shape_str(x, s2, sizeof s2));
        return -1;
    }
    return 0;
}

/* A kernel view of an optional parameter: data NULL when absent. */
static ds_kview param_view(ds_tensor *p) {
    if (p) return ds_tensor_kview(p);
    ds_kview v;
    memset(&v, 0, sizeof v);
    return v;
}

/* The gradient buffer of input k, shaped and typed like it; NULL when the
 * input needs none (check ds_node_needs_grad to tell that from a failure). */
static ds_tensor *new_input_grad(const ds_node *n, int k, ds_device dev) {
    if (!ds_node_needs_grad(n, k)) return NULL;
    return ds_tensor_new(n->next[k].ndim, n->next[k].shape, n->next[k].dtype, dev);
}

enum { NORM_X, NORM_W, NORM_MEAN, NORM_RSTD };

/* The gradient folded in from the input's node (ds_node.fold_grad), as
 * the kernel takes it: contiguous in x's dtype. NULL with none. */
static ds_tensor *folded_grad(const ds_node *n, const ds_tensor *x, int *rc) {
    ds_tensor *f = n->folded, *c = f ? ds_contiguous(f) : NULL;
    ds_tensor *out = c && c->dtype != x->dtype ? ds_to_dtype(c, x->dtype) : c;
    if (c && out != c) ds_tensor_release(c);
    if (f && !out) *rc = -1;
    return out;
}

/* Layer norm's backward (RMS norm's without a mean saved): dx, with the
 * folded gradient added, and the weight and bias gradients. */
static int norm_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *x = n->saved[NORM_X], *w = n->saved[NORM_W], *mean = n->saved[NORM_MEAN];
    const ds_kernels_nn *k = ds_tensor_kernels(x)->nn;
    int rc = 0;
    ds_tensor *gc = ds_contiguous(g), *gres = folded_grad(n, x, &rc);
    ds_tensor *dx = gc ? ds_tensor_new(x->ndim, x->shape, x->dtype, ds_tensor_device(x)) : NULL;
    ds_tensor *dw = new_input_grad(n, 1, ds_tensor_device(x));
    ds_tensor *db = mean ? new_input_grad(n, 2, ds_tensor_device(x)) : NULL;
    if (rc == 0 && dx && (dw || !ds_node_needs_grad(n, 1)) && (!mean || db || !ds_node_needs_grad(n, 2))) {
        ds_kview dxv = ds_tensor_kview(dx), gv = ds_tensor_kview(gc), xv = ds_tensor_kview(x);
        ds_kview rstd = ds_tensor_kview(n->saved[NORM_RSTD]);
        rc = mean ? k->layer_norm_backward(dxv, param_view(dw), param_view(db), gv, xv, param_view(w),
                                           ds_tensor_kview(mean), rstd, param_view(gres), n->i[0], n->i[1])
                  : k->rms_norm_backward(dxv, param_view(dw), gv, xv, param_view(w), rstd, param_view(gres),
                                         n->i[0], n->i[1]);
        if (rc) ds_fail(DS_ERR_ARG, "%s: %s", n->name, ds_kernel_error());
    } else {
        rc = -1;
    }
    ds_tensor_release(gc);
    ds_tensor_release(gres);
    if (rc) {
        ds_tensor_release(dx);
        ds_tensor_release(dw);
        ds_tensor_release(db);
        return -1;
    }
    gin[0] = dx;
    gin[1] = dw;
    if (mean) gin[2] = db;
    return 0;
}

/* x + res's node: both get the sum's gradient as it is. */
static int residual_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    (void)n;
    ds_tensor_retain(g);
    ds_tensor_retain(g);
    gin[0] = g;
    gin[1] = g;
    return 0;
}

/* The norm of x, or of x + res into *sum when res is given: layer norm
 * with b (NULL when absent) when centered, else RMS norm; the norm's node
 * folds the sum's other gradients into its backward. */
static ds_tensor *norm_of(const char *op, bool centered, ds_tensor *x, ds_tensor *res, int norm_ndim, ds_tensor *w,
                          ds_tensor *b, double eps, ds_tensor **sum) {
    int64_t rows, n;
    if (norm_shape(op, x, norm_ndim, w, "weight", &rows, &n) || norm_shape(op, x, norm_ndim, b, "bias", &rows, &n))
        return NULL;
    if (!(eps >= 0)) return ds_fail(DS_ERR_ARG, "%s: eps must be >= 0, got %g", op, eps);
    ds_device dev = ds_tensor_device(x);
    ds_dtype st = stat_dtype(x->dtype);
    bool prev = ds_set_grad_enabled(false);
    ds_tensor *xc = ds_contiguous(x), *resc = res ? ds_contiguous(res) : NULL;
    ds_tensor *wc = w ? ds_contiguous(w) : NULL, *bc = b ? ds_contiguous(b) : NULL;
    ds_set_grad_enabled(prev);
    ds_tensor *s = res ? ds_tensor_new(x->ndim, x->shape, x->dtype, dev) : NULL;
    ds_tensor *out = ds_tensor_new(x->ndim, x->shape, x->dtype, dev);
    ds_tensor *mean = centered ? ds_tensor_new(1, &rows, st, dev) : NULL, *rstd = ds_tensor_new(1, &rows, st, dev);
    int rc = -1;
    if (xc && (resc || !res) && (s || !res) && (wc || !w) && (bc || !b) && out && (mean || !centered) && rstd) {
        const ds_kernels_nn *k = ds_tensor_kernels(x)->nn;
        ds_kview ov = ds_tensor_kview(out), rv = ds_tensor_kview(rstd), xv = ds_tensor_kview(xc);
        rc = centered ? k->layer_norm(ov, ds_tensor_kview(mean), rv, xv, param_view(wc), param_view(bc),
                                      param_view(resc), param_view(s), rows, n, eps)
                      : k->rms_norm(ov, rv, xv, param_view(wc), param_view(resc), param_view(s), rows, n, eps);
        if (rc) ds_fail(DS_ERR_ARG, "%s: %s", op, ds_kernel_error());
    }
    ds_tensor *pair[2] = { x, res };
    if (rc == 0 && res) ds_autograd_record("add", residual_backward, 2, pair, s);
    ds_tensor *normed = res ? s : xc, *in[3] = { res ? s : x, w, b };
    ds_node *node = rc == 0 ? ds_autograd_record(op, norm_backward, centered ? 3 : 2, in, out) : NULL;
    if (node) {
        node->i[0] = rows;
        node->i[1] = n;
        node->fold_grad = res != NULL;
        if (ds_node_save(node, NORM_X, normed) || (wc && ds_node_save(node, NORM_W, wc)) ||
            (mean && ds_node_save(node, NORM_MEAN, mean)) || ds_node_save(node, NORM_RSTD, rstd))
            rc = -1;
    }
    ds_tensor_release(xc);
    ds_tensor_release(resc);
    ds_tensor_release(wc);
    ds_tensor_release(bc);
    ds_tensor_release(mean);
    ds_tensor_release(rstd);
    if (rc) {
        ds_tensor_release(out);
        ds_tensor_release(s);
        return NULL;
    }
    if (sum) *sum = s;
    return out;
}

/* res against x for op's residual add: same device, shape and dtype */
static int check_residual(const char *op, ds_tensor *x, ds_tensor *res) {
    char s1[96], s2[96];
    if (ds_check_same_device(op, x, res)) return -1;
    if (ds_tensor_same_shape(x, res) && x->dtype == res->dtype) return 0;
    ds_fail(DS_ERR_ARG, "%s: residual %s %s does not match input %s %s (same shape and dtype)", op,
            ds_dtype_name(res->dtype), ds_shape_str(res, s1, sizeof s1), ds_dtype_name(x->dtype),
            ds_shape_str(x, s2, sizeof s2));
    return -1;
}

ds_tensor *ds_layer_norm(ds_tensor *x, int norm_ndim, ds_tensor *w, ds_tensor *b, double eps) {
    return norm_of("layer_norm", true, x, NULL, norm_ndim, w, b, eps, NULL);
}

ds_tensor *ds_add_layer_norm(ds_tensor *x, ds_tensor *res, int norm_ndim, ds_tensor *w, ds_tensor *b, double eps,
                             ds_tensor **sum) {
    *sum = NULL;
    if (check_residual("add_layer_norm", x, res)) return NULL;
    return norm_of("add_layer_norm", true, x, res, norm_ndim, w, b, eps, sum);
}

/* eps NAN: the machine epsilon of x's compute type */
static double rms_eps(const ds_tensor *x, double eps) {
    return !isnan(eps) ? eps : x->dtype == DS_F64 ? DBL_EPSILON : FLT_EPSILON;
}

ds_tensor *ds_rms_norm(ds_tensor *x, int norm_ndim, ds_tensor *w, double eps) {
    return norm_of("rms_norm", false, x, NULL, norm_ndim, w, NULL, rms_eps(x, eps), NULL);
}

ds_tensor *ds_add_rms_norm(ds_tensor *x, ds_tensor *res, int norm_ndim, ds_tensor *w, double eps, ds_tensor **sum) {
    *sum = NULL;
    if (check_residual("add_rms_norm", x, res)) return NULL;
    return norm_of("add_rms_norm", false, x, res, norm_ndim, w, NULL, rms_eps(x, eps), sum);
}

/* ---- rotary embedding: one kernel each way, where the composed ops take
 * six forward and nine back ---- */

/* y = rope of x over cos and sin as views of x's shape (backward: x is
 * the output's gradient, y its input's) */
static int rope_into(ds_tensor *y, ds_tensor *x, ds_tensor *cos, ds_tensor *sin, bool backward) {
    char s1[96], s2[96];
    ds_tensor *c = ds_expand(cos, x->ndim, x->shape), *s = c ? ds_expand(sin, x->ndim, x->shape) : NULL;
    if (!s)
        ds_fail(DS_ERR_ARG, "rope: cos and sin %s do not broadcast to the input %s", ds_shape_str(cos, s1, sizeof s1),
                ds_shape_str(x, s2, sizeof s2));
    int rc = s ? ds_tensor_kernels(y)->nn->rope(ds_tensor_kview(y), ds_tensor_kview(x), ds_tensor_kview(c),
                                                ds_tensor_kview(s), backward) : -1;
    if (s && rc) ds_fail(DS_ERR_STATE, "rope: %s", ds_kernel_error());
    ds_tensor_release(c);
    ds_tensor_release(s);
    return rc;
}

static int rope_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *dx = ds_new_in_order(g, n->i);
    if (!dx || rope_into(dx, g, n->saved[0], n->saved[1], true)) {
        ds_tensor_release(dx);
        return -1;
    }
    gin[0] = dx;
    return 0;
}

ds_tensor *ds_rope(ds_tensor *x, ds_tensor *cos, ds_tensor *sin) {
    char s1[96], s2[96];
    if (need_float("rope", "input", x) || ds_check_same_device("rope", x, cos) || ds_check_same_device("rope", x, sin))
        return NULL;
    if (x->ndim == 0 || x->shape[x->ndim - 1] % 2)
        return ds_fail(DS_ERR_ARG, "rope: the last dim of input %s must be even (its two halves rotate together)",
                       ds_shape_str(x, s1, sizeof s1));
    if (cos->dtype != x->dtype || sin->dtype != x->dtype)
        return ds_fail(DS_ERR_ARG, "rope: cos %s and sin %s must be the input's dtype %s", ds_dtype_name(cos->dtype),
                       ds_dtype_name(sin->dtype), ds_dtype_name(x->dtype));
    if (cos->requires_grad || sin->requires_grad)
        return ds_fail(DS_ERR_ARG, "rope: cos and sin are tables and take no gradient (detach them)");
    if (!ds_tensor_same_shape(cos, sin))
        return ds_fail(DS_ERR_ARG, "rope: cos %s and sin %s differ in shape", ds_shape_str(cos, s1, sizeof s1),
                       ds_shape_str(sin, s2, sizeof s2));
    ds_tensor *out = ds_tensor_new(x->ndim, x->shape, x->dtype, ds_tensor_device(x));
    if (!out || rope_into(out, x, cos, sin, false)) {
        ds_tensor_release(out);
        return NULL;
    }
    ds_node *n = ds_autograd_record("rope", rope_backward, 1, &x, out);
    if (n) ds_dims_by_stride(x, n->i);
    if (n && (ds_node_save(n, 0, cos) || ds_node_save(n, 1, sin))) {
        ds_tensor_release(out);
        return NULL;
    }
    return out;
}

/* ---- SwiGLU: one kernel each way, keeping gate and up alone for the
 * backward (silu then mul keep silu(gate) as well) ---- */

static int swiglu_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *gate = n->saved[0], *up = n->saved[1];
    ds_tensor *dg = ds_tensor_new(g->ndim, g->shape, g->dtype, ds_tensor_device(g));
    ds_tensor *du = dg ? ds_tensor_new(g->ndim, g->shape, g->dtype, ds_tensor_device(g)) : NULL;
    int rc = du ? ds_tensor_kernels(g)->elementwise->swiglu_backward(ds_tensor_kview(dg), ds_tensor_kview(du),
                      ds_tensor_kview(g), ds_tensor_kview(gate), ds_tensor_kview(up)) : -1;
    if (du && rc) ds_fail(DS_ERR_STATE, "swiglu: %s", ds_kernel_error());
    if (rc) {
        ds_tensor_release(dg);
        ds_tensor_release(du);
        return -1;
    }
    if (ds_node_needs_grad(n, 0)) gin[0] = dg; else ds_tensor_release(dg);
    if (ds_node_needs_grad(n, 1)) gin[1] = du; else ds_tensor_release(du);
    return 0;
}

ds_tensor *ds_swiglu(ds_tensor *gate, ds_tensor *up) {
    char s1[96], s2[96];
    if (need_float("swiglu", "gate", gate) || need_float("swiglu", "up", up) ||
        ds_check_same_device("swiglu", gate, up))
        return NULL;
    if (!ds_tensor_same_shape(gate, up) || gate->dtype != up->dtype)
        return ds_fail(DS_ERR_ARG, "swiglu: gate %s %s and up %s %s must share shape and dtype (no broadcast)",
                       ds_dtype_name(gate->dtype), ds_shape_str(gate, s1, sizeof s1), ds_dtype_name(up->dtype),
                       ds_shape_str(up, s2, sizeof s2));
    ds_tensor *out = ds_tensor_new(gate->ndim, gate->shape, gate->dtype, ds_tensor_device(gate));
    if (!out) return NULL;
    if (ds_tensor_kernels(out)->elementwise->swiglu(ds_tensor_kview(out), ds_tensor_kview(gate), ds_tensor_kview(up)))
        return kernel_failed(out, "swiglu");
    ds_tensor *in[2] = { gate, up };
    ds_node *n = ds_autograd_record("swiglu", swiglu_backward, 2, in, out);
    if (n && (ds_node_save(n, 0, gate) || ds_node_save(n, 1, up))) {
        ds_tensor_release(out);
        return NULL;
    }
    return out;
}

/* ---- dropout: the backward draws the same mask from the same counters ---- */

static int dropout_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *gc = ds_contiguous(g);
    ds_tensor *dx = gc ? ds_tensor_new(g->ndim, g->shape, n->next[0].dtype, ds_tensor_device(g)) : NULL;
    if (!dx) { ds_tensor_release(gc); return -1; }
    int rc = ds_tensor_kernels(dx)->nn->dropout(ds_tensor_kview(dx), ds_tensor_kview(gc), (uint64_t)n->i[0],
                                                 (uint64_t)n->i[1], n->f[0]);
    ds_tensor_release(gc);
    if (rc) { kernel_failed(dx, "dropout"); return -1; }
    gin[0] = dx;
    return 0;
}

ds_tensor *ds_dropout(ds_tensor *x, double p, bool training, ds_generator *g) {
    if (!(p >= 0 && p <= 1)) return ds_fail(DS_ERR_ARG, "dropout: probability must be in [0, 1], got %g", p);
    if (need_float("dropout", "input", x)) return NULL;
    if (!training || p == 0) { ds_tensor_retain(x); return x; }
    ds_tensor *xc = contiguous_nograd(x);
    ds_tensor *out = xc ? ds_tensor_new(x->ndim, x->shape, x->dtype, ds_tensor_device(x)) : NULL;
    if (!out) { ds_tensor_release(xc); return NULL; }
    if (!g) g = ds_default_generator();
    uint64_t seed = g->seed, offset = ds_generator_reserve(g, ds_tensor_numel(x));
    int rc = ds_tensor_kernels(x)->nn->dropout(ds_tensor_kview(out), ds_tensor_kview(xc), seed, offset, p);
    ds_tensor_release(xc);
    if (rc) return kernel_failed(out, "dropout");
    ds_node *n = ds_autograd_record("dropout", dropout_backward, 1, &x, out);
    if (n) {
        n->i[0] = (int64_t)seed;
        n->i[1] = (int64_t)offset;
        n->f[0] = p;
    }
    return out;
}
