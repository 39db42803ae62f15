/* Per-element optimizer updates, shared by the CPU and CUDA kernels.
 * Everything is f32 in registers, as in DeepSpeed's fused kernels; factors
 * that depend only on the step (bias corrections, decayed learning rates)
 * are computed once per step by the caller, and a gradient g arrives
 * already times the step's grad_scale (Lamb's moments excepted). */
#ifndef DS_OPTIM_ELEM_H
#define DS_OPTIM_ELEM_H

#include "ds_kernels.h"
#include "ds_half.h"
#include <math.h>

/* The k buffers of one fused step (host side, before any kernel): every
 * one contiguous f32 of v[0]'s length; NULL data past the first two means
 * "absent". */
static inline int ds_optim_check_buffers(const char *op, const ds_kview *v, int k) {
    int64_t n = ds_kview_numel(&v[0]);
    for (int i = 0; i < k; i++) {
        if (!v[i].data && i > 1) continue;
        if (v[i].dtype != DS_F32 || !ds_kview_is_contiguous(&v[i]) || ds_kview_numel(&v[i]) != n)
            return ds_kernel_fail("%s: buffer %d is not a contiguous f32 buffer of %lld elements", op, i,
                                  (long long)n);
    }
    return 0;
}

/* A step's 16-bit copy of p (host side): absent (NULL data), or
 * contiguous bf16 or f16 of n elements. */
static inline int ds_optim_check_shadow(const char *op, ds_kview shadow, int64_t n) {
    if (!shadow.data) return 0;
    if ((shadow.dtype != DS_BF16 && shadow.dtype != DS_F16) || !ds_kview_is_contiguous(&shadow) ||
        ds_kview_numel(&shadow) != n)
        return ds_kernel_fail("%s: the 16-bit copy is not a contiguous bf16 or f16 buffer of %lld elements", op,
                              (long long)n);
    return 0;
}

/* An updated parameter as its 16-bit copy holds it, rounded as a copy
 * rounds it. */
DS_HOSTDEV uint16_t ds_optim_half(float p, ds_dtype t) { return t == DS_BF16 ? ds_f32_to_bf16(p) : ds_f32_to_f16(p); }

/* torch.optim.SGD without momentum: L2 decay folded into the gradient. */
DS_HOSTDEV void ds_sgd_elem(float *p, float g, float lr, float wd) {
    *p -= lr * (g + wd * *p);
}

/* torch.optim.SGD with momentum: the buffer starts as the first gradient
 * (no dampening on that step); Nesterov looks one momentum step ahead. */
DS_HOSTDEV void ds_sgd_momentum_elem(float *p, float *buf, float g, float lr, float wd, float momentum,
                                     float dampening, int nesterov, int first) {
    float d = g + wd * *p;
    float b = first ? d : momentum * *buf + (1.0f - dampening) * d;
    *buf = b;
    *p -= lr * (nesterov ? d + momentum * b : b);
}

/* torch.optim.Adam / AdamW (= DeepSpeed's FusedAdam with adam_w_mode 0 /
 * 1): decay is L2 on the gradient, or decoupled as p *= 1 - lr wd.
 * step_size = lr / (1 - beta1^t), sqrt_bc2 = sqrt(1 - beta2^t). */
DS_HOSTDEV void ds_adam_elem(float *p, float *m, float *v, float g, float beta1, float beta2, float eps, float wd,
                             float decay, float step_size, float sqrt_bc2, int decoupled) {
    float pv = *p;
    g = decoupled ? g : g + wd * pv;
    pv = decoupled ? pv * decay : pv;
    float mv = beta1 * *m + (1.0f - beta1) * g;
    float vv = beta2 * *v + (1.0f - beta2) * g * g;
    *m = mv;
    *v = vv;
    *p = pv - step_size * (mv / (sqrtf(vv) / sqrt_bc2 + eps));
}

/* torch.optim.Adagrad; clr = lr / (1 + (t - 1) lr_decay). */
DS_HOSTDEV void ds_adagrad_elem(float *p, float *sum, float g, float clr, float eps, float wd) {
    g += wd * *p;
    float s = *sum + g * g;
    *sum = s;
    *p -= clr * g / (sqrtf(s) + eps);
}

/* DeepSpeed's FusedLamb, first pass: the moments, without bias correction
 * (it is folded into the step size). */
DS_HOSTDEV void ds_lamb_moments(float *m, float *v, float g, float beta1, float beta2, float grad_scale) {
    float sg = g / grad_scale;
    *m = beta1 * *m + (1.0f - beta1) * sg;
    *v = beta2 * *v + (1.0f - beta2) * sg * sg;
}

/* FusedLamb's update direction, before the trust ratio. The ratio itself
 * is taken on the host (core/train/ds_optim.c) from each parameter's
 * squared norms, which may be summed over the ranks holding its pieces. */
DS_HOSTDEV float ds_lamb_update(float p, float m, float v, float eps, float wd, int eps_inside_sqrt) {
    float denom = eps_inside_sqrt ? sqrtf(v + eps) : sqrtf(v) + eps;
    return m / denom + wd * p;
}

/* Lamb's pieces (host side): nseg + 1 offsets rising from 0 to n. */
static inline int ds_lamb_check_segments(const char *op, const int64_t *seg, int nseg, int64_t n) {
    if (nseg < 0) return ds_kernel_fail("%s: %d segments", op, nseg);
    if (seg[0] != 0 || seg[nseg] != n)
        return ds_kernel_fail("%s: %d segments cover [%lld, %lld) of %lld elements", op, nseg, (long long)seg[0],
                              (long long)seg[nseg], (long long)n);
    for (int k = 0; k < nseg; k++)
        if (seg[k + 1] < seg[k])
            return ds_kernel_fail("%s: segment %d ends at %lld, before its start %lld", op, k, (long long)seg[k + 1],
                                  (long long)seg[k]);
    return 0;
}

/* Lion (lion-pytorch): decoupled decay, the sign of the interpolated
 * momentum (0 where it is 0), then the momentum update with beta2. */
DS_HOSTDEV void ds_lion_elem(float *p, float *m, float g, float lr, float beta1, float beta2, float decay) {
    float c = beta1 * *m + (1.0f - beta1) * g;
    float s = (float)(c > 0.0f) - (float)(c < 0.0f);
    *p = *p * decay - lr * s;
    *m = beta2 * *m + (1.0f - beta2) * g;
}

/* The 1-bit kernels' buffers (host side): x and err (absent: NULL data)
 * contiguous f32 of one length, a multiple of 8; bits contiguous u8 of an
 * eighth of it. */
static inline int ds_onebit_check(const char *op, ds_kview x, ds_kview err, ds_kview bits) {
    int64_t n = ds_kview_numel(&x);
    if (x.dtype != DS_F32 || !ds_kview_is_contiguous(&x) || n % 8 != 0)
        return ds_kernel_fail("%s: x must be contiguous f32 of a multiple of 8 elements (%lld)", op, (long long)n);
    if (err.data && (err.dtype != DS_F32 || !ds_kview_is_contiguous(&err) || ds_kview_numel(&err) != n))
        return ds_kernel_fail("%s: err must be contiguous f32 of %lld elements", op, (long long)n);
    if (bits.dtype != DS_U8 || !ds_kview_is_contiguous(&bits) || ds_kview_numel(&bits) != n / 8)
        return ds_kernel_fail("%s: bits must be contiguous u8 of %lld bytes", op, (long long)(n / 8));
    return 0;
}

/* 1-bit compression of 8 elements into one byte: bit k set when x[k] >= 0
 * (NaN and -0 count as positive, as torch's sign() + 1 cast to bool), and
 * err[k] = what scale times the sign misses. */
DS_HOSTDEV uint8_t ds_onebit_pack8(const float *x, float *err, float scale) {
    uint8_t b = 0;
    for (int k = 0; k < 8; k++) {
        int pos = !(x[k] < 0.0f);
        b = (uint8_t)(b | (pos << k));
        err[k] = x[k] - (pos ? scale : -scale);
    }
    return b;
}

DS_HOSTDEV float ds_onebit_unpack1(uint8_t byte, int k, float scale) { return (byte >> k) & 1 ? scale : -scale; }

/* The pointwise steps of DeepSpeed's OnebitAdam and ZeroOneAdam
 * (ds_onebit_op says what each does). g and acc may be NULL where op does
 * not read them. */
DS_HOSTDEV void ds_onebit_elem(int op, float *p, const float *g, float *m, const float *v, float *acc, float beta1,
                               float eps, float lr, float wd, float lrs) {
    float d = sqrtf(*v) + eps;
    if (op == DS_ONEBIT_MOMENTUM) {
        *m = beta1 * *m + (1.0f - beta1) * *g;
    } else if (op == DS_ONEBIT_APPLY) {
        float u = *m / d + wd * *p;
        *p -= lr * u;
        if (acc) *acc -= lr * u;
    } else if (op == DS_ONEBIT_UNDO) {
        *p -= *acc;
        *acc *= d;
    } else {
        *m = -*acc / lrs;
        *p += *acc / d;
        *acc = 0.0f;
    }
}

#endif
