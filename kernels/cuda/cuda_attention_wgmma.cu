/* The host side of the Hopper attention forward (cuda_attention_wgmma.cuh):
 * its launches. CMakeLists.txt builds this file for sm_90a alone, the one
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

size_t ds_cuda_attention_wgmma_smem(int D) { return D == 64 ? wg_forward_smem<64>() : wg_forward_smem<128>(); }

int ds_cuda_attention_wgmma_forward(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, double scale,
                                    int causal) {
    mma_geom g = mma_geom_of(q, k, scale, causal);
    bool bf = q.dtype == DS_BF16;
    if (q.shape[3] == 64)
        return bf ? wgmma_run<__nv_bfloat16, 64>(out, lse, q, k, v, g) : wgmma_run<__half, 64>(out, lse, q, k, v, g);
    return bf ? wgmma_run<__nv_bfloat16, 128>(out, lse, q, k, v, g) : wgmma_run<__half, 128>(out, lse, q, k, v, g);
}
