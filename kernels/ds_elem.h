/* Per-element math shared by the CPU and CUDA kernels: one definition of
 * each function and of its derivative. */
#ifndef DS_ELEM_H
#define DS_ELEM_H

#include "ds_kernels.h"
#include "ds_expf.h"
#include "ds_half.h"
#include <math.h>
#include <stdbool.h>

#define DS_SQRT_2_OVER_PI 0.7978845608028654
#define DS_INV_SQRT_2 0.7071067811865476
#define DS_INV_SQRT_2PI 0.3989422804014327

DS_HOSTDEV double ds_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

DS_HOSTDEV double ds_binary_apply(ds_binary_op op, double a, double b) {
    switch (op) {
    case DS_BIN_ADD: return a + b;
    case DS_BIN_SUB: return a - b;
    case DS_BIN_MUL: return a * b;
    case DS_BIN_DIV: return a / b;
    case DS_BIN_POW: return pow(a, b);
    case DS_BIN_MAX: return a > b || a != a ? a : b;   /* NaN propagates */
    case DS_BIN_MIN: return a < b || a != a ? a : b;
    case DS_BIN_EQ: return a == b;
    case DS_BIN_NE: return a != b;
    case DS_BIN_LT: return a < b;
    case DS_BIN_LE: return a <= b;
    case DS_BIN_GT: return a > b;
    case DS_BIN_GE: return a >= b;
    default: return 0;
    }
}

/* float versions of the same, for the fast f32 loops */
DS_HOSTDEV float ds_binary_apply_f(ds_binary_op op, float a, float b) {
    switch (op) {
    case DS_BIN_ADD: return a + b;
    case DS_BIN_SUB: return a - b;
    case DS_BIN_MUL: return a * b;
    case DS_BIN_DIV: return a / b;
    default: return (float)ds_binary_apply(op, a, b);
    }
}

DS_HOSTDEV double ds_unary_apply(ds_unary_op op, double x, double p) {
    switch (op) {
    case DS_UN_NEG: return -x;
    case DS_UN_EXP: return exp(x);
    case DS_UN_LOG: return log(x);
    case DS_UN_SQRT: return sqrt(x);
    case DS_UN_RSQRT: return 1.0 / sqrt(x);
    case DS_UN_TANH: return tanh(x);
    case DS_UN_SIGMOID: return ds_sigmoid(x);
    case DS_UN_ABS: return fabs(x);
    case DS_UN_POW_SCALAR: return pow(x, p);
    case DS_UN_RELU: return x > 0 ? x : 0;
    case DS_UN_GELU_TANH: return 0.5 * x * (1.0 + tanh(DS_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)));
    case DS_UN_GELU_ERF: return 0.5 * x * (1.0 + erf(x * DS_INV_SQRT_2));
    case DS_UN_SILU: return x * ds_sigmoid(x);
    default: return 0;
    }
}

DS_HOSTDEV float ds_unary_apply_f(ds_unary_op op, float x, float p) {
    switch (op) {
    case DS_UN_NEG: return -x;
    case DS_UN_EXP: return expf(x);
    case DS_UN_LOG: return logf(x);
    case DS_UN_SQRT: return sqrtf(x);
    case DS_UN_RSQRT: return 1.0f / sqrtf(x);
    case DS_UN_TANH: return tanhf(x);
    case DS_UN_SIGMOID: return 1.0f / (1.0f + expf(-x));
    case DS_UN_ABS: return fabsf(x);
    case DS_UN_POW_SCALAR: return powf(x, p);
    case DS_UN_RELU: return x > 0 ? x : 0;
    case DS_UN_GELU_TANH:
        return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
    case DS_UN_GELU_ERF: return 0.5f * x * (1.0f + erff(x * 0.70710678f));
    case DS_UN_SILU: return x / (1.0f + expf(-x));
    default: return 0;
    }
}

/* GELU, tanh form, as the vectorised f32 loops compute it:
 * 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)), one exp and no cancellation
 * where x is very negative; below x = -10 the result is flushed to -0. */
DS_HOSTDEV float ds_gelu_tanh_f(float x) {
    float u = 0.7978845608f * (x + 0.044715f * x * x * x);
    float y = x / (1.0f + ds_expf(-2.0f * u));
    return x < -10.0f ? -0.0f : y;
}

/* d/dx of ds_gelu_tanh_f's x s(2u): s + 2 x s (1 - s) du/dx, in f32 for
 * the vectorised loops of GELU's backward. Beyond |x| = 10, s is 0 or 1 in
 * f32 and so is the gradient; the formula would give NaN there once x * x
 * overflows (|x| > 1.8e19, infinities too). */
DS_HOSTDEV float ds_gelu_tanh_grad_from_s(float x, float s) {
    float g = s + 2.0f * x * s * (1.0f - s) * 0.7978845608f * (1.0f + 3.0f * 0.044715f * x * x);
    return x > 10.0f ? 1.0f : x < -10.0f ? 0.0f : g;
}

DS_HOSTDEV float ds_gelu_tanh_grad_f(float x) {
    float u = 0.7978845608f * (x + 0.044715f * x * x * x);
    return ds_gelu_tanh_grad_from_s(x, 1.0f / (1.0f + ds_expf(-2.0f * u)));
}

/* Whether ds_unary_derivative reads y: the others need only x, so their
 * nodes need not keep the output alive for backward. */
DS_HOSTDEV bool ds_unary_reads_out(ds_unary_op op) {
    return op == DS_UN_EXP || op == DS_UN_SQRT || op == DS_UN_RSQRT || op == DS_UN_TANH || op == DS_UN_SIGMOID;
}

/* d op(x)/dx, given x and y = op(x) */
DS_HOSTDEV double ds_unary_derivative(ds_unary_op op, double x, double y, double p) {
    switch (op) {
    case DS_UN_NEG: return -1;
    case DS_UN_EXP: return y;
    case DS_UN_LOG: return 1.0 / x;
    case DS_UN_SQRT: return 0.5 / y;
    case DS_UN_RSQRT: return -0.5 * y * y * y;
    case DS_UN_TANH: return 1.0 - y * y;
    case DS_UN_SIGMOID: return y * (1.0 - y);
    case DS_UN_ABS: return x > 0 ? 1 : x < 0 ? -1 : 0;
    case DS_UN_POW_SCALAR: return p == 0 ? 0 : p * pow(x, p - 1);
    case DS_UN_RELU: return x > 0 ? 1 : 0;
    case DS_UN_GELU_TANH: {
        double u = DS_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
        double t = tanh(u);
        double du = DS_SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x);
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du;
    }
    case DS_UN_GELU_ERF:
        return 0.5 * (1.0 + erf(x * DS_INV_SQRT_2)) + x * DS_INV_SQRT_2PI * exp(-0.5 * x * x);
    case DS_UN_SILU: {
        double s = ds_sigmoid(x);
        return s * (1.0 + x * (1.0 - s));
    }
    default: return 0;
    }
}

/* SwiGLU in f32: SiLU's own f32 expression, then the product (for f32
 * the bits of silu then mul). */
DS_HOSTDEV float ds_swiglu_f(float g, float u) { return ds_unary_apply_f(DS_UN_SILU, g, 0.0f) * u; }

/* SwiGLU, silu(g) u, stored as t: in f32 for f32, bf16 and f16
 * (ds_swiglu_f, rounded once to t), in double for f64. */
DS_HOSTDEV double ds_swiglu_elem(ds_dtype t, double g, double u) {
    if (t == DS_F64) return g * ds_sigmoid(g) * u;
    return ds_swiglu_f((float)g, (float)u);
}

/* Its gradients from d, the output's: d u silu'(g) and d silu(g), in
 * double for every dtype as SiLU's backward computes. */
DS_HOSTDEV void ds_swiglu_elem_backward(double d, double g, double u, double *dg, double *du) {
    *dg = d * u * ds_unary_derivative(DS_UN_SILU, g, 0, 0);
    *du = d * g * ds_sigmoid(g);
}

/* v rounded to t's precision, as a store and a load of t round it */
DS_HOSTDEV double ds_round_to(ds_dtype t, double v) {
    switch (t) {
    case DS_F32: return (float)v;
    case DS_BF16: return ds_bf16_to_f32(ds_f32_to_bf16((float)v));
    case DS_F16: return ds_f16_to_f32(ds_f32_to_f16((float)v));
    default: return v;
    }
}

/* A product and a sum each rounded once, never contracted into a
 * multiply-add, as separate kernels round them (CUDA's intrinsics; the
 * CPU's callers build with -ffp-contract=off). */
#ifdef __CUDA_ARCH__
#define DS_MUL_RN(a, b) __dmul_rn(a, b)
#define DS_ADD_RN(a, b) __dadd_rn(a, b)
#else
#define DS_MUL_RN(a, b) ((a) * (b))
#define DS_ADD_RN(a, b) ((a) + (b))
#endif

/* Rotary embedding in the rotate_half form, element i of a row of halves
 * h, in dtype t: x_i c_i + r_i s_i with r = cat(-x[h:], x[:h]); v is x_i,
 * vp its partner (x[i + h] in the first half, x[i - h] in the second).
 * Each product and the sum rounded to t as the composed mul, neg, cat and
 * add round them (double holds an f32 product exactly, and rounds an f32
 * sum as f32 does), so the result is theirs to the bit. */
DS_HOSTDEV double ds_rope_elem(ds_dtype t, bool first, double v, double c, double vp, double s) {
    double a = ds_round_to(t, DS_MUL_RN(v, c)), b = ds_round_to(t, DS_MUL_RN(first ? -vp : vp, s));
    return ds_round_to(t, DS_ADD_RN(a, b));
}

/* Its gradient from g, the output's: g_i c_i + q_i with q = cat(g[h:]
 * s[h:], -(g[:h] s[:h])) (gp and sp the partner's g and s), as the
 * composed ops' backward sums it; the partner's term comes through a
 * zero-filled slice, which turns a -0 sum into +0. */
DS_HOSTDEV double ds_rope_elem_backward(ds_dtype t, bool first, double g, double c, double gp, double sp) {
    double a = ds_round_to(t, DS_MUL_RN(g, c)), q = ds_round_to(t, DS_MUL_RN(gp, sp));
    return DS_ADD_RN(ds_round_to(t, DS_ADD_RN(a, first ? q : -q)), 0.0);
}

#endif
