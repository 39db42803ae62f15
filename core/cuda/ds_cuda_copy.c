/* Copies between the CPU and a GPU and between two GPUs, any strides and
 * dtypes on both sides. The bytes cross the bus contiguous and in the
 * source dtype; strides and casts are done on the side that has them (the
 * CPU kernels on the host, the CUDA kernels on the device), in scratch. */
#include "ds_cuda_impl.h"
#include "cpu/cpu_kernels.h"

#include <stdlib.h>
#include <string.h>

static int host_to_device(ds_kview dst, int dev, ds_kview src, size_t nb) {
    if (ds_cuda_set_device(dev)) return -1;
    cudaStream_t st = ds_cuda_stream();
    void *host = src.data;
    if (!ds_kview_is_contiguous(&src)) {
        if (!(host = malloc(nb))) return ds_kernel_fail("out of host memory staging %zu bytes", nb);
        ds_cpu_core.copy(ds_kview_dense(&src, host, src.dtype), src);
    }
    bool direct = dst.dtype == src.dtype && ds_kview_is_contiguous(&dst);
    void *d = direct ? dst.data : ds_cuda_scratch(nb);
    int rc = d ? 0 : -1;
    /* a pageable source is staged before this returns, so host may go now */
    if (rc == 0) rc = ds_cuda_call(cudaMemcpyAsync(d, host, nb, cudaMemcpyHostToDevice, st), "cudaMemcpyAsync");
    if (host != src.data) free(host);
    if (rc == 0 && !direct) rc = ds_cuda_core.copy(dst, ds_kview_dense(&dst, d, src.dtype));
    if (!direct) ds_cuda_scratch_free(d);
    return rc;
}

static int device_to_host(ds_kview dst, ds_kview src, int dev, size_t nb) {
    if (ds_cuda_set_device(dev)) return -1;
    cudaStream_t st = ds_cuda_stream();
    void *d = src.data;
    if (!ds_kview_is_contiguous(&src)) {
        if (!(d = ds_cuda_scratch(nb))) return -1;
        if (ds_cuda_core.copy(ds_kview_dense(&src, d, src.dtype), src)) { ds_cuda_scratch_free(d); return -1; }
    }
    bool direct = dst.dtype == src.dtype && ds_kview_is_contiguous(&dst);
    void *host = direct ? dst.data : malloc(nb);
    int rc = host ? 0 : ds_kernel_fail("out of host memory staging %zu bytes", nb);
    if (rc == 0) rc = ds_cuda_call(cudaMemcpyAsync(host, d, nb, cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync");
    if (rc == 0) rc = ds_cuda_call(cudaStreamSynchronize(st), "cudaStreamSynchronize");
    if (d != src.data) ds_cuda_scratch_free(d);
    if (rc == 0 && !direct) ds_cpu_core.copy(dst, ds_kview_dense(&dst, host, src.dtype));
    if (!direct) free(host);
    return rc;
}

/* Between two GPUs: the destination's stream drains first (its queued
 * kernels may still read dst), the peer copy runs on the source's stream
 * after the kernels that made src, and both sides wait for it. */
static int device_to_device(ds_kview dst, int ddev, ds_kview src, int sdev, size_t nb) {
    bool direct = dst.dtype == src.dtype && ds_kview_is_contiguous(&dst);
    void *d = dst.data, *s = src.data;
    int rc = ds_cuda_set_device(ddev);
    if (rc == 0 && !direct && !(d = ds_cuda_scratch(nb))) rc = -1;
    if (rc == 0) rc = ds_cuda_call(cudaStreamSynchronize(ds_cuda_stream()), "cudaStreamSynchronize");
    if (rc == 0) rc = ds_cuda_set_device(sdev);
    if (rc == 0 && !ds_kview_is_contiguous(&src)) {
        if (!(s = ds_cuda_scratch(nb))) rc = -1;
        else rc = ds_cuda_core.copy(ds_kview_dense(&src, s, src.dtype), src);
    }
    if (rc == 0) rc = ds_cuda_call(cudaMemcpyPeerAsync(d, ddev, s, sdev, nb, ds_cuda_stream()), "cudaMemcpyPeerAsync");
    if (rc == 0) rc = ds_cuda_call(cudaStreamSynchronize(ds_cuda_stream()), "cudaStreamSynchronize");
    if (s && s != src.data) ds_cuda_scratch_free(s);
    if (ds_cuda_set_device(ddev) && rc == 0) rc = -1;
    if (rc == 0 && !direct) rc = ds_cuda_core.copy(dst, ds_kview_dense(&dst, d, src.dtype));
    if (d && d != dst.data) ds_cuda_scratch_free(d);
    return rc;
}

int ds_cuda_transfer(ds_kview dst, ds_device ddev, ds_kview src, ds_device sdev) {
    int64_t n = ds_kview_numel(&dst);
    if (n == 0) return 0;
    size_t nb = (size_t)n * ds_dtype_size(src.dtype);
    if (sdev.type == DS_DEV_CPU) return host_to_device(dst, ddev.index, src, nb);
    if (ddev.type == DS_DEV_CPU) return device_to_host(dst, src, sdev.index, nb);
    if (ddev.index == sdev.index) {
        if (ds_cuda_set_device(ddev.index)) return -1;
        return ds_cuda_core.copy(dst, src);
    }
    return device_to_device(dst, ddev.index, src, sdev.index, nb);
}

/* An upload goes on the copy stream behind what the compute stream has
 * queued so far: dst is a block of the caching allocator, which work
 * queued earlier may still be reading for the tensor that had it before.
 * The compute work queued later does not wait for it until upload_wait. */
int ds_cuda_upload(void *dst, const void *src, size_t nb, int index, void **fence) {
    if (ds_cuda_set_device(index)) return -1;
    cudaStream_t up = ds_cuda_copy_stream(index);
    cudaEvent_t before, done;
    if (ds_cuda_call(cudaEventCreateWithFlags(&before, cudaEventDisableTiming), "cudaEventCreateWithFlags")) return -1;
    int rc = ds_cuda_call(cudaEventRecord(before, ds_cuda_compute_stream(index)), "cudaEventRecord");
    if (rc == 0) rc = ds_cuda_call(cudaStreamWaitEvent(up, before, 0), "cudaStreamWaitEvent");
    cudaEventDestroy(before);              /* released once the wait has used it */
    if (rc) return -1;
    if (ds_cuda_call(cudaMemcpyAsync(dst, src, nb, cudaMemcpyHostToDevice, up), "cudaMemcpyAsync")) return -1;
    rc = ds_cuda_call(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    if (rc == 0 && (rc = ds_cuda_call(cudaEventRecord(done, up), "cudaEventRecord"))) cudaEventDestroy(done);
    if (rc) {
        cudaStreamSynchronize(up);         /* no fence: src must outlive the copy all the same */
        return -1;
    }
    *fence = done;
    return 0;
}

/* By the take, a step after the start, the copy has long finished: the
 * host wait costs nothing then, and lets src go back to the cache. */
int ds_cuda_upload_wait(void *fence, int index) {
    cudaEvent_t done = fence;
    int rc = ds_cuda_set_device(index);
    if (rc == 0) rc = ds_cuda_call(cudaStreamWaitEvent(ds_cuda_compute_stream(index), done, 0), "cudaStreamWaitEvent");
    int synced = ds_cuda_call(cudaEventSynchronize(done), "cudaEventSynchronize");
    cudaEventDestroy(done);
    return rc ? rc : synced;
}
