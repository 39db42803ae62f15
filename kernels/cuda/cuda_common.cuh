/* What every .cu file in kernels/cuda shares: CUDA errors turned into
 * ds_kernel_fail, launch sizes and int64 grid-stride loops, and strided
 * addressing on the device. Include it first: it brings in ds_kernels.h
 * with C linkage, the stream (ds_cuda_stream) and scratch memory. Under
 * tests/warp_emulator.h only the device side is there. */
#ifndef CUDA_COMMON_CUH
#define CUDA_COMMON_CUH

#include "../ds_kview.h"
#include "../ds_half.h"
#include "../cpu/cpu_iter.h"     /* cpu_coalesce: host-side dim merging, any device */

#ifndef DS_WARP_EMULATOR
#include <cuda_runtime.h>

#include "cuda_kernels.h"

/* 0, or -1 after ds_kernel_fail("<what>: <CUDA's message>"). */
static inline int ds_cuda_ok(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return 0;
    return ds_kernel_fail("%s: %s", what, cudaGetErrorString(e));
}

/* Returns -1 from the calling function when a runtime call fails, naming
 * the call: DS_CUDA_CHECK(cudaMemsetAsync(p, 0, n, ds_cuda_stream())). */
#define DS_CUDA_CHECK(call) do { if (ds_cuda_ok((call), #call) != 0) return -1; } while (0)

/* Right after a <<<...>>> launch: a bad configuration names the kernel. */
static inline int ds_cuda_launched(const char *kernel) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return 0;
    return ds_kernel_fail("%s launch: %s", kernel, cudaGetErrorString(e));
}

/* Dynamic shared memory past 48 KB needs the kernel's consent, asked once
 * per device (the bits of *asked), not at every launch. */
template <typename K> static int ds_cuda_allow_smem(K kernel, size_t bytes, uint64_t *asked) {
    if (bytes <= 48 * 1024) return 0;
    int dev;
    if (ds_cuda_ok(cudaGetDevice(&dev), "cudaGetDevice")) return -1;
    uint64_t bit = dev < 64 ? 1ull << dev : 0;      /* past 64 devices: asked at every launch */
    if (*asked & bit) return 0;
    if (ds_cuda_ok(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                   "cudaFuncSetAttribute"))
        return -1;
    *asked |= bit;
    return 0;
}
#endif

#define DS_CUDA_THREADS 256
/* Grids stop growing here; grid-stride loops cover the rest (and keep
 * gridDim.x far below its limit for any int64 element count). */
#define DS_CUDA_MAX_BLOCKS 65536

/* Blocks of `threads` for n elements, at least 1, at most DS_CUDA_MAX_BLOCKS. */
static inline unsigned ds_cuda_blocks(int64_t n, int threads) {
    int64_t b = (n + threads - 1) / threads;
    if (b < 1) b = 1;
    return (unsigned)(b < DS_CUDA_MAX_BLOCKS ? b : DS_CUDA_MAX_BLOCKS);
}

/* for (i over [0, n)) spread over the whole grid, int64 throughout. */
#define DS_CUDA_LOOP(i, n) \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (int64_t)(n); \
         i += (int64_t)blockDim.x * gridDim.x)

/* The piece chunk c belongs to, pieces cut into chunks with piece k's
 * first chunk at first[k]: the last k < n with first[k] <= c (an empty
 * piece shares its first with the next one and owns nothing). */
__device__ __forceinline__ int ds_cuda_piece_of(const int64_t *first, int n, int64_t c) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first[mid] <= c) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Element offset of the i-th (row-major) element of a view passed by value
 * to a kernel. Coalesce views on the host first (cpu_coalesce) so the
 * divisions run over as few dims as the strides allow. */
__device__ __forceinline__ int64_t ds_cuda_offset(const ds_kview &v, int64_t i) {
    return ds_kview_offset(&v, i);
}

/* True when element i sits at offset i (contiguous, no broadcast). */
static inline bool ds_cuda_is_flat(const ds_kview &v) { return ds_kview_is_contiguous(&v) != 0; }

#endif
