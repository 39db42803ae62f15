/* The host side of the Hopper attention backward
 * (cuda_attention_wgmma_bwd.cuh): the row statistics, then the dQ and
 * dK/dV kernels. Built for sm_90a alone, as cuda_attention_wgmma.cu;
 * cuda_attention_mma.cu decides when to call it. */
#include "cuda_common.cuh"
#include "cuda_attention_mma.h"
#include "cuda_attention_wgmma_bwd.cuh"

template <typename T, int D>
static int wgmma_backward_run(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k,
                              ds_kview v, ds_kview out, ds_kview lse, const mma_geom &g) {
    static uint64_t asked_dq, asked_dkdv;
    size_t sq = wgb_dq_smem<D>(), skv = wgb_dkdv_smem<D>();
    if (ds_cuda_allow_smem(wgmma_dq_kernel<T, D>, sq, &asked_dq) ||
        ds_cuda_allow_smem(wgmma_dkdv_kernel<T, D>, skv, &asked_dkdv))
        return -1;
    float *stats = (float *)ds_cuda_scratch(mma_stats_bytes(g));
    if (!stats) return -1;
    cudaStream_t st = ds_cuda_stream();
    mma_stats_kernel<T, D><<<mma_stats_blocks(g), MMA_STATS_THREADS, 0, st>>>(stats, dout, out, lse, g);
    int rc = ds_cuda_launched("attention mma_stats_kernel");
    if (rc == 0) {
        wgmma_dq_kernel<T, D><<<wgmma_dq_blocks(g), WG_THREADS, sq, st>>>(dq, dout, q, k, v, stats, g);
        rc = ds_cuda_launched("attention wgmma_dq_kernel");
    }
    if (rc == 0) {
        wgmma_dkdv_kernel<T, D><<<wgmma_dkdv_blocks(g), WG_THREADS, skv, st>>>(dk, dv, dout, q, k, v, stats, g);
        rc = ds_cuda_launched("attention wgmma_dkdv_kernel");
    }
    ds_cuda_scratch_free(stats);
    return rc;
}

size_t ds_cuda_attention_wgmma_backward_smem(int D) {
    return D == 64 ? std::max(wgb_dq_smem<64>(), wgb_dkdv_smem<64>())
                   : std::max(wgb_dq_smem<128>(), wgb_dkdv_smem<128>());
}

int ds_cuda_attention_wgmma_backward(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k,
                                     ds_kview v, ds_kview out, ds_kview lse, double scale, int causal) {
    mma_geom g = mma_geom_of(q, k, scale, causal);
    bool bf = q.dtype == DS_BF16;
    if (q.shape[3] == 64)
        return bf ? wgmma_backward_run<__nv_bfloat16, 64>(dq, dk, dv, dout, q, k, v, out, lse, g)
                  : wgmma_backward_run<__half, 64>(dq, dk, dv, dout, q, k, v, out, lse, g);
    return bf ? wgmma_backward_run<__nv_bfloat16, 128>(dq, dk, dv, dout, q, k, v, out, lse, g)
              : wgmma_backward_run<__half, 128>(dq, dk, dv, dout, q, k, v, out, lse, g);
}
