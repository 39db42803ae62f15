#include "ds_ops.h"
#include "ds_op_fp8.h"
#include "ds_error.h"

#include <stdio.h>

static int check_meta(const char *op, const ds_tensor *meta, const ds_tensor *t) {
    char s[64];
    if (meta->dtype != DS_F32 || meta->ndim != 1 || meta->shape[0] != 3)
        return ds_fail(DS_ERR_ARG, "%s: meta must be f32 [3] (scale, scale_inv, amax), got %s %s", op,
                       ds_dtype_name(meta->dtype), ds_shape_str(meta, s, sizeof s)), -1;
    return ds_check_same_device(op, t, meta);
}

static int check_codes(const char *op, const char *name, const ds_tensor *q) {
    if (q->dtype == DS_U8) return 0;
    return ds_fail(DS_ERR_ARG, "%s: %s must hold fp8 codes (u8), got %s", op, name, ds_dtype_name(q->dtype)), -1;
}

static ds_tensor *kernel_failed(const char *op, ds_tensor *drop) {
    ds_tensor_release(drop);
    ds_fail(DS_ERR_STATE, "%s: %s", op, ds_kernel_error());
    return NULL;
}

/* given: NULL, or f32 [1] on x's device */
static int check_given(const char *op, const ds_tensor *given, const ds_tensor *x) {
    char s[64];
    if (!given) return 0;
    if (given->dtype != DS_F32 || given->ndim != 1 || given->shape[0] != 1)
        return ds_fail(DS_ERR_ARG, "%s: amax must be f32 [1], got %s %s", op, ds_dtype_name(given->dtype),
                       ds_shape_str(given, s, sizeof s)), -1;
    return ds_check_same_device(op, x, given);
}

static int check_cast(const char *op, ds_tensor *x, ds_tensor *meta, ds_tensor *amax) {
    if (!ds_dtype_is_float(x->dtype))
        return ds_fail(DS_ERR_ARG, "%s: x must be floating point, got %s", op, ds_dtype_name(x->dtype)), -1;
    return check_meta(op, meta, x) || check_given(op, amax, x) ? -1 : 0;
}

ds_tensor *ds_fp8_cast(ds_tensor *x, ds_tensor *meta, ds_fp8_format fmt, int current, int margin, ds_tensor *amax) {
    if (check_cast("fp8_cast", x, meta, amax)) return NULL;
    ds_tensor *xc = ds_contiguous(x);
    if (!xc) return NULL;
    ds_kview none = { .data = NULL };
    ds_tensor *q = ds_tensor_new(x->ndim, x->shape, DS_U8, ds_tensor_device(x));
    if (q && ds_tensor_kernels(x)->fp8->cast(ds_tensor_kview_w(q, "fp8_cast"), ds_tensor_kview(xc),
                                              ds_tensor_kview_w(meta, "fp8_cast"), fmt, current, margin,
                                              amax ? ds_tensor_kview(amax) : none))
        q = kernel_failed("fp8_cast", q);
    ds_tensor_release(xc);
    return q;
}

int ds_fp8_cast_transpose(ds_tensor *x, ds_tensor *meta, ds_fp8_format fmt, int current, int margin, ds_tensor *amax,
                          ds_tensor **q, ds_tensor **qt) {
    char s[64];
    *q = *qt = NULL;
    if (check_cast("fp8_cast_transpose", x, meta, amax)) return -1;
    if (x->ndim != 2)
        return ds_fail(DS_ERR_ARG, "fp8_cast_transpose: x must be 2-D [m, k], got %s", ds_shape_str(x, s, sizeof s)),
               -1;
    ds_tensor *xc = ds_contiguous(x);
    if (!xc) return -1;
    int64_t tshape[2] = { x->shape[1], x->shape[0] };
    ds_kview none = { .data = NULL };
    ds_tensor *a = ds_tensor_new(2, x->shape, DS_U8, ds_tensor_device(x));
    ds_tensor *b = a ? ds_tensor_new(2, tshape, DS_U8, ds_tensor_device(x)) : NULL;
    int rc = !b ? -1 : ds_tensor_kernels(x)->fp8->cast_transpose(
        ds_tensor_kview_w(a, "fp8_cast_transpose"), ds_tensor_kview_w(b, "fp8_cast_transpose"), ds_tensor_kview(xc),
        ds_tensor_kview_w(meta, "fp8_cast_transpose"), fmt, current, margin, amax ? ds_tensor_kview(amax) : none);
    ds_tensor_release(xc);
    if (rc) {
        if (b) kernel_failed("fp8_cast_transpose", b);
        ds_tensor_release(a);
        return -1;
    }
    *q = a;
    *qt = b;
    return 0;
}

ds_tensor *ds_fp8_amax(ds_tensor *x) {
    if (!ds_dtype_is_float(x->dtype))
        return ds_fail(DS_ERR_ARG, "fp8_amax: x must be floating point, got %s", ds_dtype_name(x->dtype)), NULL;
    ds_tensor *xc = ds_contiguous(x);
    if (!xc) return NULL;
    int64_t one = 1;
    ds_tensor *out = ds_tensor_new(1, &one, DS_F32, ds_tensor_device(x));
    if (out && ds_tensor_kernels(x)->fp8->amax(ds_tensor_kview_w(out, "fp8_amax"), ds_tensor_kview(xc)))
        out = kernel_failed("fp8_amax", out);
    ds_tensor_release(xc);
    return out;
}

ds_tensor *ds_fp8_uncast(ds_tensor *q, ds_tensor *meta, ds_fp8_format fmt, ds_dtype dtype) {
    if (check_codes("fp8_uncast", "q", q) || check_meta("fp8_uncast", meta, q)) return NULL;
    if (!ds_dtype_is_float(dtype))
        return ds_fail(DS_ERR_ARG, "fp8_uncast: dtype must be floating point, got %s", ds_dtype_name(dtype)), NULL;
    ds_tensor *qc = ds_contiguous(q);
    if (!qc) return NULL;
    ds_tensor *y = ds_tensor_new(q->ndim, q->shape, dtype, ds_tensor_device(q));
    if (y && ds_tensor_kernels(q)->fp8->uncast(ds_tensor_kview_w(y, "fp8_uncast"), ds_tensor_kview(qc),
                                                ds_tensor_kview(meta), fmt))
        y = kernel_failed("fp8_uncast", y);
    ds_tensor_release(qc);
    return y;
}

static int check_gemm(const ds_tensor *a, const ds_tensor *a_meta, const ds_tensor *b, const ds_tensor *b_meta,
                      const ds_tensor *bias, ds_dtype dtype) {
    char s1[64], s2[64];
    if (check_codes("fp8_gemm", "a", a) || check_codes("fp8_gemm", "b", b) || check_meta("fp8_gemm", a_meta, a) ||
        check_meta("fp8_gemm", b_meta, b) || ds_check_same_device("fp8_gemm", a, b) ||
        (bias && ds_check_same_device("fp8_gemm", a, bias)))
        return -1;
    if (a->ndim != 2 || b->ndim != 2 || a->shape[1] != b->shape[1])
        return ds_fail(DS_ERR_ARG, "fp8_gemm: a [m, k] and b [n, k] expected, got a %s and b %s",
                       ds_shape_str(a, s1, sizeof s1), ds_shape_str(b, s2, sizeof s2)), -1;
    if (bias && (bias->ndim != 1 || bias->shape[0] != b->shape[0] || bias->dtype != dtype))
        return ds_fail(DS_ERR_ARG, "fp8_gemm: bias must be %s [%lld], got %s %s", ds_dtype_name(dtype),
                       (long long)b->shape[0], ds_dtype_name(bias->dtype), ds_shape_str(bias, s1, sizeof s1)), -1;
    if (!ds_dtype_is_float(dtype))
        return ds_fail(DS_ERR_ARG, "fp8_gemm: dtype must be floating point, got %s", ds_dtype_name(dtype)), -1;
    return 0;
}

/* bias where its data starts on 16 bytes and is contiguous (what the GEMM
 * epilogue reads), else a copy that does: a parameter may be a view into a
 * flat buffer at any element. */
static ds_tensor *aligned(ds_tensor *bias) {
    if (ds_tensor_is_contiguous(bias) && (uintptr_t)ds_tensor_kview(bias).data % 16 == 0) {
        ds_tensor_retain(bias);
        return bias;
    }
    ds_tensor *c = ds_tensor_new(1, bias->shape, bias->dtype, ds_tensor_device(bias));
    if (c && ds_copy_(c, bias)) {
        ds_tensor_release(c);
        return NULL;
    }
    return c;
}

/* The backend's fp8 GEMM, or NULL without an error where it has none or
 * refuses the call (said once: the fallback is slower, not wrong). */
static ds_tensor *device_gemm(ds_tensor *a, ds_tensor *a_meta, ds_fp8_format af, ds_tensor *b, ds_tensor *b_meta,
                              ds_fp8_format bf, ds_tensor *bias, ds_dtype dtype) {
    static int told;
    const ds_kernels_fp8 *k = ds_tensor_kernels(a)->fp8;
    if (!k->gemm) return NULL;
    int64_t shape[2] = { a->shape[0], b->shape[0] };
    ds_tensor *c = ds_tensor_new(2, shape, dtype, ds_tensor_device(a)), *bc = bias ? aligned(bias) : NULL;
    if (!c || (bias && !bc)) {
        ds_tensor_release(c);
        return NULL;
    }
    ds_kview none = { .data = NULL };
    int rc = k->gemm(ds_tensor_kview_w(c, "fp8_gemm"), ds_tensor_kview(a), ds_tensor_kview(b),
                     ds_tensor_kview(a_meta), ds_tensor_kview(b_meta), af, bf, bc ? ds_tensor_kview(bc) : none);
    ds_tensor_release(bc);
    if (rc == 0) return c;
    if (!told++) fprintf(stderr, "dslua: fp8_gemm: %s; fp8 GEMMs run on the uncast operands\n", ds_kernel_error());
    ds_tensor_release(c);
    return NULL;
}

/* The codes' values, unscaled: uncast through a meta of ones. */
static ds_tensor *values(ds_tensor *q, ds_fp8_format fmt) {
    int64_t three = 3;
    ds_tensor *unit = ds_tensor_new(1, &three, DS_F32, DS_CPU_DEVICE);
    if (!unit) return NULL;
    for (int k = 0; k < 3; k++) ds_tensor_set(unit, k, 1.0);
    ds_tensor *m = ds_to_device(unit, ds_tensor_device(q));
    ds_tensor_release(unit);
    ds_tensor *v = m ? ds_fp8_uncast(q, m, fmt, DS_F32) : NULL;
    ds_tensor_release(m);
    return v;
}

static ds_tensor *composed_gemm(ds_tensor *a, ds_tensor *a_meta, ds_fp8_format af, ds_tensor *b, ds_tensor *b_meta,
                                ds_fp8_format bf, ds_tensor *bias, ds_dtype dtype) {
    ds_tensor *va = values(a, af), *vb = va ? values(b, bf) : NULL;
    ds_tensor *c = vb ? ds_linear(va, vb, NULL) : NULL;
    ds_tensor_release(va);
    ds_tensor_release(vb);
    if (!c) return NULL;
    ds_tensor *scaled = ds_mul_scalar(c, ds_tensor_get(a_meta, 1) * ds_tensor_get(b_meta, 1));
    ds_tensor_release(c);
    if (scaled && bias) {
        ds_tensor *b32 = ds_to_dtype(bias, DS_F32);
        c = b32 ? ds_add(scaled, b32) : NULL;
        ds_tensor_release(b32);
        ds_tensor_release(scaled);
        scaled = c;
    }
    if (!scaled) return NULL;
    c = ds_to_dtype(scaled, dtype);
    ds_tensor_release(scaled);
    return c;
}

ds_tensor *ds_fp8_gemm(ds_tensor *a, ds_tensor *a_meta, ds_fp8_format a_fmt, ds_tensor *b, ds_tensor *b_meta,
                       ds_fp8_format b_fmt, ds_tensor *bias, ds_dtype dtype) {
    if (check_gemm(a, a_meta, b, b_meta, bias, dtype)) return NULL;
    bool grad = ds_set_grad_enabled(false);
    ds_tensor *c = device_gemm(a, a_meta, a_fmt, b, b_meta, b_fmt, bias, dtype);
    if (!c) c = composed_gemm(a, a_meta, a_fmt, b, b_meta, b_fmt, bias, dtype);
    ds_set_grad_enabled(grad);
    return c;
}
