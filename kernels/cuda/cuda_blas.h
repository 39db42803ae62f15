/* What the CUDA GEMM offers beyond ds_cuda_blas: the TF32 switches (off by
 * default). Plain C, so core includes it too. */
#ifndef CUDA_BLAS_H
#define CUDA_BLAS_H

#ifdef __cplusplus
extern "C" {
#endif

/* f32 GEMMs (cuBLASLt, DS_TF32_MATMUL) and convolutions
 * (cuDNN, DS_TF32_CONV) may round their inputs to TF32 when on: about 10
 * mantissa bits, several times the speed. */
typedef enum { DS_TF32_MATMUL, DS_TF32_CONV } ds_tf32_use;
void ds_cuda_set_tf32(ds_tf32_use use, int on);
int ds_cuda_tf32(ds_tf32_use use);

#ifdef __cplusplus
}
#endif

#endif
