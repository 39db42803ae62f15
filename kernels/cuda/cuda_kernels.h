/* The CUDA backend's kernel families (assembled into ds_cuda_kernels by
 * cuda_kernels.cu) and the two things kernels need from the runtime: the
 * stream to launch on and scratch memory. The runtime (core/cuda) hands
 * them in once with ds_cuda_kernels_bind, so kernels call nothing above
 * them. Plain C, so core includes it too. */
#ifndef CUDA_KERNELS_H
#define CUDA_KERNELS_H

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "../ds_kernels.h"

extern const ds_kernels_core ds_cuda_core;
extern const ds_kernels_elementwise ds_cuda_elementwise;
extern const ds_kernels_reduce ds_cuda_reduce;
extern const ds_kernels_blas ds_cuda_blas;
extern const ds_kernels_conv ds_cuda_conv;
extern const ds_kernels_attention ds_cuda_attention;
extern const ds_kernels_index ds_cuda_index;
extern const ds_kernels_nn ds_cuda_nn;
extern const ds_kernels_optim ds_cuda_optim;
extern const ds_kernels_fp8 ds_cuda_fp8;
extern const ds_kernels ds_cuda_kernels;

/* ds_cuda_fp8's GEMM, in cuda_blas.cu beside the cuBLASLt handles and the
 * heuristic's cache it shares. */
int ds_cuda_gemm_fp8(ds_kview c, ds_kview a, ds_kview b, ds_kview a_meta, ds_kview b_meta, int af, int bf,
                     ds_kview bias);

/* A fault's message from the context its record was opened with. */
typedef void (*ds_cuda_fault_describe)(char *buf, size_t n, const void *ctx, ds_index_hit hit);

typedef struct {
    cudaStream_t (*stream)(void);
    void *(*scratch)(size_t nbytes);
    void (*scratch_free)(void *p);
    ds_index_hit *(*fault_open)(ds_cuda_fault_describe describe, const void *ctx, size_t ctx_size);
} ds_cuda_runtime_hooks;

/* Before the first launch. */
void ds_cuda_kernels_bind(const ds_cuda_runtime_hooks *hooks);

/* The stream this thread's kernels go on: the compute stream of the
 * current device (core makes a tensor's device current before it calls
 * its kernels). NCCL runs on a stream of its own (core/ds_comm_nccl.c). */
cudaStream_t ds_cuda_stream(void);

/* Temporary device memory on the current device from the caching
 * allocator, ordered on ds_cuda_stream(): free it right after queuing the
 * last launch that uses it; the block is reused only by later work on that
 * stream. NULL after ds_kernel_fail() when the device is out of memory. */
void *ds_cuda_scratch(size_t nbytes);
void ds_cuda_scratch_free(void *p);

/* A deferred fault record on the current device (core/tensor/ds_fault.h's
 * ds_fault_open): page-locked, written by a copy queued on
 * ds_cuda_stream(), reported as an error at the next synchronisation
 * when its pos is >= 0 (-1: none). NULL after ds_kernel_fail(). */
ds_index_hit *ds_cuda_fault_open(ds_cuda_fault_describe describe, const void *ctx, size_t ctx_size);

#ifdef __cplusplus
}
#endif

#endif
