/* Attention on tensor cores (cuda_attention_mma.cu), for cuda_attention.cu. */
#ifndef CUDA_ATTENTION_MMA_H
#define CUDA_ATTENTION_MMA_H

#include "../ds_kview.h"

struct wt_stall;   /* cuda_attention_wgmma.cuh */

/* Whether the tensor-core kernels take a call: views[0..2] are q, k, v,
 * the rest (out; dq, dk, dv, dout) the other tensors it touches; bf16,
 * f16 or f32, head dim 64 or 128 on q, k and v alike, tiles that fit the
 * device's shared memory, every view 16-byte aligned with a unit last
 * stride and the others multiples of 16 bytes. */
bool ds_cuda_attention_mma_fits(const ds_kview *views, int n);

/* ds_kernels_attention's forward and backward, for calls that fit, k and
 * v with q's heads or a divisor of them (grouped-query attention, on the
 * mma.sync and wgmma kernels alike); f32 in TF32 where tf32 (the caller
 * decides whether that is allowed), else in 3xTF32. */
int ds_cuda_attention_mma_forward(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, double scale,
                                  int causal, bool tf32);
int ds_cuda_attention_mma_backward(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k,
                                   ds_kview v, ds_kview out, ds_kview lse, double scale, int causal, bool tf32);

/* The forward on Hopper's wgmma (cuda_attention_wgmma.cu), built where
 * DS_CUDA_WGMMA is defined (an sm_90a target): bf16 and f16 calls that
 * fit, on a device of compute capability 9.0 with `smem` bytes of shared
 * memory for a block: with a stall record (device memory, every byte set:
 * where a bounded mbarrier wait that ran out is written) the kernel fed
 * by TMA, returning 1 (nothing launched) where q, k or v have no tensor
 * map (cuda_attention_wgmma.cuh's wt_map); with NULL the one staging K
 * and V by cp.async. ds_cuda_attention_mma_forward calls it. */
size_t ds_cuda_attention_wgmma_smem(int D, int tma);
int ds_cuda_attention_wgmma_forward(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, double scale,
                                    int causal, wt_stall *stall);

/* The backward on it (cuda_attention_wgmma_bwd.cu), the same way: `smem`
 * bytes for its larger kernel's block; with a stall record the kernels fed
 * by TMA (both writing to the one record), returning 1 (nothing launched)
 * where q, k, v or dout have no tensor map. ds_cuda_attention_mma_backward
 * calls it. */
size_t ds_cuda_attention_wgmma_backward_smem(int D, int tma);
int ds_cuda_attention_wgmma_backward(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k,
                                     ds_kview v, ds_kview out, ds_kview lse, double scale, int causal,
                                     wt_stall *stall);

#endif
