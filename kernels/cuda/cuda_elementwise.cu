/* Elementwise kernels on the GPU: one thread per element, grid-stride.
 * Views are coalesced on the host; a flat view is read at i, others
 * through their strides. All-f32 binary and unary ops compute in f32 (the
 * CPU's fast loops; GELU-tanh on the hardware's exp and reciprocal),
 * everything else through double, as on the CPU.
 * Contiguous f32/bf16/f16 operands (and a bias row or one value broadcast)
 * take pw_fast_kernel instead: 16-byte accesses, f32 math, which for
 * bf16/f16 is within a unit in the last place of the f64 route. */
#include "cuda_pointwise.cuh"
#include "../ds_elem.h"

struct binary_f {
    ds_binary_op op;
    __device__ float operator()(const float *a) const { return ds_binary_apply_f(op, a[0], a[1]); }
};

/* GELU-tanh's sigmoid(2u) on the hardware's exp and reciprocal: a few ulps
 * from the CPU's ds_expf and division (the error of CUDA's own tanhf), and
 * GELU's passes are bound by memory instead of by the polynomial and the
 * division (f32 ran at 70% of the copy rate with them). */
__device__ __forceinline__ float gelu_tanh_sigmoid_fast(float x) {
    float u = 0.7978845608f * (x + 0.044715f * x * x * x);
    return __frcp_rn(1.0f + __expf(-2.0f * u));
}

__device__ __forceinline__ float gelu_tanh_fast(float x) { return x < -10.0f ? -0.0f : x * gelu_tanh_sigmoid_fast(x); }

/* ds_unary_apply_f, with GELU-tanh on the fast sigmoid (the strided path) */
__device__ __forceinline__ float unary_f32(ds_unary_op op, float v, float p) {
    return op == DS_UN_GELU_TANH ? gelu_tanh_fast(v) : ds_unary_apply_f(op, v, p);
}

struct gelu_tanh_f {
    __device__ float operator()(const float *a) const { return gelu_tanh_fast(a[0]); }
};

/* every other op: GELU-tanh takes gelu_tanh_f's kernel */
struct unary_f {
    ds_unary_op op;
    float p;
    __device__ float operator()(const float *a) const { return ds_unary_apply_f(op, a[0], p); }
};

/* inputs g, x: GELU-tanh, the training hot spot, in f32 without reading y */
struct gelu_tanh_backward_f {
    __device__ float operator()(const float *a) const {
        float x = a[1];
        return a[0] * ds_gelu_tanh_grad_from_s(x, gelu_tanh_sigmoid_fast(x));
    }
};

/* inputs g, x, y: through ds_unary_derivative in double, as the strided path */
struct unary_backward_f {
    ds_unary_op op;
    double p;
    __device__ float operator()(const float *a) const {
        return (float)((double)a[0] * ds_unary_derivative(op, a[1], a[2], p));
    }
};

static __global__ void binary_kernel(ds_binary_op op, ds_kview out, ds_kview a, ds_kview b, int64_t n, int64_t so,
                                     int64_t sa, int64_t sb) {
    bool f32 = out.dtype == DS_F32 && a.dtype == DS_F32 && b.dtype == DS_F32;
    DS_CUDA_LOOP(i, n) {
        int64_t io = pw_at(out, so, i), ia = pw_at(a, sa, i), ib = pw_at(b, sb, i);
        if (f32)
            ((float *)out.data)[io] = ds_binary_apply_f(op, ((const float *)a.data)[ia], ((const float *)b.data)[ib]);
        else
            ds_store(out.dtype, out.data, io,
                     ds_binary_apply(op, ds_load(a.dtype, a.data, ia), ds_load(b.dtype, b.data, ib)));
    }
}

static int cuda_binary(ds_binary_op op, ds_kview out, ds_kview a, ds_kview b) {
    ds_kview *v[3] = { &out, &a, &b };
    cpu_coalesce(v, 3);
    int64_t n = ds_kview_numel(&out);
    if (n == 0) return 0;
    const ds_kview *in[2] = { &a, &b };
    int rc;
    if (pw_fast_try<2>(binary_f{ op }, out, in, n, "binary fast kernel", &rc)) return rc;
    binary_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        op, out, a, b, n, pw_step(out), pw_step(a), pw_step(b));
    return ds_cuda_launched("binary_kernel");
}

static __global__ void unary_kernel(ds_unary_op op, ds_kview out, ds_kview x, double param, int64_t n, int64_t so,
                                    int64_t sx) {
    bool f32 = out.dtype == DS_F32 && x.dtype == DS_F32;
    float pf = (float)param;
    DS_CUDA_LOOP(i, n) {
        int64_t io = pw_at(out, so, i), ix = pw_at(x, sx, i);
        if (f32) {
            ((float *)out.data)[io] = unary_f32(op, ((const float *)x.data)[ix], pf);
        } else {
            ds_store(out.dtype, out.data, io, ds_unary_apply(op, ds_load(x.dtype, x.data, ix), param));
        }
    }
}

static int cuda_unary(ds_unary_op op, ds_kview out, ds_kview x, double param) {
    ds_kview *v[2] = { &out, &x };
    cpu_coalesce(v, 2);
    int64_t n = ds_kview_numel(&out);
    if (n == 0) return 0;
    const ds_kview *in[1] = { &x };
    int rc;
    if (op == DS_UN_GELU_TANH ? pw_fast_try<1>(gelu_tanh_f{}, out, in, n, "gelu fast kernel", &rc)
                              : pw_fast_try<1, 2>(unary_f{ op, (float)param }, out, in, n, "unary fast kernel", &rc))
        return rc;
    unary_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        op, out, x, param, n, pw_step(out), pw_step(x));
    return ds_cuda_launched("unary_kernel");
}

/* dx = g * d op(x)/dx in double for every dtype, as the CPU does */
static __global__ void unary_backward_kernel(ds_unary_op op, ds_kview dx, ds_kview g, ds_kview x, ds_kview y,
                                             double param, int64_t n, int64_t sd, int64_t sg, int64_t sx, int64_t sy) {
    DS_CUDA_LOOP(i, n) {
        double xv = ds_load(x.dtype, x.data, pw_at(x, sx, i));
        double yv = ds_load(y.dtype, y.data, pw_at(y, sy, i));
        double gv = ds_load(g.dtype, g.data, pw_at(g, sg, i));
        ds_store(dx.dtype, dx.data, pw_at(dx, sd, i), gv * ds_unary_derivative(op, xv, yv, param));
    }
}

static int cuda_unary_backward(ds_unary_op op, ds_kview dx, ds_kview g, ds_kview x, ds_kview y, double param) {
    ds_kview *v[4] = { &dx, &g, &x, &y };
    cpu_coalesce(v, 4);
    int64_t n = ds_kview_numel(&dx);
    if (n == 0) return 0;
    const ds_kview *in[3] = { &g, &x, &y };
    int rc;
    if (op == DS_UN_GELU_TANH ? pw_fast_try<2>(gelu_tanh_backward_f{}, dx, in, n, "gelu backward fast kernel", &rc)
                              : pw_fast_try<3, 2>(unary_backward_f{ op, param }, dx, in, n, "unary_backward fast kernel", &rc))
        return rc;
    unary_backward_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        op, dx, g, x, y, param, n, pw_step(dx), pw_step(g), pw_step(x), pw_step(y));
    return ds_cuda_launched("unary_backward_kernel");
}

static __global__ void where_kernel(ds_kview out, ds_kview cond, ds_kview a, ds_kview b, int64_t n, int64_t so,
                                    int64_t sc, int64_t sa, int64_t sb) {
    DS_CUDA_LOOP(i, n) {
        double v = ds_load(cond.dtype, cond.data, pw_at(cond, sc, i)) != 0
                   ? ds_load(a.dtype, a.data, pw_at(a, sa, i)) : ds_load(b.dtype, b.data, pw_at(b, sb, i));
        ds_store(out.dtype, out.data, pw_at(out, so, i), v);
    }
}

static int cuda_where(ds_kview out, ds_kview cond, ds_kview a, ds_kview b) {
    ds_kview *v[4] = { &out, &cond, &a, &b };
    cpu_coalesce(v, 4);
    int64_t n = ds_kview_numel(&out);
    if (n == 0) return 0;
    where_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        out, cond, a, b, n, pw_step(out), pw_step(cond), pw_step(a), pw_step(b));
    return ds_cuda_launched("where_kernel");
}

/* ---- SwiGLU: forward on pw_fast_kernel where it applies (SiLU's f32
 * math, the product rounded once), else through ds_swiglu_elem; backward
 * one thread per 8 elements of contiguous 16-bit-aligned floats, writing
 * both gradients, the math in double as SiLU's backward ---- */

struct swiglu_f {
    __device__ float operator()(const float *a) const { return ds_swiglu_f(a[0], a[1]); }
};

static __global__ void swiglu_kernel(ds_kview out, ds_kview gate, ds_kview up, int64_t n, int64_t so, int64_t sg,
                                     int64_t su) {
    DS_CUDA_LOOP(i, n) {
        double g = ds_load(gate.dtype, gate.data, pw_at(gate, sg, i)), u = ds_load(up.dtype, up.data, pw_at(up, su, i));
        ds_store(out.dtype, out.data, pw_at(out, so, i), ds_swiglu_elem(out.dtype, g, u));
    }
}

static int cuda_swiglu(ds_kview out, ds_kview gate, ds_kview up) {
    ds_kview *v[3] = { &out, &gate, &up };
    cpu_coalesce(v, 3);
    int64_t n = ds_kview_numel(&out);
    if (n == 0) return 0;
    const ds_kview *in[2] = { &gate, &up };
    int rc;
    if (pw_fast_try<2>(swiglu_f{}, out, in, n, "swiglu fast kernel", &rc)) return rc;
    swiglu_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        out, gate, up, n, pw_step(out), pw_step(gate), pw_step(up));
    return ds_cuda_launched("swiglu_kernel");
}

/* v: dgate, dup, g, gate, up; vec: all contiguous, 16-byte aligned and
 * f32, bf16 or f16, read and written 8 at a time */
static __global__ void swiglu_backward_kernel(ds_kview dg, ds_kview du, ds_kview g, ds_kview gate, ds_kview up,
                                              int64_t n, bool vec) {
    int64_t nv = vec ? n / PW_VEC : 0;
    DS_CUDA_LOOP(c, nv) {
        float x[3][PW_VEC], y[2][PW_VEC];
        pw_load8(g.dtype, g.data, c * PW_VEC, x[0]);
        pw_load8(gate.dtype, gate.data, c * PW_VEC, x[1]);
        pw_load8(up.dtype, up.data, c * PW_VEC, x[2]);
        for (int k = 0; k < PW_VEC; k++) {
            double a, b;
            ds_swiglu_elem_backward(x[0][k], x[1][k], x[2][k], &a, &b);
            y[0][k] = (float)a;
            y[1][k] = (float)b;
        }
        pw_store8(dg.dtype, dg.data, c * PW_VEC, y[0]);
        pw_store8(du.dtype, du.data, c * PW_VEC, y[1]);
    }
    int64_t st = vec ? 1 : -1;   /* the tail of flat views, or every element through the strides */
    DS_CUDA_LOOP(t, n - nv * PW_VEC) {
        int64_t i = nv * PW_VEC + t;
        double a, b;
        ds_swiglu_elem_backward(ds_load(g.dtype, g.data, pw_at(g, st, i)),
                                ds_load(gate.dtype, gate.data, pw_at(gate, st, i)),
                                ds_load(up.dtype, up.data, pw_at(up, st, i)), &a, &b);
        ds_store(dg.dtype, dg.data, pw_at(dg, st, i), a);
        ds_store(du.dtype, du.data, pw_at(du, st, i), b);
    }
}

static int cuda_swiglu_backward(ds_kview dgate, ds_kview dup, ds_kview g, ds_kview gate, ds_kview up) {
    ds_kview *v[5] = { &dgate, &dup, &g, &gate, &up };
    cpu_coalesce(v, 5);
    int64_t n = ds_kview_numel(&dgate);
    if (n == 0) return 0;
    bool vec = true;
    for (int k = 0; k < 5; k++)
        vec = vec && pw_is_f32ish(v[k]->dtype) && ds_kview_is_contiguous(v[k]) && pw_aligned(v[k]->data);
    swiglu_backward_kernel<<<pw_fast_blocks(n, vec, PW_VEC), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        dgate, dup, g, gate, up, n, vec);
    return ds_cuda_launched("swiglu_backward_kernel");
}

extern "C" const ds_kernels_elementwise ds_cuda_elementwise = {
    cuda_binary, cuda_unary, cuda_unary_backward, cuda_where, cuda_swiglu, cuda_swiglu_backward,
};
