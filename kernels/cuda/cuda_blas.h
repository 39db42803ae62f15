/* What the CUDA GEMM offers beyond ds_cuda_blas: the TF32 switch (off by
 * default, as in PyTorch). Plain C, so core includes it too. */
#ifndef CUDA_BLAS_H
#define CUDA_BLAS_H

#ifdef __cplusplus
extern "C" {
#endif

/* f32 GEMMs (cuBLASLt) and convolutions (cuDNN) may round their inputs to
 * TF32 when on: about 10 mantissa bits, several times the speed. */
void ds_cuda_set_tf32(int on);
int ds_cuda_tf32(void);

#ifdef __cplusplus
}
#endif

#endif
