/* The host side of attention on tensor cores (cuda_attention_mma.cuh):
 * which calls qualify, launch sizes, and the launches. */
#include "cuda_common.cuh"
#include "cuda_attention_mma.h"
#include "cuda_attention_mma.cuh"

static bool view_fits(const ds_kview &x) {
    int64_t es = (int64_t)ds_dtype_size(x.dtype);
    if (x.stride[3] != 1 || ((uintptr_t)x.data & 15)) return false;
    for (int d = 0; d < 3; d++)
        if (x.stride[d] * es % 16) return false;
    return true;
}

/* The shared memory a block may opt in to on the current device, asked
 * once per device (past 64 devices, at every call); 0 when CUDA fails. */
static int smem_optin() {
    static int known[64];
    int dev, limit = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    if (dev < 64 && known[dev]) return known[dev];
    if (cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) return 0;
    if (dev < 64) known[dev] = limit;
    return limit;
}

/* Whether all three kernels' tiles of T at head dim D fit the device's
 * shared memory (f32 at D = 128 needs 165 KiB: an H100's, not an A100's;
 * 3xTF32 needs no more than TF32). */
template <typename T> static bool smem_fits(int D) {
    size_t need = mma_forward_smem<T>(D);
    if (mma_dq_smem<T>(D) > need) need = mma_dq_smem<T>(D);
    if (mma_dkdv_smem<T>(D) > need) need = mma_dkdv_smem<T>(D);
    return need <= (size_t)smem_optin();
}

bool ds_cuda_attention_mma_fits(const ds_kview *views, int n) {
    const ds_kview &q = views[0], &v = views[2];
    int D = (int)q.shape[3];
    if ((D != 64 && D != 128) || v.shape[3] != q.shape[3]) return false;
    bool fits = q.dtype == DS_BF16 ? smem_fits<__nv_bfloat16>(D)
              : q.dtype == DS_F16 ? smem_fits<__half>(D) : q.dtype == DS_F32 && smem_fits<float>(D);
    for (int i = 0; i < n && fits; i++) fits = view_fits(views[i]);
    return fits;
}

/* Dynamic shared memory past 48 KB needs the kernel's consent, asked once
 * per device (the bits of *asked), not at every launch. */
template <typename K> static int allow_smem(K kernel, size_t bytes, uint64_t *asked) {
    if (bytes <= 48 * 1024) return 0;
    int dev;
    if (ds_cuda_ok(cudaGetDevice(&dev), "attention: cudaGetDevice")) return -1;
    uint64_t bit = dev < 64 ? 1ull << dev : 0;      /* past 64 devices: asked at every launch */
    if (*asked & bit) return 0;
    if (ds_cuda_ok(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                   "attention: cudaFuncSetAttribute"))
        return -1;
    *asked |= bit;
    return 0;
}

template <typename T, int D>
static int forward_run(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, const mma_geom &g) {
    static uint64_t asked;
    size_t sm = mma_forward_smem<T>(D);
    if (allow_smem(mma_forward_kernel<T, D>, sm, &asked)) return -1;
    mma_forward_kernel<T, D><<<mma_query_blocks(g), MMA_THREADS, sm, ds_cuda_stream()>>>(out, lse, q, k, v, g);
    return ds_cuda_launched("attention mma_forward_kernel");
}

template <typename T, int D>
static int backward_run(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k,
                        ds_kview v, ds_kview out, ds_kview lse, const mma_geom &g) {
    float *stats = (float *)ds_cuda_scratch(mma_stats_bytes(g));
    if (!stats) return -1;
    cudaStream_t st = ds_cuda_stream();
    int rc = 0;
    mma_stats_kernel<T, D><<<mma_stats_blocks(g), MMA_STATS_THREADS, 0, st>>>(stats, dout, out, lse, g);
    rc = ds_cuda_launched("attention mma_stats_kernel");
    static uint64_t asked_dq, asked_dkdv;
    size_t sq = mma_dq_smem<T>(D), skv = mma_dkdv_smem<T>(D);
    if (rc == 0) rc = allow_smem(mma_dq_kernel<T, D>, sq, &asked_dq);
    if (rc == 0) {
        mma_dq_kernel<T, D><<<mma_dq_blocks<T>(g, D), MMA_THREADS, sq, st>>>(dq, dout, q, k, v, stats, g);
        rc = ds_cuda_launched("attention mma_dq_kernel");
    }
    if (rc == 0) rc = allow_smem(mma_dkdv_kernel<T, D>, skv, &asked_dkdv);
    if (rc == 0) {
        mma_dkdv_kernel<T, D><<<mma_dkdv_blocks(g, D), MMA_THREADS, skv, st>>>(dk, dv, dout, q, k, v, stats, g);
        rc = ds_cuda_launched("attention mma_dkdv_kernel");
    }
    ds_cuda_scratch_free(stats);
    return rc;
}

template <int D>
static int forward_of(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, const mma_geom &g, bool tf32) {
    if (q.dtype == DS_BF16) return forward_run<__nv_bfloat16, D>(out, lse, q, k, v, g);
    if (q.dtype == DS_F16) return forward_run<__half, D>(out, lse, q, k, v, g);
    return tf32 ? forward_run<float, D>(out, lse, q, k, v, g) : forward_run<tf32x3, D>(out, lse, q, k, v, g);
}

template <int D>
static int backward_of(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k, ds_kview v,
                       ds_kview out, ds_kview lse, const mma_geom &g, bool tf32) {
    if (q.dtype == DS_BF16) return backward_run<__nv_bfloat16, D>(dq, dk, dv, dout, q, k, v, out, lse, g);
    if (q.dtype == DS_F16) return backward_run<__half, D>(dq, dk, dv, dout, q, k, v, out, lse, g);
    return tf32 ? backward_run<float, D>(dq, dk, dv, dout, q, k, v, out, lse, g)
                : backward_run<tf32x3, D>(dq, dk, dv, dout, q, k, v, out, lse, g);
}

int ds_cuda_attention_mma_forward(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, double scale,
                                  int causal, bool tf32) {
    mma_geom g = mma_geom_of(q, k, scale, causal);
    return q.shape[3] == 64 ? forward_of<64>(out, lse, q, k, v, g, tf32)
                            : forward_of<128>(out, lse, q, k, v, g, tf32);
}

int ds_cuda_attention_mma_backward(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k,
                                   ds_kview v, ds_kview out, ds_kview lse, double scale, int causal, bool tf32) {
    mma_geom g = mma_geom_of(q, k, scale, causal);
    return q.shape[3] == 64 ? backward_of<64>(dq, dk, dv, dout, q, k, v, out, lse, g, tf32)
                            : backward_of<128>(dq, dk, dv, dout, q, k, v, out, lse, g, tf32);
}
