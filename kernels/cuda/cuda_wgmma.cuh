/* The warpgroup-level PTX of the Hopper attention kernel
 * (cuda_attention_wgmma.cuh): wgmma.mma_async m64nNk16 with f32
 * accumulators and bf16/f16 inputs, its fence, commit and wait,
 * fence.proxy.async, and named barriers. Only sm_90a has these
 * (DS_WGMMA_ARCH); elsewhere this header declares nothing. tests/warp_emulator_wgmma.h stands in for it on
 * the CPU, as warp_emulator.h does for cuda_warp.cuh.
 *
 * Accumulators d[N/8][4]: thread l of warp w of the warpgroup (g = l/4,
 * t = l%4) holds rows 16w + g and 16w + g + 8, columns 8i + 2t and +1:
 * d[i] = (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1), mma.sync's C layout
 * repeated over N/8. A from registers: mma.m16n8k16's A layout on the
 * warp's 16 rows. Shared operands go by 64-bit matrix descriptors. */
#ifndef CUDA_WGMMA_CUH
#define CUDA_WGMMA_CUH

#include "cuda_warp.cuh"

#include <type_traits>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DS_WGMMA_ARCH 1

/* Orders this thread's register accesses before the wgmma that follow:
 * before the first of a chain, whenever registers were touched since. */
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

/* Closes the group of wgmma issued since the last commit. */
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

/* Waits for all but the newest PENDING groups; their accumulators are
 * undefined until then. */
template <int PENDING> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}

/* Named barrier id (1..15; 0 is __syncthreads') for `threads` threads:
 * sync waits until that many have arrived, arrive counts this warp and
 * goes on. Two warpgroups take turns with them. */
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

/* Pins n registers in place around wgmma's issue and wait: the compiler
 * may move no access to them across this point (ptxas would otherwise
 * see accumulators read between issue and wait and serialise with a
 * wait of its own). */
__device__ __forceinline__ void wgmma_pin(float *x, int n) {
#pragma unroll
    for (int i = 0; i < n; i++) asm volatile("" : "+f"(x[i])::"memory");
}
__device__ __forceinline__ void wgmma_pin(uint32_t *x, int n) {
#pragma unroll
    for (int i = 0; i < n; i++) asm volatile("" : "+r"(x[i])::"memory");
}

/* Orders this thread's generic-proxy writes to shared memory (cp.async
 * data landed by cp_async_wait) before async-proxy reads (wgmma) that a
 * barrier then releases. */
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#define WG_ACC8(c, i) "+f"(c[i]), "+f"(c[i + 1]), "+f"(c[i + 2]), "+f"(c[i + 3]), "+f"(c[i + 4]), "+f"(c[i + 5]), \
                      "+f"(c[i + 6]), "+f"(c[i + 7])
#define WG_ACC32(c) WG_ACC8(c, 0), WG_ACC8(c, 8), WG_ACC8(c, 16), WG_ACC8(c, 24)
#define WG_ACC64(c) WG_ACC32(c), WG_ACC8(c, 32), WG_ACC8(c, 40), WG_ACC8(c, 48), WG_ACC8(c, 56)
#define WG_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "\
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "\
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "\
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "\
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

/* One wgmma.mma_async m64nNk16 with f32 accumulators: TY the input type,
 * D the accumulators' register list, A the A operand (a descriptor, or
 * four registers), B's descriptor, the scale-d predicate's operand and
 * trans-b; the operands follow. */
#define WG_MMA(N, TY, D, A, B, P, TB, ...) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " D ", " A ", %" B ", p, 1, 1" TB \
                 ";\n}\n" : __VA_ARGS__)

/* d (64 x N) = A B + (scale_d ? d : 0): A (64 x 16) and B (16 x N) both
 * K-major in shared memory (descriptors a and b); T the input type. */
template <int N, typename T>
__device__ __forceinline__ void wgmma_ss(float d[][4], uint64_t a, uint64_t b, int scale_d, T) {
    static_assert(N == 64 || N == 128, "wgmma: N is 64 or 128");
    constexpr bool bf = std::is_same<T, __nv_bfloat16>::value;
    float *c = &d[0][0];
    if constexpr (N == 64 && bf)
        WG_MMA(64, "bf16", WG_D32, "%32", "33", "34", ", 0, 0", WG_ACC32(c) : "l"(a), "l"(b), "r"(scale_d));
    else if constexpr (N == 64)
        WG_MMA(64, "f16", WG_D32, "%32", "33", "34", ", 0, 0", WG_ACC32(c) : "l"(a), "l"(b), "r"(scale_d));
    else if constexpr (bf)
        WG_MMA(128, "bf16", WG_D64, "%64", "65", "66", ", 0, 0", WG_ACC64(c) : "l"(a), "l"(b), "r"(scale_d));
    else
        WG_MMA(128, "f16", WG_D64, "%64", "65", "66", ", 0, 0", WG_ACC64(c) : "l"(a), "l"(b), "r"(scale_d));
}

/* The same with A from registers (a[4]) and B MN-major (its N
 * contiguous: trans-b), as P V takes V. */
template <int N, typename T>
__device__ __forceinline__ void wgmma_rs(float d[][4], const uint32_t a[4], uint64_t b, int scale_d, T) {
    static_assert(N == 64 || N == 128, "wgmma: N is 64 or 128");
    constexpr bool bf = std::is_same<T, __nv_bfloat16>::value;
    float *c = &d[0][0];
    if constexpr (N == 64 && bf)
        WG_MMA(64, "bf16", WG_D32, "{%32, %33, %34, %35}", "36", "37", ", 1", WG_ACC32(c)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
    else if constexpr (N == 64)
        WG_MMA(64, "f16", WG_D32, "{%32, %33, %34, %35}", "36", "37", ", 1", WG_ACC32(c)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
    else if constexpr (bf)
        WG_MMA(128, "bf16", WG_D64, "{%64, %65, %66, %67}", "68", "69", ", 1", WG_ACC64(c)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
    else
        WG_MMA(128, "f16", WG_D64, "{%64, %65, %66, %67}", "68", "69", ", 1", WG_ACC64(c)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

#endif

#endif
