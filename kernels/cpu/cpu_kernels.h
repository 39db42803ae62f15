/* The CPU backend's kernel families, assembled into ds_cpu_kernels. */
#ifndef CPU_KERNELS_H
#define CPU_KERNELS_H

#include "../ds_kernels.h"

extern const ds_kernels_core ds_cpu_core;
extern const ds_kernels_elementwise ds_cpu_elementwise;
extern const ds_kernels_reduce ds_cpu_reduce;
extern const ds_kernels_nn ds_cpu_nn;
extern const ds_kernels_blas ds_cpu_blas;
extern const ds_kernels_conv ds_cpu_conv;
extern const ds_kernels_attention ds_cpu_attention;
extern const ds_kernels_index ds_cpu_index;
extern const ds_kernels_optim ds_cpu_optim;
extern const ds_kernels_fp8 ds_cpu_fp8;
extern const ds_kernels ds_cpu_kernels;

/* cpu_rope.c, built apart (without contracted multiply-adds) */
int cpu_rope(ds_kview y, ds_kview x, ds_kview cos, ds_kview sin, bool backward);

#endif
