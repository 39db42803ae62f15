#include "ds_ops.h"
#include "ds_error.h"
#include "ds_gemm_layout.h"
#include "ds_op_linalg_impl.h"

#include <string.h>

#define OP "gelu_mlp"

enum { MLP_X, MLP_W1, MLP_B1, MLP_W2, MLP_B2 };

static ds_kview view_or_none(const ds_tensor *t) { return t ? ds_tensor_kview(t) : (ds_kview){ .data = NULL }; }

static int kernel_failed(void) {
    ds_fail(DS_ERR_STATE, "%s: %s", OP, ds_kernel_error());
    return -1;
}

static int check_args(ds_tensor *const *t) {
    static const char *const names[5] = { "x", "w1", "b1", "w2", "b2" };
    char s1[16], s2[16];
    if (!ds_dtype_is_float(t[MLP_X]->dtype)) {
        ds_fail(DS_ERR_ARG, "%s: x must be floating point, got %s", OP, ds_dtype_name(t[MLP_X]->dtype));
        return -1;
    }
    for (int k = MLP_W1; k <= MLP_B2; k++) {
        if (!t[k]) continue;
        if (!ds_device_equal(ds_tensor_device(t[k]), ds_tensor_device(t[MLP_X]))) {
            ds_device_name(ds_tensor_device(t[k]), s1, sizeof s1);
            ds_device_name(ds_tensor_device(t[MLP_X]), s2, sizeof s2);
            ds_fail(DS_ERR_ARG, "%s: %s is on %s but x is on %s", OP, names[k], s1, s2);
            return -1;
        }
        if (t[k]->dtype != t[MLP_X]->dtype) {
            ds_fail(DS_ERR_ARG, "%s: %s is %s but x is %s", OP, names[k], ds_dtype_name(t[k]->dtype),
                    ds_dtype_name(t[MLP_X]->dtype));
            return -1;
        }
    }
    if (ds_linalg_check_linear(OP, t[MLP_X], t[MLP_W1], t[MLP_B1], names)) return -1;
    /* the second linear reads the hidden activations, [..., w1's out] */
    static const char *const names2[3] = { "hidden", "w2", "b2" };
    ds_tensor hidden = { .ndim = t[MLP_X]->ndim };
    memcpy(hidden.shape, t[MLP_X]->shape, sizeof hidden.shape);
    hidden.shape[hidden.ndim - 1] = t[MLP_W1]->shape[0];
    return ds_linalg_check_linear(OP, &hidden, t[MLP_W2], t[MLP_B2], names2);
}

/* t's BLAS table where cuBLASLt's GELU epilogues may stand in for the
 * GELU kernels, else NULL: the tanh form, for bf16/f16 results only, where
 * its fast tanh (about 5e-4 relative) stays below their rounding; f32 keeps
 * the exact kernels. The caller still checks for its entry (none on the
 * CPU), and calls it through ds_tensor_kernels, which counts the call. */
static const ds_kernels_blas *gelu_epilogues(const ds_tensor *t, int64_t act) {
    if (act != DS_UN_GELU_TANH || (t->dtype != DS_BF16 && t->dtype != DS_F16)) return NULL;
    return ds_tensor_kernel_table(t)->blas;
}

/* pre = x2 w1^T + b1 and h = gelu(pre): where gelu_in_epilogue, one
 * cuBLASLt call (GELU_AUX_BIAS writes h, and pre as its aux); otherwise,
 * or where cuBLASLt refuses, the linear and the GELU kernel apart. */
static int hidden_forward(ds_tensor *x2, ds_tensor *w1, ds_tensor *b1, ds_unary_op act, ds_tensor *pre,
                          ds_tensor *h) {
    const ds_kernels_blas *blas = gelu_epilogues(h, act);
    if (blas && blas->gemm_bias_gelu) {
        ds_kview w1t = ds_tensor_kview(w1);
        ds_gemm_transpose(&w1t);
        if (ds_tensor_kernels(h)->blas->gemm_bias_gelu(ds_tensor_kview(h), ds_tensor_kview(pre), ds_tensor_kview(x2),
                                                      w1t, view_or_none(b1)) == 0)
            return 0;
    }
    if (ds_linalg_linear_into(OP, pre, x2, w1, b1)) return -1;
    if (ds_tensor_kernels(h)->elementwise->unary(act, ds_tensor_kview(h), ds_tensor_kview(pre), 0))
        return kernel_failed();
    return 0;
}

/* dpre = (gc w2) gelu'(pre) in one cuBLASLt call (DGELU; db1 comes from
 * layer 1's weight-gradient GEMM, as every linear's bias gradient does).
 * False where the fused call does not apply: the caller runs the
 * composed kernels. */
static bool hidden_backward_fused(ds_node *n, ds_tensor *gc, ds_tensor *w2, ds_tensor *pre, ds_tensor *dpre) {
    const ds_kernels_blas *blas = gelu_epilogues(dpre, n->i[0]);
    if (!blas || !blas->gemm_gelu_grad) return false;
    int64_t gshape[2] = { pre->shape[0], w2->shape[0] };
    ds_tensor *g2 = ds_reshape(gc, 2, gshape);
    if (!g2) return false;
    bool done = ds_tensor_kernels(dpre)->blas->gemm_gelu_grad(ds_tensor_kview(dpre), ds_tensor_kview(pre),
                                                               ds_tensor_kview(g2), ds_tensor_kview(w2)) == 0;
    ds_tensor_release(g2);
    return done;
}

/* Layer 2's gradients from gc (dw2, db2, and dh = gc w2), dpre = dh
 * gelu'(pre), then layer 1's from dpre: what the composed ops' nodes do,
 * with the GELU's backward in the first GEMM on the GPU where it fuses. */
static int gelu_mlp_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *x2 = n->saved[0], *w1 = n->saved[1], *w2 = n->saved[2], *pre = n->saved[3], *h = n->saved[4];
    bool want1[3], layer1 = false;
    for (int k = 0; k < 3; k++) layer1 |= want1[k] = ds_node_needs_grad(n, MLP_X + k);
    ds_tensor *gc = ds_linalg_grad_input(g, w2->dtype);
    ds_tensor *dpre = gc && layer1 ? ds_tensor_new(2, pre->shape, pre->dtype, ds_tensor_device(pre)) : NULL;
    if (!gc || (layer1 && !dpre)) {
        ds_tensor_release(gc);
        return -1;
    }
    bool fused = layer1 && hidden_backward_fused(n, gc, w2, pre, dpre);
    ds_tensor *g2[3] = { NULL, NULL, NULL };
    bool want2[3] = { layer1 && !fused, ds_node_needs_grad(n, MLP_W2), ds_node_needs_grad(n, MLP_B2) };
    int rc = ds_linalg_linear_grads(OP, gc, h, w2, want2, 2, h->shape, g2);
    gin[MLP_W2] = g2[1];
    gin[MLP_B2] = g2[2];
    if (rc == 0 && g2[0]
        && ds_tensor_kernels(dpre)->elementwise->unary_backward((ds_unary_op)n->i[0], ds_tensor_kview(dpre),
                                                                ds_tensor_kview(g2[0]), ds_tensor_kview(pre),
                                                                ds_tensor_kview(h), 0))
        rc = kernel_failed();
    ds_tensor_release(g2[0]);
    if (rc == 0 && layer1)
        rc = ds_linalg_linear_grads(OP, dpre, x2, w1, want1, n->next[MLP_X].ndim, n->next[MLP_X].shape, gin);
    ds_tensor_release(gc);
    ds_tensor_release(dpre);
    return rc;
}

ds_tensor *ds_gelu_mlp(ds_tensor *x, ds_tensor *w1, ds_tensor *b1, ds_tensor *w2, ds_tensor *b2,
                       int approximate_tanh) {
    ds_tensor *in[5] = { x, w1, b1, w2, b2 };
    if (check_args(in)) return NULL;
    ds_unary_op act = approximate_tanh ? DS_UN_GELU_TANH : DS_UN_GELU_ERF;
    ds_device dev = ds_tensor_device(x);
    int64_t shape[DS_MAX_DIMS];
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
    shape[x->ndim - 1] = w2->shape[0];
    ds_tensor *x2 = ds_linalg_rows(x);
    int64_t hshape[2] = { x2 ? x2->shape[0] : 0, w1->shape[0] };
    ds_tensor *pre = x2 ? ds_tensor_new(2, hshape, x->dtype, dev) : NULL;
    ds_tensor *h = pre ? ds_tensor_new(2, hshape, x->dtype, dev) : NULL;
    ds_tensor *out = h ? ds_tensor_new(x->ndim, shape, x->dtype, dev) : NULL;
    int rc = out ? hidden_forward(x2, w1, b1, act, pre, h) : -1;
    if (rc == 0) rc = ds_linalg_linear_into(OP, out, h, w2, b2);
    ds_node *n = rc == 0 ? ds_autograd_record(OP, gelu_mlp_backward, 5, in, out) : NULL;
    if (n) {
        n->i[0] = act;
        if (ds_node_save(n, 0, x2) || ds_node_save(n, 1, w1) || ds_node_save(n, 2, w2) || ds_node_save(n, 3, pre)
            || ds_node_save(n, 4, h))
            rc = -1;
    }
    ds_tensor_release(x2);
    ds_tensor_release(pre);
    ds_tensor_release(h);
    if (rc) { ds_tensor_release(out); return NULL; }
    return out;
}
