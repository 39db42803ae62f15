/* Hopper's tensor memory accelerator (TMA) and the mbarriers it completes
 * on, as PTX (forms as CUTLASS's cute/arch/copy_sm90_tma.hpp and
 * cluster_sm90.hpp issue them): a bulk tensor copy of a box from global
 * memory into shared memory through a tensor map the host encoded
 * (cuTensorMapEncodeTiled), swizzled on the way and zero-filled out of
 * bounds, counted in bytes on an mbarrier; mbarrier init, arrive,
 * arrive.expect_tx and the parity wait, bounded in time; setmaxnreg, which moves registers
 * from a producer warpgroup to the consumers. Only sm_90a has these
 * (DS_WGMMA_ARCH); tests/warp_emulator_tma.h stands in for this header on
 * the CPU. And, for the host, the driver's encoder of tensor maps. */
#ifndef CUDA_TMA_CUH
#define CUDA_TMA_CUH

#include "cuda_wgmma.cuh"

#include <cudaTypedefs.h>

/* The driver's cuTensorMapEncodeTiled, found through the runtime (no link
 * to libcuda) once per file that asks; NULL where the driver has none. */
static inline PFN_cuTensorMapEncodeTiled_v12000 ds_tma_encoder() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn;
    static bool asked;
    if (!asked) {
        void *p = NULL;
        cudaDriverEntryPointQueryResult found;
        asked = true;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found) ==
                cudaSuccess && found == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
        else
            cudaGetLastError();
    }
    return fn;
}

#ifdef DS_WGMMA_ARCH

/* An mbarrier expecting `count` arrivals per phase; phase 0 begins. */
__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

/* Makes this thread's inits visible to the async proxy (TMA's completions). */
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

/* Announces `bytes` of copies completing on this phase, then arrives. */
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

/* A bounded wait's budget: 4 s of %globaltimer. A phase of a healthy
 * pipeline completes within a tile's copies or a tile step (microseconds;
 * milliseconds where the GPU is time-sliced between processes), so only a
 * phase that never completes (expect_tx bytes that never land, a parity
 * off by one) reaches it; and the stall is reported seconds after. Each
 * try_wait may suspend the thread up to MBAR_SUSPEND_NS for the phase. */
#define MBAR_WAIT_NS 4000000000ull
#define MBAR_SUSPEND_NS 1000000u

/* Waits until the phase of this parity has completed: true. False once
 * MBAR_WAIT_NS went by without it or *stop (the block's stall flag) was
 * set by a thread whose own wait ran out. While the phase completes on
 * the first try_wait that is the whole cost: the clock is read only
 * after one came back without it. */
__device__ __forceinline__ bool mbar_wait(uint64_t *bar, unsigned parity, const volatile int *stop) {
    uint64_t start = 0, now;
    for (;;) {
        uint32_t done;
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(parity), "r"(MBAR_SUSPEND_NS) : "memory");
        if (done) return true;
        asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(now));
        if (*stop) return false;
        if (!start) start = now;
        else if (now - start > MBAR_WAIT_NS) return false;
    }
}

/* The box of a 4-d tensor map at coordinates (c0 innermost .. c3) into
 * shared memory at dst, its bytes completing on bar. */
__device__ __forceinline__ void tma_load_4d(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1, int c2,
                                            int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_addr(dst)), "l"((uint64_t)map),
                 "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}

/* This warpgroup's registers per thread lowered (dec) or raised (inc) to N. */
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

#endif

#endif
