/* The warp-level PTX the tensor-core kernels build on: ldmatrix, mma.sync
 * m16n8k16 (bf16, f16) and m16n8k8 (tf32) with f32 accumulation, packing
 * two f32 into one bf16x2/f16x2 register, rounding f32 to tf32, and
 * cp.async with its commit and wait. Nothing else in those
 * kernels is PTX, so tests/warp_emulator.h can stand in for this header and
 * run them on the CPU. */
#ifndef CUDA_WARP_CUH
#define CUDA_WARP_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* Four 8x8 b16 matrices: lanes 8i..8i+7 give matrix i's row addresses
 * (16 bytes each), and r[i] of lane l holds row l/4, columns 2(l%4) and +1. */
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

/* The same, each matrix transposed on the way. */
__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

/* c += a b for one 16x8 tile: a 16x16 (row), b 16x8 (col). */
__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, __nv_bfloat16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, __half) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* c += a b for one 16x8 tile in TF32: a 16x8 (row), b 8x8 (col); lane l
 * (g = l/4, t = l%4) holds a (g, t) (g+8, t) (g, t+4) (g+8, t+4), b (k t,
 * n g) (k t+4, n g), c as m16n8k16's. Operands come from tf32_of. */
__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, float) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* The f32 with these bits rounded to TF32 (10 mantissa bits, to nearest,
 * ties away from zero), as the tf32 mma takes it. */
__device__ __forceinline__ uint32_t tf32_of(uint32_t f32_bits) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(__uint_as_float(f32_bits)));
    return r;
}

/* lo in the low half, both rounded to nearest even. */
__device__ __forceinline__ uint32_t pack2(float lo, float hi, __nv_bfloat16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi, __half) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *(uint32_t *)&v;
}

/* 2^x in one MUFU.EX2, subnormal inputs and results as 0: exp2f keeps
 * subnormals with a compare and two multiplies around it, three more
 * instructions per attention score, and a probability below 2^-126
 * counts for nothing next to the row's largest, which is 1. */
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* Starts copying 16 bytes from global src to shared dst (both 16-byte
 * aligned), or writing 16 zeros when !real; lands after cp_async_wait. */
__device__ __forceinline__ void cp_async_16(void *dst, const void *src, bool real) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(smem_addr(dst)), "l"(src), "r"(real ? 16 : 0));
}

/* The same for 4 bytes (cp.async.cg takes only 16). */
__device__ __forceinline__ void cp_async_4(void *dst, const void *src, bool real) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(smem_addr(dst)), "l"(src), "r"(real ? 4 : 0));
}

/* Closes the group of copies started since the last commit. */
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

/* Waits for all but the newest `pending` groups of this thread's copies
 * (0 or 1); other threads see them after a barrier. */
__device__ __forceinline__ void cp_async_wait(int pending) {
    if (pending) asm volatile("cp.async.wait_group 1;\n" ::);
    else asm volatile("cp.async.wait_group 0;\n" ::);
}

#endif
