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
 * Tiles are the forward's 128-byte-swizzled panels (wg_load_tile), staged
 * by cp.async one tile ahead. lse (base 2) and delta = dO . O per query
 * row come from mma_stats_kernel. Every wgmma group is waited for before
 * its registers are read and before the barrier that lets its tiles be
 * refilled. Outputs as mma_dq_kernel and mma_dkdv_kernel write them.
 * Grouped-query attention as there: k and v may have H / G heads, query
 * head h reading kv head h / G; a dK/dV block walks the query tiles of its
 * kv head's G query heads one after another, dK and dV in registers the
 * whole way (K and V loaded once, no partials, no reduction after). The
 * only PTX is cuda_warp.cuh's and cuda_wgmma.cuh's, so
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
    int wg = threadIdx.x / 128, l = threadIdx.x % 32;
    int64_t b, kh, blk;
    block_task_of(g, g.H / g.G, (g.Tk + WG_ROWS - 1) / WG_ROWS, false, &b, &kh, &blk);
    int64_t j0 = blk * WG_ROWS, kw0 = j0 + 64 * wg, key0 = kw0 + 16 * (threadIdx.x / 32 % 4) + l / 4;
    float dka[D / 8][4] = {}, dva[D / 8][4] = {}, p[QT / 8][4], ds[QT / 8][4];
    uint32_t pa[QT / 16][4], da[QT / 16][4];
    /* under a causal mask the queries before this block see none of its keys */
    int64_t first = g.causal ? j0 : 0, h0 = kh * g.G, hend = h0 + g.G;
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
            const unsigned char *qs = qg + buf * 2 * QB, *gs = qs + QB;
            const float *lrow = rows + buf * 2 * QT, *drow = lrow + QT;
            cp_async_wait(0);                 /* this tile (and K, V) */
            fence_proxy_async();
            __syncthreads();                  /* ... landed for all; the last tile's wgmma all done */
            bool last = i0 + QT >= g.Tq;      /* a head's last tile: the next head's first comes next */
            if (!last || h + 1 < hend) fetch(buf ^ 1, h + last, last ? first : i0 + QT);
            /* under a causal mask, a warpgroup whose keys all follow the tile's queries has nothing in it */
            if (g.causal && i0 + QT <= kw0) continue;
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
    int64_t w0 = kw0 + 16 * (threadIdx.x / 32 % 4);
    store_rows<T, D>(dk, b, kh, w0, g.Tk, dka, g.scale, g.scale);
    store_rows<T, D>(dv, b, kh, w0, g.Tk, dva, 1.f, 1.f);
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
    int wg = threadIdx.x / 128, l = threadIdx.x % 32;
    int64_t b, h, blk;
    block_task(g, (g.Tq + WG_ROWS - 1) / WG_ROWS, g.causal, &b, &h, &blk);
    int64_t i0 = blk * WG_ROWS, qw0 = i0 + 64 * wg, w0 = qw0 + 16 * (threadIdx.x / 32 % 4), r0 = w0 + l / 4;
    int64_t kh = wg_kv_head(g, h);
    const float *L = stats + (b * g.H + h) * g.Tq, *Dl = L + g.B * g.H * g.Tq;
    float rows[4];                    /* lse (base 2) of rows r0 and r0 + 8, then their delta */
    for (int r = 0; r < 2; r++) {
        rows[r] = r0 + 8 * r < g.Tq ? L[r0 + 8 * r] : 0.f;
        rows[2 + r] = r0 + 8 * r < g.Tq ? Dl[r0 + 8 * r] : 0.f;
    }
    float acc[D / 8][4] = {}, s[KT / 8][4], dp[KT / 8][4];
    uint32_t sa[KT / 16][4];
    int64_t kend = g.causal ? min(g.Tk, i0 + WG_ROWS) : g.Tk;
    wg_load_tile<T, D, WG_ROWS>(qs, q, b, h, i0, g.Tq);
    wg_load_tile<T, D, WG_ROWS>(gs, dout, b, h, i0, g.Tq);
    wg_load_tile<T, D, KT>(kv, k, b, kh, 0, g.Tk);
    wg_load_tile<T, D, KT>(kv + KB, v, b, kh, 0, g.Tk);
    cp_async_commit();
    for (int64_t j0 = 0, it = 0; j0 < kend; j0 += KT, it++) {
        const unsigned char *ks = kv + (it & 1) * 2 * KB, *vs = ks + KB;
        cp_async_wait(0);
        fence_proxy_async();
        __syncthreads();
        if (j0 + KT < kend) {
            wg_load_tile<T, D, KT>(kv + (~it & 1) * 2 * KB, k, b, kh, j0 + KT, g.Tk);
            wg_load_tile<T, D, KT>(kv + (~it & 1) * 2 * KB + KB, v, b, kh, j0 + KT, g.Tk);
            cp_async_commit();
        }
        /* under a causal mask, a warpgroup whose rows all precede the tile sees none of it */
        if (g.causal && qw0 + 64 <= j0) continue;
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
    store_rows<T, D>(dq, b, h, w0, g.Tq, acc, g.scale, g.scale);
#endif
}

/* The dK/dV kernel's blocks (128 keys each, per kv head) and the dQ kernel's (128 queries). */
static inline unsigned wgmma_dkdv_blocks(const mma_geom &g) { return mma_blocks_of(g, g.H / g.G, g.Tk, WG_ROWS); }
static inline unsigned wgmma_dq_blocks(const mma_geom &g) { return mma_blocks(g, g.Tq, WG_ROWS); }

#endif
