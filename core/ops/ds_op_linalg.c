#include "ds_ops.h"
#include "ds_error.h"
#include "ds_gemm_layout.h"
#include "ds_op_linalg_impl.h"

#include <string.h>

/* ---- views the gemm kernel reads ---- */

static ds_kview contiguous_view(void *data, ds_dtype dt, int nd, const int64_t *shape) {
    ds_kview v = { .data = data, .dtype = dt, .ndim = nd };
    int64_t s = 1;
    for (int i = nd - 1; i >= 0; i--) { v.shape[i] = shape[i]; v.stride[i] = s; s *= shape[i]; }
    return v;
}

/* A tensor's dims and strides seen as [tn dims] broadcast to shape [nd]:
 * new leading dims and size-1 dims that grow get stride 0. */
static ds_kview expand_view(void *data, ds_dtype dt, int tn, const int64_t *tshape, const int64_t *tstride, int nd,
                            const int64_t *shape) {
    ds_kview v = { .data = data, .dtype = dt, .ndim = nd };
    for (int i = 0; i < nd; i++) {
        int j = i - (nd - tn);
        v.shape[i] = shape[i];
        v.stride[i] = j >= 0 && tshape[j] == shape[i] ? tstride[j] : 0;
    }
    return v;
}

/* t's dims, with a vector made a matrix: a row [1,k] on the left of a
 * product, a column [k,1] on the right. Returns the ndim. */
static int promote(const ds_tensor *t, bool left, int64_t *shape, int64_t *stride) {
    if (t->ndim != 1) {
        memcpy(shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
        memcpy(stride, t->stride, sizeof(int64_t) * (size_t)t->ndim);
        return t->ndim;
    }
    int64_t k = t->shape[0], s = t->stride[0];
    shape[0] = left ? 1 : k;  stride[0] = left ? k * s : s;
    shape[1] = left ? k : 1;  stride[1] = left ? s : 1;
    return 2;
}

static int run_gemm(const char *op, const ds_tensor *on, ds_kview c, ds_kview a, ds_kview b, double beta) {
    if (ds_tensor_kernels(on)->blas->gemm(c, a, b, 1.0, beta) == 0) return 0;
    ds_fail(DS_ERR_STATE, "%s: %s", op, ds_kernel_error());
    return -1;
}

static int check_pair(const char *op, const ds_tensor *a, const ds_tensor *b) {
    if (ds_check_same_device(op, a, b) || ds_check_same_dtype(op, a, b)) return -1;
    if (!ds_dtype_is_float(a->dtype)) {
        ds_fail(DS_ERR_ARG, "%s: needs floating point tensors, got %s", op, ds_dtype_name(a->dtype));
        return -1;
    }
    return 0;
}

ds_tensor *ds_linalg_grad_input(ds_tensor *g, ds_dtype dt) {
    return g->dtype == dt ? ds_contiguous(g) : ds_to_dtype(g, dt);
}

/* ---- matmul ---- */

/* A product laid out for the kernel: c [batch..., m, n] = a @ b. */
typedef struct {
    int nd;                           /* batch dims + 2 */
    int64_t shape[DS_MAX_DIMS];       /* c's */
    ds_kview a, b;                    /* [batch..., m, k] and [batch..., k, n] */
    int out_ndim;
    int64_t out_shape[DS_MAX_DIMS];   /* c without the dims of promoted vectors */
} mm_geom;

static int mm_geometry(const char *op, ds_tensor *a, ds_tensor *b, mm_geom *g) {
    char s1[96], s2[96];
    if (a->ndim == 0 || b->ndim == 0) {
        ds_fail(DS_ERR_ARG, "%s: both arguments need at least 1 dim, got %s and %s", op,
                ds_shape_str(a, s1, sizeof s1), ds_shape_str(b, s2, sizeof s2));
        return -1;
    }
    int64_t ash[DS_MAX_DIMS], ast[DS_MAX_DIMS], bsh[DS_MAX_DIMS], bst[DS_MAX_DIMS];
    int an = promote(a, true, ash, ast), bn = promote(b, false, bsh, bst);
    int64_t m = ash[an - 2], k = ash[an - 1], n = bsh[bn - 1];
    if (bsh[bn - 2] != k) {
        ds_fail(DS_ERR_ARG, "%s: shapes %s and %s do not match", op, ds_shape_str(a, s1, sizeof s1),
                ds_shape_str(b, s2, sizeof s2));
        return -1;
    }
    int nb = (an > bn ? an : bn) - 2;
    g->nd = nb + 2;
    g->out_ndim = 0;
    for (int i = 0; i < nb; i++) {
        int ia = i - (nb - (an - 2)), ib = i - (nb - (bn - 2));
        int64_t sa = ia >= 0 ? ash[ia] : 1, sb = ib >= 0 ? bsh[ib] : 1;
        if (sa != sb && sa != 1 && sb != 1) {
            ds_fail(DS_ERR_ARG, "%s: batch dims of %s and %s do not broadcast", op, ds_shape_str(a, s1, sizeof s1),
                    ds_shape_str(b, s2, sizeof s2));
            return -1;
        }
        g->shape[i] = g->out_shape[g->out_ndim++] = sa == 1 ? sb : sa;
    }
    if (a->ndim > 1) g->out_shape[g->out_ndim++] = m;
    if (b->ndim > 1) g->out_shape[g->out_ndim++] = n;
    int64_t full[DS_MAX_DIMS];
    memcpy(full, g->shape, sizeof(int64_t) * (size_t)nb);
    full[nb] = m; full[nb + 1] = k;
    g->a = expand_view(ds_tensor_data(a), a->dtype, an, ash, ast, g->nd, full);
    full[nb] = k; full[nb + 1] = n;
    g->b = expand_view(ds_tensor_data(b), b->dtype, bn, bsh, bst, g->nd, full);
    g->shape[nb] = m;
    g->shape[nb + 1] = n;
    return 0;
}

/* The gradient of operand t (left or right of the product) as x @ y over
 * the batch, summed by the kernel over the batch dims t was broadcast in. */
static ds_tensor *operand_grad(const char *op, ds_tensor *t, bool left, const mm_geom *g, ds_kview x, ds_kview y) {
    ds_tensor *r = ds_tensor_new(t->ndim, t->shape, t->dtype, ds_tensor_device(t));
    if (!r) return NULL;
    int64_t sh[DS_MAX_DIMS], st[DS_MAX_DIMS], full[DS_MAX_DIMS], batch = 1;
    int tn = promote(r, left, sh, st), nb = g->nd - 2;
    for (int i = 0; i < nb; i++) { full[i] = g->shape[i]; batch *= g->shape[i]; }
    full[nb] = sh[tn - 2];
    full[nb + 1] = sh[tn - 1];
    ds_kview rv = expand_view(ds_tensor_data(r), r->dtype, tn, sh, st, g->nd, full);
    int rc = batch == 0 ? ds_fill_(r, 0) : run_gemm(op, r, rv, x, y, 0.0);
    if (rc) { ds_tensor_release(r); return NULL; }
    return r;
}

/* da = g @ b^T and db = a^T @ g, each summed over its broadcast batch dims. */
static int matmul_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *a = n->saved[0], *b = n->saved[1];
    mm_geom geo;
    if (mm_geometry(n->name, a, b, &geo)) return -1;
    ds_tensor *gc = ds_linalg_grad_input(g, a->dtype);
    if (!gc) return -1;
    ds_kview gv = contiguous_view(ds_tensor_data(gc), gc->dtype, geo.nd, geo.shape);
    ds_kview at = geo.a, bt = geo.b;
    ds_gemm_transpose(&at);
    ds_gemm_transpose(&bt);
    int rc = 0;
    if (ds_node_needs_grad(n, 0) && !(gin[0] = operand_grad(n->name, a, true, &geo, gv, bt))) rc = -1;
    if (rc == 0 && ds_node_needs_grad(n, 1) && !(gin[1] = operand_grad(n->name, b, false, &geo, at, gv))) rc = -1;
    ds_tensor_release(gc);
    return rc;
}

static ds_tensor *matmul_op(const char *op, ds_tensor *a, ds_tensor *b) {
    mm_geom g;
    if (check_pair(op, a, b) || mm_geometry(op, a, b, &g)) return NULL;
    ds_tensor *out = ds_tensor_new(g.out_ndim, g.out_shape, a->dtype, ds_tensor_device(a));
    if (!out) return NULL;
    if (run_gemm(op, out, contiguous_view(ds_tensor_data(out), out->dtype, g.nd, g.shape), g.a, g.b, 0.0)) {
        ds_tensor_release(out);
        return NULL;
    }
    ds_tensor *in[2] = { a, b };
    ds_node *n = ds_autograd_record(op, matmul_backward, 2, in, out);
    if (n && (ds_node_save(n, 0, a) || ds_node_save(n, 1, b))) {
        ds_tensor_release(out);
        return NULL;
    }
    return out;
}

ds_tensor *ds_matmul(ds_tensor *a, ds_tensor *b) { return matmul_op("matmul", a, b); }

ds_tensor *ds_mm(ds_tensor *a, ds_tensor *b) {
    char s1[96], s2[96];
    if (a->ndim != 2 || b->ndim != 2)
        return ds_fail(DS_ERR_ARG, "mm: expected 2-D tensors, got %s and %s", ds_shape_str(a, s1, sizeof s1),
                       ds_shape_str(b, s2, sizeof s2));
    return matmul_op("mm", a, b);
}

ds_tensor *ds_bmm(ds_tensor *a, ds_tensor *b) {
    char s1[96], s2[96];
    if (a->ndim != 3 || b->ndim != 3)
        return ds_fail(DS_ERR_ARG, "bmm: expected 3-D tensors, got %s and %s", ds_shape_str(a, s1, sizeof s1),
                       ds_shape_str(b, s2, sizeof s2));
    if (a->shape[0] != b->shape[0])
        return ds_fail(DS_ERR_ARG, "bmm: shapes %s and %s do not match", ds_shape_str(a, s1, sizeof s1),
                       ds_shape_str(b, s2, sizeof s2));
    return matmul_op("bmm", a, b);
}

/* ---- linear ---- */

static ds_kview matrix_view(const ds_tensor *t) {
    return expand_view(ds_tensor_data(t), t->dtype, 2, t->shape, t->stride, 2, t->shape);
}

int ds_linalg_check_linear(const char *op, const ds_tensor *x, const ds_tensor *w, const ds_tensor *bias,
                           const char *const names[3]) {
    char s1[96], s2[96];
    if (w->ndim != 2) {
        ds_fail(DS_ERR_ARG, "%s: %s must be 2-D [out,in], got %s", op, names[1], ds_shape_str(w, s1, sizeof s1));
        return -1;
    }
    int64_t outf = w->shape[0], in = w->shape[1];
    if (x->ndim == 0 || x->shape[x->ndim - 1] != in) {
        ds_fail(DS_ERR_ARG, "%s: %s %s and %s %s do not match (%s takes %lld features)", op, names[0],
                ds_shape_str(x, s1, sizeof s1), names[1], ds_shape_str(w, s2, sizeof s2), names[1], (long long)in);
        return -1;
    }
    if (bias && (bias->ndim != 1 || bias->shape[0] != outf)) {
        ds_fail(DS_ERR_ARG, "%s: %s %s does not match %s %s (expected [%lld])", op, names[2],
                ds_shape_str(bias, s1, sizeof s1), names[1], ds_shape_str(w, s2, sizeof s2), (long long)outf);
        return -1;
    }
    return 0;
}

ds_tensor *ds_linalg_rows(ds_tensor *x) {
    int64_t shape[2] = { 1, x->shape[x->ndim - 1] };
    for (int i = 0; i < x->ndim - 1; i++) shape[0] *= x->shape[i];
    bool was = ds_set_grad_enabled(false);
    ds_tensor *x2 = x->ndim == 2 ? (ds_tensor_retain(x), x) : ds_reshape(x, 2, shape);
    ds_set_grad_enabled(was);
    return x2;
}

int ds_linalg_linear_into(const char *op, ds_tensor *out, ds_tensor *x2, ds_tensor *w, ds_tensor *bias) {
    int64_t cshape[2] = { x2->shape[0], w->shape[0] };
    ds_kview cv = contiguous_view(ds_tensor_data(out), out->dtype, 2, cshape);
    ds_kview wt = matrix_view(w);
    ds_gemm_transpose(&wt);
    if (bias && ds_tensor_kernel_table(out)->blas->gemm_bias
        && ds_tensor_kernels(out)->blas->gemm_bias(cv, matrix_view(x2), wt, ds_tensor_kview(bias)) == 0)
        return 0;
    if (bias) {
        ds_kview bv = expand_view(ds_tensor_data(bias), bias->dtype, 1, bias->shape, bias->stride, 2, cshape);
        if (ds_tensor_kernels(out)->core->copy(cv, bv)) {
            ds_fail(DS_ERR_STATE, "%s: %s", op, ds_kernel_error());
            return -1;
        }
    }
    return run_gemm(op, out, cv, matrix_view(x2), wt, bias ? 1.0 : 0.0);
}

int ds_linalg_linear_grads(const char *op, ds_tensor *gc, ds_tensor *x2, ds_tensor *w, const bool want[3], int xnd,
                           const int64_t *xshape, ds_tensor **gin) {
    int64_t rows = x2->shape[0], in = w->shape[1], outf = w->shape[0];
    int64_t gshape[2] = { rows, outf };
    ds_kview gv = contiguous_view(ds_tensor_data(gc), gc->dtype, 2, gshape);
    int rc = 0;
    if (want[0]) {
        gin[0] = ds_tensor_new(xnd, xshape, w->dtype, ds_tensor_device(w));
        int64_t xs[2] = { rows, in };
        rc = !gin[0] || run_gemm(op, w, contiguous_view(ds_tensor_data(gin[0]), w->dtype, 2, xs), gv,
                                 matrix_view(w), 0.0);
    }
    if (rc == 0 && want[1]) {
        gin[1] = ds_tensor_new(2, w->shape, w->dtype, ds_tensor_device(w));
        ds_kview gt = gv;
        ds_gemm_transpose(&gt);
        /* the bias gradient comes out of the weight gradient's GEMM where
         * the device has that epilogue (cuBLASLt's BGRADB). */
        bool dw_done = false;
        if (gin[1] && want[2] && ds_tensor_kernel_table(w)->blas->gemm_bias_grad) {
            gin[2] = ds_tensor_new(1, &outf, w->dtype, ds_tensor_device(w));
            dw_done = gin[2] && ds_tensor_kernels(w)->blas->gemm_bias_grad(matrix_view(gin[1]), gt, matrix_view(x2),
                                                                            ds_tensor_kview(gin[2])) == 0;
            if (!dw_done) {
                ds_tensor_release(gin[2]);
                gin[2] = NULL;
            }
        }
        rc = !gin[1] || (!dw_done && run_gemm(op, w, matrix_view(gin[1]), gt, matrix_view(x2), 0.0));
    }
    if (rc == 0 && want[2] && !gin[2]) {
        ds_tensor *g2 = ds_reshape(gc, 2, gshape);
        int64_t rows_dim = 0;
        gin[2] = g2 ? ds_sum(g2, 1, &rows_dim, false) : NULL;
        ds_tensor_release(g2);
        rc = !gin[2];
    }
    return rc ? -1 : 0;
}

/* dx = g @ w, dw = g^T @ x over all leading dims at once, db = column sums of g. */
static int linear_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *x2 = n->saved[0], *w = n->saved[1];
    ds_tensor *gc = ds_linalg_grad_input(g, w->dtype);
    if (!gc) return -1;
    bool want[3] = { ds_node_needs_grad(n, 0), ds_node_needs_grad(n, 1), ds_node_needs_grad(n, 2) };
    int rc = ds_linalg_linear_grads("linear", gc, x2, w, want, n->next[0].ndim, n->next[0].shape, gin);
    ds_tensor_release(gc);
    return rc;
}

ds_tensor *ds_linear(ds_tensor *x, ds_tensor *w, ds_tensor *bias) {
    static const char *const names[3] = { "input", "weight", "bias" };
    if (check_pair("linear", x, w) || (bias && check_pair("linear", w, bias))
        || ds_linalg_check_linear("linear", x, w, bias, names))
        return NULL;
    int64_t shape[DS_MAX_DIMS];
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
    shape[x->ndim - 1] = w->shape[0];
    ds_tensor *x2 = ds_linalg_rows(x);
    ds_tensor *out = x2 ? ds_tensor_new(x->ndim, shape, x->dtype, ds_tensor_device(x)) : NULL;
    if (!out) { ds_tensor_release(x2); return NULL; }
    int rc = ds_linalg_linear_into("linear", out, x2, w, bias);
    ds_tensor *in3[3] = { x, w, bias };
    ds_node *n = rc == 0 ? ds_autograd_record("linear", linear_backward, 3, in3, out) : NULL;
    if (n && (ds_node_save(n, 0, x2) || ds_node_save(n, 1, w))) rc = -1;
    ds_tensor_release(x2);
    if (rc) { ds_tensor_release(out); return NULL; }
    return out;
}
