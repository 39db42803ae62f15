/* The TMA half of tests/warp_emulator.h: kernels/cuda/cuda_tma.cuh's
 * interface (mbarrier init / arrive / arrive.expect_tx / try_wait.parity,
 * fence.mbarrier_init, cp.async.bulk.tensor in tile mode with
 * mbarrier::complete_tx, setmaxnreg) and the driver's
 * cuTensorMapEncodeTiled on the CPU. Included by warp_emulator.h after
 * warp_emulator_wgmma.h; the rest of the emulator is there.
 *
 * An mbarrier (8 bytes of shared memory, state kept here by address)
 * counts arrivals and transaction bytes: a phase completes when all its
 * expected arrivals came and the bytes its arrive.expect_tx announced
 * landed, then the next phase begins. A bulk tensor copy turns its
 * destination NaN when issued and lands (global data, swizzled, zeros out
 * of bounds) only when its mbarrier's phase completes, so reading it
 * before the wait shows up in the results. A thread waiting on a parity
 * blocks as at a barrier. The kernels' wait is bounded (cuda_tma.cuh: a
 * budget of seconds, or the block's stall flag): here it runs out where
 * the hardware's would, when every live thread of the block is blocked
 * and some in bounded waits (no time would bring progress), and all
 * those waits return "not completed"; an unbounded wait (emu::mbar_wait
 * without one) still aborts there. The tensor map is the driver's opaque 128 bytes,
 * here holding the emulator's own fields; encoding checks the driver's
 * documented limits and returns CUDA_ERROR_INVALID_VALUE past them.
 * It aborts, naming the kernel and thread, on: an mbarrier used before
 * init or a TMA completing on one whose init had no fence.mbarrier_init;
 * more bytes landing on a phase than its expect_tx announced, or a
 * deadlock with a phase whose arrivals came but whose bytes differ, or a
 * thread blocked on a phase that cannot complete (named in the deadlock),
 * when no thread is in a bounded wait;
 * a tensor map never encoded; a destination misaligned for the map's
 * swizzle; a copy overwriting shared memory an issued wgmma still reads
 * (its stage's "empty" barrier skipped); setmaxnreg not uniform over the
 * warpgroup or outside 24..256 or not a multiple of 8. */
#ifndef WARP_EMULATOR_TMA_H
#define WARP_EMULATOR_TMA_H

#include <map>

/* ---- the driver's types (cuda.h), for kernels' host code ---- */

typedef int CUresult;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
typedef uint32_t cuuint32_t;
typedef uint64_t cuuint64_t;
typedef enum { CU_TENSOR_MAP_DATA_TYPE_UINT16 = 1, CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6,
               CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9 } CUtensorMapDataType;
typedef enum { CU_TENSOR_MAP_INTERLEAVE_NONE = 0 } CUtensorMapInterleave;
typedef enum { CU_TENSOR_MAP_SWIZZLE_NONE = 0, CU_TENSOR_MAP_SWIZZLE_32B, CU_TENSOR_MAP_SWIZZLE_64B,
               CU_TENSOR_MAP_SWIZZLE_128B } CUtensorMapSwizzle;
typedef enum { CU_TENSOR_MAP_L2_PROMOTION_NONE = 0, CU_TENSOR_MAP_L2_PROMOTION_L2_128B = 2 } CUtensorMapL2promotion;
typedef enum { CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0 } CUtensorMapFloatOOBfill;
struct alignas(64) CUtensorMap { uint64_t opaque[16]; };
typedef CUresult (*PFN_cuTensorMapEncodeTiled_v12000)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                                      const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                                      const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                                      CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
#define __grid_constant__

namespace emu {

/* The emulator's fields inside the opaque 128 bytes. */
struct tmap {
    uint32_t magic, rank, esize, swizzle;
    const unsigned char *base;
    uint64_t dim[5], stride[5];   /* stride in bytes; stride[0] the element */
    uint32_t box[5];
};
static_assert(sizeof(tmap) <= sizeof(CUtensorMap), "tensor map fields fit its 128 bytes");
#define EMU_TMAP_MAGIC 0x544d4150u

/* One issued bulk copy, landing at its mbarrier's phase completion. */
struct tma_copy { unsigned char *dst; tmap m; int c[5]; uint32_t bytes; };

struct mbar {
    unsigned count, pending, phase;   /* expected arrivals, still to come, phases completed */
    int64_t tx;                       /* bytes announced by expect_tx and not yet landed */
    bool fenced;                      /* fence.mbarrier_init since init */
    unsigned init_by;
    std::vector<tma_copy> inflight;
};

static std::map<uint32_t, mbar> MB;
static std::vector<int64_t> waiting_on;   /* per thread: the mbarrier it blocks on, or -1 */
static std::vector<char> bounded, expired; /* per thread: that wait bounded; ran out */
struct wg_nreg { int arrived, n; unsigned gen; };
static std::vector<wg_nreg> NREG;

static void tma_block_start() {
    MB.clear();
    waiting_on.assign(blockDim.x, -1);
    bounded.assign(blockDim.x, 0);
    expired.assign(blockDim.x, 0);
    NREG.assign(blockDim.x / 128 + 1, wg_nreg{ 0, 0, 0 });
}

static mbar &mbar_at(const void *p) {
    uint32_t a = (uint32_t)((const unsigned char *)p - smem);
    shared(a, 8, 8);
    auto it = MB.find(a);
    if (it == MB.end()) fail("mbarrier used before mbarrier.init");
    return it->second;
}

/* Bytes of element (i0..i4) of the box at copy c's coordinates, or null
 * out of bounds (then zeros land). */
static const unsigned char *tma_src(const tma_copy &c, const uint32_t i[5]) {
    const unsigned char *p = c.m.base;
    for (uint32_t d = 0; d < c.m.rank; d++) {
        int64_t x = (int64_t)c.c[d] + i[d];
        if (x < 0 || x >= (int64_t)c.m.dim[d]) return nullptr;
        p += x * c.m.stride[d];
    }
    return p;
}

/* The box lands at dst: dense, innermost dimension first; with a swizzle
 * of W 16-byte chunks, address bits [4, 4 + log2 W) xor bits [7, 7 + log2 W). */
static void tma_land(const tma_copy &c) {
    uint32_t W = c.m.swizzle == 3 ? 8 : c.m.swizzle == 2 ? 4 : c.m.swizzle == 1 ? 2 : 1, n[5] = { 1, 1, 1, 1, 1 };
    for (uint32_t d = 0; d < c.m.rank; d++) n[d] = c.m.box[d];
    uint32_t i[5], off = 0, base = (uint32_t)(c.dst - smem);
    for (i[4] = 0; i[4] < n[4]; i[4]++)
        for (i[3] = 0; i[3] < n[3]; i[3]++)
            for (i[2] = 0; i[2] < n[2]; i[2]++)
                for (i[1] = 0; i[1] < n[1]; i[1]++)
                    for (i[0] = 0; i[0] < n[0]; i[0]++, off += c.m.esize) {
                        uint32_t a = base + off;
                        a ^= (a >> 7 & (W - 1)) << 4;
                        const unsigned char *s = tma_src(c, i);
                        if (s) memcpy(smem + a, s, c.m.esize);
                        else memset(smem + a, 0, c.m.esize);
                    }
}

/* Completes b's phase if its arrivals and bytes are all in. */
static void mbar_settle(mbar &b) {
    if (b.pending) return;
    int64_t landing = 0;
    for (const tma_copy &c : b.inflight) landing += c.bytes;
    if (landing > b.tx) fail("bulk copies land more bytes on an mbarrier phase than its expect_tx announced");
    if (landing < b.tx) return;
    for (const tma_copy &c : b.inflight) tma_land(c);
    b.inflight.clear();
    b.tx = 0;
    b.pending = b.count;
    b.phase++;
    S.progress++;
}

static void mbar_init(void *p, unsigned count) {
    uint32_t a = (uint32_t)((unsigned char *)p - smem);
    shared(a, 8, 8);
    if (count == 0 || count >= 1u << 20) fail("mbarrier.init with a bad count");
    MB[a] = mbar{ count, count, 0, 0, false, threadIdx.x, {} };
}

static void mbar_fence_init() {
    for (auto &kv : MB)
        if (kv.second.init_by == threadIdx.x) kv.second.fenced = true;
}

static void mbar_arrive(void *p, uint32_t tx) {
    mbar &b = mbar_at(p);
    if (b.pending == 0) fail("mbarrier arrive past its expected count");
    b.tx += tx;
    b.pending--;
    S.progress++;
    mbar_settle(b);
}

/* try_wait.parity in a loop: true once the phase of this parity
 * completed, that is when the current (incomplete) phase's parity
 * differs. Bounded: false once tma_stuck ran the wait out, or stop (the
 * block's stall flag) was set when it looks. */
static bool mbar_wait(void *p, unsigned parity, bool bound, const volatile int *stop) {
    mbar &b = mbar_at(p);
    unsigned t = threadIdx.x;
    waiting_on[t] = (int64_t)((unsigned char *)p - smem);
    bounded[t] = bound;
    bool done = true;
    while ((b.phase & 1) == (parity & 1) && done) {
        if (bound && (*stop || expired[t])) done = false;
        else {                              /* until the phase completes or tma_stuck wakes it */
            S.lanes[t].wait_on = &b.phase;
            S.lanes[t].wait_was = b.phase;
            yield();
            S.lanes[t].wait_on = nullptr;
        }
    }
    waiting_on[t] = -1;
    expired[t] = 0;
    S.progress++;
    return done;
}

/* A deadlocked block: its bounded mbarrier waits run out (all at once, as
 * no time would complete them), or, with none, it fails naming a thread
 * that waits on an mbarrier. */
static void tma_stuck() {
    bool ran_out = false;
    for (unsigned t = 0; t < waiting_on.size(); t++)
        if (waiting_on[t] >= 0 && bounded[t] && !S.lanes[t].done) {
            expired[t] = 1;
            S.lanes[t].wait_on = nullptr;
            ran_out = true;
        }
    if (ran_out) {
        S.progress++;
        return;
    }
    for (unsigned t = 0; t < waiting_on.size(); t++) {
        if (waiting_on[t] < 0 || S.lanes[t].done) continue;
        mbar &b = MB[(uint32_t)waiting_on[t]];
        threadIdx = { t, 0, 0 };
        if (b.pending == 0) fail("deadlock: an mbarrier phase's arrivals came but its bytes never match its expect_tx");
        fail("deadlock: a thread waits on an mbarrier phase that cannot complete (an arrive missing or a wrong parity)");
    }
}

static tmap tmap_of(const void *desc) {
    tmap m;
    memcpy(&m, desc, sizeof m);
    if (m.magic != EMU_TMAP_MAGIC) fail("bulk tensor copy through a tensor map never encoded");
    return m;
}

/* cp.async.bulk.tensor.Nd.shared::cluster.global.mbarrier::complete_tx::bytes. */
static void tma_load(void *dst, const void *desc, void *bar, int rank, const int *c) {
    const tmap m = tmap_of(desc);
    if ((uint32_t)rank != m.rank) fail("bulk tensor copy of a rank other than its tensor map's");
    uint32_t align = m.swizzle == 3 ? 1024 : m.swizzle == 2 ? 512 : m.swizzle == 1 ? 256 : 128, bytes = m.esize;
    for (uint32_t d = 0; d < m.rank; d++) bytes *= m.box[d];
    uint32_t a = (uint32_t)((unsigned char *)dst - smem);
    if (a % align) fail("bulk tensor copy destination misaligned for its tensor map's swizzle");
    shared(a, bytes, 1);
    mbar &b = mbar_at(bar);
    if (!b.fenced) fail("bulk tensor copy completing on an mbarrier whose init had no fence.mbarrier_init");
    for (const wgroup &w : WG)
        for (const wg_mma_rec &r : w.mmas)
            for (const wg_read &rd : r.smem)
                if (rd.addr + 16 > a && rd.addr < a + bytes)
                    fail("bulk tensor copy overwrites shared memory an issued wgmma still reads (an empty barrier "
                         "skipped)");
    memset(smem + a, 0xff, bytes);   /* NaN until its phase completes */
    tma_copy cp = { smem + a, m, {}, bytes };
    for (int d = 0; d < rank; d++) cp.c[d] = c[d];
    b.inflight.push_back(cp);
    S.progress++;
    mbar_settle(b);
}

/* setmaxnreg.{inc,dec}.sync.aligned.u32 n: warpgroup-wide, one n. */
static void setmaxnreg(int n) {
    if (n < 24 || n > 256 || n % 8) fail("setmaxnreg count outside 24..256 or not a multiple of 8");
    wg_nreg &w = NREG[threadIdx.x / 128];
    if (w.arrived == 0) w.n = n;
    else if (w.n != n) fail("setmaxnreg with different counts in one warpgroup");
    for (unsigned x = threadIdx.x / 128 * 4; x < threadIdx.x / 128 * 4 + 4; x++)
        if (x >= S.warps.size() || S.warps[x].live != 32) fail("setmaxnreg in a warpgroup not all there");
    S.progress++;
    if (++w.arrived == 128) {
        w.arrived = 0;
        w.gen++;
        return;
    }
    block_on(&w.gen, w.gen);
}

} /* namespace emu */

/* The driver's cuTensorMapEncodeTiled, its documented limits checked:
 * rank 1..5, a 16-byte-aligned base, dims 1..2^32, strides multiples of 16
 * under 2^40, boxes 1..256 with an inner dimension of a multiple of 16
 * bytes and, swizzled, at most the swizzle's span; element strides 1..8
 * (only 1 modelled), no interleave. */
static inline CUresult cuTensorMapEncodeTiled(CUtensorMap *map, CUtensorMapDataType dt, cuuint32_t rank, void *base,
                                       const cuuint64_t *dim, const cuuint64_t *stride, const cuuint32_t *box,
                                       const cuuint32_t *estride, CUtensorMapInterleave inter, CUtensorMapSwizzle sw,
                                       CUtensorMapL2promotion, CUtensorMapFloatOOBfill) {
    uint32_t es = dt == CU_TENSOR_MAP_DATA_TYPE_UINT16 || dt == CU_TENSOR_MAP_DATA_TYPE_FLOAT16 ||
                  dt == CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 ? 2 : 0;
    uint32_t span = sw == CU_TENSOR_MAP_SWIZZLE_128B ? 128 : sw == CU_TENSOR_MAP_SWIZZLE_64B ? 64 : 32;
    if ((uintptr_t)map % 64 || !es || rank < 1 || rank > 5 || (uintptr_t)base % 16 || inter != 0 || (unsigned)sw > 3)
        return CUDA_ERROR_INVALID_VALUE;
    if (box[0] * es % 16 || (sw && box[0] * es > span)) return CUDA_ERROR_INVALID_VALUE;
    emu::tmap m = { EMU_TMAP_MAGIC, rank, es, (uint32_t)sw, (const unsigned char *)base, {}, {}, {} };
    for (uint32_t d = 0; d < rank; d++) {
        if (dim[d] == 0 || dim[d] > 1ull << 32 || box[d] == 0 || box[d] > 256 || estride[d] == 0 || estride[d] > 8)
            return CUDA_ERROR_INVALID_VALUE;
        if (estride[d] != 1) return CUDA_ERROR_INVALID_VALUE;   /* not modelled */
        if (d > 0 && (stride[d - 1] % 16 || stride[d - 1] >= 1ull << 40)) return CUDA_ERROR_INVALID_VALUE;
        m.dim[d] = dim[d];
        m.stride[d] = d ? stride[d - 1] : es;
        m.box[d] = box[d];
    }
    memset(map, 0, sizeof *map);
    memcpy(map, &m, sizeof m);
    return CUDA_SUCCESS;
}

/* ---- cuda_tma.cuh's interface ---- */

static inline void mbar_init(uint64_t *bar, unsigned count) { emu::mbar_init(bar, count); }
static inline void mbar_fence_init() { emu::mbar_fence_init(); }
static inline void mbar_arrive(uint64_t *bar) { emu::mbar_arrive(bar, 0); }
static inline void mbar_arrive_expect_tx(uint64_t *bar, unsigned bytes) { emu::mbar_arrive(bar, bytes); }
static inline bool mbar_wait(uint64_t *bar, unsigned parity, const volatile int *stop) {
    return emu::mbar_wait(bar, parity, true, stop);
}
static inline void tma_load_4d(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1, int c2, int c3) {
    int c[4] = { c0, c1, c2, c3 };
    emu::tma_load(dst, map, bar, 4, c);
}
template <int N> static inline void setmaxnreg_dec() { emu::setmaxnreg(N); }
template <int N> static inline void setmaxnreg_inc() { emu::setmaxnreg(N); }

#endif
