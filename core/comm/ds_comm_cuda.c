/* The device half of collectives, in CUDA builds: the ordering of a
 * collective's stream after the work queued on the device (NCCL's backend
 * and the staged one), and the staged backend's stager
 * (ds_comm_staged.c): copies between device memory and page-locked host
 * memory on the device's communication stream, each with an event the
 * backend polls. */
#include "ds_comm_impl.h"
#include "ds_cuda_impl.h"
#include "ds_error.h"

#include <stdio.h>

static int check(cudaError_t e, const char *op, const char *call) {
    if (e == cudaSuccess) return 0;
    return ds_fail(DS_ERR_STATE, "%s: %s: %s", op, call, cudaGetErrorString(e)), -1;
}

int ds_comm_cuda_device_of(const void *ptr, const char *op, int *dev) {
    struct cudaPointerAttributes a;
    if (check(cudaPointerGetAttributes(&a, ptr), op, "cudaPointerGetAttributes")) return -1;
    if (a.type != cudaMemoryTypeDevice) return ds_fail(DS_ERR_ARG, "%s: buffer is not device memory", op), -1;
    *dev = a.device;
    if (ds_cuda_set_device(a.device)) return ds_fail(DS_ERR_STATE, "%s: %s", op, ds_kernel_error()), -1;
    return 0;
}

void *ds_comm_cuda_begin(const void *ptr, const char *op, int *dev) {
    cudaEvent_t ready;
    if (ds_comm_cuda_device_of(ptr, op, dev)) return NULL;
    cudaStream_t cs = ds_cuda_compute_stream(*dev), ms = ds_cuda_comm_stream(*dev);
    if (check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), op, "cudaEventCreateWithFlags")) return NULL;
    int rc = check(cudaEventRecord(ready, cs), op, "cudaEventRecord");
    if (!rc) rc = check(cudaStreamWaitEvent(ms, ready, 0), op, "cudaStreamWaitEvent");
    cudaEventDestroy(ready);       /* released once the wait has used it */
    return rc ? NULL : ms;
}

static bool stage_owns(const void *ptr) {
    struct cudaPointerAttributes a;
    if (!ptr || ds_cuda_device_count() == 0) return false;
    if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return a.type == cudaMemoryTypeDevice;
}

static void *stage_begin(const void *ptr, const char *op) {
    int dev;
    return ds_comm_cuda_begin(ptr, op, &dev);
}

static void *stage_host_alloc(size_t nb) { return ds_cuda_host_allocator.alloc(&ds_cuda_host_allocator, nb); }

static void stage_host_free(void *p, size_t nb) { ds_cuda_host_allocator.free(&ds_cuda_host_allocator, p, nb); }

static int stage_copy(void *dst, const void *src, size_t nb, void *stream, void **fence) {
    cudaEvent_t e;
    if (check(cudaMemcpyAsync(dst, src, nb, cudaMemcpyDefault, stream), "comm", "cudaMemcpyAsync") ||
        check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "comm", "cudaEventCreateWithFlags"))
        return -1;
    if (check(cudaEventRecord(e, stream), "comm", "cudaEventRecord")) {
        cudaEventDestroy(e);
        return -1;
    }
    *fence = e;
    return 0;
}

static int stage_passed(void *fence, bool *done) {
    cudaError_t e = cudaEventQuery(fence);
    *done = e == cudaSuccess;
    return *done || e == cudaErrorNotReady ? 0 : check(e, "comm", "cudaEventQuery");
}

static void stage_fence_free(void *fence) { cudaEventDestroy(fence); }

const ds_comm_stager ds_cuda_stager = {
    .name = "cuda",
    .owns = stage_owns,
    .begin = stage_begin,
    .host_alloc = stage_host_alloc,
    .host_free = stage_host_free,
    .copy = stage_copy,
    .passed = stage_passed,
    .fence_free = stage_fence_free,
};
