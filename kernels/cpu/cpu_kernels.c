#include "cpu_kernels.h"

const ds_kernels ds_cpu_kernels = {
    .name = "cpu",
    .core = &ds_cpu_core,
    .elementwise = &ds_cpu_elementwise,
    .reduce = &ds_cpu_reduce,
};
