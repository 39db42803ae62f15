/* The CUDA runtime: found on first use, devices made current per thread
 * with their streams, the backend registered, and what --report prints. */
#include "ds_cuda_impl.h"
#include "ds_error.h"
#include "ds_fault.h"
#include "ds_tensor.h"
#include "cuda/cuda_attention_choice.h"
#include "cuda/cuda_blas.h"

#include <cublasLt.h>
#include <cudnn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

static struct {
    pthread_once_t once;
    int count;
    char reason[256];
    pthread_mutex_t lock;                        /* stream creation */
    _Atomic bool ready[DS_CUDA_MAX_DEVICES];
    cudaStream_t compute[DS_CUDA_MAX_DEVICES], comm[DS_CUDA_MAX_DEVICES], copy[DS_CUDA_MAX_DEVICES];
} R = { PTHREAD_ONCE_INIT, 0, "", PTHREAD_MUTEX_INITIALIZER, { false }, { 0 }, { 0 }, { 0 } };

static _Thread_local int cur_dev = -1;
static _Thread_local cudaStream_t cur_stream;

static void activate(int index) {
    if (index == cur_dev && cur_stream) return;
    if (ds_cuda_set_device(index) != 0)
        fprintf(stderr, "dslua: cuda:%d: %s\n", index, ds_kernel_error());
}

static cudaStream_t current_stream(void);

static int synchronize_device(int index) {
    if (ds_cuda_set_device(index)) return -1;
    return ds_cuda_call(cudaStreamSynchronize(R.compute[index]), "cudaStreamSynchronize");
}

/* A fault record on the current device, for kernels (ds_cuda_fault_open). */
static ds_index_hit *fault_open_current(ds_cuda_fault_describe describe, const void *ctx, size_t ctx_size) {
    int dev = 0;
    if (ds_cuda_call(cudaGetDevice(&dev), "cudaGetDevice")) return NULL;
    ds_index_hit *hit = ds_fault_open((ds_device){ DS_DEV_CUDA, dev }, describe, ctx, ctx_size);
    if (!hit) ds_kernel_fail("%s", ds_error_message());
    return hit;
}

static void init(void) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n <= 0) {
        int drv = 0;
        cudaDriverGetVersion(&drv);
        /* the runtime counts only the GPUs CUDA_VISIBLE_DEVICES lets it see */
        const char *vis = drv ? getenv("CUDA_VISIBLE_DEVICES") : NULL;
        snprintf(R.reason, sizeof R.reason, "%s%s%s%s",
                 drv == 0 ? "no CUDA driver" : e != cudaSuccess ? cudaGetErrorString(e) : "no GPU found",
                 vis ? " with CUDA_VISIBLE_DEVICES='" : "", vis ? vis : "", vis ? "'" : "");
        cudaGetLastError();           /* not sticky: later calls start clean */
        return;
    }
    R.count = n < DS_CUDA_MAX_DEVICES ? n : DS_CUDA_MAX_DEVICES;
    ds_cuda_kernels_bind(&(ds_cuda_runtime_hooks){ current_stream, ds_cuda_block_alloc, ds_cuda_block_free,
                                                   fault_open_current });
    ds_backend b = { &ds_cuda_kernels, &ds_cuda_allocator, R.count, activate, ds_cuda_transfer,
                     &ds_cuda_host_allocator, ds_cuda_upload, ds_cuda_upload_wait, synchronize_device };
    ds_backend_register(DS_DEV_CUDA, &b);
}

int ds_cuda_built(void) { return 1; }

int ds_cuda_device_count(void) {
    pthread_once(&R.once, init);
    return R.count;
}

const char *ds_cuda_unavailable_reason(void) {
    ds_cuda_device_count();
    return R.reason;
}

int ds_cuda_device_name(int index, char *buf, size_t n) {
    struct cudaDeviceProp p;
    if (index < 0 || index >= ds_cuda_device_count() || cudaGetDeviceProperties(&p, index) != cudaSuccess) return -1;
    snprintf(buf, n, "%s", p.name);
    return 0;
}

int ds_cuda_check_device(const char *op, int index) {
    int n = ds_cuda_device_count();
    if (n == 0) return ds_fail(DS_ERR_ARG, "%s: no CUDA device available (%s)", op, R.reason), -1;
    if (index < 0 || index >= n)
        return ds_fail(DS_ERR_ARG, "%s: no device cuda:%d (this machine has %d, cuda:0 to cuda:%d)", op, index, n,
                       n - 1), -1;
    return 0;
}

static int make_streams(int index) {
    int rc = 0;
    pthread_mutex_lock(&R.lock);
    if (!atomic_load(&R.ready[index])) {
        /* non-blocking: no implicit ordering with the legacy default stream */
        cudaError_t e = cudaStreamCreateWithFlags(&R.compute[index], cudaStreamNonBlocking);
        if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&R.comm[index], cudaStreamNonBlocking);
        if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&R.copy[index], cudaStreamNonBlocking);
        if (e == cudaSuccess) atomic_store(&R.ready[index], true);
        else rc = ds_kernel_fail("cudaStreamCreateWithFlags: %s", cudaGetErrorString(e));
    }
    pthread_mutex_unlock(&R.lock);
    return rc;
}

int ds_cuda_set_device(int index) {
    if (index < 0 || index >= ds_cuda_device_count())
        return ds_kernel_fail("no device cuda:%d (%d present)", index, R.count);
    if (index != cur_dev) {
        cudaError_t e = cudaSetDevice(index);
        if (e != cudaSuccess) return ds_kernel_fail("cudaSetDevice(%d): %s", index, cudaGetErrorString(e));
        cur_dev = index;
        cur_stream = NULL;
    }
    if (!atomic_load(&R.ready[index]) && make_streams(index) != 0) return -1;
    cur_stream = R.compute[index];
    return 0;
}

int ds_cuda_current_device(void) { return cur_dev; }

cudaStream_t ds_cuda_compute_stream(int index) { return R.compute[index]; }

cudaStream_t ds_cuda_comm_stream(int index) { return R.comm[index]; }

cudaStream_t ds_cuda_copy_stream(int index) { return R.copy[index]; }

static cudaStream_t current_stream(void) { return cur_stream; }

/* Every device waited for, even after one fails (the first error is the
 * one reported), and the thread's device put back as it was. */
int ds_cuda_synchronize(void) {
    int prev = cur_dev, rc = 0;
    for (int i = 0; i < ds_cuda_device_count(); i++) {
        if (!atomic_load(&R.ready[i])) continue;
        cudaError_t e = cudaSetDevice(i);
        if (e == cudaSuccess) e = cudaDeviceSynchronize();
        if (rc != 0) continue;
        if (e != cudaSuccess) {
            ds_fail(DS_ERR_STATE, "cuda:%d: synchronize: %s", i, cudaGetErrorString(e));
            rc = -1;
        } else {
            rc = ds_fault_settle((ds_device){ DS_DEV_CUDA, i });
        }
    }
    if (prev >= 0) cudaSetDevice(prev);
    return rc;
}

int ds_cuda_memory_info(int index, ds_cuda_mem_info *out) {
    *out = (ds_cuda_mem_info){ 0 };
    if (ds_cuda_check_device("memory_info", index)) return -1;
    ds_cuda_alloc_info(index, out);
    return 0;
}

int ds_cuda_reset_peak(int index) {
    if (ds_cuda_check_device("reset_peak", index)) return -1;
    ds_cuda_alloc_reset_peak(index);
    return 0;
}

void ds_cuda_empty_cache(void) { ds_cuda_alloc_trim(-1); }

int ds_cuda_allow_tf32(bool conv, int on) {
    ds_tf32_use use = conv ? DS_TF32_CONV : DS_TF32_MATMUL;
    if (on >= 0) ds_cuda_set_tf32(use, on);
    return ds_cuda_tf32(use);
}

int ds_cuda_allow_wgmma(int on) { return ds_cuda_attention_set_wgmma(on); }

const char *ds_cuda_attention_kernel(ds_dtype dt, int D, bool backward, const char **why) {
    if ((dt != DS_BF16 && dt != DS_F16) || (D != 64 && D != 128))
        return ds_fail(DS_ERR_ARG, "attention_kernel: bf16 and f16 at head dim 64 or 128 run on tensor cores, not %s "
                       "at head dim %d", ds_dtype_name(dt), D), NULL;
    if (ds_cuda_check_device("attention_kernel", 0)) return NULL;
    const char *k = ds_cuda_attention_pass_kernel(dt, D, backward, why);
    if (!k) ds_fail(DS_ERR_STATE, "attention_kernel: %s", ds_kernel_error());
    return k;
}

static void print_version(FILE *f, const char *what, int v, int major_div, int minor_div) {
    if (v <= 0) fprintf(f, "%s: none\n", what);
    else fprintf(f, "%s: %d.%d.%d\n", what, v / major_div, v % major_div / minor_div, v % minor_div);
}

void ds_cuda_report(FILE *f) {
    int rt = 0, drv = 0, nccl = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    print_version(f, "CUDA runtime", rt, 1000, 10);
    if (drv > 0) print_version(f, "CUDA driver (highest CUDA it supports)", drv, 1000, 10);
    else fprintf(f, "CUDA driver: no driver\n");
    print_version(f, "cuBLAS(Lt)", (int)cublasLtGetVersion(), 10000, 100);
    print_version(f, "cuDNN", (int)cudnnGetVersion(), 10000, 100);
    if (ncclGetVersion(&nccl) == ncclSuccess) print_version(f, "NCCL", nccl, 10000, 100);
    else fprintf(f, "NCCL: unknown\n");
    int n = ds_cuda_device_count();
    fprintf(f, "GPUs: %d%s%s%s\n", n, n ? "" : " (", n ? "" : R.reason, n ? "" : ")");
    for (int i = 0; i < n; i++) {
        struct cudaDeviceProp p;
        cudaError_t e = cudaGetDeviceProperties(&p, i);
        if (e != cudaSuccess) { fprintf(f, "  cuda:%d: %s\n", i, cudaGetErrorString(e)); continue; }
        fprintf(f, "  cuda:%d: %s, %.1f GiB, compute capability %d.%d, %d SMs\n", i, p.name,
                (double)p.totalGlobalMem / (1 << 30), p.major, p.minor, p.multiProcessorCount);
    }
}
