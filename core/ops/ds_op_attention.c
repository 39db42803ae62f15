#include "ds_ops.h"
#include "ds_error.h"

#include <math.h>

#define OP "scaled_dot_product_attention"

/* The most bytes of scores one call of auto's math backend may hold (the
 * softmax keeps them for backward): past it the fused kernel, slower but
 * with no Tq x Tk matrix, keeps long sequences in memory. */
#define MATH_SCORES_MAX ((int64_t)2 << 30)

/* The backend auto picks: math on a device whose fused kernel would not
 * run these inputs at full rate (a GPU in f64, or with a head dim its
 * tensor-core kernel lacks), where cuBLAS's GEMMs around a softmax
 * beat it, while the B*H*Tq*Tk scores fit; fused everywhere else. */
static ds_attention_backend pick_backend(ds_attention_backend backend, ds_tensor *q, ds_tensor *k, ds_tensor *v) {
    if (backend != DS_ATTN_AUTO) return backend;
    if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4) return DS_ATTN_FUSED;    /* check_args says what is wrong */
    const ds_kernels_attention *a = ds_tensor_kernel_table(q)->attention;
    if (!a || a->full_rate(ds_tensor_kview(q), ds_tensor_kview(k), ds_tensor_kview(v))) return DS_ATTN_FUSED;
    double scores = (double)q->shape[0] * (double)q->shape[1] * (double)q->shape[2] * (double)k->shape[2] *
                    (double)ds_dtype_size(q->dtype);
    return scores <= (double)MATH_SCORES_MAX ? DS_ATTN_MATH : DS_ATTN_FUSED;
}

static int check_args(ds_tensor *q, ds_tensor *k, ds_tensor *v, bool causal, ds_attention_backend backend) {
    char sq[96], sk[96], sv[96];
    ds_shape_str(q, sq, sizeof sq);
    ds_shape_str(k, sk, sizeof sk);
    ds_shape_str(v, sv, sizeof sv);
    if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4)
        return ds_fail(DS_ERR_ARG, "%s: q, k, v must be [B,H,T,D], got q %s, k %s, v %s", OP, sq, sk, sv), -1;
    if (q->dtype != k->dtype || q->dtype != v->dtype || !ds_dtype_is_float(q->dtype))
        return ds_fail(DS_ERR_ARG, "%s: q, k, v must share one floating point dtype, got %s, %s, %s", OP,
                       ds_dtype_name(q->dtype), ds_dtype_name(k->dtype), ds_dtype_name(v->dtype)), -1;
    if (!ds_device_equal(ds_tensor_device(q), ds_tensor_device(k)) ||
        !ds_device_equal(ds_tensor_device(q), ds_tensor_device(v)))
        return ds_fail(DS_ERR_ARG, "%s: q, k, v must be on one device", OP), -1;
    if (k->shape[0] != q->shape[0] || v->shape[0] != q->shape[0] || v->shape[1] != k->shape[1] ||
        k->shape[3] != q->shape[3] || v->shape[2] != k->shape[2])
        return ds_fail(DS_ERR_ARG, "%s: shapes q %s, k %s, v %s do not fit q [B,H,Tq,D], k [B,KV,Tk,D], "
                       "v [B,KV,Tk,Dv]", OP, sq, sk, sv), -1;
    if (k->shape[1] != q->shape[1] && (k->shape[1] == 0 || q->shape[1] % k->shape[1] != 0))
        return ds_fail(DS_ERR_ARG, "%s: q's heads must be a multiple of k and v's (grouped-query attention), "
                       "got q %s, k %s, v %s", OP, sq, sk, sv), -1;
    if (causal && q->shape[2] != k->shape[2])
        return ds_fail(DS_ERR_ARG, "%s: causal attention needs as many queries as keys, got q %s and k %s "
                       "(pass causal = false for cross attention)", OP, sq, sk), -1;
    if (q->shape[3] == 0 || (k->shape[2] == 0 && q->shape[2] > 0))
        return ds_fail(DS_ERR_ARG, "%s: needs a head dim and at least one key, got q %s and k %s", OP, sq, sk), -1;
    if (backend == DS_ATTN_FUSED && !ds_tensor_kernel_table(q)->attention)
        return ds_fail(DS_ERR_ARG, "%s: not available on this device", OP), -1;
    return 0;
}

/* A [B,H,T,D] tensor laid out [B,T,H,D] in memory, the layout of a fused
 * projection's heads: the output and the gradients of q, k and v go back
 * to [B,T,H*D] (transpose(2, 3) then view) without a copy. */
static ds_tensor *new_heads_inner(int64_t B, int64_t H, int64_t T, int64_t D, ds_dtype dtype, ds_device dev) {
    int64_t shape[4] = { B, H, T, D }, mem_shape[4] = { B, T, H, D }, stride[4] = { T * H * D, D, H * D, 1 };
    ds_tensor *mem = ds_tensor_new(4, mem_shape, dtype, dev);
    ds_tensor *t = mem ? ds_tensor_view_of(mem, 4, shape, stride, 0) : NULL;
    ds_tensor_release(mem);
    return t;
}

/* The gradient of input x: contiguous like x when x is (a leaf's .grad
 * then adopts it, and later ones add without a strided pass), else
 * heads-inner, which a fused projection's view takes back without a copy. */
static ds_tensor *new_grad_like(const ds_tensor *x) {
    if (ds_tensor_is_contiguous(x)) return ds_tensor_new_like(x);
    return new_heads_inner(x->shape[0], x->shape[1], x->shape[2], x->shape[3], x->dtype, ds_tensor_device(x));
}

/* Adds -inf, in place and off the tape, to the scores s [B,H,Tq,Tk] of the
 * keys a query does not see (key j > query i, ds_attn_keys_visible's rule).
 * The softmax gives them probability 0 and so gradient 0, and the other
 * scores take their gradient unchanged, so the tape needs no mask node. The
 * [Tq,Tk] mask is built on s's device. */
static int mask_future(ds_tensor *s) {
    int64_t Tq = s->shape[2], Tk = s->shape[3], col[2] = { Tq, 1 }, row[2] = { 1, Tk };
    ds_device dev = ds_tensor_device(s);
    ds_tensor *i = ds_arange(0, (double)Tq, 1, DS_I64, dev), *j = ds_arange(0, (double)Tk, 1, DS_I64, dev);
    ds_tensor *ic = i ? ds_view(i, 2, col) : NULL, *jr = j ? ds_view(j, 2, row) : NULL;
    ds_tensor *hidden = ic && jr ? ds_binary(DS_BIN_GT, jr, ic) : NULL;
    ds_tensor *ninf = ds_scalar_like(s, -INFINITY), *zero = ds_scalar_like(s, 0);
    ds_tensor *bias = hidden && ninf && zero ? ds_where(hidden, ninf, zero) : NULL;
    int rc = bias ? ds_add_(s, bias) : -1;
    ds_tensor *tmp[8] = { i, j, ic, jr, hidden, ninf, zero, bias };
    for (int t = 0; t < 8; t++) ds_tensor_release(tmp[t]);
    return rc;
}

/* The math backend from differentiable ops, so autograd gives its
 * backward. Returns [B,Tq,H,Dv] contiguous: the memory layout of the fused
 * op's output. */
static ds_tensor *math_attention(ds_tensor *q, ds_tensor *k, ds_tensor *v, bool causal, double scale) {
    ds_tensor *qs = ds_mul_scalar(q, scale);    /* on q: Tk/D times fewer elements than the scores */
    ds_tensor *kt = qs ? ds_transpose(k, 2, 3) : NULL;
    ds_tensor *s = kt ? ds_matmul(qs, kt) : NULL;
    ds_tensor_release(qs);
    ds_tensor_release(kt);
    ds_tensor *p = s && (!causal || mask_future(s) == 0) ? ds_softmax(s, -1) : NULL;
    ds_tensor_release(s);
    ds_tensor *o = p ? ds_matmul(p, v) : NULL;
    ds_tensor_release(p);
    ds_tensor *ot = o ? ds_transpose(o, 1, 2) : NULL;
    ds_tensor_release(o);
    ds_tensor *out = ot ? ds_contiguous(ot) : NULL;
    ds_tensor_release(ot);
    return out;
}

static int attention_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *q = n->saved[0], *k = n->saved[1], *v = n->saved[2], *out = n->saved[3], *lse = n->saved[4];
    ds_tensor *gc = g->dtype == q->dtype ? (ds_tensor_retain(g), g) : ds_to_dtype(g, q->dtype);
    ds_tensor *dq = new_grad_like(q), *dk = new_grad_like(k), *dv = new_grad_like(v);
    int rc = gc && dq && dk && dv ? 0 : -1;
    if (rc == 0 && ds_tensor_kernels(q)->attention->backward(
            ds_tensor_kview(dq), ds_tensor_kview(dk), ds_tensor_kview(dv), ds_tensor_kview(gc),
            ds_tensor_kview(q), ds_tensor_kview(k), ds_tensor_kview(v), ds_tensor_kview(out),
            ds_tensor_kview(lse), n->f[0], (int)n->i[0])) {
        ds_fail(DS_ERR_STATE, "%s: %s", OP, ds_kernel_error());
        rc = -1;
    }
    ds_tensor_release(gc);
    if (rc) {
        ds_tensor_release(dq); ds_tensor_release(dk); ds_tensor_release(dv);
        return -1;
    }
    gin[0] = dq; gin[1] = dk; gin[2] = dv;
    return 0;
}

/* ds_scaled_dot_product_attention on checked inputs whose head counts the
 * backend takes. */
static ds_tensor *attention(ds_tensor *q, ds_tensor *k, ds_tensor *v, bool causal, double scale,
                            ds_attention_backend backend) {
    if (isnan(scale)) scale = 1.0 / sqrt((double)q->shape[3]);
    if (backend == DS_ATTN_MATH) {
        ds_tensor *o = math_attention(q, k, v, causal, scale);
        ds_tensor *out = o ? ds_transpose(o, 1, 2) : NULL;
        ds_tensor_release(o);
        return out;
    }
    int64_t shape[3] = { q->shape[0], q->shape[1], q->shape[2] };
    ds_device dev = ds_tensor_device(q);
    ds_tensor *out = new_heads_inner(q->shape[0], q->shape[1], q->shape[2], v->shape[3], q->dtype, dev);
    ds_tensor *lse = ds_tensor_new(3, shape, q->dtype == DS_F64 ? DS_F64 : DS_F32, dev);
    if (!out || !lse) {
        ds_tensor_release(out); ds_tensor_release(lse);
        return NULL;
    }
    if (ds_tensor_kernels(q)->attention->forward(ds_tensor_kview(out), ds_tensor_kview(lse), ds_tensor_kview(q),
                                                 ds_tensor_kview(k), ds_tensor_kview(v), scale, causal)) {
        ds_tensor_release(out); ds_tensor_release(lse);
        return ds_fail(DS_ERR_STATE, "%s: %s", OP, ds_kernel_error());
    }
    ds_tensor *in[3] = { q, k, v };
    ds_node *n = ds_autograd_record(OP, attention_backward, 3, in, out);
    if (n) {
        n->f[0] = scale;
        n->i[0] = causal;
        if (ds_node_save(n, 0, q) || ds_node_save(n, 1, k) || ds_node_save(n, 2, v) || ds_node_save(n, 3, out) ||
            ds_node_save(n, 4, lse)) {
            ds_tensor_release(out); ds_tensor_release(lse);
            return NULL;
        }
    }
    ds_tensor_release(lse);    /* the node keeps its own reference */
    return out;
}

/* k or v with fewer heads than q, repeated to q's heads on the tape (the
 * backward sums each group's gradients), for a backend or kernel that
 * takes one head count; else x itself, retained. */
static ds_tensor *heads_for(ds_tensor *x, ds_tensor *q, ds_tensor *k, ds_tensor *v, ds_attention_backend backend) {
    const ds_kernels_attention *a = ds_tensor_kernel_table(q)->attention;
    if (x->shape[1] == q->shape[1] || (backend == DS_ATTN_FUSED &&
                                       a->grouped(ds_tensor_kview(q), ds_tensor_kview(k), ds_tensor_kview(v)))) {
        ds_tensor_retain(x);
        return x;
    }
    return ds_repeat_interleave(x, q->shape[1] / x->shape[1], 1);
}

ds_tensor *ds_scaled_dot_product_attention(ds_tensor *q, ds_tensor *k, ds_tensor *v, bool causal, double scale,
                                           ds_attention_backend backend) {
    backend = pick_backend(backend, q, k, v);
    if (check_args(q, k, v, causal, backend)) return NULL;
    ds_tensor *kh = heads_for(k, q, k, v, backend), *vh = kh ? heads_for(v, q, k, v, backend) : NULL;
    ds_tensor *out = vh ? attention(q, kh, vh, causal, scale, backend) : NULL;
    ds_tensor_release(kh);
    ds_tensor_release(vh);
    return out;
}

/* The q, k and v heads of a fused projection qkv [B,T,3*H*D], as [B,H,T,D]
 * views without history. */
static int qkv_heads(ds_tensor *qkv, int64_t H, ds_tensor *heads[3]) {
    int64_t C = qkv->shape[2] / 3, D = C / H, unit = qkv->stride[2];
    int64_t shape[4] = { qkv->shape[0], H, qkv->shape[1], D };
    int64_t stride[4] = { qkv->stride[0], D * unit, qkv->stride[1], unit };
    for (int i = 0; i < 3; i++) {
        heads[i] = ds_tensor_view_of(qkv, 4, shape, stride, qkv->offset + i * C * unit);
        if (!heads[i]) {
            while (i-- > 0) ds_tensor_release(heads[i]);
            return -1;
        }
    }
    return 0;
}

static void release_heads(ds_tensor *heads[3]) {
    for (int i = 0; i < 3; i++) ds_tensor_release(heads[i]);
}

/* [B,T,H*D] with unit last stride read as heads [B,H,T,D]. */
static ds_tensor *split_heads(ds_tensor *x, int64_t H) {
    int64_t D = x->shape[2] / H;
    int64_t shape[4] = { x->shape[0], H, x->shape[1], D }, stride[4] = { x->stride[0], D, x->stride[1], 1 };
    return ds_tensor_view_of(x, 4, shape, stride, x->offset);
}

#define QKV_OP "qkv_attention"

static int qkv_attention_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    ds_tensor *qkv = n->saved[0], *out = n->saved[1], *lse = n->saved[2];
    int64_t H = n->i[1];
    ds_tensor *gt = g->dtype == qkv->dtype ? (ds_tensor_retain(g), g) : ds_to_dtype(g, qkv->dtype);
    ds_tensor *gc = gt ? ds_contiguous(gt) : NULL;
    ds_tensor_release(gt);
    ds_tensor *dqkv = ds_tensor_new_like(qkv);
    ds_tensor *heads[3] = { NULL }, *dheads[3] = { NULL };
    ds_tensor *g4 = gc ? split_heads(gc, H) : NULL, *out4 = split_heads(out, H);
    int rc = g4 && out4 && dqkv && qkv_heads(qkv, H, heads) == 0 ? 0 : -1;
    if (rc == 0 && qkv_heads(dqkv, H, dheads)) {
        release_heads(heads);
        rc = -1;
    }
    if (rc == 0) {
        if (ds_tensor_kernels(qkv)->attention->backward(
                ds_tensor_kview(dheads[0]), ds_tensor_kview(dheads[1]), ds_tensor_kview(dheads[2]),
                ds_tensor_kview(g4), ds_tensor_kview(heads[0]), ds_tensor_kview(heads[1]),
                ds_tensor_kview(heads[2]), ds_tensor_kview(out4), ds_tensor_kview(lse), n->f[0], (int)n->i[0])) {
            ds_fail(DS_ERR_STATE, "%s: %s", QKV_OP, ds_kernel_error());
            rc = -1;
        }
        release_heads(heads);
        release_heads(dheads);
    }
    ds_tensor_release(g4); ds_tensor_release(out4); ds_tensor_release(gc);
    if (rc) {
        ds_tensor_release(dqkv);
        return -1;
    }
    gin[0] = dqkv;
    return 0;
}

/* The heads of qkv as for qkv_heads, but on the tape, for the math backend. */
static int qkv_heads_tracked(ds_tensor *qkv, int64_t H, ds_tensor *heads[3]) {
    int64_t C = qkv->shape[2] / 3, shape[4] = { qkv->shape[0], qkv->shape[1], H, C / H };
    for (int i = 0; i < 3; i++) {
        ds_tensor *part = ds_narrow(qkv, 2, i * C, C);
        ds_tensor *split = part ? ds_reshape(part, 4, shape) : NULL;
        heads[i] = split ? ds_transpose(split, 1, 2) : NULL;
        ds_tensor_release(part);
        ds_tensor_release(split);
        if (!heads[i]) {
            while (i-- > 0) ds_tensor_release(heads[i]);
            return -1;
        }
    }
    return 0;
}

ds_tensor *ds_qkv_attention(ds_tensor *qkv, int64_t n_head, bool causal, double scale,
                            ds_attention_backend backend) {
    char s[96];
    /* n_head first: 3 * n_head could overflow */
    if (qkv->ndim != 3 || n_head <= 0 || n_head > qkv->shape[2] || qkv->shape[2] % 3 != 0 ||
        qkv->shape[2] / 3 % n_head != 0)
        return ds_fail(DS_ERR_ARG, "%s: qkv must be [B,T,3*C] with C divisible by n_head %lld, got %s", QKV_OP,
                       (long long)n_head, ds_shape_str(qkv, s, sizeof s));
    if (!ds_dtype_is_float(qkv->dtype))
        return ds_fail(DS_ERR_ARG, "%s: qkv must be a floating point tensor, got %s", QKV_OP, ds_dtype_name(qkv->dtype));
    if (qkv->shape[2] == 0 || qkv->shape[1] == 0)
        return ds_fail(DS_ERR_ARG, "%s: needs a head dim and at least one position, got %s", QKV_OP,
                       ds_shape_str(qkv, s, sizeof s));
    ds_tensor *heads[3];
    if (qkv_heads(qkv, n_head, heads)) return NULL;
    backend = pick_backend(backend, heads[0], heads[1], heads[2]);
    if (check_args(heads[0], heads[1], heads[2], causal, backend)) {
        release_heads(heads);
        return NULL;
    }
    int64_t B = qkv->shape[0], T = qkv->shape[1], C = qkv->shape[2] / 3, D = C / n_head;
    if (isnan(scale)) scale = 1.0 / sqrt((double)D);
    int64_t lse_shape[3] = { B, n_head, T }, shape[3] = { B, T, C }, stride[3] = { T * C, C, 1 };
    if (backend == DS_ATTN_MATH) {
        release_heads(heads);
        if (qkv_heads_tracked(qkv, n_head, heads)) return NULL;
        ds_tensor *o = math_attention(heads[0], heads[1], heads[2], causal, scale);
        release_heads(heads);
        ds_tensor *out = o ? ds_view(o, 3, shape) : NULL;
        ds_tensor_release(o);
        return out;
    }
    ds_device dev = ds_tensor_device(qkv);
    ds_tensor *out4 = new_heads_inner(B, n_head, T, D, qkv->dtype, dev);
    ds_tensor *out = out4 ? ds_tensor_view_of(out4, 3, shape, stride, 0) : NULL;
    ds_tensor *lse = ds_tensor_new(3, lse_shape, qkv->dtype == DS_F64 ? DS_F64 : DS_F32, dev);
    int rc = out && lse ? 0 : -1;
    if (rc == 0 && ds_tensor_kernels(qkv)->attention->forward(ds_tensor_kview(out4), ds_tensor_kview(lse),
                                                              ds_tensor_kview(heads[0]), ds_tensor_kview(heads[1]),
                                                              ds_tensor_kview(heads[2]), scale, causal)) {
        ds_fail(DS_ERR_STATE, "%s: %s", QKV_OP, ds_kernel_error());
        rc = -1;
    }
    release_heads(heads);
    ds_tensor_release(out4);
    ds_node *n = rc == 0 ? ds_autograd_record(QKV_OP, qkv_attention_backward, 1, &qkv, out) : NULL;
    if (n) {
        n->f[0] = scale;
        n->i[0] = causal;
        n->i[1] = n_head;
        if (ds_node_save(n, 0, qkv) || ds_node_save(n, 1, out) || ds_node_save(n, 2, lse)) rc = -1;
    }
    ds_tensor_release(lse);
    if (rc) {
        ds_tensor_release(out);
        return NULL;
    }
    return out;
}

