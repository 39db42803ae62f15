/* OCP FP8 <-> f32: e4m3 (e4m3fn: bias 7, max 448, no infinities, NaN
 * 0x7f/0xff) and e5m2 (bias 15, max 57344, IEEE-like: infinities 0x7c/0xfc,
 * NaNs above). To fp8 rounds to nearest, ties to even, and saturates: a
 * finite value or infinity beyond the largest code becomes that code (what
 * cuBLAS and Transformer Engine do with scaling, cvt's .satfinite); NaN
 * becomes 0x7f. Bit-level, so gcc and nvcc give identical results; sm_89+
 * devices use cvt, which rounds the same. */
#ifndef DS_FP8_H
#define DS_FP8_H

#include "ds_half.h"

#ifdef __CUDACC__
#include <cuda_fp8.h>
#endif

typedef enum { DS_FP8_E4M3, DS_FP8_E5M2, DS_NFP8 } ds_fp8_format;

DS_HOSTDEV float ds_fp8_max(ds_fp8_format f) { return f == DS_FP8_E4M3 ? 448.0f : 57344.0f; }

/* Transformer Engine's scale for a tensor of largest magnitude amax:
 * f's max / amax / 2^margin, so that amax lands 2^margin below the format's
 * max; prev where amax is 0 or not finite (nothing to go by), the
 * largest float where the quotient overflows. */
DS_HOSTDEV float ds_fp8_scale(float amax, ds_fp8_format f, int margin, float prev) {
    if (!(amax > 0.0f) || amax - amax != 0.0f) return prev;
    float s = ds_fp8_max(f) / amax;
    for (int k = 0; k < margin; k++) s *= 0.5f;
    return s - s != 0.0f ? 3.40282347e38f : s;                 /* amax so small the scale overflows */
}

DS_HOSTDEV uint8_t ds_f32_to_fp8(float x, ds_fp8_format f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if (x != x) return 0x7f;
    return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, f == DS_FP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
#else
    const int m = f == DS_FP8_E4M3 ? 3 : 2, bias = f == DS_FP8_E4M3 ? 7 : 15;
    const uint32_t top = f == DS_FP8_E4M3 ? 0x7eu : 0x7bu;     /* the largest finite code */
    uint32_t u = ds_f32_bits(x), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7f;
    int e = (int)(a >> 23) - 127;                               /* f32 subnormals: far below e5m2's least */
    uint32_t code;
    if (e >= 1 - bias) {                                        /* normal in fp8: drop 23 - m bits, ties to even */
        int s = 23 - m;
        uint32_t r = a + (1u << (s - 1)) - 1u + ((a >> s) & 1u);
        code = (r >> s) - ((uint32_t)(127 - bias) << m);        /* a carry moves into the exponent, as it should */
    } else {                                                    /* subnormal: the significand in units of 2^(1-bias-m) */
        int s = 23 + (1 - bias - m) - e;
        uint32_t sig = (a & 0x7fffffu) | 0x800000u;
        code = s > 25 || a < 0x00800000u ? 0u : (sig + (1u << (s - 1)) - 1u + ((sig >> s) & 1u)) >> s;
    }
    return (uint8_t)(sign | (code > top ? top : code));
#endif
}

DS_HOSTDEV float ds_fp8_to_f32(uint8_t c, ds_fp8_format f) {
    if (f == DS_FP8_E5M2) return ds_f16_to_f32((uint16_t)(c << 8));   /* e5m2 is f16's top byte */
    uint32_t sign = (uint32_t)(c & 0x80u) << 24, e = (c >> 3) & 0xfu, m = c & 7u;
    if (e == 15 && m == 7) return ds_bits_f32(sign | 0x7fc00000u);
    if (e == 0) return ds_bits_f32(sign | ds_f32_bits((float)m * 0.001953125f));   /* m 2^-9, exact */
    return ds_bits_f32(sign | ((e + 120u) << 23) | (m << 20));
}

#endif
