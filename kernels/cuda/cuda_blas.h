/* What the CUDA GEMM offers beyond ds_cuda_blas: the TF32 switch (off by
 * default, as in PyTorch) and cuBLASLt's fused bias/GELU epilogues, for a
 * fused linear and MLP. Plain C, so core and the Lua binding include it too. */
#ifndef CUDA_BLAS_H
#define CUDA_BLAS_H

#include "../ds_kview.h"

#ifdef __cplusplus
extern "C" {
#endif

/* f32 GEMMs (cuBLASLt) and convolutions (cuDNN) may round their inputs to
 * TF32 when on: about 10 mantissa bits, several times the speed. */
void ds_cuda_set_tf32(int on);
int ds_cuda_tf32(void);

/* c = a @ b + bias, then GELU (tanh approximation, as DS_UN_GELU_TANH)
 * when gelu is set, in one cuBLASLt call. Shapes as ds_kernels_blas.gemm
 * with these limits: f32, bf16 or f16; c's matrices row-major (unit column
 * stride) and no summed (stride 0) batch dims of c; k > 0. bias is [n],
 * c's dtype, unit stride, added to every row; bias.data NULL means none.
 * Returns 0, or -1 after ds_kernel_fail() (a caller falls back to gemm
 * plus separate ops then). */
int ds_cuda_gemm_epilogue(ds_kview c, ds_kview a, ds_kview b, ds_kview bias, int gelu);

/* c = a @ b for 2-D views, and grad [m] = the sums of a's rows (over k),
 * in one cuBLASLt call (its BGRADB epilogue): a linear's weight gradient
 * g^T x with the bias gradient, the column sums of g, on the way. grad is
 * c's dtype, unit stride, on 16 bytes. 0, or -1 after ds_kernel_fail()
 * (the caller runs the GEMM and the sum apart then). */
int ds_cuda_gemm_bgrad(ds_kview c, ds_kview a, ds_kview b, ds_kview grad);

/* c = gelu(a @ b + bias), GELU's tanh form, writing aux = a @ b + bias,
 * the GELU's input (its backward reads it), in one cuBLASLt call
 * (GELU_AUX_BIAS, or GELU_AUX when bias.data is NULL). c and aux are 2-D,
 * nonempty, row-major, of one shape and dtype; aux's row stride is a
 * multiple of 8 elements and it starts on 16 bytes (cuBLASLt's limits);
 * bias as ds_cuda_gemm_epilogue takes it. 0, or -1 after
 * ds_kernel_fail() (the caller runs the GEMM and the GELU apart then). */
int ds_cuda_gemm_gelu_aux(ds_kview c, ds_kview aux, ds_kview a, ds_kview b, ds_kview bias);

/* c = (a @ b) * gelu'(aux), GELU's tanh form, in one cuBLASLt call
 * (DGELU): the GELU's backward out of the GEMM that makes the hidden
 * gradient. Not DGELU_BGRAD: on an H100 (cuBLASLt 13) that epilogue takes
 * a generic kernel at half DGELU's speed, more than the bias gradient
 * costs in the weight gradient's GEMM (BGRADB). Views and returns as
 * ds_cuda_gemm_gelu_aux. */
int ds_cuda_gemm_dgelu(ds_kview c, ds_kview aux, ds_kview a, ds_kview b);

#ifdef __cplusplus
}
#endif

#endif
