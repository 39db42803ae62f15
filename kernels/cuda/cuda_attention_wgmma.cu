/* The host side of the Hopper attention forward (cuda_attention_wgmma.cuh):
 * its launches, and the TMA kernel's tensor maps. CMakeLists.txt builds this file for sm_90a alone, the one
 * target with wgmma, so the kernels' only code is what a device of compute
 * capability 9.0 runs; cuda_attention_mma.cu decides when to call it. */
#include "cuda_common.cuh"
#include "cuda_attention_mma.h"
#include "cuda_attention_wgmma.cuh"

template <typename T, int D>
static int wgmma_run(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, const mma_geom &g) {
    static uint64_t asked;
    size_t sm = wg_forward_smem<D>();
    if (ds_cuda_allow_smem(wgmma_forward_kernel<T, D>, sm, &asked)) return -1;
    wgmma_forward_kernel<T, D><<<wgmma_query_blocks(g), WG_THREADS, sm, ds_cuda_stream()>>>(out, lse, q, k, v, g);
    return ds_cuda_launched("attention wgmma_forward_kernel");
}

/* The TMA kernel, or 1 (nothing launched) where q, k or v have no tensor map. */
template <typename T, int D>
static int wgmma_tma_run(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, const mma_geom &g,
                         wt_stall *stall) {
    static uint64_t asked;
    PFN_cuTensorMapEncodeTiled_v12000 encode = ds_tma_encoder();
    wt_maps m;
    if (!encode || wt_map(&m.q, q, encode) || wt_map(&m.k, k, encode) || wt_map(&m.v, v, encode)) return 1;
    size_t sm = wt_forward_smem<D>();
    if (ds_cuda_allow_smem(wgmma_tma_forward_kernel<T, D>, sm, &asked)) return -1;
    wgmma_tma_forward_kernel<T, D>
        <<<wgmma_query_blocks(g), WT_THREADS, sm, ds_cuda_stream()>>>(out, lse, m, g, stall);
    return ds_cuda_launched("attention wgmma_tma_forward_kernel");
}

template <typename T, int D>
static int forward_run(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, const mma_geom &g,
                       wt_stall *stall) {
    return stall ? wgmma_tma_run<T, D>(out, lse, q, k, v, g, stall) : wgmma_run<T, D>(out, lse, q, k, v, g);
}

size_t ds_cuda_attention_wgmma_smem(int D, int tma) {
    if (tma) return D == 64 ? wt_forward_smem<64>() : wt_forward_smem<128>();
    return D == 64 ? wg_forward_smem<64>() : wg_forward_smem<128>();
}

int ds_cuda_attention_wgmma_forward(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, double scale,
                                    int causal, wt_stall *stall) {
    mma_geom g = mma_geom_of(q, k, scale, causal);
    bool bf = q.dtype == DS_BF16;
    if (q.shape[3] == 64)
        return bf ? forward_run<__nv_bfloat16, 64>(out, lse, q, k, v, g, stall)
                  : forward_run<__half, 64>(out, lse, q, k, v, g, stall);
    return bf ? forward_run<__nv_bfloat16, 128>(out, lse, q, k, v, g, stall)
              : forward_run<__half, 128>(out, lse, q, k, v, g, stall);
}
