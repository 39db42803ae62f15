/* 2-D pooling on the CPU, the pooling half of ds_cpu_conv. */
#ifndef CPU_POOL_H
#define CPU_POOL_H

#include "../ds_kernels.h"

int cpu_pool_max2d(ds_kview y, ds_kview indices, ds_kview x, const ds_pool2d_params *p);
int cpu_pool_max2d_backward(ds_kview dx, ds_kview dy, ds_kview indices);
int cpu_pool_avg2d(ds_kview y, ds_kview x, const ds_pool2d_params *p);
int cpu_pool_avg2d_backward(ds_kview dx, ds_kview dy, const ds_pool2d_params *p);

#endif
