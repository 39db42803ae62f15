/* Attention on tensor cores (cuda_attention_mma.cu), for cuda_attention.cu. */
#ifndef CUDA_ATTENTION_MMA_H
#define CUDA_ATTENTION_MMA_H

#include "../ds_kview.h"

/* Whether the tensor-core kernels take a call: views[0..2] are q, k, v,
 * the rest (out; dq, dk, dv, dout) the other tensors it touches; bf16 or
 * f16, head dim 64 or 128 on q, k and v alike, every view 16-byte aligned
 * with a unit last stride and the others multiples of 8. */
bool ds_cuda_attention_mma_fits(const ds_kview *views, int n);

/* ds_kernels_attention's forward and backward, for calls that fit. */
int ds_cuda_attention_mma_forward(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, double scale,
                                  int causal);
int ds_cuda_attention_mma_backward(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k,
                                   ds_kview v, ds_kview out, ds_kview lse, double scale, int causal);

#endif
