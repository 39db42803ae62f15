/* The host side of the Hopper attention backward
 * (cuda_attention_wgmma_bwd.cuh): the row statistics, then the dQ and
 * dK/dV kernels, fed by TMA (their tensor maps encoded here) or staging
 * by cp.async. Built for sm_90a alone, as cuda_attention_wgmma.cu;
 * cuda_attention_mma.cu decides when to call it. */
#include "cuda_common.cuh"
#include "cuda_attention_mma.h"
#include "cuda_attention_wgmma_bwd.cuh"

/* The dQ and dK/dV kernels staging by cp.async. */
template <typename T, int D>
static int cp_async_kernels(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k,
                            ds_kview v, const float *stats, const mma_geom &g) {
    cudaStream_t st = ds_cuda_stream();
    wgmma_dq_kernel<T, D><<<wgmma_dq_blocks(g), WG_THREADS, wgb_dq_smem<D>(), st>>>(dq, dout, q, k, v, stats, g);
    int rc = ds_cuda_launched("attention wgmma_dq_kernel");
    if (rc == 0) {
        wgmma_dkdv_kernel<T, D><<<wgmma_dkdv_blocks(g), WG_THREADS, wgb_dkdv_smem<D>(), st>>>(dk, dv, dout, q, k, v,
                                                                                              stats, g);
        rc = ds_cuda_launched("attention wgmma_dkdv_kernel");
    }
    return rc;
}

/* The dQ and dK/dV kernels fed by TMA through the maps m. */
template <typename T, int D>
static int tma_kernels(ds_kview dq, ds_kview dk, ds_kview dv, const wtb_maps &m, const float *stats,
                       const mma_geom &g, wt_stall *stall) {
    cudaStream_t st = ds_cuda_stream();
    wgmma_tma_dq_kernel<T, D><<<wgmma_dq_blocks(g), WT_THREADS, wtb_dq_smem<D>(), st>>>(dq, m, stats, g, stall);
    int rc = ds_cuda_launched("attention wgmma_tma_dq_kernel");
    if (rc == 0) {
        wgmma_tma_dkdv_kernel<T, D>
            <<<wgmma_dkdv_blocks(g), WT_THREADS, wtb_dkdv_smem<D>(), st>>>(dk, dv, m, stats, g, stall);
        rc = ds_cuda_launched("attention wgmma_tma_dkdv_kernel");
    }
    return rc;
}

/* The backward; with a stall record the kernels fed by TMA, or 1
 * (nothing launched) where q, k, v or dout have no tensor map. */
template <typename T, int D>
static int wgmma_backward_run(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k,
                              ds_kview v, ds_kview out, ds_kview lse, const mma_geom &g, wt_stall *stall) {
    static uint64_t asked[4];
    wtb_maps m;
    if (stall) {
        PFN_cuTensorMapEncodeTiled_v12000 encode = ds_tma_encoder();
        if (!encode || wt_map(&m.q, q, encode, WGB_TILE) || wt_map(&m.k, k, encode, WGB_TILE) ||
            wt_map(&m.v, v, encode, WGB_TILE) || wt_map(&m.dout, dout, encode, WGB_TILE))
            return 1;
        if (ds_cuda_allow_smem(wgmma_tma_dq_kernel<T, D>, wtb_dq_smem<D>(), &asked[2]) ||
            ds_cuda_allow_smem(wgmma_tma_dkdv_kernel<T, D>, wtb_dkdv_smem<D>(), &asked[3]))
            return -1;
    } else if (ds_cuda_allow_smem(wgmma_dq_kernel<T, D>, wgb_dq_smem<D>(), &asked[0]) ||
               ds_cuda_allow_smem(wgmma_dkdv_kernel<T, D>, wgb_dkdv_smem<D>(), &asked[1])) {
        return -1;
    }
    float *stats = (float *)ds_cuda_scratch(mma_stats_bytes(g));
    if (!stats) return -1;
    mma_stats_kernel<T, D><<<mma_stats_blocks(g), MMA_STATS_THREADS, 0, ds_cuda_stream()>>>(stats, dout, out, lse, g);
    int rc = ds_cuda_launched("attention mma_stats_kernel");
    if (rc == 0) rc = stall ? tma_kernels<T, D>(dq, dk, dv, m, stats, g, stall)
                          : cp_async_kernels<T, D>(dq, dk, dv, dout, q, k, v, stats, g);
    ds_cuda_scratch_free(stats);
    return rc;
}

size_t ds_cuda_attention_wgmma_backward_smem(int D, int tma) {
    if (tma) return D == 64 ? std::max(wtb_dq_smem<64>(), wtb_dkdv_smem<64>())
                            : std::max(wtb_dq_smem<128>(), wtb_dkdv_smem<128>());
    return D == 64 ? std::max(wgb_dq_smem<64>(), wgb_dkdv_smem<64>())
                   : std::max(wgb_dq_smem<128>(), wgb_dkdv_smem<128>());
}

int ds_cuda_attention_wgmma_backward(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k,
                                     ds_kview v, ds_kview out, ds_kview lse, double scale, int causal,
                                     wt_stall *stall) {
    mma_geom g = mma_geom_of(q, k, scale, causal);
    bool bf = q.dtype == DS_BF16;
    if (q.shape[3] == 64)
        return bf ? wgmma_backward_run<__nv_bfloat16, 64>(dq, dk, dv, dout, q, k, v, out, lse, g, stall)
                  : wgmma_backward_run<__half, 64>(dq, dk, dv, dout, q, k, v, out, lse, g, stall);
    return bf ? wgmma_backward_run<__nv_bfloat16, 128>(dq, dk, dv, dout, q, k, v, out, lse, g, stall)
              : wgmma_backward_run<__half, 128>(dq, dk, dv, dout, q, k, v, out, lse, g, stall);
}
