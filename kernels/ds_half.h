/* bf16 and f16 <-> f32 conversions, round-to-nearest-even, NaN kept quiet.
 * Bit-level so gcc and nvcc give identical results. */
#ifndef DS_HALF_H
#define DS_HALF_H

#include "ds_kview.h"
#include <string.h>

DS_HOSTDEV uint32_t ds_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
DS_HOSTDEV float ds_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

DS_HOSTDEV uint16_t ds_f32_to_bf16(float f) {
    uint32_t u = ds_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint16_t h;                               /* the same rounding, one instruction instead of four */
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    u += 0x7fffu + ((u >> 16) & 1u);          /* ties go to the even mantissa */
    return (uint16_t)(u >> 16);
#endif
}

DS_HOSTDEV float ds_bf16_to_f32(uint16_t h) { return ds_bits_f32((uint32_t)h << 16); }

DS_HOSTDEV uint16_t ds_f32_to_f16(float f) {
    uint32_t u = ds_f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
#ifdef __CUDA_ARCH__
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);         /* NaN */
    uint16_t h;                                                      /* the rounding below, in one instruction */
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    /* Selects instead of branches, so loops over it vectorize. */
    uint32_t h = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;        /* rebias exponent (-112<<23) and round */
    /* f16 subnormal or zero: adding 0.5 makes the FPU do the round-to-nearest-even shift for us */
    if (a < 0x38800000u) h = ds_f32_bits(ds_bits_f32(a) + 0.5f) - 0x3f000000u;
    if (a >= 0x477ff000u) h = 0x7c00u;                               /* rounds to inf */
    if (a > 0x7f800000u) h = 0x7e00u;                                /* NaN */
    return (uint16_t)(sign | h);
#endif
}

/* Selects instead of branches, so loops over it vectorize. */
DS_HOSTDEV float ds_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t o = (uint32_t)(h & 0x7fffu) << 13, e = o & 0x0f800000u;
    o += 0x38000000u;                                 /* rebias the exponent: (127 - 15) << 23 */
    if (e == 0x0f800000u) o += 0x38000000u;           /* inf, NaN: all ones, the payload kept */
    else if (e == 0)                                  /* subnormal: 2^-14 (1 + m/2^10) - 2^-14, exact */
        o = ds_f32_bits(ds_bits_f32(o + 0x00800000u) - 6.103515625e-05f);
    return ds_bits_f32(sign | o);
}

/* Load and store any dtype as double: the slow, universal path. */
DS_HOSTDEV double ds_load(ds_dtype t, const void *p, int64_t i) {
    switch (t) {
    case DS_F32: return ((const float *)p)[i];
    case DS_F64: return ((const double *)p)[i];
    case DS_BF16: return ds_bf16_to_f32(((const uint16_t *)p)[i]);
    case DS_F16: return ds_f16_to_f32(((const uint16_t *)p)[i]);
    case DS_I32: return ((const int32_t *)p)[i];
    case DS_I64: return (double)((const int64_t *)p)[i];
    case DS_U8: return ((const uint8_t *)p)[i];
    default: return ((const uint8_t *)p)[i] != 0;
    }
}

DS_HOSTDEV void ds_store(ds_dtype t, void *p, int64_t i, double v) {
    switch (t) {
    case DS_F32: ((float *)p)[i] = (float)v; break;
    case DS_F64: ((double *)p)[i] = v; break;
    case DS_BF16: ((uint16_t *)p)[i] = ds_f32_to_bf16((float)v); break;
    case DS_F16: ((uint16_t *)p)[i] = ds_f32_to_f16((float)v); break;
    case DS_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    case DS_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    case DS_U8: ((uint8_t *)p)[i] = (uint8_t)(int64_t)v; break;
    default: ((uint8_t *)p)[i] = v != 0; break;
    }
}

#endif
