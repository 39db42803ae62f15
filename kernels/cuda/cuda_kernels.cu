/* The CUDA backend's dispatch table: one family per file of kernels/cuda. */
#include "cuda_common.cuh"

extern "C" const ds_kernels ds_cuda_kernels = {
    "cuda",
    &ds_cuda_core,
    &ds_cuda_elementwise,
    &ds_cuda_reduce,
    &ds_cuda_blas,
    &ds_cuda_conv,
    &ds_cuda_attention,
    &ds_cuda_index,
    &ds_cuda_nn,
    &ds_cuda_optim,
    &ds_cuda_fp8,
};

static ds_cuda_runtime_hooks runtime;

extern "C" void ds_cuda_kernels_bind(const ds_cuda_runtime_hooks *hooks) { runtime = *hooks; }

extern "C" cudaStream_t ds_cuda_stream(void) { return runtime.stream(); }

extern "C" void *ds_cuda_scratch(size_t nbytes) { return runtime.scratch(nbytes); }

extern "C" void ds_cuda_scratch_free(void *p) { runtime.scratch_free(p); }

extern "C" ds_index_hit *ds_cuda_fault_open(ds_cuda_fault_describe describe, const void *ctx, size_t ctx_size) {
    return runtime.fault_open(describe, ctx, ctx_size);
}
