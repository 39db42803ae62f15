/* Runs CUDA kernels on the CPU, so they are tested where no GPU is: plain
 * CUDA C++ and the warp-level PTX of kernels/cuda/cuda_warp.cuh, the one
 * header of PTX the tensor-core kernels use. Each thread of a block is
 * a coroutine (ucontext) on one OS thread; a thread runs until it reaches
 * a warp collective (ldmatrix, mma, shuffle) or a barrier, and the last
 * lane to arrive computes the collective for all 32 from the PTX ISA's
 * fragment layouts. Blocks run one after another.
 *
 * It checks what the hardware leaves undefined: lanes of a warp at
 * different collectives, a collective with exited lanes, ldmatrix rows
 * that are misaligned or past the launch's shared memory, barriers that
 * never fill (deadlock), tf32 mma operands not rounded to TF32 by cvt. Shared memory starts as NaN, and a cp.async
 * destination turns NaN when the copy is issued and gets its data only at
 * the wait that covers it, so reading a tile before its wait, or
 * overwriting one another warp still reads, shows up in the results.
 *
 * The warpgroup MMA (wgmma) of kernels/cuda/cuda_wgmma.cuh is in
 * warp_emulator_wgmma.h, and TMA with mbarriers (kernels/cuda/cuda_tma.cuh)
 * in warp_emulator_tma.h, both included from here.
 *
 * Include it first, in one translation unit, then the kernels' header. */
#ifndef WARP_EMULATOR_H
#define WARP_EMULATOR_H

#define DS_WARP_EMULATOR 1

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "ds_half.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct emu_dim3 { unsigned x, y, z; };
static emu_dim3 threadIdx, blockIdx, blockDim, gridDim;

/* The 16-bit element types, as tags and storage. */
struct __nv_bfloat16 {
    uint16_t bits;
    operator float() const { return ds_bf16_to_f32(bits); }
};
struct __half {
    uint16_t bits;
    operator float() const { return ds_f16_to_f32(bits); }
};

/* The vector types of 16-byte loads and stores. */
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
static inline float2 make_float2(float x, float y) { return float2{ x, y }; }
static inline float4 make_float4(float x, float y, float z, float w) { return float4{ x, y, z, w }; }

static inline uint32_t __float_as_uint(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}
static inline int __float_as_int(float x) { return (int)__float_as_uint(x); }
static inline float __uint_as_float(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

static inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }

#define EMU_SMEM_MAX (228 * 1024)
#define EMU_STACK (256 * 1024)

/* The kernels' `extern __shared__ unsigned char smem[]`. */
__attribute__((aligned(128))) unsigned char smem[EMU_SMEM_MAX];

namespace emu {

struct copy { unsigned char *dst; const void *src; int bytes; bool real; };

struct lane {
    ucontext_t ctx;
    std::vector<char> stack;
    bool done;
    const unsigned *wait_on;                 /* blocked until *wait_on moves past wait_was */
    unsigned wait_was;
    std::vector<copy> open;                  /* cp.async since the last commit */
    std::vector<std::vector<copy>> groups;   /* committed, oldest first */
};

/* The warp collectives, so lanes at different ones are caught. */
enum collective_op { OP_LDSM = 1, OP_LDSM_TRANS, OP_MMA_BF16, OP_MMA_F16, OP_MMA_TF32, OP_SHFL };

struct warp { int arrived, op, live; unsigned gen; void *args[32]; };

struct state {
    ucontext_t sched;
    std::vector<lane> lanes;
    std::vector<warp> warps;
    unsigned live, bar_arrived, bar_gen;
    size_t smem_bytes;
    unsigned long progress;
    const char *kernel;
    std::function<void()> body;
#ifdef EMU_ASAN
    const void *main_bottom;      /* the scheduler's stack, for switches back to it */
    size_t main_size;
#endif
};

static state S;

[[noreturn]] static void fail(const char *what) {
    fprintf(stderr, "warp emulator: %s: block %u thread %u: %s\n", S.kernel, blockIdx.x, threadIdx.x, what);
    abort();
}

/* Back to the scheduler; returns when this thread is resumed. */
static void yield() {
#ifdef EMU_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, S.main_bottom, S.main_size);
#endif
    swapcontext(&S.lanes[threadIdx.x].ctx, &S.sched);
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, &S.main_bottom, &S.main_size);
#endif
}

/* Back to the scheduler until *gen moves past `was` (a barrier's or
 * collective's generation): the scheduler passes this thread over until
 * then rather than switching to it only to come back. */
static void block_on(const unsigned *gen, unsigned was) {
    lane &me = S.lanes[threadIdx.x];
    me.wait_on = gen;
    me.wait_was = was;
    while (*gen == was) yield();
    me.wait_on = nullptr;
}

static void release_barrier_if_full() {
    if (S.bar_arrived > 0 && S.bar_arrived == S.live) {
        S.bar_arrived = 0;
        S.bar_gen++;
    }
}

static void lane_main() {
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &S.main_bottom, &S.main_size);
#endif
    S.body();
    lane &me = S.lanes[threadIdx.x];
    me.done = true;
    S.warps[threadIdx.x / 32].live--;
    S.live--;
    S.progress++;
    release_barrier_if_full();
#ifdef EMU_ASAN
    __sanitizer_start_switch_fiber(nullptr, S.main_bottom, S.main_size);   /* this fiber ends */
#endif
    /* uc_link returns to the scheduler */
}

/* Every lane of the warp calls this at the same op with its own arg; the
 * last to arrive runs finish(args of lanes 0..31), then all go on. */
template <typename F> static void collective(int op, void *arg, F finish) {
    warp &w = S.warps[threadIdx.x / 32];
    if (w.live != 32) fail("warp collective with exited lanes");
    if (w.arrived == 0) w.op = op;
    else if (w.op != op) fail("lanes of one warp at different collectives");
    w.args[threadIdx.x % 32] = arg;
    S.progress++;
    if (++w.arrived == 32) {
        finish(w.args);
        w.arrived = 0;
        w.gen++;
        return;
    }
    block_on(&w.gen, w.gen);
}

/* xorshift, reseeded per launch: runs repeat exactly */
static uint32_t rand_state;

static unsigned rand_below(unsigned n) {
    rand_state ^= rand_state << 13;
    rand_state ^= rand_state >> 17;
    rand_state ^= rand_state << 5;
    return rand_state % n;
}

/* Lets thread t run to its next collective or barrier. */
static void resume(unsigned t) {
    if (S.lanes[t].done || (S.lanes[t].wait_on && *S.lanes[t].wait_on == S.lanes[t].wait_was)) return;
    threadIdx = { t, 0, 0 };
#ifdef EMU_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, S.lanes[t].stack.data(), S.lanes[t].stack.size());
#endif
    swapcontext(&S.sched, &S.lanes[t].ctx);
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

static void wg_block_start();   /* warp_emulator_wgmma.h */
static void tma_block_start();  /* warp_emulator_tma.h */
static void tma_stuck();

/* Runs body as a grid of `blocks` blocks of `threads` threads with
 * smem_bytes of dynamic shared memory; aborts on what the checks find. */
static void launch(const char *kernel, unsigned blocks, unsigned threads, size_t smem_bytes,
                   std::function<void()> body) {
    if (threads % 32 || threads == 0 || smem_bytes > EMU_SMEM_MAX) {
        fprintf(stderr, "warp emulator: %s: bad launch (%u threads, %zu bytes)\n", kernel, threads, smem_bytes);
        abort();
    }
    S.kernel = kernel;
    S.body = body;
    S.smem_bytes = smem_bytes;
    S.lanes.resize(threads);
    S.warps.assign(threads / 32, warp{});
    rand_state = 2463534242u;
    blockDim = { threads, 1, 1 };
    gridDim = { blocks, 1, 1 };
    for (unsigned b = 0; b < blocks; b++) {
        blockIdx = { b, 0, 0 };
#ifdef EMU_ASAN
        ASAN_UNPOISON_MEMORY_REGION(smem, smem_bytes);
        ASAN_POISON_MEMORY_REGION(smem + smem_bytes, EMU_SMEM_MAX - smem_bytes);
#endif
        memset(smem, 0xff, smem_bytes);
        wg_block_start();
        tma_block_start();
        S.live = threads;
        S.bar_arrived = 0;
        for (warp &w : S.warps) w = warp{ 0, 0, 32, 0, {} };
        for (lane &l : S.lanes) {
            l.stack.resize(EMU_STACK);
            l.done = false;
            l.wait_on = nullptr;
            l.open.clear();
            l.groups.clear();
            getcontext(&l.ctx);
            l.ctx.uc_stack.ss_sp = l.stack.data();
            l.ctx.uc_stack.ss_size = l.stack.size();
            l.ctx.uc_link = &S.sched;
            makecontext(&l.ctx, lane_main, 0);
#ifdef EMU_ASAN
            /* ASan's swapcontext clears the shadow of the whole stack a
             * context names at every switch into it (32 KiB of memset per
             * resume, half an emulated test's time); the fiber annotations
             * already say which stack runs, so the context stops naming it */
            l.ctx.uc_stack.ss_size = 0;
#endif
        }
        /* warps in a random order, each for one step (every lane to its
         * next collective or barrier) or now and then a sprint of up to 64,
         * so a warp runs ahead of the others as far as a barrier lets it */
        std::vector<unsigned> order(threads / 32);
        for (unsigned w = 0; w < order.size(); w++) order[w] = w;
        for (;;) {
            unsigned long before = S.progress;
            for (unsigned w = (unsigned)order.size(); w > 1; w--) std::swap(order[w - 1], order[rand_below(w)]);
            for (unsigned w : order)
                for (unsigned step = rand_below(4) ? 1 : 1 + rand_below(64); step > 0; step--)
                    for (unsigned t = 32 * w; t < 32 * w + 32; t++) resume(t);
            if (S.live == 0) break;
            if (S.progress == before) tma_stuck();
            if (S.progress == before) fail("deadlock: no thread can go on (a barrier or collective never fills)");
        }
    }
#ifdef EMU_ASAN
    ASAN_UNPOISON_MEMORY_REGION(smem, EMU_SMEM_MAX);
#endif
}

/* Whether launch(...) aborts, run in a child process (its stderr
 * silenced): how tests check that a misuse is caught. */
static inline bool launch_aborts(const char *kernel, unsigned threads, size_t smem_bytes, std::function<void()> body) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        if (!freopen("/dev/null", "w", stderr)) _exit(3);
        launch(kernel, 1, threads, smem_bytes, body);
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

/* A view of ndim dims over data, for a test to hand a kernel. */
static inline ds_kview view(void *data, ds_dtype dt, int ndim, const int64_t *shape, const int64_t *stride) {
    ds_kview v = {};
    v.data = data;
    v.dtype = dt;
    v.ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        v.shape[d] = shape[d];
        v.stride[d] = stride[d];
    }
    return v;
}

/* A shared-memory address as the kernels pass it, checked. */
static unsigned char *shared(uint32_t addr, size_t bytes, size_t align) {
    if (addr % align || addr + bytes > S.smem_bytes) fail("shared access misaligned or past the launch's size");
    return smem + addr;
}

static float f16bits(uint16_t h, bool bf) { return bf ? ds_bf16_to_f32(h) : ds_f16_to_f32(h); }

struct ldsm_arg { uint32_t addr; uint32_t *r; };

static void ldsm(uint32_t r[4], uint32_t addr, bool trans) {
    ldsm_arg me = { addr, r };
    collective(trans ? OP_LDSM_TRANS : OP_LDSM, &me, [trans](void **args) {
        for (int l = 0; l < 32; l++) {
            ldsm_arg *a = (ldsm_arg *)args[l];
            for (int i = 0; i < 4; i++) {
                uint16_t e[2];
                for (int h = 0; h < 2; h++) {
                    /* plain: row l/4, column 2(l%4)+h; transposed: row 2(l%4)+h, column l/4 */
                    int row = trans ? 2 * (l % 4) + h : l / 4, col = trans ? l / 4 : 2 * (l % 4) + h;
                    const uint16_t *p = (const uint16_t *)shared(((ldsm_arg *)args[8 * i + row])->addr, 16, 16);
                    e[h] = p[col];
                }
                a->r[i] = e[0] | (uint32_t)e[1] << 16;
            }
        }
    });
}

struct mma_arg { const uint32_t *a; uint32_t b0, b1; float *c; };

/* c += A B on each lane's C elements, (g, 2t) (g, 2t+1) (g+8, 2t) (g+8,
 * 2t+1) with g = l/4, t = l%4: summed in double, rounded to f32 once. */
template <int K> static void mma_accumulate(void **args, const double A[16][K], const double B[K][8]) {
    for (int l = 0; l < 32; l++) {
        mma_arg *m = (mma_arg *)args[l];
        int g = l / 4, t = l % 4;
        for (int e = 0; e < 4; e++) {
            int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
            double s = m->c[e];
            for (int k = 0; k < K; k++) s += A[row][k] * B[k][col];
            m->c[e] = (float)s;
        }
    }
}

/* d = a b + c over the warp, m16n8k16: lane l holds, with g = l/4, t = l%4,
 * a: (g, 2t..) (g+8, 2t..) (g, 2t+8..) (g+8, 2t+8..); b: (k 2t.., n g)
 * (k 2t+8.., n g); c: (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1). */
static void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, bool bf) {
    mma_arg me = { a, b0, b1, c };
    collective(bf ? OP_MMA_BF16 : OP_MMA_F16, &me, [bf](void **args) {
        double A[16][16], B[16][8];
        for (int l = 0; l < 32; l++) {
            mma_arg *m = (mma_arg *)args[l];
            int g = l / 4, t = l % 4;
            for (int h = 0; h < 2; h++) {
                A[g][2 * t + h] = f16bits((uint16_t)(m->a[0] >> 16 * h), bf);
                A[g + 8][2 * t + h] = f16bits((uint16_t)(m->a[1] >> 16 * h), bf);
                A[g][2 * t + 8 + h] = f16bits((uint16_t)(m->a[2] >> 16 * h), bf);
                A[g + 8][2 * t + 8 + h] = f16bits((uint16_t)(m->a[3] >> 16 * h), bf);
                B[2 * t + h][g] = f16bits((uint16_t)(m->b0 >> 16 * h), bf);
                B[2 * t + 8 + h][g] = f16bits((uint16_t)(m->b1 >> 16 * h), bf);
            }
        }
        mma_accumulate<16>(args, A, B);
    });
}

/* cvt.rna.tf32.f32: 10 mantissa bits, to nearest, ties away from zero
 * (half of the last kept place added to the magnitude, the rest dropped;
 * subnormals alike); infinities stay, NaN becomes a quiet NaN, a carry
 * past the largest finite TF32 gives infinity. */
static uint32_t tf32_round(uint32_t f) {
    if ((f & 0x7f800000u) == 0x7f800000u) return (f & 0x7fffffu) ? 0x7fffe000u : f;
    return (f + 0x1000u) & ~0x1fffu;
}

/* An mma operand register as TF32: one tf32_of did not make fails, as
 * the PTX ISA leaves such operands' low bits to the hardware. */
static float tf32_operand(uint32_t r) {
    if (r & 0x1fffu) fail("tf32 mma operand with low mantissa bits set (not rounded by cvt.rna.tf32.f32)");
    return __uint_as_float(r);
}

/* d = a b + c over the warp, m16n8k8 in TF32: lane l holds, with g = l/4,
 * t = l%4, a: (g, t) (g+8, t) (g, t+4) (g+8, t+4); b: (k t, n g) (k t+4,
 * n g); c as m16n8k16's. */
static void mma1688_tf32(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    mma_arg me = { a, b0, b1, c };
    collective(OP_MMA_TF32, &me, [](void **args) {
        double A[16][8], B[8][8];
        for (int l = 0; l < 32; l++) {
            mma_arg *m = (mma_arg *)args[l];
            int g = l / 4, t = l % 4;
            A[g][t] = tf32_operand(m->a[0]);
            A[g + 8][t] = tf32_operand(m->a[1]);
            A[g][t + 4] = tf32_operand(m->a[2]);
            A[g + 8][t + 4] = tf32_operand(m->a[3]);
            B[t][g] = tf32_operand(m->b0);
            B[t + 4][g] = tf32_operand(m->b1);
        }
        mma_accumulate<8>(args, A, B);
    });
}

struct shfl_arg { float v, out; };

static void copy_issue(void *dst, const void *src, int bytes, bool real) {
    unsigned char *d = shared((uint32_t)((unsigned char *)dst - smem), bytes, bytes);
    if (real && (uintptr_t)src % bytes) fail("cp.async source misaligned");
    memset(d, 0xff, bytes);    /* NaN until the wait that covers it */
    S.lanes[threadIdx.x].open.push_back({ d, src, bytes, real });
}

} /* namespace emu */

#include "warp_emulator_wgmma.h"
#include "warp_emulator_tma.h"

/* ---- cuda_warp.cuh's interface ---- */

static inline uint32_t smem_addr(const void *p) { return (uint32_t)((const unsigned char *)p - smem); }
static inline void ldsm_x4(uint32_t r[4], const void *p) { emu::ldsm(r, smem_addr(p), false); }
static inline void ldsm_x4_trans(uint32_t r[4], const void *p) { emu::ldsm(r, smem_addr(p), true); }

static inline void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, __nv_bfloat16) {
    emu::mma16816(c, a, b0, b1, true);
}
static inline void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, __half) {
    emu::mma16816(c, a, b0, b1, false);
}

static inline void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, float) {
    emu::mma1688_tf32(c, a, b0, b1);
}

static inline uint32_t tf32_of(uint32_t f32_bits) { return emu::tf32_round(f32_bits); }

static inline uint32_t pack2(float lo, float hi, __nv_bfloat16) {
    return ds_f32_to_bf16(lo) | (uint32_t)ds_f32_to_bf16(hi) << 16;
}
static inline uint32_t pack2(float lo, float hi, __half) {
    return ds_f32_to_f16(lo) | (uint32_t)ds_f32_to_f16(hi) << 16;
}

static inline float exp2_ftz(float x) {
    float y = exp2f(fabsf(x) < FLT_MIN ? 0.f : x);
    return y < FLT_MIN ? 0.f : y;
}

static inline void cp_async_16(void *dst, const void *src, bool real) { emu::copy_issue(dst, src, 16, real); }
static inline void cp_async_4(void *dst, const void *src, bool real) { emu::copy_issue(dst, src, 4, real); }

static inline void cp_async_commit() {
    emu::lane &me = emu::S.lanes[threadIdx.x];
    me.groups.push_back(me.open);
    me.open.clear();
}

static inline void cp_async_wait(int pending) {
    emu::lane &me = emu::S.lanes[threadIdx.x];
    while (me.groups.size() > (size_t)pending) {
        for (const emu::copy &c : me.groups.front()) {
            if (c.real) memcpy(c.dst, c.src, c.bytes);
            else memset(c.dst, 0, c.bytes);
            emu::generic_landed(c.dst, c.bytes);
        }
        me.groups.erase(me.groups.begin());
    }
}

static inline void __syncthreads() {
    emu::S.bar_arrived++;
    emu::S.progress++;
    unsigned gen = emu::S.bar_gen;
    emu::release_barrier_if_full();
    emu::block_on(&emu::S.bar_gen, gen);
}

/* Blocks run one after another: a block's writes are all there for the next. */
static inline void __threadfence() {}
template <typename T> static inline T __ldcg(const T *p) { return *p; }
static inline unsigned atomicAdd(unsigned *p, unsigned v) {
    unsigned old = *p;
    *p = old + v;
    return old;
}
static inline int atomicMax(int *p, int v) {
    int old = *p;
    *p = std::max(old, v);
    return old;
}
static inline int atomicExch(int *p, int v) {
    int old = *p;
    *p = v;
    return old;
}
static inline unsigned long long atomicCAS(unsigned long long *p, unsigned long long cmp, unsigned long long v) {
    unsigned long long old = *p;
    if (old == cmp) *p = v;
    return old;
}

static inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    emu::shfl_arg me = { v, 0.f };
    emu::collective(emu::OP_SHFL, &me, [lane_mask](void **args) {
        for (int l = 0; l < 32; l++) ((emu::shfl_arg *)args[l])->out = ((emu::shfl_arg *)args[l ^ lane_mask])->v;
    });
    return me.out;
}

#endif
