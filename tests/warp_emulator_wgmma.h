/* The warpgroup half of tests/warp_emulator.h: kernels/cuda/cuda_wgmma.cuh's
 * interface (wgmma.mma_async m64nNk16 with bf16/f16 inputs and f32
 * accumulators, wgmma.fence, commit_group, wait_group, fence.proxy.async,
 * named barriers)
 * on the CPU. Included by warp_emulator.h; the rest of the emulator is
 * there.
 *
 * wgmma instructions are collectives of a warpgroup (4 warps, 128 threads,
 * all arriving at the same one). An mma's result is computed when the last
 * thread arrives but kept aside: its accumulator registers read NaN until
 * the wait_group that covers it, as the PTX ISA leaves them undefined
 * until then, and a later mma of the same chain reads the value kept aside.
 * Shared operands are read through the 64-bit matrix descriptor, decoded
 * as CUTLASS's canonical GMMA layouts (cute/atom/mma_traits_sm90_gmma.hpp)
 * with the swizzle applied to the shared address, as the hardware does.
 * It aborts, naming the kernel and thread, on: threads of a warpgroup at
 * different wgmma instructions or passing different descriptors; an mma
 * without a wgmma.fence since the last commit or wait (the ISA asks for
 * one wherever registers were touched in between; kernels touch them at
 * every step); a descriptor reaching past the launch's shared memory, a
 * swizzled operand whose start is not at its swizzle pattern's first row
 * (base offset 0), a base offset; shared memory an mma reads that changes,
 * or A registers that change, before the wait that covers the mma; an mma
 * reading cp.async data the copying thread has not passed a
 * fence.proxy.async for since it landed. Named barriers (bar.sync and
 * bar.arrive with an id and a thread count) are here too. */
#ifndef WARP_EMULATOR_WGMMA_H
#define WARP_EMULATOR_WGMMA_H

#include <unordered_map>

namespace emu {

enum wg_op { WG_FENCE = 1, WG_COMMIT, WG_WAIT, WG_MMA = 0x100 };

/* One issued mma: what it must find unchanged when it completes. */
struct wg_read { uint32_t addr; unsigned char bytes[16]; };
struct wg_mma_rec {
    unsigned seq;
    std::vector<wg_read> smem;                    /* 16-byte pieces of shared memory it read */
    std::vector<std::pair<const uint32_t *, uint32_t>> aregs;   /* A registers and their values */
};

struct wgroup {
    int arrived, op;
    unsigned gen;
    void *args[128];
    bool fenced;
    unsigned seq;                                 /* mma issued so far */
    std::vector<unsigned> groups;                 /* committed, oldest first: each one's last mma */
    std::vector<wg_mma_rec> mmas;                 /* issued, not yet completed */
    std::unordered_map<float *, std::pair<float, unsigned>> held;   /* accumulator -> (value, mma) until its wait */
};

static std::vector<wgroup> WG;
/* Per 16 bytes of shared memory: 1 + the thread whose cp.async data
 * landed there without a fence.proxy.async since; 0 when none. */
static std::vector<uint16_t> unfenced;
static std::vector<std::vector<uint32_t>> unfenced_by;   /* per thread, its pieces */

/* Named barriers 1..15 (bar.sync / bar.arrive with a thread count; 0 is
 * __syncthreads'): arrivals so far, the count they were given, releases. */
struct named_bar { unsigned arrived, count, gen; };
static named_bar NB[16];

static void wg_block_start() {
    for (named_bar &b : NB) b = named_bar{ 0, 0, 0 };
    if (blockDim.x % 128 == 0) {
        WG.assign(blockDim.x / 128, wgroup{});
        for (wgroup &w : WG) w.arrived = 0, w.gen = 0, w.fenced = false, w.seq = 0;
    } else {
        WG.clear();
    }
    unfenced.assign(EMU_SMEM_MAX / 16, 0);
    unfenced_by.assign(blockDim.x, {});
}

/* cp.async data landed at dst for this thread (cp_async_wait). */
static void generic_landed(const unsigned char *dst, int bytes) {
    for (uint32_t c = (uint32_t)(dst - smem) / 16; c <= (uint32_t)(dst - smem + bytes - 1) / 16; c++) {
        unfenced[c] = (uint16_t)(threadIdx.x + 1);
        unfenced_by[threadIdx.x].push_back(c);
    }
}

static void proxy_fence() {
    for (uint32_t c : unfenced_by[threadIdx.x])
        if (unfenced[c] == threadIdx.x + 1) unfenced[c] = 0;
    unfenced_by[threadIdx.x].clear();
}

/* Like collective(), over the 128 threads of this thread's warpgroup. */
template <typename F> static void wg_collective(int op, void *arg, F finish) {
    if (WG.empty()) fail("wgmma in a block that is not whole warpgroups");
    unsigned g = threadIdx.x / 128;
    for (unsigned w = 4 * g; w < 4 * g + 4; w++)
        if (S.warps[w].live != 32) fail("warpgroup collective with exited threads");
    wgroup &wg = WG[g];
    if (wg.arrived == 0) wg.op = op;
    else if (wg.op != op) fail("threads of one warpgroup at different wgmma instructions");
    wg.args[threadIdx.x % 128] = arg;
    S.progress++;
    if (++wg.arrived == 128) {
        finish(wg, wg.args);
        wg.arrived = 0;
        wg.gen++;
        return;
    }
    block_on(&wg.gen, wg.gen);
}

/* The shared address of element (r, k) of an operand: r its M or N index,
 * k its K index, 2-byte elements; K-major (rows of K contiguous) or
 * MN-major. Units of 16 bytes ("chunks"); W chunks per row of the swizzle
 * pattern (8, 4, 2 for 128B, 64B, 32B; 1 without), LBO and SBO as in
 * GmmaDescriptor:
 *   K-major,  none:    (r%8) + (r/8) SBO + (k/8) LBO
 *   K-major,  swizzled: (r%8) W + (r/8) SBO + k/8            (LBO unused)
 *   MN-major, none:    (r/8) SBO + (k%8) + (k/8) LBO
 *   MN-major, swizzled: (r/8)%W + (r/8/W) LBO + (k%8) W + (k/8) SBO
 * then the element within its chunk, and the swizzle: address bits
 * [4, 4 + log2 W) xor bits [7, 7 + log2 W). */
static uint32_t desc_elem(uint64_t desc, bool mn_major, int r, int k) {
    int mode = (int)(desc >> 62);
    uint32_t start = (uint32_t)(desc & 0x3fff) << 4, lbo = (uint32_t)(desc >> 16 & 0x3fff) << 4,
             sbo = (uint32_t)(desc >> 32 & 0x3fff) << 4, W = mode == 1 ? 8 : mode == 2 ? 4 : mode == 3 ? 2 : 1;
    if (desc >> 49 & 7) fail("wgmma descriptor with a base offset (not modelled)");
    if (start >> 7 & (W - 1)) fail("swizzled wgmma operand not at its swizzle pattern's first row");
    uint32_t off, e = mn_major ? r % 8 : k % 8;
    if (!mn_major && W == 1) off = (r % 8) * 16 + (r / 8) * sbo + (k / 8) * lbo;
    else if (!mn_major) off = (r % 8) * W * 16 + (r / 8) * sbo + k / 8 * 16;
    else if (W == 1) off = (r / 8) * sbo + (k % 8) * 16 + (k / 8) * lbo;
    else off = (r / 8 % W) * 16 + (r / 8 / W) * lbo + (k % 8) * W * 16 + (k / 8) * sbo;
    uint32_t a = start + off + 2 * e;
    return a ^ ((a >> 7 & (W - 1)) << 4);
}

/* Reads an operand of `rows` x 16 through desc into x[r][k], noting the
 * 16-byte pieces read in rec. */
static void desc_read(double x[][16], int rows, uint64_t desc, bool mn_major, bool bf, wg_mma_rec &rec) {
    std::vector<uint32_t> pieces;
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < 16; k++) {
            uint32_t a = desc_elem(desc, mn_major, r, k);
            x[r][k] = f16bits(*(const uint16_t *)shared(a, 2, 2), bf);
            pieces.push_back(a / 16);
        }
    std::sort(pieces.begin(), pieces.end());
    pieces.erase(std::unique(pieces.begin(), pieces.end()), pieces.end());
    for (uint32_t p : pieces) {
        if (unfenced[p]) fail("wgmma reads cp.async data its thread landed without a fence.proxy.async since");
        wg_read rd = { p * 16, {} };
        memcpy(rd.bytes, smem + p * 16, 16);
        rec.smem.push_back(rd);
    }
}

/* bar.arrive (wait false) or bar.sync on barrier id for `count` threads:
 * released when that many have arrived; all must name the same count. */
static void named_barrier(int id, unsigned count, bool wait) {
    if (id < 1 || id > 15 || count % 32 || count == 0 || count > blockDim.x)
        fail("named barrier with a bad id or thread count");
    named_bar &b = NB[id];
    if (b.arrived == 0) b.count = count;
    else if (b.count != count) fail("threads at one named barrier with different thread counts");
    unsigned gen = b.gen;
    S.progress++;
    if (++b.arrived == count) {
        b.arrived = 0;
        b.gen++;
        return;
    }
    if (wait) block_on(&b.gen, gen);
}

struct wg_mma_arg { float *d; const uint32_t *a; uint64_t adesc, bdesc; int scale_d; };

/* The accumulator value an mma reads: the one kept aside if an earlier
 * mma's result is still pending there. */
static float acc_in(wgroup &wg, float *p) {
    auto it = wg.held.find(p);
    return it == wg.held.end() ? *p : it->second.first;
}

/* d (64 x N) = A (64 x 16) B (16 x N) + (scale_d ? d : 0). A: registers
 * (a != null: warp w's rows 16w.., lane l (g = l/4, t = l%4) holding
 * mma.m16n8k16's A layout: (g, 2t..) (g+8, 2t..) (g, 2t+8..) (g+8, 2t+8..))
 * or K-major through adesc; B K-major or (mn_b) MN-major through bdesc.
 * Thread l of warp w holds d[4i..4i+3] = rows 16w + g, 16w + g + 8,
 * columns 8i + 2t, +1: (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1). Sums in
 * double, rounded to f32 once. */
static void wgmma(int N, bool a_regs, bool mn_b, bool bf, const wg_mma_arg &me) {
    int op = WG_MMA | N << 4 | a_regs << 2 | mn_b << 1 | bf;
    wg_collective(op, (void *)&me, [N, a_regs, mn_b, bf](wgroup &wg, void **args) {
        if (!wg.fenced) fail("wgmma.mma_async without a wgmma.fence since the last commit or wait");
        const wg_mma_arg *a0 = (const wg_mma_arg *)args[0];
        for (int t = 0; t < 128; t++) {
            const wg_mma_arg *m = (const wg_mma_arg *)args[t];
            if (m->bdesc != a0->bdesc || (!a_regs && m->adesc != a0->adesc) || m->scale_d != a0->scale_d)
                fail("threads of one warpgroup passed different wgmma descriptors or scale-d");
        }
        wg_mma_rec rec;
        rec.seq = ++wg.seq;
        static double A[64][16], Bt[256][16];   /* Bt[n][k] */
        if (a_regs) {
            for (int t = 0; t < 128; t++) {
                const uint32_t *a = ((const wg_mma_arg *)args[t])->a;
                int w = t / 32, g = t % 32 / 4, c = t % 4, r0 = 16 * w + g;
                for (int h = 0; h < 2; h++) {
                    A[r0][2 * c + h] = f16bits((uint16_t)(a[0] >> 16 * h), bf);
                    A[r0 + 8][2 * c + h] = f16bits((uint16_t)(a[1] >> 16 * h), bf);
                    A[r0][2 * c + 8 + h] = f16bits((uint16_t)(a[2] >> 16 * h), bf);
                    A[r0 + 8][2 * c + 8 + h] = f16bits((uint16_t)(a[3] >> 16 * h), bf);
                }
                for (int i = 0; i < 4; i++) rec.aregs.push_back({ a + i, a[i] });
            }
        } else {
            desc_read(A, 64, a0->adesc, false, bf, rec);
        }
        desc_read(Bt, N, a0->bdesc, mn_b, bf, rec);
        for (int t = 0; t < 128; t++) {
            float *d = ((const wg_mma_arg *)args[t])->d;
            int w = t / 32, g = t % 32 / 4, c = t % 4;
            for (int i = 0; i < N / 8; i++)
                for (int e = 0; e < 4; e++) {
                    int row = 16 * w + g + (e >= 2 ? 8 : 0), col = 8 * i + 2 * c + (e & 1);
                    double s = a0->scale_d ? acc_in(wg, d + 4 * i + e) : 0.0;
                    for (int k = 0; k < 16; k++) s += A[row][k] * Bt[col][k];
                    wg.held[d + 4 * i + e] = { (float)s, rec.seq };
                    d[4 * i + e] = NAN;
                }
        }
        wg.mmas.push_back(std::move(rec));
    });
}

static void wg_fence() {
    wg_collective(WG_FENCE, nullptr, [](wgroup &wg, void **) { wg.fenced = true; });
}

static void wg_commit() {
    wg_collective(WG_COMMIT, nullptr, [](wgroup &wg, void **) {
        unsigned last = wg.groups.empty() ? 0 : wg.groups.back();
        if (wg.seq > last) wg.groups.push_back(wg.seq);   /* an empty group completes at once */
        wg.fenced = false;
    });
}

/* Completes every committed group but the newest `pending`: their
 * accumulators get their values, after checking what they read held still. */
static void wg_wait(int pending) {
    wg_collective(WG_WAIT | pending << 8, nullptr, [pending](wgroup &wg, void **) {
        wg.fenced = false;
        if (wg.groups.size() <= (size_t)pending) return;
        unsigned done = wg.groups[wg.groups.size() - 1 - pending];
        wg.groups.erase(wg.groups.begin(), wg.groups.end() - pending);
        while (!wg.mmas.empty() && wg.mmas.front().seq <= done) {
            const wg_mma_rec &r = wg.mmas.front();
            for (const wg_read &rd : r.smem)
                if (memcmp(smem + rd.addr, rd.bytes, 16))
                    fail("shared memory a wgmma reads changed before the wait that covers it");
            for (const auto &ar : r.aregs)
                if (*ar.first != ar.second) fail("wgmma A registers changed before the wait that covers it");
            wg.mmas.erase(wg.mmas.begin());
        }
        for (auto it = wg.held.begin(); it != wg.held.end();) {
            if (it->second.second <= done) {
                *it->first = it->second.first;
                it = wg.held.erase(it);
            } else {
                ++it;
            }
        }
    });
}

} /* namespace emu */

/* ---- cuda_wgmma.cuh's interface ---- */

static inline void wgmma_fence() { emu::wg_fence(); }
static inline void wgmma_commit() { emu::wg_commit(); }
template <int PENDING> static inline void wgmma_wait() { emu::wg_wait(PENDING); }
static inline void fence_proxy_async() { emu::proxy_fence(); }
static inline void named_barrier_sync(int id, int threads) { emu::named_barrier(id, (unsigned)threads, true); }
static inline void named_barrier_arrive(int id, int threads) { emu::named_barrier(id, (unsigned)threads, false); }
static inline void wgmma_pin(float *, int) {}        /* registers are memory here */
static inline void wgmma_pin(uint32_t *, int) {}

template <int N> static inline void wgmma_ss(float d[][4], uint64_t a, uint64_t b, int scale_d, __nv_bfloat16) {
    emu::wgmma(N, false, false, true, { &d[0][0], nullptr, a, b, scale_d });
}
template <int N> static inline void wgmma_ss(float d[][4], uint64_t a, uint64_t b, int scale_d, __half) {
    emu::wgmma(N, false, false, false, { &d[0][0], nullptr, a, b, scale_d });
}
template <int N>
static inline void wgmma_rs(float d[][4], const uint32_t a[4], uint64_t b, int scale_d, __nv_bfloat16) {
    emu::wgmma(N, true, true, true, { &d[0][0], a, 0, b, scale_d });
}
template <int N> static inline void wgmma_rs(float d[][4], const uint32_t a[4], uint64_t b, int scale_d, __half) {
    emu::wgmma(N, true, true, false, { &d[0][0], a, 0, b, scale_d });
}

#endif
