/* The fp8 cast into both layouts of cuda_fp8.cu (Transformer Engine's
 * cast_transpose): x [m, k] to codes q [m, k] and qt [k, m] in one pass,
 * plain CUDA, so tests/test_fp8_transpose.cc runs it on the CPU. */
#ifndef CUDA_FP8_CUH
#define CUDA_FP8_CUH

#include "cuda_common.cuh"
#include "../ds_fp8.h"

#include <math.h>

/* A square tile of x a block step: CT_TILE lanes along a row, CT_ROWS
 * warps taking every CT_ROWS-th row. */
#define CT_TILE 32
#define CT_ROWS 8
#define CT_THREADS (CT_TILE * CT_ROWS)
/* the tile's codes as words, a row padded by one: a column's 32 words
 * fall in 32 banks */
#define CT_SMEM (CT_TILE * (CT_TILE + 1) * sizeof(unsigned))

__device__ __forceinline__ float fp8_load(const void *p, ds_dtype t, int64_t i) {
    if (t == DS_BF16) return ds_bf16_to_f32(((const uint16_t *)p)[i]);
    if (t == DS_F16) return ds_f16_to_f32(((const uint16_t *)p)[i]);
    if (t == DS_F64) return (float)((const double *)p)[i];
    return ((const float *)p)[i];
}

/* The scale a cast kernel applies: from *cur (the tensor's amax) under
 * current scaling, whose thread 0 of block 0 also writes it into meta
 * (scale, scale_inv, amax at stride ms); else meta's. */
__device__ __forceinline__ float fp8_scale_of(float *meta, int64_t ms, int fmt, const float *cur, int margin) {
    if (!cur) return meta[0];
    float s = ds_fp8_scale(*cur, (ds_fp8_format)fmt, margin, 1.0f);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        meta[0] = s;
        meta[ms] = 1.0f / s;
        meta[2 * ms] = fmaxf(meta[2 * ms], *cur);
    }
    return s;
}

/* Tile by tile (grid-stride): each warp reads a row's 32 values and writes
 * their codes to q, both along the row, and into shared memory; after the
 * barrier each warp writes a column of the tile along qt's row. Without
 * cur, max |x| folds into meta's amax, a warp's max by atomicMax on its
 * bits (non-negative floats order as their bits do). */
static __global__ void __launch_bounds__(CT_THREADS)
fp8_cast_transpose_kernel(uint8_t *q, uint8_t *qt, const void *x, ds_dtype t, int64_t m, int64_t k, float *meta,
                          int64_t ms, int fmt, const float *cur, int margin) {
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned *tile = (unsigned *)smem;
    float s = fp8_scale_of(meta, ms, fmt, cur, margin), amax = 0.0f;
    int lane = threadIdx.x % CT_TILE, row = threadIdx.x / CT_TILE;
    int64_t across = (k + CT_TILE - 1) / CT_TILE, tiles = (m + CT_TILE - 1) / CT_TILE * across;
    for (int64_t b = blockIdx.x; b < tiles; b += gridDim.x) {
        int64_t r0 = b / across * CT_TILE, c0 = b % across * CT_TILE;
        for (int i = row; i < CT_TILE; i += CT_ROWS) {
            int64_t r = r0 + i, c = c0 + lane;
            if (r >= m || c >= k) continue;
            float v = fp8_load(x, t, r * k + c);
            amax = fmaxf(amax, fabsf(v));
            uint8_t code = ds_f32_to_fp8(v * s, (ds_fp8_format)fmt);
            q[r * k + c] = code;
            tile[i * (CT_TILE + 1) + lane] = code;
        }
        __syncthreads();
        for (int i = row; i < CT_TILE; i += CT_ROWS) {
            int64_t c = c0 + i, r = r0 + lane;
            if (r < m && c < k) qt[c * m + r] = (uint8_t)tile[lane * (CT_TILE + 1) + i];
        }
        __syncthreads();                  /* the tile read before the next is written */
    }
    if (cur) return;
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) atomicMax((int *)(meta + 2 * ms), __float_as_int(amax));
}

#endif
