/* Attention backward on Hopper's warpgroup MMA (sm_90a), bf16 and f16,
 * head dims 64 and 128: FlashAttention-3's block per key tile for dK and
 * dV, and a block per query tile for dQ, both two warpgroups of 64 rows
 * (wgmma's M) with the accumulators in registers.
 * dK/dV: a block owns 128 keys (64 per warpgroup) and walks 64-query tiles
 * of Q and dO: S^T = K Q^T and dP^T = V dO^T are wgmma m64n64k16 with both
 * operands in shared memory (K-major); P^T = exp2(S^T scale - lse) and
 * dS^T = P^T (dP^T - delta) are cuda_attention_mma.cuh's (its transposed
 * frame: a warp's rows are keys); dV += P^T dO and dK += dS^T Q take P^T
 * and dS^T from registers and dO and Q MN-major through the descriptor.
 * dQ: a block owns 128 queries and walks 64-key tiles of K and V: S = Q
 * K^T and dP = dO V^T from shared memory, dS = P (dP - delta), dQ += dS K
 * with K MN-major. So dQ needs no f32 workspace and no atomics, and every
 * output is written once, deterministically, as the mma.sync kernels do;
 * the price is S and dP computed twice, as there.
 * Tiles are the forward's 128-byte-swizzled panels, staged by the
 * kernels' own cp.async one tile ahead (wgmma_dkdv_kernel,
 * wgmma_dq_kernel) or loaded by TMA from a producer warpgroup through a
 * ring of stages (wgmma_tma_dkdv_kernel, wgmma_tma_dq_kernel, below);
 * both run the same tile steps (wgb_dkdv_tile, wgb_dq_tile) and stores.
 * lse (base 2) and delta = dO . O per query row come from
 * mma_stats_kernel. Every wgmma group is waited for before its registers
 * are read and before its tiles may be refilled. Outputs as mma_dq_kernel
 * and mma_dkdv_kernel write them.
 * Grouped-query attention as there: k and v may have H / G heads, query
 * head h reading kv head h / G; a dK/dV block walks the query tiles of its
 * kv head's G query heads one after another, dK and dV in registers the
 * whole way (K and V loaded once, no partials, no reduction after). The
 * only PTX is cuda_warp.cuh's, cuda_wgmma.cuh's and cuda_tma.cuh's, so
 * tests/test_wgmma_backward.cc runs this file on the CPU. */
#ifndef CUDA_ATTENTION_WGMMA_BWD_CUH
#define CUDA_ATTENTION_WGMMA_BWD_CUH

#include "cuda_attention_wgmma.cuh"

#define WGB_TILE 64    /* queries per tile of the dK/dV kernel, keys per tile of the dQ kernel */

/* Shared memory of the dK/dV kernel: K and V of the block's keys, then Q
 * and dO tiles twice, then the tiles' lse and delta twice. */
template <int D> __host__ __device__ constexpr size_t wgb_dkdv_smem() {
    return 2 * (size_t)wg_tile_bytes(WG_ROWS, D) + 4 * (size_t)wg_tile_bytes(WGB_TILE, D) + 4 * WGB_TILE * 4 + 1024;
}

/* Shared memory of the dQ kernel: Q and dO of the block's queries, then K
 * and V tiles twice. */
template <int D> __host__ __device__ constexpr size_t wgb_dq_smem() {
    return 2 * (size_t)wg_tile_bytes(WG_ROWS, D) + 4 * (size_t)wg_tile_bytes(WGB_TILE, D) + 1024;
}

#ifdef WG_CODE
/* acc (64 x N) = A B^T over D, in flight (no fence, no commit): A the 64
 * rows at a of a K-major tile whose panels are `arows` rows apart, B the N
 * rows of the K-major tile at b. */
template <typename T, int N, int D>
__device__ __forceinline__ void wgb_rows_times(float acc[N / 8][4], const unsigned char *a, int arows,
                                               const unsigned char *b) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        int off = kk % 4 * 32;
        wgmma_ss<N>(acc, wg_desc(a + kk / 4 * arows * 128 + off, 16), wg_desc(b + kk / 4 * N * 128 + off, 16), kk > 0,
                    T());
    }
}

/* acc (64 x D) += X (64 x K, packed in x) Y, Y the K rows of the tile at y
 * read MN-major, in flight. */
template <typename T, int D, int K>
__device__ __forceinline__ void wgb_regs_times(float acc[D / 8][4], const uint32_t x[K / 16][4],
                                               const unsigned char *y) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) wgmma_rs<D>(acc, x[kk], wg_desc(y + kk * 16 * 128, K * 128), 1, T());
}

/* Waits for this warpgroup's wgmma; nothing in a or b moves above it. */
template <int NA, int NB> __device__ __forceinline__ void wgb_wait(float a[NA / 8][4], float b[NB / 8][4]) {
    wgmma_wait<0>();
    wgmma_pin(&a[0][0], NA / 2);
    wgmma_pin(&b[0][0], NB / 2);
}

/* x's f32 C fragments (64 x K) as wgmma's A operand, k-step by k-step. */
template <typename T, int K>
__device__ __forceinline__ void wgb_pack(uint32_t a[K / 16][4], const float x[K / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) probs_operand<T>(a[kk], x, kk);
}
#endif

#ifdef WG_CODE
/* One query tile (from i0) of a dK/dV block, for warpgroup wg's 64 keys
 * from kw0: S^T and dP^T from K and V (ks, vs: the block's 128 keys) and
 * the tile's Q and dO (qs, gs), then dV += P^T dO and dK += dS^T Q; lrow
 * and drow the tile's lse and delta. Every wgmma it issues has completed
 * when it returns, so the tile's buffers are free. */
template <typename T, int D>
__device__ __forceinline__ void wgb_dkdv_tile(int wg, const unsigned char *ks, const unsigned char *vs,
                                              const unsigned char *qs, const unsigned char *gs, const float *lrow,
                                              const float *drow, int64_t i0, int64_t kw0, float dka[D / 8][4],
                                              float dva[D / 8][4], const mma_geom &g) {
    constexpr int QT = WGB_TILE;
    /* under a causal mask, a warpgroup whose keys all follow the tile's queries has nothing in it */
    if (g.causal && i0 + QT <= kw0) return;
    int64_t key0 = kw0 + 16 * (threadIdx.x / 32 % 4) + threadIdx.x % 32 / 4;
    float p[QT / 8][4], ds[QT / 8][4];
    uint32_t pa[QT / 16][4], da[QT / 16][4];
    wgmma_fence();
    wgb_rows_times<T, QT, D>(p, ks + wg * 64 * 128, WG_ROWS, qs);     /* S^T */
    wgb_rows_times<T, QT, D>(ds, vs + wg * 64 * 128, WG_ROWS, gs);    /* dP^T */
    wgmma_commit();
    wgb_wait<QT, QT>(p, ds);
    if (tile_unmasked(i0, QT, kw0, 64, g)) dkdv_scores<false, QT>(p, ds, key0, key0 + 8, i0, lrow, drow, g);
    else dkdv_scores<true, QT>(p, ds, key0, key0 + 8, i0, lrow, drow, g);
    wgb_pack<T, QT>(pa, p);
    wgb_pack<T, QT>(da, ds);
    wgmma_fence();
    wgb_regs_times<T, D, QT>(dva, pa, gs);
    wgb_regs_times<T, D, QT>(dka, da, qs);
    wgmma_commit();
    wgb_wait<D, D>(dva, dka);
    wgmma_pin(&pa[0][0], QT / 4);
    wgmma_pin(&da[0][0], QT / 4);
}

/* One key tile (from j0) of a dQ block, for warpgroup wg's 64 queries
 * from qw0: S and dP from the block's Q and dO (qs, gs) and the tile's K
 * and V (ks, vs), dS = P (dP - delta), then acc += dS K; rows the lse and
 * delta of this thread's rows (dq_scores's). As wgb_dkdv_tile, it returns
 * with its wgmma completed. */
template <typename T, int D>
__device__ __forceinline__ void wgb_dq_tile(int wg, const unsigned char *qs, const unsigned char *gs,
                                            const unsigned char *ks, const unsigned char *vs, int64_t j0,
                                            int64_t qw0, const float rows[4], float acc[D / 8][4],
                                            const mma_geom &g) {
    constexpr int KT = WGB_TILE;
    /* under a causal mask, a warpgroup whose rows all precede the tile sees none of it */
    if (g.causal && qw0 + 64 <= j0) return;
    int64_t r0 = qw0 + 16 * (threadIdx.x / 32 % 4) + threadIdx.x % 32 / 4;
    float s[KT / 8][4], dp[KT / 8][4];
    uint32_t sa[KT / 16][4];
    wgmma_fence();
    wgb_rows_times<T, KT, D>(s, qs + wg * 64 * 128, WG_ROWS, ks);     /* S */
    wgb_rows_times<T, KT, D>(dp, gs + wg * 64 * 128, WG_ROWS, vs);    /* dP */
    wgmma_commit();
    wgb_wait<KT, KT>(s, dp);
    if (tile_unmasked(qw0, 64, j0, KT, g)) dq_scores<false, KT>(s, dp, r0, r0 + 8, j0, rows, g);
    else dq_scores<true, KT>(s, dp, r0, r0 + 8, j0, rows, g);
    wgb_pack<T, KT>(sa, s);
    wgmma_fence();
    wgb_regs_times<T, D, KT>(acc, sa, ks);
    wgmma_commit();
    wgb_wait<D, KT>(acc, s);
    wgmma_pin(&sa[0][0], KT / 4);
}
#endif

/* The first query a dK/dV block of keys from j0 walks: under a causal
 * mask the queries before j0 see none of its keys. */
__device__ __forceinline__ int64_t wgb_first_query(const mma_geom &g, int64_t j0) { return g.causal ? j0 : 0; }

/* The end of the keys a dQ block of queries from i0 sees. */
__device__ __forceinline__ int64_t wgb_key_end(const mma_geom &g, int64_t i0) {
    return g.causal ? min(g.Tk, i0 + WG_ROWS) : g.Tk;
}

/* dK (times scale) and dV of this thread's rows of warpgroup keys from kw0. */
template <typename T, int D>
__device__ __forceinline__ void wgb_dkdv_store(const ds_kview &dk, const ds_kview &dv, int64_t b, int64_t kh,
                                               int64_t kw0, float dka[D / 8][4], float dva[D / 8][4],
                                               const mma_geom &g) {
    int64_t w0 = kw0 + 16 * (threadIdx.x / 32 % 4);
    store_rows<T, D>(dk, b, kh, w0, g.Tk, dka, g.scale, g.scale);
    store_rows<T, D>(dv, b, kh, w0, g.Tk, dva, 1.f, 1.f);
}

/* The lse (base 2) and delta of this thread's dQ rows r0 and r0 + 8 of
 * query head h (0 past the queries), from mma_stats_kernel's stats. */
__device__ __forceinline__ void wgb_dq_rows(float rows[4], const float *stats, int64_t b, int64_t h, int64_t r0,
                                            const mma_geom &g) {
    const float *L = stats + (b * g.H + h) * g.Tq, *Dl = L + g.B * g.H * g.Tq;
    for (int r = 0; r < 2; r++) {
        rows[r] = r0 + 8 * r < g.Tq ? L[r0 + 8 * r] : 0.f;
        rows[2 + r] = r0 + 8 * r < g.Tq ? Dl[r0 + 8 * r] : 0.f;
    }
}

/* dK and dV for a block of 128 keys of kv head kh, 64 per warpgroup, over
 * the query tiles that see them of each of the group's query heads in turn
 * (see the head of this file). */
template <typename T, int D>
__global__ void __launch_bounds__(WG_THREADS, 1)
wgmma_dkdv_kernel(ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k, ds_kview v, const float *stats,
                  mma_geom g) {
#ifdef WG_CODE
    constexpr int QT = WGB_TILE, KB = wg_tile_bytes(WG_ROWS, D), QB = wg_tile_bytes(QT, D);
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char *ks = smem + (-smem_addr(smem) & 1023), *vs = ks + KB, *qg = vs + KB;   /* buffer i: Q, dO */
    float *rows = (float *)(qg + 4 * QB);                  /* buffer i: lse of its queries, then delta */
    int wg = threadIdx.x / 128;
    int64_t b, kh, blk;
    block_task_of(g, g.H / g.G, (g.Tk + WG_ROWS - 1) / WG_ROWS, false, &b, &kh, &blk);
    int64_t j0 = blk * WG_ROWS, kw0 = j0 + 64 * wg;
    float dka[D / 8][4] = {}, dva[D / 8][4] = {};
    int64_t first = wgb_first_query(g, j0), h0 = kh * g.G, hend = h0 + g.G;
    auto fetch = [&](int buf, int64_t h, int64_t i0) {
        const float *L = stats + (b * g.H + h) * g.Tq, *Dl = L + g.B * g.H * g.Tq;
        wg_load_tile<T, D, QT>(qg + buf * 2 * QB, q, b, h, i0, g.Tq);
        wg_load_tile<T, D, QT>(qg + buf * 2 * QB + QB, dout, b, h, i0, g.Tq);
        if (threadIdx.x < 2 * QT) {     /* a float each: lse, then delta; zeros past the queries */
            int r = threadIdx.x % QT;
            bool real = i0 + r < g.Tq;
            cp_async_4(rows + buf * 2 * QT + threadIdx.x, (threadIdx.x < QT ? L : Dl) + (real ? i0 + r : 0), real);
        }
        cp_async_commit();
    };
    wg_load_tile<T, D, WG_ROWS>(ks, k, b, kh, j0, g.Tk);
    wg_load_tile<T, D, WG_ROWS>(vs, v, b, kh, j0, g.Tk);
    cp_async_commit();
    if (first < g.Tq) fetch(0, h0, first);
    /* the group's query heads one after another, the next tile fetched one ahead */
    for (int64_t h = h0, it = 0; h < hend; h++)
        for (int64_t i0 = first; i0 < g.Tq; i0 += QT, it++) {
            int buf = (int)(it & 1);
            const unsigned char *qs = qg + buf * 2 * QB;
            const float *lrow = rows + buf * 2 * QT;
            cp_async_wait(0);                 /* this tile (and K, V) */
            fence_proxy_async();
            __syncthreads();                  /* ... landed for all; the last tile's wgmma all done */
            bool last = i0 + QT >= g.Tq;      /* a head's last tile: the next head's first comes next */
            if (!last || h + 1 < hend) fetch(buf ^ 1, h + last, last ? first : i0 + QT);
            wgb_dkdv_tile<T, D>(wg, ks, vs, qs, qs + QB, lrow, lrow + QT, i0, kw0, dka, dva, g);
        }
    wgb_dkdv_store<T, D>(dk, dv, b, kh, kw0, dka, dva, g);
#endif
}

/* dQ for a block of 128 queries, 64 per warpgroup, over the key tiles they
 * see: dS = P (dO V^T - delta), dQ += dS K; times scale at the end. */
template <typename T, int D>
__global__ void __launch_bounds__(WG_THREADS, 1)
wgmma_dq_kernel(ds_kview dq, ds_kview dout, ds_kview q, ds_kview k, ds_kview v, const float *stats, mma_geom g) {
#ifdef WG_CODE
    constexpr int KT = WGB_TILE, QB = wg_tile_bytes(WG_ROWS, D), KB = wg_tile_bytes(KT, D);
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char *qs = smem + (-smem_addr(smem) & 1023), *gs = qs + QB, *kv = gs + QB;   /* buffer i: K, V */
    int wg = threadIdx.x / 128;
    int64_t b, h, blk;
    block_task(g, (g.Tq + WG_ROWS - 1) / WG_ROWS, g.causal, &b, &h, &blk);
    int64_t i0 = blk * WG_ROWS, qw0 = i0 + 64 * wg, kh = wg_kv_head(g, h), kend = wgb_key_end(g, i0);
    float rows[4], acc[D / 8][4] = {};
    wgb_dq_rows(rows, stats, b, h, qw0 + 16 * (threadIdx.x / 32 % 4) + threadIdx.x % 32 / 4, g);
    wg_load_tile<T, D, WG_ROWS>(qs, q, b, h, i0, g.Tq);
    wg_load_tile<T, D, WG_ROWS>(gs, dout, b, h, i0, g.Tq);
    wg_load_tile<T, D, KT>(kv, k, b, kh, 0, g.Tk);
    wg_load_tile<T, D, KT>(kv + KB, v, b, kh, 0, g.Tk);
    cp_async_commit();
    for (int64_t j0 = 0, it = 0; j0 < kend; j0 += KT, it++) {
        const unsigned char *ks = kv + (it & 1) * 2 * KB;
        cp_async_wait(0);
        fence_proxy_async();
        __syncthreads();
        if (j0 + KT < kend) {
            wg_load_tile<T, D, KT>(kv + (~it & 1) * 2 * KB, k, b, kh, j0 + KT, g.Tk);
            wg_load_tile<T, D, KT>(kv + (~it & 1) * 2 * KB + KB, v, b, kh, j0 + KT, g.Tk);
            cp_async_commit();
        }
        wgb_dq_tile<T, D>(wg, qs, gs, ks, ks + KB, j0, qw0, rows, acc, g);
    }
    store_rows<T, D>(dq, b, h, qw0 + 16 * (threadIdx.x / 32 % 4), g.Tq, acc, g.scale, g.scale);
#endif
}

/* ---- the backward fed by TMA ----
 * The forward's warp specialisation (cuda_attention_wgmma.cuh): a
 * producer warpgroup first in the block (setmaxnreg down) loads, by TMA,
 * the block's own tiles once (dK/dV: K and V; dQ: Q and dO) and then the
 * streamed tiles (dK/dV: Q and dO per query tile; dQ: K and V per key
 * tile) into a ring of WTB_STAGES stages, each with a "full" and an
 * "empty" mbarrier; the two consumer warpgroups run the tile steps above.
 * A consumer warpgroup's first thread arrives on "empty" once the tile
 * step returned, its wgmma reading the stage all completed. In the dK/dV
 * kernel the producer's first warp also copies the tile's lse and delta
 * rows into the stage with plain loads (mma_stats_kernel's rows are Tq
 * floats apart, not the multiple of 16 bytes TMA needs), each lane
 * arriving on "full" after its stores. Streamed tiles are 64 rows: every map has boxes of
 * WGB_TILE rows, two per panel of a 128-row tile. */
#define WTB_STAGES 2
#define WTB_ONCE 0                        /* mbarriers: the block's own tiles, */
#define WTB_FULL 1                        /* full[stage], */
#define WTB_EMPTY (1 + WTB_STAGES)        /* empty[stage] */
#define WTB_BARS (1 + 2 * WTB_STAGES)     /* then the block's stall flag (wt_wait) */

/* Tensor maps of q, k, v and dO (wt_map, WGB_TILE rows a box). */
struct wtb_maps { CUtensorMap q, k, v, dout; };

/* Shared memory of the TMA dK/dV kernel: K and V, the stages' Q and dO,
 * the stages' lse and delta rows, the mbarriers. */
template <int D> __host__ __device__ constexpr size_t wtb_dkdv_smem() {
    return 2 * (size_t)wg_tile_bytes(WG_ROWS, D) +
           WTB_STAGES * (2 * (size_t)wg_tile_bytes(WGB_TILE, D) + 2 * WGB_TILE * 4) + 8 * (WTB_BARS + 1) + 1024;
}

/* Shared memory of the TMA dQ kernel: Q and dO, the stages' K and V, the mbarriers. */
template <int D> __host__ __device__ constexpr size_t wtb_dq_smem() {
    return 2 * (size_t)wg_tile_bytes(WG_ROWS, D) + WTB_STAGES * 2 * (size_t)wg_tile_bytes(WGB_TILE, D) +
           8 * (WTB_BARS + 1) + 1024;
}

#ifdef WG_CODE
/* ROWS rows from t0 of head h of batch b through map m into the swizzled
 * tile at dst, completing on bar: per 64-column panel, boxes of WGB_TILE rows. */
template <int D, int ROWS>
__device__ __forceinline__ void wtb_load(unsigned char *dst, const CUtensorMap *m, uint64_t *bar, int64_t t0,
                                         int64_t h, int64_t b) {
    for (int c = 0; c < D / 64; c++)
        for (int r = 0; r < ROWS; r += WGB_TILE)
            tma_load_4d(dst + c * ROWS * 128 + r * 128, m, bar, 64 * c, (int)(t0 + r), (int)h, (int)b);
}

/* Initialises the mbarriers (full: `full` arrivals, empty: one per
 * consumer warpgroup) for all threads, then lowers the producer
 * warpgroup's registers or raises the consumers'; true in the producer. */
__device__ __forceinline__ bool wtb_start(uint64_t *bar, unsigned full, wt_kernel kernel) {
    wt_bars_init<WTB_BARS>(bar, [full](int i) {
        return i == WTB_ONCE ? 1u : i < WTB_EMPTY ? full : (unsigned)WG_GROUPS;
    }, kernel);
    if (threadIdx.x < 128) {
        setmaxnreg_dec<WT_PRODUCER_REGS>();
        return true;
    }
    setmaxnreg_inc<WT_CONSUMER_REGS>();
    return false;
}

/* Stage and parity of the it-th streamed tile. */
__device__ __forceinline__ int wtb_stage(int64_t it) { return (int)(it % WTB_STAGES); }
__device__ __forceinline__ unsigned wtb_parity(int64_t it) { return (unsigned)(it / WTB_STAGES) & 1; }

/* The dK/dV producer's first warp: K and V, then per query tile of the
 * group's heads Q, dO (by lane 0) and the lse and delta rows (each lane
 * two of each) into the next stage once the consumers emptied it. */
template <int D>
__device__ __forceinline__ void wtb_dkdv_produce(const wtb_maps &m, const float *stats, unsigned char *ks,
                                                 unsigned char *qg, float *rows, uint64_t *bar, wt_stall *stall,
                                                 int64_t b, int64_t kh, int64_t j0, const mma_geom &g) {
    constexpr int QT = WGB_TILE, KB = wg_tile_bytes(WG_ROWS, D), QB = wg_tile_bytes(QT, D);
    int l = threadIdx.x;
    if (l == 0) {
        mbar_arrive_expect_tx(bar + WTB_ONCE, 2 * KB);
        wtb_load<D, WG_ROWS>(ks, &m.k, bar + WTB_ONCE, j0, kh, b);
        wtb_load<D, WG_ROWS>(ks + KB, &m.v, bar + WTB_ONCE, j0, kh, b);
    }
    int64_t it = 0;
    for (int64_t h = kh * g.G; h < (kh + 1) * g.G; h++)
        for (int64_t i0 = wgb_first_query(g, j0); i0 < g.Tq; i0 += QT, it++) {
            int st = wtb_stage(it);
            uint64_t *full = bar + WTB_FULL + st;
            const float *L = stats + (b * g.H + h) * g.Tq, *Dl = L + g.B * g.H * g.Tq;
            float *lrow = rows + st * 2 * QT;
            if (!wt_wait<WTB_BARS>(bar, WTB_EMPTY + st, wtb_parity(it) ^ 1, stall)) return;
            for (int r = l; r < QT; r += 32) {     /* zeros past the queries */
                lrow[r] = i0 + r < g.Tq ? L[i0 + r] : 0.f;
                lrow[QT + r] = i0 + r < g.Tq ? Dl[i0 + r] : 0.f;
            }
            if (l == 0) {
                mbar_arrive_expect_tx(full, 2 * QB);
                wtb_load<D, QT>(qg + st * 2 * QB, &m.q, full, i0, h, b);
                wtb_load<D, QT>(qg + st * 2 * QB + QB, &m.dout, full, i0, h, b);
            } else {
                mbar_arrive(full);
            }
        }
}

/* The dQ producer's one thread: Q and dO, then K and V per key tile. */
template <int D>
__device__ __forceinline__ void wtb_dq_produce(const wtb_maps &m, unsigned char *qs, unsigned char *kv,
                                               uint64_t *bar, wt_stall *stall, int64_t b, int64_t h, int64_t kh,
                                               int64_t i0, const mma_geom &g) {
    constexpr int KT = WGB_TILE, QB = wg_tile_bytes(WG_ROWS, D), KB = wg_tile_bytes(KT, D);
    mbar_arrive_expect_tx(bar + WTB_ONCE, 2 * QB);
    wtb_load<D, WG_ROWS>(qs, &m.q, bar + WTB_ONCE, i0, h, b);
    wtb_load<D, WG_ROWS>(qs + QB, &m.dout, bar + WTB_ONCE, i0, h, b);
    int64_t kend = wgb_key_end(g, i0);
    for (int64_t j0 = 0, it = 0; j0 < kend; j0 += KT, it++) {
        int st = wtb_stage(it);
        uint64_t *full = bar + WTB_FULL + st;
        if (!wt_wait<WTB_BARS>(bar, WTB_EMPTY + st, wtb_parity(it) ^ 1, stall)) return;
        mbar_arrive_expect_tx(full, 2 * KB);
        wtb_load<D, KT>(kv + st * 2 * KB, &m.k, full, j0, kh, b);
        wtb_load<D, KT>(kv + st * 2 * KB + KB, &m.v, full, j0, kh, b);
    }
}
#endif

/* dK and dV as wgmma_dkdv_kernel, its tiles by TMA from a producer warpgroup. */
template <typename T, int D>
__global__ void __launch_bounds__(WT_THREADS, 1)
wgmma_tma_dkdv_kernel(ds_kview dk, ds_kview dv, const __grid_constant__ wtb_maps m, const float *stats, mma_geom g,
                      wt_stall *stall) {
#ifdef WG_CODE
    constexpr int QT = WGB_TILE, KB = wg_tile_bytes(WG_ROWS, D), QB = wg_tile_bytes(QT, D);
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char *ks = smem + (-smem_addr(smem) & 1023), *qg = ks + 2 * KB;   /* stage i: Q, dO at qg + 2 i QB */
    float *rows = (float *)(qg + WTB_STAGES * 2 * QB);                        /* stage i: lse, delta */
    uint64_t *bar = (uint64_t *)(rows + WTB_STAGES * 2 * QT);
    int64_t b, kh, blk;
    block_task_of(g, g.H / g.G, (g.Tk + WG_ROWS - 1) / WG_ROWS, false, &b, &kh, &blk);
    int64_t j0 = blk * WG_ROWS;
    if (wtb_start(bar, 32, WT_KERNEL_DKDV)) {
        if (threadIdx.x < 32) wtb_dkdv_produce<D>(m, stats, ks, qg, rows, bar, stall, b, kh, j0, g);
        return;
    }
    int wg = threadIdx.x / 128 - 1;
    bool lead = threadIdx.x % 128 == 0;   /* arrives on "empty" for its warpgroup */
    int64_t kw0 = j0 + 64 * wg;
    float dka[D / 8][4] = {}, dva[D / 8][4] = {};
    if (!wt_wait<WTB_BARS>(bar, WTB_ONCE, 0, stall)) return;
    int64_t it = 0;
    for (int64_t h = kh * g.G; h < (kh + 1) * g.G; h++)
        for (int64_t i0 = wgb_first_query(g, j0); i0 < g.Tq; i0 += QT, it++) {
            int st = wtb_stage(it);
            const unsigned char *qs = qg + st * 2 * QB;
            const float *lrow = rows + st * 2 * QT;
            if (!wt_wait<WTB_BARS>(bar, WTB_FULL + st, wtb_parity(it), stall)) return;
            wgb_dkdv_tile<T, D>(wg, ks, ks + KB, qs, qs + QB, lrow, lrow + QT, i0, kw0, dka, dva, g);
            if (lead) mbar_arrive(bar + WTB_EMPTY + st);
        }
    wgb_dkdv_store<T, D>(dk, dv, b, kh, kw0, dka, dva, g);
#endif
}

/* dQ as wgmma_dq_kernel, its tiles by TMA from a producer warpgroup. */
template <typename T, int D>
__global__ void __launch_bounds__(WT_THREADS, 1)
wgmma_tma_dq_kernel(ds_kview dq, const __grid_constant__ wtb_maps m, const float *stats, mma_geom g,
                    wt_stall *stall) {
#ifdef WG_CODE
    constexpr int KT = WGB_TILE, QB = wg_tile_bytes(WG_ROWS, D), KB = wg_tile_bytes(KT, D);
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char *qs = smem + (-smem_addr(smem) & 1023), *kv = qs + 2 * QB;   /* stage i: K, V at kv + 2 i KB */
    uint64_t *bar = (uint64_t *)(kv + WTB_STAGES * 2 * KB);
    int64_t b, h, blk;
    block_task(g, (g.Tq + WG_ROWS - 1) / WG_ROWS, g.causal, &b, &h, &blk);
    int64_t i0 = blk * WG_ROWS, kh = wg_kv_head(g, h), kend = wgb_key_end(g, i0);
    if (wtb_start(bar, 1, WT_KERNEL_DQ)) {
        if (threadIdx.x == 0) wtb_dq_produce<D>(m, qs, kv, bar, stall, b, h, kh, i0, g);
        return;
    }
    int wg = threadIdx.x / 128 - 1;
    bool lead = threadIdx.x % 128 == 0;
    int64_t qw0 = i0 + 64 * wg;
    float rows[4], acc[D / 8][4] = {};
    wgb_dq_rows(rows, stats, b, h, qw0 + 16 * (threadIdx.x / 32 % 4) + threadIdx.x % 32 / 4, g);
    if (!wt_wait<WTB_BARS>(bar, WTB_ONCE, 0, stall)) return;
    for (int64_t j0 = 0, it = 0; j0 < kend; j0 += KT, it++) {
        int st = wtb_stage(it);
        if (!wt_wait<WTB_BARS>(bar, WTB_FULL + st, wtb_parity(it), stall)) return;
        wgb_dq_tile<T, D>(wg, qs, qs + QB, kv + st * 2 * KB, kv + st * 2 * KB + KB, j0, qw0, rows, acc, g);
        if (lead) mbar_arrive(bar + WTB_EMPTY + st);
    }
    store_rows<T, D>(dq, b, h, qw0 + 16 * (threadIdx.x / 32 % 4), g.Tq, acc, g.scale, g.scale);
#endif
}

/* The dK/dV kernel's blocks (128 keys each, per kv head) and the dQ kernel's (128 queries). */
static inline unsigned wgmma_dkdv_blocks(const mma_geom &g) { return mma_blocks_of(g, g.H / g.G, g.Tk, WG_ROWS); }
static inline unsigned wgmma_dq_blocks(const mma_geom &g) { return mma_blocks(g, g.Tq, WG_ROWS); }

#endif
