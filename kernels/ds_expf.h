/* The f32 exp of the vectorised loops (softmax rows, attention scores,
 * tanh), shared by the CPU and CUDA kernels. */
#ifndef DS_EXPF_H
#define DS_EXPF_H

#include "ds_kview.h"
#include <math.h>

/* Cephes' range reduction and polynomial (about 1 ulp), branch-free and
 * without memcpy so loops over it vectorise; results below FLT_MIN (and
 * exp(-inf)) flush to 0, overflow gives inf, NaN stays NaN (the clamped k
 * never converts a NaN to int). */
DS_HOSTDEV float ds_expf(float x) {
    float c = x < -87.33654f ? -87.33654f : x > 88.37626f ? 88.37626f : x;
    float k = rintf(c * 1.44269504f);
    float r = c - k * 0.693359375f;
    r = r + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } scale = { (uint32_t)((int32_t)(k > -126.0f ? k : -126.0f) + 127) << 23 };  /* 2^k */
    float y = p * scale.f;
    return x < -87.33654f ? 0.0f : x > 88.37626f ? INFINITY : y;
}

#endif
