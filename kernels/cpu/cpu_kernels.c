#include "cpu_kernels.h"

const ds_kernels ds_cpu_kernels = {
    .name = "cpu",
    .core = &ds_cpu_core,
    .elementwise = &ds_cpu_elementwise,
    .reduce = &ds_cpu_reduce,
    .blas = &ds_cpu_blas,
    .conv = &ds_cpu_conv,
    .nn = &ds_cpu_nn,
    .attention = &ds_cpu_attention,
    .index = &ds_cpu_index,
    .optim = &ds_cpu_optim,
    .fp8 = &ds_cpu_fp8,
};
