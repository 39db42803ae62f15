/* FP8 casts on the GPU (ds_fp8.h's conversions: cvt on sm_89+). amax is a
 * block's max folded into one float with atomicMax on its bits, which order
 * as the values do for non-negative floats. Current scaling takes two
 * launches: the amax into scratch, then the cast, whose every block derives
 * the same scale from it. The cast into both layouts is cuda_fp8.cuh's;
 * the GEMM is ds_cuda_gemm_fp8 (cuda_blas.cu). */
#include "cuda_fp8.cuh"

__device__ __forceinline__ void store_float(void *p, ds_dtype t, int64_t i, float v) {
    if (t == DS_BF16) ((uint16_t *)p)[i] = ds_f32_to_bf16(v);
    else if (t == DS_F16) ((uint16_t *)p)[i] = ds_f32_to_f16(v);
    else if (t == DS_F64) ((double *)p)[i] = v;
    else ((float *)p)[i] = v;
}

/* The block's max of v folded into *out (non-negative floats). */
__device__ void block_max_into(float v, float *out) {
    __shared__ float warp_max[DS_CUDA_THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < DS_CUDA_THREADS / 32; w++) v = fmaxf(v, warp_max[w]);
        atomicMax((int *)out, __float_as_int(v));
    }
}

__global__ void fp8_amax_kernel(const void *x, ds_dtype t, int64_t n, float *out) {
    float m = 0.0f;
    DS_CUDA_LOOP(i, n) m = fmaxf(m, fabsf(fp8_load(x, t, i)));
    block_max_into(m, out);
}

/* meta: scale, scale_inv, amax at stride ms. current: the scale from *cur
 * (this tensor's amax), written by one thread; else meta's, and this
 * tensor's amax folded into meta's. */
__global__ void fp8_cast_kernel(uint8_t *q, const void *x, ds_dtype t, int64_t n, float *meta, int64_t ms,
                                int fmt, const float *cur, int margin) {
    float s = fp8_scale_of(meta, ms, fmt, cur, margin), m = 0.0f;
    DS_CUDA_LOOP(i, n) {
        float v = fp8_load(x, t, i);
        m = fmaxf(m, fabsf(v));
        q[i] = ds_f32_to_fp8(v * s, (ds_fp8_format)fmt);
    }
    if (!cur) block_max_into(m, meta + 2 * ms);
}

__global__ void fp8_uncast_kernel(void *y, ds_dtype t, const uint8_t *q, int64_t n, const float *inv, int fmt) {
    float f = *inv;
    DS_CUDA_LOOP(i, n) store_float(y, t, i, ds_fp8_to_f32(q[i], (ds_fp8_format)fmt) * f);
}

/* max |x| into out (f32 on the device), which is zeroed first */
static int amax_into(float *out, ds_kview x) {
    int64_t n = ds_kview_numel(&x);
    if (ds_cuda_ok(cudaMemsetAsync(out, 0, sizeof(float), ds_cuda_stream()), "cudaMemsetAsync")) return -1;
    if (n == 0) return 0;
    fp8_amax_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(x.data, x.dtype, n,
                                                                                                    out);
    return ds_cuda_launched("fp8_amax_kernel");
}

static int cuda_fp8_amax(ds_kview out, ds_kview x) { return amax_into((float *)out.data, x); }

/* The amax current scaling takes the scale from: given (the group's), or
 * x's own made into *scratch, which the caller frees; NULL without current
 * scaling. -1 where the scratch could not be made. */
static int current_amax(ds_kview x, int current, ds_kview given, float **cur, float **scratch) {
    *cur = *scratch = NULL;
    if (!current) return 0;
    if (given.data) {
        *cur = (float *)given.data;
        return 0;
    }
    if (!(*scratch = (float *)ds_cuda_scratch(sizeof(float)))) return -1;
    *cur = *scratch;
    return amax_into(*scratch, x);
}

static int cuda_fp8_cast(ds_kview q, ds_kview x, ds_kview meta, int fmt, int current, int margin, ds_kview given) {
    int64_t n = ds_kview_numel(&x);
    float *cur, *scratch;
    int rc = current_amax(x, current, given, &cur, &scratch);
    if (rc == 0) {
        fp8_cast_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
            (uint8_t *)q.data, x.data, x.dtype, n, (float *)meta.data, meta.stride[0], fmt, cur, margin);
        rc = ds_cuda_launched("fp8_cast_kernel");
    }
    if (scratch) ds_cuda_scratch_free(scratch);
    return rc;
}

/* A block per tile of 32 x 32 (at least one, which sets a current scale). */
static int cuda_fp8_cast_transpose(ds_kview q, ds_kview qt, ds_kview x, ds_kview meta, int fmt, int current,
                                   int margin, ds_kview given) {
    int64_t m = x.shape[0], k = x.shape[1];
    int64_t tiles = (m + CT_TILE - 1) / CT_TILE * ((k + CT_TILE - 1) / CT_TILE);
    float *cur, *scratch;
    int rc = current_amax(x, current, given, &cur, &scratch);
    if (rc == 0) {
        fp8_cast_transpose_kernel<<<ds_cuda_blocks(tiles, 1), CT_THREADS, CT_SMEM, ds_cuda_stream()>>>(
            (uint8_t *)q.data, (uint8_t *)qt.data, x.data, x.dtype, m, k, (float *)meta.data, meta.stride[0], fmt,
            cur, margin);
        rc = ds_cuda_launched("fp8_cast_transpose_kernel");
    }
    if (scratch) ds_cuda_scratch_free(scratch);
    return rc;
}

static int cuda_fp8_uncast(ds_kview y, ds_kview q, ds_kview meta, int fmt) {
    int64_t n = ds_kview_numel(&y);
    if (n == 0) return 0;
    fp8_uncast_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        y.data, y.dtype, (const uint8_t *)q.data, n, (const float *)meta.data + meta.stride[0], fmt);
    return ds_cuda_launched("fp8_uncast_kernel");
}

extern "C" const ds_kernels_fp8 ds_cuda_fp8 = { cuda_fp8_cast, cuda_fp8_cast_transpose, cuda_fp8_amax, cuda_fp8_uncast,
                                                ds_cuda_gemm_fp8 };
