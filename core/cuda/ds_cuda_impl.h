/* Inside the CUDA runtime (core/ds_cuda*.c, ds_comm_nccl.c and
 * ds_comm_cuda.c only; these files exist in CUDA builds alone): devices, streams, the caching
 * allocator and cross-device copies. */
#ifndef DS_CUDA_IMPL_H
#define DS_CUDA_IMPL_H

#include "ds_cuda.h"
#include "cuda/cuda_kernels.h"

#include <cuda_runtime_api.h>

#define DS_CUDA_MAX_DEVICES 64

/* 0, or -1 after ds_kernel_fail("<what>: <CUDA's message>"). */
static inline int ds_cuda_call(cudaError_t e, const char *what) {
    return e == cudaSuccess ? 0 : ds_kernel_fail("%s: %s", what, cudaGetErrorString(e));
}

/* Makes cuda:index current for this thread, its streams created on first
 * use: 0, or -1 after ds_kernel_fail. */
int ds_cuda_set_device(int index);
int ds_cuda_current_device(void);          /* -1 before any */
/* Each device has a compute stream (every kernel and copy), a
 * communication stream (NCCL), so gradient all-reduce overlaps backward,
 * and a copy stream (uploads of the next batch), so input copies overlap
 * the step before. */
cudaStream_t ds_cuda_compute_stream(int index);
cudaStream_t ds_cuda_comm_stream(int index);
cudaStream_t ds_cuda_copy_stream(int index);
/* Device memory ordered on the current stream (the kernels' scratch). */
void *ds_cuda_block_alloc(size_t nbytes);
void ds_cuda_block_free(void *p);

extern ds_allocator ds_cuda_allocator;
/* Page-locked host memory (ds_backend.host_allocator), cached by size. */
extern ds_allocator ds_cuda_host_allocator;
/* Frees the cached blocks of cuda:index (-1: every device). */
void ds_cuda_alloc_trim(int index);
void ds_cuda_alloc_info(int index, ds_cuda_mem_info *out);
void ds_cuda_alloc_reset_peak(int index);

/* ds_backend.transfer of the CUDA backend (ds_cuda_copy.c). */
int ds_cuda_transfer(ds_kview dst, ds_device ddev, ds_kview src, ds_device sdev);
/* ds_backend.upload and upload_wait of the CUDA backend (ds_cuda_copy.c). */
int ds_cuda_upload(void *dst, const void *src, size_t nb, int index, void **fence);
int ds_cuda_upload_wait(void *fence, int index);


#endif
