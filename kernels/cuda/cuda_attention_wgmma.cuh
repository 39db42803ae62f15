/* Attention forward on Hopper's warpgroup MMA (sm_90a), bf16 and f16, head
 * dims 64 and 128, FlashAttention-3's design: a block of two warpgroups
 * owns 128 query rows, 64 per warpgroup (wgmma's M), and walks 128-key
 * tiles of K and V. S = Q K^T is wgmma m64n128k16 with Q and K in shared
 * memory (both K-major); O += P V is wgmma m64nDk16 with P from registers
 * (S's accumulators are P's A fragments once packed) and V in shared
 * memory read MN-major through the descriptor (no transpose anywhere).
 * Within a warpgroup the softmax of tile j runs while P(j-1) V(j-1) is in
 * flight: tile j issues S(j) and P(j-1) V(j-1), waits for S(j) only,
 * computes its softmax, then waits for the rest and rescales O to tile j's
 * max (no register of a pending wgmma is touched, so ptxas keeps them
 * asynchronous). The two warpgroups take turns to issue their GEMMs (two
 * named barriers, FA3's ping-pong): warpgroup 1's wait behind warpgroup
 * 0's on the tensor cores, so one's softmax runs while the other's GEMMs
 * do.
 * Tiles live in shared memory as 128-byte-swizzled panels of 64 columns
 * (row r's 16-byte chunk c at chunk c ^ (r % 8) of its 128-byte row: the
 * layout the SW128 descriptors read, free of bank conflicts), staged by
 * the kernel's own cp.async one tile ahead (wgmma_forward_kernel: K(j+1)
 * and V(j) stream in while tile j computes) or loaded by TMA from a
 * producer warpgroup through a ring of stages (wgmma_tma_forward_kernel,
 * below); both run the same tile step (wg_tile) and end (wg_finish).
 * The online softmax, masking and stores are cuda_attention_mma.cuh's, in
 * its fragment layout (wgmma's accumulator is mma.sync's C per warp).
 * Out and lse as mma_forward_kernel writes them; k and v may have fewer
 * heads than q, query head h reading kv head h / G as there. The only PTX is
 * cuda_warp.cuh's, cuda_wgmma.cuh's and cuda_tma.cuh's, so tests/test_wgmma_attention.cc
 * runs this file on the CPU through tests/warp_emulator.h. */
#ifndef CUDA_ATTENTION_WGMMA_CUH
#define CUDA_ATTENTION_WGMMA_CUH

#include "cuda_attention_mma.cuh"
#include <stdio.h>
#ifndef DS_WARP_EMULATOR
#include "cuda_tma.cuh"
#endif

/* Where the wgmma code is compiled: sm_90a, and the CPU's emulation; in
 * other passes the kernel is empty and never launched. */
#if defined(DS_WGMMA_ARCH) || defined(DS_WARP_EMULATOR)
#define WG_CODE 1
#endif

#define WG_GROUPS 2                        /* consumer warpgroups per block */
#define WG_THREADS (WG_GROUPS * 128)
#define WG_ROWS (WG_GROUPS * 64)           /* query rows per block */
#define WG_KEYS 128                        /* keys per tile */
#define WG_TURN 1                          /* named barriers WG_TURN + w: warpgroup w's turn to issue */

/* Bytes of a [rows][D] tile of 2-byte elements: D / 64 panels of rows x 128 bytes. */
__host__ __device__ constexpr int wg_tile_bytes(int rows, int D) { return rows * D * 2; }

/* Shared memory: Q, then K and V tiles twice: [buffer][K, V], from the
 * first 1024-byte boundary (the 128B swizzle's pattern is 8 rows of 128
 * bytes, xor-ed by address bits, so tiles must start on one; the 1 KiB
 * more leaves room to find it whatever the dynamic base). */
template <int D> __host__ __device__ constexpr size_t wg_forward_smem() {
    return (size_t)wg_tile_bytes(WG_ROWS, D) + 4 * (size_t)wg_tile_bytes(WG_KEYS, D) + 1024;
}

/* Starts copying rows t0.. (ROWS of them) of x[b, h] into the swizzled
 * tile s, 16 bytes per cp.async; rows at or past `end` are zeros. */
template <typename T, int D, int ROWS>
__device__ __forceinline__ void wg_load_tile(unsigned char *s, const ds_kview &x, int64_t b, int64_t h, int64_t t0,
                                             int64_t end) {
    const int chunks = D / 8;
    const T *base = (const T *)x.data + b * x.stride[0] + h * x.stride[1];
    for (int e = threadIdx.x; e < ROWS * chunks; e += WG_THREADS) {
        int r = e / chunks, c = e % chunks;
        bool real = t0 + r < end;
        const T *src = real ? base + (t0 + r) * x.stride[2] + c * 8 : base;
        cp_async_16(s + c / 8 * ROWS * 128 + r * 128 + ((c % 8) ^ (r % 8)) * 16, src, real);
    }
}

/* Query head h's kv head, divided in 32 bits: a 64-bit division costs the
 * forward and dQ kernels 6 to 26 registers more. */
__device__ __forceinline__ int64_t wg_kv_head(const mma_geom &g, int64_t h) { return (int)h / (int)g.G; }

#ifdef WG_CODE
/* The SW128 descriptor of a tile's 16-byte-aligned piece at p: rows 8 x
 * 128 bytes apart (SBO 1024), lbo the next panel (MN-major) or unused (16). */
__device__ __forceinline__ uint64_t wg_desc(const unsigned char *p, uint32_t lbo) {
    return (uint64_t)(smem_addr(p) >> 4 & 0x3fff) | (uint64_t)(lbo >> 4) << 16 | (uint64_t)(1024 >> 4) << 32 |
           1ull << 62;
}

/* s (this warpgroup's 64 rows x 128 keys) = Q K^T over D, in flight. */
template <typename T, int D>
__device__ __forceinline__ void wg_scores(float s[WG_KEYS / 8][4], const unsigned char *qs, const unsigned char *ks) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        int off = kk % 4 * 32;   /* within a panel: 16 columns are 32 bytes */
        wgmma_ss<WG_KEYS>(s, wg_desc(qs + kk / 4 * WG_ROWS * 128 + off, 16),
                          wg_desc(ks + kk / 4 * WG_KEYS * 128 + off, 16), kk > 0, T());
    }
    wgmma_commit();
}

/* o += P V for the tile's 128 keys, P packed in p, in flight. */
template <typename T, int D>
__device__ __forceinline__ void wg_probs_v(float o[D / 8][4], const uint32_t p[WG_KEYS / 16][4],
                                           const unsigned char *vs) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < WG_KEYS / 16; kk++) wgmma_rs<D>(o, p[kk], wg_desc(vs + kk * 16 * 128, WG_KEYS * 128), 1, T());
    wgmma_commit();
}

/* Waits for warpgroup w's turn (sync), or hands it the turn (arrive):
 * named barrier WG_TURN + w, the 128 threads that wait and the 128 that
 * hand over (warpgroup 1's last hand-over is left unanswered when the
 * block ends). */
__device__ __forceinline__ void wg_turn(int w, bool sync) {
    if (w == 0) sync ? named_barrier_sync(WG_TURN, WG_THREADS) : named_barrier_arrive(WG_TURN, WG_THREADS);
    else sync ? named_barrier_sync(WG_TURN + 1, WG_THREADS) : named_barrier_arrive(WG_TURN + 1, WG_THREADS);
}

/* After a wait: no access to s, o or p moves above it. */
template <int D>
__device__ __forceinline__ void wg_pin_all(float s[WG_KEYS / 8][4], float o[D / 8][4], uint32_t p[WG_KEYS / 16][4]) {
    wgmma_pin(&s[0][0], WG_KEYS / 2);
    wgmma_pin(&o[0][0], D / 2);
    wgmma_pin(&p[0][0], WG_KEYS / 4);
}
#endif

#ifdef WG_CODE
/* One warpgroup's key tile from j0 (wg: 0 or 1 of the pair, first: the
 * block's first tile): on its turn it issues S = Q K^T (ks) and, past the
 * first, P V of the tile before (vs), hands the turn on, masks and
 * softmaxes S once it completed, then rescales o once P V did and packs
 * the new P. k_done runs once K's wgmma completed, v_done (past the
 * first) once V's did: the tiles are free from there. */
template <typename T, int D, typename KDone, typename VDone>
__device__ __forceinline__ void wg_tile(int wg, int64_t j0, bool first, const unsigned char *qs,
                                        const unsigned char *ks, const unsigned char *vs, float s[WG_KEYS / 8][4],
                                        float o[D / 8][4], uint32_t p[WG_KEYS / 16][4], float mx[2], float sum[2],
                                        int64_t g0, int64_t w0, const mma_geom &g, KDone k_done, VDone v_done) {
    float scale[2];
    wg_turn(wg, true);                    /* this warpgroup's turn to issue */
    wg_scores<T, D>(s, qs + wg * 64 * 128, ks);
    if (!first) {
        wg_probs_v<T, D>(o, p, vs);
        wg_turn(wg ^ 1, false);           /* the other's */
        wgmma_wait<1>();                  /* S */
    } else {
        wg_turn(wg ^ 1, false);
        wgmma_wait<0>();
    }
    wg_pin_all<D>(s, o, p);
    k_done();
    int64_t r0 = w0 + threadIdx.x % 32 / 4;
    if (tile_unmasked(g0, 64, j0, WG_KEYS, g)) scale_scores<false, WG_KEYS>(s, r0, r0 + 8, j0, g);
    else scale_scores<true, WG_KEYS>(s, r0, r0 + 8, j0, g);
    softmax_tile<WG_KEYS>(s, mx, sum, scale);
    wgmma_wait<0>();                      /* P V of the tile before: p and o are free */
    wg_pin_all<D>(s, o, p);
    if (!first) v_done();
    rescale_rows<D>(o, scale);
#pragma unroll
    for (int kk = 0; kk < WG_KEYS / 16; kk++) probs_operand<T>(p[kk], s, kk);
}

/* The last tile's P V (V at vs), then out and lse of this thread's rows. */
template <typename T, int D>
__device__ __forceinline__ void wg_finish(const unsigned char *vs, float s[WG_KEYS / 8][4], float o[D / 8][4],
                                          uint32_t p[WG_KEYS / 16][4], const float mx[2], const float sum[2],
                                          const ds_kview &out, const ds_kview &lse, int64_t b, int64_t h, int64_t w0,
                                          const mma_geom &g) {
    wg_probs_v<T, D>(o, p, vs);
    wgmma_wait<0>();
    wg_pin_all<D>(s, o, p);
    float l0 = quad_sum(sum[0]), l1 = quad_sum(sum[1]);
    store_rows<T, D>(out, b, h, w0, g.Tq, o, 1.f / l0, 1.f / l1);
    float *L = (float *)lse.data + b * lse.stride[0] + h * lse.stride[1];
    int64_t r0 = w0 + threadIdx.x % 32 / 4, r1 = r0 + 8;
    if (threadIdx.x % 4 == 0 && r0 < g.Tq) L[r0 * lse.stride[2]] = (mx[0] + log2f(l0)) / LOG2E;
    if (threadIdx.x % 4 == 0 && r1 < g.Tq) L[r1 * lse.stride[2]] = (mx[1] + log2f(l1)) / LOG2E;
}
#endif

/* The forward with K and V staged by its own threads' cp.async. */
template <typename T, int D>
__global__ void __launch_bounds__(WG_THREADS, 1)
wgmma_forward_kernel(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, mma_geom g) {
#ifdef WG_CODE
    constexpr int QB = wg_tile_bytes(WG_ROWS, D), KB = wg_tile_bytes(WG_KEYS, D);
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char *qs = smem + (-smem_addr(smem) & 1023), *kv = qs + QB;   /* buffer i: K at kv + 2 i KB, V after it */
    int wg = threadIdx.x / 128;
    int64_t b, h, blk;
    block_task(g, (g.Tq + WG_ROWS - 1) / WG_ROWS, g.causal, &b, &h, &blk);
    int64_t kh = wg_kv_head(g, h), i0 = blk * WG_ROWS, g0 = i0 + 64 * wg, w0 = g0 + 16 * (threadIdx.x / 32 % 4);
    int64_t kend = g.causal ? min(g.Tk, i0 + WG_ROWS) : g.Tk, tiles = (kend + WG_KEYS - 1) / WG_KEYS;
    float o[D / 8][4] = {}, s[WG_KEYS / 8][4], mx[2] = { -INFINITY, -INFINITY }, sum[2] = { 0.f, 0.f };
    uint32_t p[WG_KEYS / 16][4];
    wg_load_tile<T, D, WG_ROWS>(qs, q, b, h, i0, g.Tq);
    wg_load_tile<T, D, WG_KEYS>(kv, k, b, kh, 0, g.Tk);
    cp_async_commit();
    if (wg == 1) wg_turn(0, false);      /* warpgroup 0 issues first */
    auto none = [] {};
    for (int64_t j = 0; j < tiles; j++) {
        int64_t j0 = j * WG_KEYS;
        cp_async_wait(0);                 /* K(j) and V(j-1) */
        fence_proxy_async();
        __syncthreads();                  /* ... landed for all; tile j-1's wgmma all done */
        if (j + 1 < tiles) wg_load_tile<T, D, WG_KEYS>(kv + (j + 1) % 2 * 2 * KB, k, b, kh, j0 + WG_KEYS, g.Tk);
        wg_load_tile<T, D, WG_KEYS>(kv + j % 2 * 2 * KB + KB, v, b, kh, j0, g.Tk);
        cp_async_commit();
        wg_tile<T, D>(wg, j0, j == 0, qs, kv + j % 2 * 2 * KB, kv + (j + 1) % 2 * 2 * KB + KB, s, o, p, mx, sum, g0,
                      w0, g, none, none);
    }
    cp_async_wait(0);                     /* V of the last tile */
    fence_proxy_async();
    __syncthreads();
    wg_finish<T, D>(kv + (tiles - 1) % 2 * 2 * KB + KB, s, o, p, mx, sum, out, lse, b, h, w0, g);
#endif
}

/* ---- the forward fed by TMA ----
 * FlashAttention-3's warp specialisation: a third warpgroup (the
 * producer, first in the block) gives up registers (setmaxnreg) and one
 * of its threads loads Q and then K and V tile after tile by TMA into a
 * ring of WT_STAGES stages; the two consumer warpgroups (raising their
 * registers) run wg_tile as above. Each stage has a "full" and an "empty"
 * mbarrier for K and for V: the producer announces a tile's bytes on
 * "full" (arrive.expect_tx) and the copies complete it; a consumer
 * warpgroup's first thread arrives on "empty" once the wgmma reading the
 * tile completed, and the producer waits for both before loading the
 * stage again. Tails past the sequence end are TMA's zero fill. */
#define WT_STAGES 2
#define WT_THREADS (WG_THREADS + 128)
#define WT_PRODUCER_REGS 24
#define WT_CONSUMER_REGS 240               /* 24 x 128 + 240 x 256 <= 64K per SM */

/* mbarriers after the stages: Q's, then full[stage][K, V], then empty[stage][K, V];
 * after them the block's stall flag (wt_wait) */
#define WT_Q 0
#define WT_FULL 1
#define WT_EMPTY (1 + 2 * WT_STAGES)
#define WT_BARS (1 + 4 * WT_STAGES)

/* The tensor maps of q, k and v (wt_map), kernel parameters in constant memory. */
struct wt_maps { CUtensorMap q, k, v; };

template <int D> __host__ __device__ constexpr size_t wt_forward_smem() {
    return (size_t)wg_tile_bytes(WG_ROWS, D) + 2 * WT_STAGES * (size_t)wg_tile_bytes(WG_KEYS, D) + 8 * (WT_BARS + 1) +
           1024;
}

/* Where the TMA kernels report a stall: the grid's first thread whose
 * bounded mbarrier wait ran out writes its block (pos; -1, every byte
 * set, until then) and WT_STALL_BARS x its kernel (wt_kernel) + the
 * mbarrier's index (value): ds_index_hit's layout, so a deferred fault
 * record (core/tensor/ds_fault.h) takes it. */
struct wt_stall { long long pos, value; };
enum wt_kernel { WT_KERNEL_FORWARD, WT_KERNEL_DQ, WT_KERNEL_DKDV };
#define WT_STALL_BARS 64

/* The kernel and mbarrier of a stall record's value, as
 * "wgmma_tma_forward_kernel's full[1] of V". */
static inline void wt_stall_name(char *buf, size_t n, long long value) {
    static const char *const kernels[] = { "wgmma_tma_forward_kernel", "wgmma_tma_dq_kernel",
                                           "wgmma_tma_dkdv_kernel" };
    int k = (int)(value / WT_STALL_BARS), i = (int)(value % WT_STALL_BARS);
    if (k < 0 || k > 2) {
        snprintf(buf, n, "an unknown kernel's mbarrier %lld", value);
    } else if (k == WT_KERNEL_FORWARD) {
        if (i == 0) snprintf(buf, n, "%s's mbarrier of Q", kernels[k]);
        else snprintf(buf, n, "%s's %s[%d] of %s", kernels[k], i < 1 + 2 * WT_STAGES ? "full" : "empty",
                      (i - 1) / 2 % WT_STAGES, (i - 1) % 2 ? "V" : "K");
    } else {
        if (i == 0) snprintf(buf, n, "%s's mbarrier of the block's own tiles", kernels[k]);
        else snprintf(buf, n, "%s's %s[%d]", kernels[k], i < 1 + WT_STAGES ? "full" : "empty", (i - 1) % WT_STAGES);
    }
}

/* The first-call check's reading of a TMA kernel's stall record: true,
 * with its line for stderr in buf (the pass, the variant, the kernel and
 * mbarrier, the block, and then: what runs instead), when a wait ran
 * out; the check then takes the kernel as off for the process. */
static inline bool wt_check_stalled(const wt_stall &seen, const char *pass, bool bf16, int D, int causal,
                                    const char *then, char *buf, size_t n) {
    if (seen.pos < 0) return false;
    char where[160];
    wt_stall_name(where, sizeof where, seen.value);
    snprintf(buf, n, "dslua: attention: the sm_90a wgmma %s (%s, head dim %d, causal %d) stalled: an mbarrier "
             "wait ran out (%s, block %lld) on its check; %s", pass, bf16 ? "bf16" : "f16", D, causal, where,
             seen.pos, then);
    return true;
}

/* The tensor map of x ([B, H, T, D] 2-byte elements, last stride 1) as
 * dims {D, T, H, B}: boxes of 64 columns x `rows` rows, one 128B-swizzled
 * panel of a tile, zeros past the ends. 0, or -1 where the driver refuses
 * x's base or strides (TMA wants 16-byte multiples under 2^40) or the
 * last stride is not 1. */
static inline int wt_map(CUtensorMap *m, const ds_kview &x, PFN_cuTensorMapEncodeTiled_v12000 encode,
                         unsigned rows = WG_KEYS) {
    cuuint64_t dim[4] = { (cuuint64_t)x.shape[3], (cuuint64_t)x.shape[2], (cuuint64_t)x.shape[1],
                          (cuuint64_t)x.shape[0] }, stride[3];
    cuuint32_t box[4] = { 64, rows, 1, 1 }, one[4] = { 1, 1, 1, 1 };
    if (x.stride[3] != 1) return -1;
    for (int d = 0; d < 3; d++) {
        if (x.stride[2 - d] < 0) return -1;
        stride[d] = (cuuint64_t)x.stride[2 - d] * 2;
    }
    CUtensorMapDataType dt = x.dtype == DS_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    return encode(m, dt, 4, x.data, dim, stride, box, one, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS ? 0 : -1;
}

#ifdef WG_CODE
/* Bounded wait (mbar_wait) on mbarrier i of bar's NB, the block's stall
 * flag after them: false when it ran out here or in another thread of the
 * block, the grid's first recording it in *rec. The thread then leaves
 * without writing anything more (no trap: that would poison the context). */
template <int NB>
__device__ __forceinline__ bool wt_wait(uint64_t *bar, int i, unsigned parity, wt_stall *rec) {
    volatile int *stop = (volatile int *)(bar + NB);
    if (mbar_wait(bar + i, parity, stop)) return true;
    if (atomicExch((int *)stop, 1) == 0 &&
        atomicCAS((unsigned long long *)&rec->pos, ~0ull, (unsigned long long)blockIdx.x) == ~0ull)
        rec->value = (long long)stop[1] * WT_STALL_BARS + i;
    return false;
}

/* Initialises NB mbarriers (init(i): mbarrier i's arrivals per phase), the
 * stall flag after them and the kernel's wt_kernel after it, for all
 * threads of the block. */
template <int NB, typename Count>
__device__ __forceinline__ void wt_bars_init(uint64_t *bar, Count init, wt_kernel kernel) {
    static_assert(NB <= WT_STALL_BARS, "a stall record names each mbarrier");
    if (threadIdx.x == 0) {
        for (int i = 0; i < NB; i++) mbar_init(bar + i, init(i));
        ((volatile int *)(bar + NB))[0] = 0;
        ((volatile int *)(bar + NB))[1] = kernel;
        mbar_fence_init();
    }
    __syncthreads();
}

/* The producer's one thread: Q, then K(j) and V(j) into stage j % WT_STAGES
 * once the consumers emptied it (the first pass finds every stage empty:
 * it waits on the parity before phase 0). */
template <int D>
__device__ __forceinline__ void wt_produce(const wt_maps &m, unsigned char *qs, unsigned char *kv, uint64_t *bar,
                                           wt_stall *stall, int b, int h, int kh, int i0, int64_t tiles) {
    constexpr int QB = wg_tile_bytes(WG_ROWS, D), KB = wg_tile_bytes(WG_KEYS, D);
    mbar_arrive_expect_tx(bar + WT_Q, QB);
    for (int c = 0; c < D / 64; c++) tma_load_4d(qs + c * WG_ROWS * 128, &m.q, bar + WT_Q, 64 * c, i0, h, b);
    for (int64_t j = 0; j < tiles; j++) {
        int st = (int)(j % WT_STAGES);
        unsigned ph = (unsigned)(j / WT_STAGES) & 1;
        for (int x = 0; x < 2; x++) {     /* K, then V */
            uint64_t *full = bar + WT_FULL + 2 * st + x;
            unsigned char *dst = kv + (2 * st + x) * KB;
            if (!wt_wait<WT_BARS>(bar, WT_EMPTY + 2 * st + x, ph ^ 1, stall)) return;
            mbar_arrive_expect_tx(full, KB);
            for (int c = 0; c < D / 64; c++)
                tma_load_4d(dst + c * WG_KEYS * 128, x ? &m.v : &m.k, full, 64 * c, (int)(j * WG_KEYS), kh, b);
        }
    }
}
#endif

template <typename T, int D>
__global__ void __launch_bounds__(WT_THREADS, 1)
wgmma_tma_forward_kernel(ds_kview out, ds_kview lse, const __grid_constant__ wt_maps m, mma_geom g,
                         wt_stall *stall) {
#ifdef WG_CODE
    constexpr int QB = wg_tile_bytes(WG_ROWS, D), KB = wg_tile_bytes(WG_KEYS, D);
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char *qs = smem + (-smem_addr(smem) & 1023), *kv = qs + QB;   /* stage i: K at kv + 2 i KB, V after it */
    uint64_t *bar = (uint64_t *)(kv + 2 * WT_STAGES * KB);
    int64_t b, h, blk;
    block_task(g, (g.Tq + WG_ROWS - 1) / WG_ROWS, g.causal, &b, &h, &blk);
    int64_t kh = wg_kv_head(g, h), i0 = blk * WG_ROWS;
    int64_t kend = g.causal ? min(g.Tk, i0 + WG_ROWS) : g.Tk, tiles = (kend + WG_KEYS - 1) / WG_KEYS;
    wt_bars_init<WT_BARS>(bar, [](int i) { return i < WT_EMPTY ? 1u : 2u; }, WT_KERNEL_FORWARD);
    if (threadIdx.x < 128) {
        setmaxnreg_dec<WT_PRODUCER_REGS>();
        if (threadIdx.x == 0) wt_produce<D>(m, qs, kv, bar, stall, (int)b, (int)h, (int)kh, (int)i0, tiles);
        return;
    }
    setmaxnreg_inc<WT_CONSUMER_REGS>();
    int wg = threadIdx.x / 128 - 1;
    bool lead = threadIdx.x % 128 == 0;   /* arrives on "empty" for its warpgroup */
    int64_t g0 = i0 + 64 * wg, w0 = g0 + 16 * (threadIdx.x / 32 % 4);
    float o[D / 8][4] = {}, s[WG_KEYS / 8][4], mx[2] = { -INFINITY, -INFINITY }, sum[2] = { 0.f, 0.f };
    uint32_t p[WG_KEYS / 16][4];
    if (!wt_wait<WT_BARS>(bar, WT_Q, 0, stall)) return;
    if (wg == 1) wg_turn(0, false);      /* warpgroup 0 issues first */
    for (int64_t j = 0; j < tiles; j++) {
        int st = (int)(j % WT_STAGES), pst = (int)((j + WT_STAGES - 1) % WT_STAGES);   /* K(j)'s, V(j-1)'s */
        if (!wt_wait<WT_BARS>(bar, WT_FULL + 2 * st, (unsigned)(j / WT_STAGES) & 1, stall) ||
            (j > 0 && !wt_wait<WT_BARS>(bar, WT_FULL + 2 * pst + 1, (unsigned)((j - 1) / WT_STAGES) & 1, stall)))
            return;
        wg_tile<T, D>(wg, j * WG_KEYS, j == 0, qs, kv + 2 * st * KB, kv + (2 * pst + 1) * KB, s, o, p, mx, sum, g0,
                      w0, g, [&] { if (lead) mbar_arrive(bar + WT_EMPTY + 2 * st); },
                      [&] { if (lead) mbar_arrive(bar + WT_EMPTY + 2 * pst + 1); });
    }
    int lst = (int)((tiles - 1) % WT_STAGES);
    if (!wt_wait<WT_BARS>(bar, WT_FULL + 2 * lst + 1, (unsigned)((tiles - 1) / WT_STAGES) & 1, stall)) return;
    wg_finish<T, D>(kv + (2 * lst + 1) * KB, s, o, p, mx, sum, out, lse, b, h, w0, g);
#endif
}

/* The forward's blocks: one per 128 query rows per batch and head. */
static inline unsigned wgmma_query_blocks(const mma_geom &g) { return mma_blocks(g, g.Tq, WG_ROWS); }

#endif
