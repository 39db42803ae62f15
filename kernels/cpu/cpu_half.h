/* n contiguous bf16 or f16 values (dtype t) as f32, and back: the loops
 * the compiler vectorizes, shared by the CPU kernels that widen a half
 * operand or narrow an f32 result. */
#ifndef CPU_HALF_H
#define CPU_HALF_H

#include "../ds_half.h"

static inline void cpu_half_to_f32(float *d, const uint16_t *s, int64_t n, ds_dtype t) {
    if (t == DS_BF16) {
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = ds_bf16_to_f32(s[i]);
    } else {
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = ds_f16_to_f32(s[i]);
    }
}

static inline void cpu_f32_to_half(uint16_t *d, const float *s, int64_t n, ds_dtype t) {
    if (t == DS_BF16) {
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = ds_f32_to_bf16(s[i]);
    } else {
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = ds_f32_to_f16(s[i]);
    }
}

#endif
