/* The emulated TMA and mbarriers (tests/warp_emulator_tma.h) before a
 * kernel relies on them: cuTensorMapEncodeTiled refuses what the driver's
 * documentation refuses; a bulk tensor copy of a strided 4-d tensor lands
 * each element where the wgmma descriptors of its swizzle (32B, 64B,
 * 128B; warp_emulator_wgmma.h's reading, itself held to a plain product by
 * test_wgmma) look for it, dense without swizzle, with zeros past every
 * edge; the destination is NaN until the phase completes; phases and
 * parities as the PTX ISA has them; the attention kernel's tensor maps
 * (wt_map) encode only views TMA can read. Each misuse aborts, in a child
 * process. */
#include "warp_emulator.h"
#include "cuda/cuda_attention_wgmma.cuh"

extern "C" {
#include "check.h"
}

namespace {

/* A [B, H, T, C] tensor of 2-byte elements, rows padded to LD elements:
 * element i holds i + 1 (0 never appears, so zero fill shows). */
constexpr int B = 2, H = 3, T = 50, C = 80, LD = 88;
uint16_t global[B * H * T * LD] __attribute__((aligned(16)));
CUtensorMap map;

uint16_t elem(int b, int h, int t, int c) { return global[((b * H + h) * T + t) * LD + c]; }

/* Encodes map over `global` as dims {C, T, H, B} with a box of cols x rows. */
CUresult encode(CUtensorMapSwizzle sw, uint32_t cols, uint32_t rows) {
    cuuint64_t dim[4] = { C, T, H, B }, stride[3] = { LD * 2, T * LD * 2, H * T * LD * 2 };
    cuuint32_t box[4] = { cols, rows, 1, 1 }, one[4] = { 1, 1, 1, 1 };
    return cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, global, dim, stride, box, one,
                                  CU_TENSOR_MAP_INTERLEAVE_NONE, sw, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

/* Thread 0 sets up an mbarrier at smem + at (fenced unless told); all wait for it. */
uint64_t *barrier(uint32_t at, unsigned count, bool fence = true) {
    uint64_t *bar = (uint64_t *)(smem + at);
    if (threadIdx.x == 0) {
        mbar_init(bar, count);
        if (fence) mbar_fence_init();
    }
    __syncthreads();
    return bar;
}

/* An unbounded wait, as the misuses below need: a deadlock aborts. */
void wait(uint64_t *bar, unsigned parity) { emu::mbar_wait(bar, parity, false, nullptr); }

/* Thread 0 announces `bytes` on bar and copies map m's box at (c0, t0, h, b) to dst. */
void issue(uint64_t *bar, unsigned bytes, unsigned char *dst, const CUtensorMap *m = &map, int t0 = 0, int c0 = 0,
           int h = 0, int b = 0) {
    if (threadIdx.x != 0) return;
    mbar_arrive_expect_tx(bar, bytes);
    tma_load_4d(dst, m, bar, c0, t0, h, b);
}

/* One 128-thread block: the barrier at smem + 16 KiB (after the box), the
 * copy of (c0, t0, h, b); all wait. */
void copy_box(int c0, int t0, int h, int b, uint32_t bytes) {
    emu::launch("copy_box", 1, 128, 16384 + 8, [&] {
        uint64_t *bar = barrier(16384, 1);
        issue(bar, bytes, smem, &map, t0, c0, h, b);
        wait(bar, 0);
    });
}

/* The box's element (row r, column k) as it should land: global, or 0 out of bounds. */
uint16_t want(int c0, int t0, int h, int b, int r, int k) {
    int t = t0 + r, c = c0 + k;
    return t < 0 || t >= T || c < 0 || c >= C ? 0 : elem(b, h, t, c);
}

/* Copies a box of each swizzle and checks every element: W chunks of 16
 * bytes per row (the swizzle's span), 40 rows; some boxes cross the
 * tensor's end and start before its beginning. */
void copies() {
    for (uint32_t i = 0; i < sizeof global / 2; i++) global[i] = (uint16_t)(i + 1);
    struct { CUtensorMapSwizzle sw; int mode, W; } modes[] = {
        { CU_TENSOR_MAP_SWIZZLE_32B, 3, 2 }, { CU_TENSOR_MAP_SWIZZLE_64B, 2, 4 }, { CU_TENSOR_MAP_SWIZZLE_128B, 1, 8 },
        { CU_TENSOR_MAP_SWIZZLE_NONE, 0, 8 },
    };
    struct { int c0, t0, h, b; } at[] = { { 0, 0, 0, 0 }, { 16, 3, 2, 1 }, { 64, 30, 1, 1 }, { -8, -5, 0, 1 } };
    for (auto &m : modes) {
        const int cols = m.W * 8, rows = 40;
        check(encode(m.sw, cols, rows) == CUDA_SUCCESS, "a box of %d columns encodes with swizzle mode %d", cols,
              (int)m.sw);
        for (auto &a : at) {
            copy_box(a.c0, a.t0, a.h, a.b, cols * rows * 2);
            bool ok = true;
            for (int r = 0; r < rows; r++)
                for (int k = 0; k < cols; k++) {
                    /* K-major through a descriptor: rows 8 x span apart per 8 (SBO) */
                    uint64_t desc = (uint64_t)(8 * m.W * 16 >> 4) << 32 | (uint64_t)m.mode << 62 | 1ull << 16;
                    uint32_t addr = m.mode ? emu::desc_elem(desc, false, r, k) : (uint32_t)(r * cols + k) * 2;
                    uint16_t got;
                    memcpy(&got, smem + addr, 2);
                    ok = ok && got == want(a.c0, a.t0, a.h, a.b, r, k);
                }
            check(ok, "swizzle mode %d at (%d, %d, %d, %d): every element where its descriptor reads it", (int)m.sw,
                  a.c0, a.t0, a.h, a.b);
        }
    }
}

/* A copy's destination is NaN until its phase completes; phases and parities. */
void phases() {
    check(encode(CU_TENSOR_MAP_SWIZZLE_128B, 64, 8) == CUDA_SUCCESS, "a 64 x 8 box encodes");
    bool nan_before = true, landed = false;
    int through = 0;
    emu::launch("phases", 1, 128, 1024 + 16, [&] {
        uint64_t *bar = barrier(1024, 2);
        wait(bar, 1);   /* the phase before phase 0 counts as complete */
        issue(bar, 1024, smem);
        if (threadIdx.x == 0)
            for (int i = 0; i < 1024; i++) nan_before = nan_before && smem[i] == 0xff;
        __syncthreads();
        if (threadIdx.x == 32) mbar_arrive(bar);   /* the second arrival completes phase 0 */
        wait(bar, 0);
        if (threadIdx.x == 0) {
            uint16_t first;
            memcpy(&first, smem, 2);
            landed = first == elem(0, 0, 0, 0);
        }
        __syncthreads();
        if (threadIdx.x < 2) mbar_arrive(bar);      /* phase 1, no bytes */
        wait(bar, 1);
        through++;
    });
    check(nan_before, "a bulk copy's destination is NaN until its phase completes");
    check(landed, "the copy lands when the phase's arrivals and bytes are in");
    check(through == 128, "every thread through phase 1's wait (%d)", through);
}

/* The driver's documented limits: each refused. */
void limits() {
    check(encode(CU_TENSOR_MAP_SWIZZLE_128B, 128, 8) != CUDA_SUCCESS, "a 256-byte inner box with 128B swizzle");
    check(encode(CU_TENSOR_MAP_SWIZZLE_64B, 64, 8) != CUDA_SUCCESS, "a 128-byte inner box with 64B swizzle");
    check(encode(CU_TENSOR_MAP_SWIZZLE_NONE, 4, 8) != CUDA_SUCCESS, "an inner box of 8 bytes");
    check(encode(CU_TENSOR_MAP_SWIZZLE_NONE, 64, 257) != CUDA_SUCCESS, "a box of 257 rows");
    check(encode(CU_TENSOR_MAP_SWIZZLE_NONE, 64, 0) != CUDA_SUCCESS, "a box of no rows");
    cuuint64_t dim[2] = { C, T }, bad[1] = { LD * 2 + 2 }, big[1] = { 1ull << 40 }, zero[2] = { C, 0 };
    cuuint32_t box[2] = { 64, 8 }, one[2] = { 1, 1 }, two[2] = { 1, 2 };
    auto enc = [&](void *base, cuuint32_t rank, const cuuint64_t *d, const cuuint64_t *s, const cuuint32_t *es) {
        return cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, base, d, s, box, es,
                                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    };
    cuuint64_t good[1] = { LD * 2 };
    check(enc(global, 2, dim, good, one) == CUDA_SUCCESS, "a 2-d map encodes");
    check(enc(global, 2, dim, bad, one) != CUDA_SUCCESS, "a stride not a multiple of 16 bytes");
    check(enc(global, 2, dim, big, one) != CUDA_SUCCESS, "a stride of 2^40 bytes");
    check(enc(global + 1, 2, dim, good, one) != CUDA_SUCCESS, "a base not 16-byte aligned");
    check(enc(global, 2, zero, good, one) != CUDA_SUCCESS, "a dimension of 0");
    check(enc(global, 0, dim, good, one) != CUDA_SUCCESS, "rank 0");
    check(enc(global, 6, dim, good, one) != CUDA_SUCCESS, "rank 6");
    check(enc(global, 2, dim, good, two) != CUDA_SUCCESS, "an element stride other than 1 (not modelled)");

    /* the attention kernel's maps: views TMA reads, and the ones it does not */
    int64_t sz[4] = { B, H, T, 64 }, st[4] = { H * T * LD, T * LD, LD, 1 };
    ds_kview x = emu::view(global, DS_BF16, 4, sz, st);
    check(wt_map(&map, x, cuTensorMapEncodeTiled) == 0, "wt_map maps a view with padded rows");
    x.stride[2] = LD + 1;
    check(wt_map(&map, x, cuTensorMapEncodeTiled) != 0, "wt_map refuses rows 178 bytes apart");
    x.stride[2] = LD, x.stride[3] = 2;
    check(wt_map(&map, x, cuTensorMapEncodeTiled) != 0, "wt_map refuses a last stride of 2");
    x.stride[3] = 1, x.stride[1] = -T * LD;
    check(wt_map(&map, x, cuTensorMapEncodeTiled) != 0, "wt_map refuses a negative stride");
    x.stride[1] = T * LD, x.data = global + 1;
    check(wt_map(&map, x, cuTensorMapEncodeTiled) != 0, "wt_map refuses a base 2 bytes past 16-byte alignment");
}

/* A misuse: body run as a one-warpgroup kernel in a child must abort. */
void must_abort(const char *what, const std::function<void()> &body) {
    check(emu::launch_aborts(what, 128, 16384, body), "the emulator aborts on %s", what);
}

/* A misuse in one copy to smem + dst: barrier, copy, wait must abort. */
void copy_must_abort(const char *what, unsigned bytes, int dst, const CUtensorMap *m = &map, bool fence = true) {
    must_abort(what, [=] {
        uint64_t *bar = barrier(12288, 1, fence);
        issue(bar, bytes, smem + dst, m);
        wait(bar, 0);
    });
}

/* The kernels' bounded waits (mbar_wait with the block's stall flag):
 * one whose phase completes returns true, also while the arrival it waits
 * for is a long way off in another warp; one whose phase cannot complete
 * (expect_tx a box past the bytes landing) returns false in every thread
 * instead of aborting, once nothing else can go on; one blocked beside a
 * named barrier that never fills still ends in the deadlock's abort. */
void bounded_waits() {
    encode(CU_TENSOR_MAP_SWIZZLE_128B, 64, 8);   /* 1 KiB boxes */
    int stop = 0, done = 0, ran_out = 0;
    bool landed = false;
    emu::launch("bounded_wait", 1, 128, 16384 + 8, [&] {
        uint64_t *bar = barrier(16384, 2);
        issue(bar, 1024, smem);
        if (threadIdx.x / 32 == 3) {
            float v = 1.f;
            for (int i = 0; i < 200; i++) v = __shfl_xor_sync(~0u, v, 1);   /* a while before the arrival */
            if (threadIdx.x == 96) mbar_arrive(bar);
        }
        done += mbar_wait(bar, 0, &stop);
        if (threadIdx.x == 0) landed = ((uint16_t *)smem)[0] == elem(0, 0, 0, 0);
    });
    check(done == 128 && landed, "a bounded wait whose phase completes returns true (%d of 128) with the copy in",
          done);
    done = 0;
    emu::launch("bounded_wait_runs_out", 1, 128, 16384 + 8, [&] {
        uint64_t *bar = barrier(16384, 1);
        issue(bar, 2048, smem);   /* 1 KiB lands: the phase never completes */
        if (mbar_wait(bar, 0, &stop)) done++;
        else ran_out++;
    });
    check(done == 0 && ran_out == 128, "a bounded wait on a phase that cannot complete runs out in every thread "
          "(%d completed, %d ran out)", done, ran_out);
    must_abort("a bounded wait beside a named barrier that never fills", [&stop] {
        uint64_t *bar = barrier(12288, 1);
        if (threadIdx.x < 32) mbar_wait(bar, 0, &stop);
        else named_barrier_sync(1, 128);
    });
}

void misuse() {
    encode(CU_TENSOR_MAP_SWIZZLE_128B, 64, 8);   /* 1 KiB boxes */
    static CUtensorMap blank;
    copy_must_abort("expect_tx short of the bytes landing", 512, 0);
    copy_must_abort("expect_tx past the bytes landing", 2048, 0);
    copy_must_abort("a destination misaligned for 128B swizzle", 1024, 512);
    copy_must_abort("a tensor map never encoded", 1024, 0, &blank);
    copy_must_abort("a copy on an mbarrier whose init had no fence.mbarrier_init", 1024, 0, &map, false);
    must_abort("a wait on a phase no arrival completes (a wrong parity)", [] {
        uint64_t *bar = barrier(12288, 1);
        if (threadIdx.x == 0) mbar_arrive(bar);
        wait(bar, 1);   /* phase 1's: nobody arrives again */
    });
    must_abort("an arrive missing", [] {
        uint64_t *bar = barrier(12288, 2);
        if (threadIdx.x == 0) mbar_arrive(bar);
        wait(bar, 0);
    });
    must_abort("an mbarrier used before init", [] {
        uint64_t *bar = (uint64_t *)(smem + 12288);
        if (threadIdx.x == 0) mbar_arrive(bar);
    });
    must_abort("a copy over shared memory a pending wgmma reads (an empty barrier skipped)", [] {
        uint64_t *bar = barrier(12288, 1);
        issue(bar, 1024, smem);
        wait(bar, 0);
        float d[8][4];
        uint64_t sw = (uint64_t)(1024 >> 4) << 32 | 1ull << 62 | 1ull << 16;   /* smem 0, SW128 */
        wgmma_fence();
        wgmma_ss<64>(d, sw, sw, 0, __nv_bfloat16());
        wgmma_commit();
        issue(bar, 1024, smem, &map, 8);
        wgmma_wait<0>();
    });
    must_abort("setmaxnreg with different counts in a warpgroup", [] {
        if (threadIdx.x < 64) setmaxnreg_dec<24>();
        else setmaxnreg_dec<32>();
    });
    must_abort("setmaxnreg below 24", [] { setmaxnreg_dec<16>(); });
    must_abort("setmaxnreg above 256", [] { setmaxnreg_inc<264>(); });
    must_abort("setmaxnreg not a multiple of 8", [] { setmaxnreg_inc<100>(); });
    must_abort("an arrive past the count of a phase waiting for bytes", [] {
        uint64_t *bar = barrier(12288, 1);
        if (threadIdx.x == 0) {
            mbar_arrive_expect_tx(bar, 1024);
            mbar_arrive(bar);
        }
    });
}

} /* namespace */

int main() {
    copies();
    phases();
    limits();
    bounded_waits();
    misuse();
    return check_summary("test_tma");
}
