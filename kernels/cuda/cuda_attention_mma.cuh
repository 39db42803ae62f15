/* Attention on tensor cores for bf16 and f16 with head dims 64 and 128:
 * FlashAttention-2's tiling on mma.sync m16n8k16 (f32 accumulation); f32
 * the same on m16n8k8, either in TF32 (operands rounded by cvt.rna, sums
 * in f32) for the callers that allow TF32, or in 3xTF32 (T = tf32x3: each
 * operand split into two TF32 parts, three mma per product) for those
 * that keep f32's accuracy. The element type T picks the mma.
 * A block of 4 warps owns rows of one side (queries, or keys in the dK/dV
 * kernel), 32 per warp (each fragment of the other side feeds two mma; 16
 * in the dK/dV kernel at D = 128, and in 3xTF32's dQ kernel there, whose
 * accumulators fill the registers), and walks tiles of the other side
 * staged in shared memory; every product is a warp's rows times a tile, so
 * no warp waits on another's partial sums.
 * Scores live in registers, scaled by log2(e) so the exponentials are exp2.
 * Backward gathers each query row's lse (base 2) and delta = dO . O, then
 * runs two kernels, deterministic, without atomics: dK and dV per key block
 * (walking query tiles), dQ per query block (walking key tiles); each
 * rebuilds P from q, k and the lse.
 * Grouped-query attention: k and v may have H / G heads, query head h
 * reading kv head h / G. A dK/dV block walks the query tiles of its kv
 * head's G query heads one after another, its sums in registers the whole
 * way: no per-query-head partials in memory, no reduction after, and K and
 * V loaded once for the group.
 * Views need unit stride on the head dim, the other strides a multiple of 16
 * bytes and 16-byte aligned data (128-bit loads); ds_cuda_attention_mma_fits
 * says whether a call qualifies, and cuda_attention.cu runs the rest.
 * The only PTX is cuda_warp.cuh's, so tests/test_attention_mma.cc runs this
 * file on the CPU through tests/warp_emulator.h. */
#ifndef CUDA_ATTENTION_MMA_CUH
#define CUDA_ATTENTION_MMA_CUH

#ifndef DS_WARP_EMULATOR
#include "cuda_warp.cuh"    /* tests/warp_emulator.h supplies these on the CPU */
#endif
#include "../ds_kview.h"

#include <math.h>

#define MMA_WARPS 4
#define MMA_THREADS (MMA_WARPS * 32)
/* Rows of a block whose warps own `frags` 16-row fragments each. */
#define MMA_BLOCK_ROWS(frags) (MMA_WARPS * 16 * (frags))

#define LOG2E 1.4426950408889634f

/* f32 data taken in 3xTF32: a float in memory and in shared tiles, whose
 * mma operands are split as they load (tf32_split). */
struct tf32x3 {
    float f;
    __host__ __device__ operator float() const { return f; }
};

/* Registers an mma operand value takes: two TF32 parts in 3xTF32, else one. */
template <typename T> __host__ __device__ constexpr int mma_parts() { return 1; }
template <> __host__ __device__ constexpr int mma_parts<tf32x3>() { return 2; }

typedef struct {
    int64_t B, H, Tq, Tk;
    int causal;
    float scale;        /* the softmax scale */
    float scale_log2;   /* scale * log2(e): scores in base 2 */
    int64_t G;          /* query heads per key/value head */
} mma_geom;

/* ---- warp-level building blocks ---- */

/* Elements of T in 16 bytes: a cp.async copy, a row of an ldmatrix
 * matrix, and the padding of each shared row (ldmatrix's 8 rows then hit
 * distinct banks). */
template <typename T> __host__ __device__ constexpr int mma_chunk() { return 16 / (int)sizeof(T); }

/* A shared tile's row stride: D elements and the padding. */
template <typename T, int D> __host__ __device__ constexpr int mma_ld() { return D + mma_chunk<T>(); }

/* The k of one mma: 16 for 16-bit inputs (m16n8k16), 8 for TF32 (m16n8k8). */
template <typename T> __host__ __device__ constexpr int mma_k() { return 2 * mma_chunk<T>(); }

/* Splits the f32 x in each of r[0..3] for 3xTF32: r[i] becomes big = x
 * rounded to TF32, r[i + 4] small = x - big (exact in f32) rounded to
 * TF32, so x - big - small is within 2^-22 |x| (2^-137 where x - big is
 * below f32's normal range). In registers, so the tiles stay f32. */
__device__ __forceinline__ void tf32_split(uint32_t r[8]) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float x = __uint_as_float(r[i]);
        r[i] = tf32_of(r[i]);
        r[i + 4] = tf32_of(__float_as_uint(x - __uint_as_float(r[i])));
    }
}

/* The A operand (16 rows x mma_k columns from column k0) of a row-major
 * shared tile with row stride ld. ldmatrix hands lane l row l/4 and the
 * 4 bytes at 4 (l%4) of each 16-byte row: a 16-bit pair, or one f32,
 * either way the mma's A layout. TF32 tiles are rounded already
 * (tf32_landed); 3xTF32 splits here, into a[4..7]. */
template <typename T>
__device__ __forceinline__ void load_a(uint32_t a[4 * mma_parts<T>()], const T *s, int ld, int row0, int k0) {
    int l = threadIdx.x % 32;
    ldsm_x4(a, s + (row0 + l % 16) * ld + k0 + l / 16 * mma_chunk<T>());
    if constexpr (mma_parts<T>() == 2) tf32_split(a);
}

/* B operands of two 8-column tiles (n0.., n0+8..) over k0..k0+mma_k-1,
 * from a tile stored [n][k] (the keys of S = Q K^T): b[0..1] and b[2..3]
 * (3xTF32: their small parts in b[4..7]). */
template <typename T>
__device__ __forceinline__ void load_b_nk(uint32_t b[4 * mma_parts<T>()], const T *s, int ld, int n0, int k0) {
    int l = threadIdx.x % 32;
    ldsm_x4(b, s + (n0 + l % 8 + l / 16 * 8) * ld + k0 + (l / 8 % 2) * mma_chunk<T>());
    if constexpr (mma_parts<T>() == 2) tf32_split(b);
}

/* The same from a tile stored [k][n] (V in O = P V): transposed loads. A
 * 32-bit element cannot be transposed by ldmatrix, so TF32 loads its four
 * values itself: row k0 + 2t as the mma's k index t and row k0 + 2t + 1 as
 * t + 4 (g = l/4, t = l%4), the order probs_operand gives P's columns in;
 * rows 2t lie 8 banks apart (mma_ld pads a row by 4 words), so the 32
 * lanes hit 32 banks. */
template <typename T>
__device__ __forceinline__ void load_b_kn(uint32_t b[4 * mma_parts<T>()], const T *s, int ld, int k0, int n0) {
    int l = threadIdx.x % 32;
    if constexpr (sizeof(T) == 4) {
        const float *p = (const float *)s + (k0 + 2 * (l % 4)) * ld + n0 + l / 4;
        b[0] = __float_as_uint(p[0]), b[1] = __float_as_uint(p[ld]);
        b[2] = __float_as_uint(p[8]), b[3] = __float_as_uint(p[ld + 8]);
        if constexpr (mma_parts<T>() == 2) tf32_split(b);
    } else {
        ldsm_x4_trans(b, s + (k0 + l % 8 + (l / 8 % 2) * 8) * ld + n0 + l / 16 * 8);
    }
}

/* x rounded to TF32, still an f32. */
__device__ __forceinline__ float tf32_value(float x) { return __uint_as_float(tf32_of(__float_as_uint(x))); }

/* Columns k0 = kk mma_k.. of a fragment's probabilities p (the f32 C
 * tiles of rows_times_tile) as an A operand. 16-bit: the C layout of two
 * 8-column tiles is the A layout of one k16 step, packed in pairs. TF32:
 * one C tile, whose lane holds columns 2t and 2t + 1 where A wants t and
 * t + 4; the sum over k does not care which column is which k index as
 * long as B agrees, so column 2t goes as t and 2t + 1 as t + 4 (load_b_kn).
 * 3xTF32: the same columns, split. */
template <typename T>
__device__ __forceinline__ void probs_operand(uint32_t a[4 * mma_parts<T>()], const float p[][4], int kk) {
    if constexpr (mma_parts<T>() == 2) {
        a[0] = __float_as_uint(p[kk][0]), a[1] = __float_as_uint(p[kk][2]);
        a[2] = __float_as_uint(p[kk][1]), a[3] = __float_as_uint(p[kk][3]);
        tf32_split(a);
    } else if constexpr (sizeof(T) == 4) {
        a[0] = tf32_of(__float_as_uint(p[kk][0])), a[1] = tf32_of(__float_as_uint(p[kk][2]));
        a[2] = tf32_of(__float_as_uint(p[kk][1])), a[3] = tf32_of(__float_as_uint(p[kk][3]));
    } else {
        a[0] = pack2(p[2 * kk][0], p[2 * kk][1], T());
        a[1] = pack2(p[2 * kk][2], p[2 * kk][3], T());
        a[2] = pack2(p[2 * kk + 1][0], p[2 * kk + 1][1], T());
        a[3] = pack2(p[2 * kk + 1][2], p[2 * kk + 1][3], T());
    }
}

/* Two f32 into adjacent elements of T at x, one 4- or 8-byte store. */
template <typename T> __device__ __forceinline__ void store2(T *x, float lo, float hi) {
    if constexpr (sizeof(T) == 4) *(float2 *)x = make_float2(lo, hi);
    else *(uint32_t *)x = pack2(lo, hi, T());
}

/* c[m][n] += a[m] b[0..1] and c[m][n + 1] += a[m] b[2..3] for each of M
 * fragments: the two 8-column tiles one ldmatrix.x4 of B feeds. 3xTF32
 * adds a's small part times b's big, a's big times b's small, then big
 * times big (CUTLASS's order); small times small, within 2^-22 of the
 * product, is left out. */
template <typename T, int M, int W>
__device__ __forceinline__ void mma_b_pair(float c[][W][4], int n, const uint32_t a[][4 * mma_parts<T>()],
                                           const uint32_t b[4 * mma_parts<T>()]) {
#pragma unroll
    for (int m = 0; m < M; m++) {
        if constexpr (mma_parts<T>() == 2) {
            mma(c[m][n], a[m] + 4, b[0], b[1], float());
            mma(c[m][n + 1], a[m] + 4, b[2], b[3], float());
            mma(c[m][n], a[m], b[4], b[5], float());
            mma(c[m][n + 1], a[m], b[6], b[7], float());
            mma(c[m][n], a[m], b[0], b[1], float());
            mma(c[m][n + 1], a[m], b[2], b[3], float());
        } else {
            mma(c[m][n], a[m], b[0], b[1], T());
            mma(c[m][n + 1], a[m], b[2], b[3], T());
        }
    }
}

/* c[m] (16 x N) = A[16 x D] B^T for the M 16-row fragments of A from
 * row0 (rows row0 + 16 m.. of `as`), B the N rows of `bs` (both row-major
 * [row][D]); each B fragment is loaded once for all M. */
template <typename T, int D, int M = 1, int N = 64>
__device__ __forceinline__ void rows_times_tile(float c[][N / 8][4], const T *as, int row0, const T *bs) {
    const int ld = mma_ld<T, D>(), ks = mma_k<T>();
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int n = 0; n < N / 8; n++) c[m][n][0] = c[m][n][1] = c[m][n][2] = c[m][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / ks; kk++) {
        uint32_t a[M][4 * mma_parts<T>()];
#pragma unroll
        for (int m = 0; m < M; m++) load_a(a[m], as, ld, row0 + 16 * m, kk * ks);
#pragma unroll
        for (int n2 = 0; n2 < N / 16; n2++) {
            uint32_t b[4 * mma_parts<T>()];
            load_b_nk(b, bs, ld, n2 * 16, kk * ks);
            mma_b_pair<T, M>(c, 2 * n2, a, b);
        }
    }
}

/* acc[m] (16 x D) += P[m] (16 x K) X for M fragments, P in registers as
 * the f32 result of rows_times_tile (probs_operand), X the K rows of `xs`,
 * row-major [row][D]; each X fragment is loaded once for all M. */
template <typename T, int D, int M = 1, int K = 64>
__device__ __forceinline__ void probs_times_tile(float acc[][D / 8][4], const float p[][K / 8][4], const T *xs) {
    const int ld = mma_ld<T, D>(), ks = mma_k<T>();
#pragma unroll
    for (int kk = 0; kk < K / ks; kk++) {
        uint32_t a[M][4 * mma_parts<T>()];
#pragma unroll
        for (int m = 0; m < M; m++) probs_operand<T>(a[m], p[m], kk);
#pragma unroll
        for (int n2 = 0; n2 < D / 16; n2++) {
            uint32_t b[4 * mma_parts<T>()];
            load_b_kn(b, xs, ld, kk * ks, n2 * 16);
            mma_b_pair<T, M>(acc, 2 * n2, a, b);
        }
    }
}

/* Starts copying rows t0..t0+ROWS-1 of x[b, h] into a shared tile, 16
 * bytes per cp.async; rows at or past `end` are filled with zeros. The copy
 * lands after cp_async_wait and a barrier, so the next tile streams in
 * while the block computes on the current one. */
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_tile(T *s, const ds_kview &x, int64_t b, int64_t h, int64_t t0, int64_t end) {
    const int ld = mma_ld<T, D>(), ch = mma_chunk<T>(), chunks = D / ch;
    const T *base = (const T *)x.data + b * x.stride[0] + h * x.stride[1];
    for (int e = threadIdx.x; e < ROWS * chunks; e += MMA_THREADS) {
        int r = e / chunks, c = e % chunks;
        bool real = t0 + r < end;
        const T *src = real ? base + (t0 + r) * x.stride[2] + c * ch : base;
        cp_async_16(s + r * ld + c * ch, src, real);
    }
}

/* f32 tiles go into the mma as TF32: each thread rounds in place the
 * elements load_tile<T, D, ROWS> had it copy into s, once they have
 * landed (all but its newest `pending` groups); the barrier that
 * publishes the tile publishes them rounded. So the fragments loaded
 * from it, up to four times (once per warp), need no cvt each. 16-bit
 * tiles are left as they are, and so are 3xTF32's, whose fragments are
 * split from f32 as they load. */
template <typename T, int D, int ROWS> __device__ __forceinline__ void tf32_landed(T *s, int pending) {
    if constexpr (sizeof(T) == 4 && mma_parts<T>() == 1) {
        const int ld = mma_ld<T, D>(), chunks = D / 4;
        cp_async_wait(pending);
        for (int e = threadIdx.x; e < ROWS * chunks; e += MMA_THREADS) {
            float4 *x = (float4 *)(s + e / chunks * ld + e % chunks * 4);
            float4 y = *x;
            y.x = tf32_value(y.x), y.y = tf32_value(y.y), y.z = tf32_value(y.z), y.w = tf32_value(y.w);
            *x = y;
        }
    }
}

/* The K and V tiles (ROWS keys each) of key block j0 (the it-th of the
 * walk), from the buffer pair it % 2 of kv, once they have landed; the next
 * block's pair starts streaming into the other buffer first. */
template <typename T, int D, int ROWS>
__device__ __forceinline__ T *kv_tiles(T *kv, const ds_kview &k, const ds_kview &v, int64_t b, int64_t h, int64_t j0,
                                       int64_t it, int64_t kend, int64_t Tk) {
    const int tile = ROWS * mma_ld<T, D>();
    T *next = kv + (~it & 1) * 2 * tile;
    bool more = j0 + ROWS < kend;
    if (more) {
        load_tile<T, D, ROWS>(next, k, b, h, j0 + ROWS, Tk);
        load_tile<T, D, ROWS>(next + tile, v, b, h, j0 + ROWS, Tk);
        cp_async_commit();
    }
    T *cur = kv + (it & 1) * 2 * tile;
    cp_async_wait(more);
    tf32_landed<T, D, ROWS>(cur, more);
    tf32_landed<T, D, ROWS>(cur + tile, more);
    __syncthreads();
    return cur;
}

/* Stores a warp's 16 x D accumulator rows (row0 = this block's first row)
 * times mul into x[b, h], two elements per store, rows at or past end skipped. */
template <typename T, int D>
__device__ __forceinline__ void store_rows(const ds_kview &x, int64_t b, int64_t h, int64_t row0, int64_t end,
                                           const float acc[D / 8][4], float mul0, float mul1) {
    int l = threadIdx.x % 32;
    T *base = (T *)x.data + b * x.stride[0] + h * x.stride[1];
    int64_t r0 = row0 + l / 4, r1 = r0 + 8;
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        int c = n * 8 + 2 * (l % 4);
        if (r0 < end) store2(base + r0 * x.stride[2] + c, acc[n][0] * mul0, acc[n][1] * mul0);
        if (r1 < end) store2(base + r1 * x.stride[2] + c, acc[n][2] * mul1, acc[n][3] * mul1);
    }
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

/* Whether score (row, col) takes part: col a real key the row may see. */
__device__ __forceinline__ bool visible(int64_t row, int64_t col, const mma_geom &g) {
    return col < g.Tk && !(g.causal && col > row);
}

/* Whether every score of the `rows` queries from i0 against the `cols`
 * keys from j0 takes part and every query is real: then a tile needs no mask
 * (under a causal mask, every tile off the diagonal). The mask costs
 * several 64-bit compares and selects per score, instructions of the
 * order of the tile's mma, so only the tiles on the diagonal and at the
 * edges pay for it. */
__device__ __forceinline__ bool tile_unmasked(int64_t i0, int rows, int64_t j0, int cols, const mma_geom &g) {
    return i0 + rows <= g.Tq && j0 + cols <= g.Tk && !(g.causal && j0 + cols - 1 > i0);
}

/* Block t's (batch, head of H, block of rows): heads vary fastest; with
 * `heavy_last` the last blocks (under a causal mask, the ones with the most
 * work) go first. */
__device__ __forceinline__ void block_task_of(const mma_geom &g, int64_t H, int64_t nblocks, bool heavy_last,
                                              int64_t *b, int64_t *h, int64_t *blk) {
    int64_t heads = g.B * H, t = blockIdx.x, bh = t % heads;
    *blk = heavy_last ? nblocks - 1 - t / heads : t / heads;
    *b = bh / H;
    *h = bh % H;
}

/* The same over the query heads. */
__device__ __forceinline__ void block_task(const mma_geom &g, int64_t nblocks, bool heavy_last, int64_t *b,
                                           int64_t *h, int64_t *blk) {
    block_task_of(g, g.H, nblocks, heavy_last, b, h, blk);
}

/* ---- forward ---- */

/* A fragment's scores of rows r0, r1 against the KT keys from j0, into
 * base 2; with MASKED, the ones visible() hides become -inf. */
template <bool MASKED, int KT>
__device__ __forceinline__ void scale_scores(float s[KT / 8][4], int64_t r0, int64_t r1, int64_t j0,
                                             const mma_geom &g) {
    int l = threadIdx.x % 32;
#pragma unroll
    for (int n = 0; n < KT / 8; n++) {
        int64_t c = j0 + n * 8 + 2 * (l % 4);
        s[n][0] = !MASKED || visible(r0, c, g) ? s[n][0] * g.scale_log2 : -INFINITY;
        s[n][1] = !MASKED || visible(r0, c + 1, g) ? s[n][1] * g.scale_log2 : -INFINITY;
        s[n][2] = !MASKED || visible(r1, c, g) ? s[n][2] * g.scale_log2 : -INFINITY;
        s[n][3] = !MASKED || visible(r1, c + 1, g) ? s[n][3] * g.scale_log2 : -INFINITY;
    }
}

/* One step of the online softmax for a fragment's rows r and r + 8 (mx:
 * their running max in base 2, sum: this thread's partial sums): s, the
 * scaled scores of a tile of KT keys, becomes exp2(s - max), and scale
 * the factor that takes the row's earlier sums to the new max. */
template <int KT>
__device__ __forceinline__ void softmax_tile(float s[KT / 8][4], float mx[2], float sum[2], float scale[2]) {
    float bm[2] = { -INFINITY, -INFINITY };
#pragma unroll
    for (int n = 0; n < KT / 8; n++) {
        bm[0] = fmaxf(bm[0], fmaxf(s[n][0], s[n][1]));
        bm[1] = fmaxf(bm[1], fmaxf(s[n][2], s[n][3]));
    }
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float nm = fmaxf(mx[r], quad_max(bm[r]));
        /* a row with nothing visible yet keeps a finite base: exp2(-inf - 0) = 0, never nan */
        base[r] = nm == -INFINITY ? 0.f : nm;
        scale[r] = exp2_ftz(mx[r] - base[r]);
        mx[r] = nm;
        sum[r] *= scale[r];
    }
#pragma unroll
    for (int n = 0; n < KT / 8; n++) {
        s[n][0] = exp2_ftz(s[n][0] - base[0]);
        s[n][1] = exp2_ftz(s[n][1] - base[0]);
        s[n][2] = exp2_ftz(s[n][2] - base[1]);
        s[n][3] = exp2_ftz(s[n][3] - base[1]);
        sum[0] += s[n][0] + s[n][1];
        sum[1] += s[n][2] + s[n][3];
    }
}

/* acc's rows r and r + 8 times scale[0] and scale[1]. */
template <int D> __device__ __forceinline__ void rescale_rows(float acc[D / 8][4], const float scale[2]) {
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        acc[n][0] *= scale[0]; acc[n][1] *= scale[0];
        acc[n][2] *= scale[1]; acc[n][3] *= scale[1];
    }
}

/* softmax_tile, with acc rescaled to the new max at once. */
template <int D, int KT>
__device__ __forceinline__ void online_softmax(float s[KT / 8][4], float acc[D / 8][4], float mx[2], float sum[2]) {
    float scale[2];
    softmax_tile<KT>(s, mx, sum, scale);
    rescale_rows<D>(acc, scale);
}

/* Query rows a warp owns in the forward and dQ kernels, in 16-row
 * fragments: two, every K and V fragment loaded from shared memory once
 * for both (FlashAttention-2's layout); a block is 4 warps, 128 queries. */
#define MMA_Q_FRAGS 2

/* The forward's key tiles: 64 keys at D = 64, 32 at D = 128, where the 32
 * rows' accumulators leave registers for only 32 x 32 scores. */
#define MMA_FWD_KEYS(D) ((D) == 64 ? 64 : 32)

template <typename T, int D>
__global__ void __launch_bounds__(MMA_THREADS)
mma_forward_kernel(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, mma_geom g) {
    constexpr int M = MMA_Q_FRAGS, ROWS = MMA_BLOCK_ROWS(M), KT = MMA_FWD_KEYS(D);
    extern __shared__ __align__(16) unsigned char smem[];
    const int ld = mma_ld<T, D>(), tile = KT * ld;
    T *qs = (T *)smem, *kv = qs + ROWS * ld;     /* then K and V tiles, twice: [buffer][K, V] */
    int warp = threadIdx.x / 32, l = threadIdx.x % 32;
    int64_t b, h, blk;
    block_task(g, (g.Tq + ROWS - 1) / ROWS, g.causal, &b, &h, &blk);
    int64_t i0 = blk * ROWS, w0 = i0 + warp * 16 * M;   /* the block's and the warp's first rows */
    float o[M][D / 8][4] = {};
    float mx[M][2], sum[M][2];     /* per fragment, rows +l/4 and +l/4+8: running max (base 2), partial sums */
#pragma unroll
    for (int m = 0; m < M; m++) mx[m][0] = mx[m][1] = -INFINITY, sum[m][0] = sum[m][1] = 0.f;
    int64_t kend = g.causal ? min(g.Tk, i0 + ROWS) : g.Tk;
    load_tile<T, D, ROWS>(qs, q, b, h, i0, g.Tq);
    cp_async_commit();
    load_tile<T, D, KT>(kv, k, b, h / g.G, 0, g.Tk);
    load_tile<T, D, KT>(kv + tile, v, b, h / g.G, 0, g.Tk);
    cp_async_commit();
    tf32_landed<T, D, ROWS>(qs, 1);
    for (int64_t j0 = 0, it = 0; j0 < kend; j0 += KT, it++) {
        T *ks = kv_tiles<T, D, KT>(kv, k, v, b, h / g.G, j0, it, kend, g.Tk), *vs = ks + tile;
        /* under a causal mask, a warp whose rows all precede the tile sees none of it */
        if (!(g.causal && w0 + 16 * M <= j0)) {
            float s[M][KT / 8][4];
            rows_times_tile<T, D, M, KT>(s, qs, warp * 16 * M, ks);
            bool whole = tile_unmasked(i0, ROWS, j0, KT, g);
#pragma unroll
            for (int m = 0; m < M; m++) {
                int64_t r0 = w0 + 16 * m + l / 4;
                if (whole) scale_scores<false, KT>(s[m], r0, r0 + 8, j0, g);
                else scale_scores<true, KT>(s[m], r0, r0 + 8, j0, g);
                online_softmax<D, KT>(s[m], o[m], mx[m], sum[m]);
            }
            probs_times_tile<T, D, M, KT>(o, s, vs);
        }
        __syncthreads();                         /* every warp is done with this buffer before it refills */
    }
    float *L = (float *)lse.data + b * lse.stride[0] + h * lse.stride[1];
#pragma unroll
    for (int m = 0; m < M; m++) {
        float l0 = quad_sum(sum[m][0]), l1 = quad_sum(sum[m][1]);
        store_rows<T, D>(out, b, h, w0 + 16 * m, g.Tq, o[m], 1.f / l0, 1.f / l1);
        int64_t r0 = w0 + 16 * m + l / 4, r1 = r0 + 8;
        if (l % 4 == 0 && r0 < g.Tq) L[r0 * lse.stride[2]] = (mx[m][0] + log2f(l0)) / LOG2E;
        if (l % 4 == 0 && r1 < g.Tq) L[r1 * lse.stride[2]] = (mx[m][1] + log2f(l1)) / LOG2E;
    }
}

/* ---- backward ---- */

/* The backward's per-row statistics, for row (b H + h) Tq + i of the
 * 2 B H Tq floats at stats: first every row's lse in base 2, then every
 * row's delta = dO_i . O_i; a warp per row. */
template <typename T, int D>
__global__ void mma_stats_kernel(float *stats, ds_kview dout, ds_kview out, ds_kview lse, mma_geom g) {
    int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int l = threadIdx.x % 32;
    if (row >= g.B * g.H * g.Tq) return;
    int64_t b = row / (g.H * g.Tq), h = row / g.Tq % g.H, i = row % g.Tq;
    const T *go = (const T *)dout.data + b * dout.stride[0] + h * dout.stride[1] + i * dout.stride[2];
    const T *oo = (const T *)out.data + b * out.stride[0] + h * out.stride[1] + i * out.stride[2];
    float s = 0.f;
    for (int c = 2 * l; c < D; c += 64)
        s += (float)go[c] * (float)oo[c] + (float)go[c + 1] * (float)oo[c + 1];
    for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (l == 0) {
        stats[row] = ((const float *)lse.data)[b * lse.stride[0] + h * lse.stride[1] + i * lse.stride[2]] * LOG2E;
        stats[g.B * g.H * g.Tq + row] = s;
    }
}

/* dS = P (dP - delta) into s, P = exp2(s scale - lse), for a fragment's
 * rows r0, r1 against the KT keys from j0; rows = { lse0, lse1, delta0,
 * delta1 } (lse in base 2). With MASKED, P is 0 where visible() hides a
 * score or the row is past the queries. */
template <bool MASKED, int KT>
__device__ __forceinline__ void dq_scores(float s[KT / 8][4], const float dp[KT / 8][4], int64_t r0, int64_t r1,
                                          int64_t j0, const float rows[4], const mma_geom &g) {
    int l = threadIdx.x % 32;
#pragma unroll
    for (int n = 0; n < KT / 8; n++) {
        int64_t c = j0 + n * 8 + 2 * (l % 4);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int64_t row = e < 2 ? r0 : r1, col = c + (e & 1);
            float p = !MASKED || (row < g.Tq && visible(row, col, g))
                      ? exp2_ftz(s[n][e] * g.scale_log2 - rows[e / 2]) : 0.f;
            s[n][e] = p * (dp[n][e] - rows[2 + e / 2]);
        }
    }
}

/* The dQ kernel's key tiles: 32 keys, so a warp's S and dP are 32 x 32;
 * 16 in f32, where 32 spill registers. */
#define MMA_DQ_KEYS(T) (sizeof(T) == 4 ? 16 : 32)

/* Query rows a warp owns in the dQ kernel: MMA_Q_FRAGS fragments, but one
 * in 3xTF32 at D = 128, where two fragments' accumulators and the split
 * operands spill registers. */
#define MMA_DQ_FRAGS(T, D) (mma_parts<T>() == 2 && (D) == 128 ? 1 : MMA_Q_FRAGS)

/* dQ for a block of 4 warps' query rows: over the key tiles it sees,
 * dS = P (dO V^T - delta), dQ += dS K; times scale at the end. */
template <typename T, int D>
__global__ void __launch_bounds__(MMA_THREADS)
mma_dq_kernel(ds_kview dq, ds_kview dout, ds_kview q, ds_kview k, ds_kview v, const float *stats, mma_geom g) {
    constexpr int M = MMA_DQ_FRAGS(T, D), ROWS = MMA_BLOCK_ROWS(M), KT = MMA_DQ_KEYS(T);
    extern __shared__ __align__(16) unsigned char smem[];
    const int ld = mma_ld<T, D>(), qtile = ROWS * ld, ktile = KT * ld;
    T *qs = (T *)smem, *gs = qs + qtile, *kv = gs + qtile;   /* then K and V tiles, twice */
    int warp = threadIdx.x / 32, l = threadIdx.x % 32;
    int64_t b, h, blk;
    block_task(g, (g.Tq + ROWS - 1) / ROWS, g.causal, &b, &h, &blk);
    int64_t i0 = blk * ROWS, w0 = i0 + warp * 16 * M;     /* the block's and the warp's first rows */
    load_tile<T, D, ROWS>(qs, q, b, h, i0, g.Tq);
    load_tile<T, D, ROWS>(gs, dout, b, h, i0, g.Tq);
    cp_async_commit();
    load_tile<T, D, KT>(kv, k, b, h / g.G, 0, g.Tk);
    load_tile<T, D, KT>(kv + ktile, v, b, h / g.G, 0, g.Tk);
    cp_async_commit();
    tf32_landed<T, D, ROWS>(qs, 1);
    tf32_landed<T, D, ROWS>(gs, 1);
    const float *L = stats + (b * g.H + h) * g.Tq, *Dl = L + g.B * g.H * g.Tq;
    float rows[M][4];            /* per fragment: lse (base 2) of rows +l/4 and +l/4+8, then their delta */
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            int64_t row = w0 + 16 * m + l / 4 + 8 * r;
            rows[m][r] = row < g.Tq ? L[row] : 0.f;
            rows[m][2 + r] = row < g.Tq ? Dl[row] : 0.f;
        }
    float acc[M][D / 8][4] = {};
    int64_t kend = g.causal ? min(g.Tk, i0 + ROWS) : g.Tk;
    for (int64_t j0 = 0, it = 0; j0 < kend; j0 += KT, it++) {
        T *ks = kv_tiles<T, D, KT>(kv, k, v, b, h / g.G, j0, it, kend, g.Tk), *vs = ks + ktile;
        /* under a causal mask, a warp whose rows all precede the tile sees none of it */
        if (!(g.causal && w0 + 16 * M <= j0)) {
            float s[M][KT / 8][4], dp[M][KT / 8][4];
            rows_times_tile<T, D, M, KT>(s, qs, warp * 16 * M, ks);
            rows_times_tile<T, D, M, KT>(dp, gs, warp * 16 * M, vs);
            bool whole = tile_unmasked(i0, ROWS, j0, KT, g);
#pragma unroll
            for (int m = 0; m < M; m++) {
                int64_t r0 = w0 + 16 * m + l / 4;
                if (whole) dq_scores<false, KT>(s[m], dp[m], r0, r0 + 8, j0, rows[m], g);
                else dq_scores<true, KT>(s[m], dp[m], r0, r0 + 8, j0, rows[m], g);
            }
            probs_times_tile<T, D, M, KT>(acc, s, ks);
        }
        __syncthreads();
    }
#pragma unroll
    for (int m = 0; m < M; m++) store_rows<T, D>(dq, b, h, w0 + 16 * m, g.Tq, acc[m], g.scale, g.scale);
}

/* The transposed frame's P^T into p and dS^T into ds for a fragment's
 * keys key0, key1 against the QT queries from i0 (lrow, drow: their lse in
 * base 2 and delta). With MASKED, P is 0 where visible() hides a score or
 * the key or the query is past the end. */
template <bool MASKED, int QT>
__device__ __forceinline__ void dkdv_scores(float p[QT / 8][4], float ds[QT / 8][4], int64_t key0, int64_t key1,
                                            int64_t i0, const float *lrow, const float *drow, const mma_geom &g) {
    int l = threadIdx.x % 32;
    /* in the tile's own int coordinates: key k sees queries i0 + qi for
     * from[k] <= qi < last (causal: query >= key) */
    int last = 0, from[2] = { 0, 0 };
    if (MASKED) {
        last = (int)min(g.Tq - i0, (int64_t)QT);
        for (int h = 0; h < 2; h++) {
            int64_t key = h ? key1 : key0;
            from[h] = key >= g.Tk ? QT : g.causal ? (int)min(max(key - i0, (int64_t)0), (int64_t)QT) : 0;
        }
    }
#pragma unroll
    for (int n = 0; n < QT / 8; n++) {
        int c = n * 8 + 2 * (l % 4);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int qi = c + (e & 1);
            float pr = !MASKED || (qi >= from[e / 2] && qi < last) ? exp2_ftz(p[n][e] * g.scale_log2 - lrow[qi]) : 0.f;
            p[n][e] = pr;
            ds[n][e] = pr * (ds[n][e] - drow[qi]);
        }
    }
}

/* Keys a warp owns in the dK/dV kernel, in 16-row fragments: two at D = 64
 * (32 keys against query tiles of 32, every Q and dO fragment loaded once
 * for both, P and dS 32 x 32 a warp), one at D = 128 (16 keys against
 * tiles of 64: its dK and dV accumulators fill the registers; tiles of 32
 * in f32, whose four loads per B fragment need registers of their own;
 * 16 in 3xTF32 at D = 64, whose split operands do too). */
#define MMA_DKDV_FRAGS(D) ((D) == 64 ? 2 : 1)
#define MMA_DKDV_QUERIES(T, D) \
    (mma_parts<T>() == 2 && (D) == 64 ? 16 : sizeof(T) == 4 ? 32 : 64 / MMA_DKDV_FRAGS(D))

/* dK and dV for a block of 4 warps' keys of kv head kh: over the query
 * tiles that see them, of each of the group's query heads in turn, in the
 * transposed frame (a warp's rows are keys): P^T = exp(K Q^T - lse), dS^T =
 * P^T (V dO^T - delta), dV += P^T dO, dK += dS^T Q (times scale). */
template <typename T, int D>
__global__ void __launch_bounds__(MMA_THREADS)
mma_dkdv_kernel(ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k, ds_kview v, const float *stats,
                mma_geom g) {
    constexpr int M = MMA_DKDV_FRAGS(D), KEYS = MMA_BLOCK_ROWS(M), QT = MMA_DKDV_QUERIES(T, D);
    static_assert(MMA_THREADS >= 2 * QT, "a thread per row statistic");
    extern __shared__ __align__(16) unsigned char smem[];
    const int ld = mma_ld<T, D>(), ktile = KEYS * ld, qtile = QT * ld;
    T *ks = (T *)smem, *vs = ks + ktile, *qg = vs + ktile;   /* then Q and dO tiles, twice */
    float *rows = (float *)(qg + 4 * qtile);                /* then lse and delta of each buffer's rows */
    int warp = threadIdx.x / 32, l = threadIdx.x % 32;
    int64_t b, kh, blk;
    block_task_of(g, g.H / g.G, (g.Tk + KEYS - 1) / KEYS, false, &b, &kh, &blk);
    int64_t j0 = blk * KEYS, w0 = j0 + warp * 16 * M;       /* the block's and the warp's first keys */
    float dka[M][D / 8][4] = {}, dva[M][D / 8][4] = {};
    /* under a causal mask the queries before this block see none of its keys;
     * step s is query tile s % tiles of the group's query head s / tiles */
    int64_t first = g.causal ? j0 : 0, tiles = first < g.Tq ? (g.Tq - first + QT - 1) / QT : 0, steps = g.G * tiles;
    auto fetch = [&](int buf, int64_t s) {
        int64_t h = kh * g.G + s / tiles, i0 = first + s % tiles * QT;
        const float *L = stats + (b * g.H + h) * g.Tq, *Dl = L + g.B * g.H * g.Tq;
        T *qs = qg + buf * 2 * qtile;
        load_tile<T, D, QT>(qs, q, b, h, i0, g.Tq);
        load_tile<T, D, QT>(qs + qtile, dout, b, h, i0, g.Tq);
        /* with the tiles, a float per thread: the rows' lse (threads
         * 0..QT-1), then their delta; zeros past the queries */
        if (threadIdx.x < 2 * QT) {
            int r = threadIdx.x % QT;
            bool real = i0 + r < g.Tq;
            cp_async_4(rows + buf * 2 * QT + threadIdx.x, (threadIdx.x < QT ? L : Dl) + (real ? i0 + r : 0), real);
        }
        cp_async_commit();
    };
    load_tile<T, D, KEYS>(ks, k, b, kh, j0, g.Tk);
    load_tile<T, D, KEYS>(vs, v, b, kh, j0, g.Tk);
    cp_async_commit();
    if (steps > 0) fetch(0, 0);
    tf32_landed<T, D, KEYS>(ks, steps > 0);
    tf32_landed<T, D, KEYS>(vs, steps > 0);
    for (int64_t s = 0; s < steps; s++) {
        int buf = (int)(s & 1);
        int64_t i0 = first + s % tiles * QT;
        T *qs = qg + buf * 2 * qtile, *gs = qs + qtile;
        float *lrow = rows + buf * 2 * QT, *drow = lrow + QT;
        bool more = s + 1 < steps;
        if (more) fetch(buf ^ 1, s + 1);
        cp_async_wait(more);
        tf32_landed<T, D, QT>(qs, more);
        tf32_landed<T, D, QT>(gs, more);
        __syncthreads();
        /* under a causal mask, a warp whose keys all follow the tile's queries has nothing in it */
        if (!(g.causal && i0 + QT <= w0)) {
            float p[M][QT / 8][4], ds[M][QT / 8][4];
            rows_times_tile<T, D, M, QT>(p, ks, warp * 16 * M, qs);
            rows_times_tile<T, D, M, QT>(ds, vs, warp * 16 * M, gs);
            bool whole = tile_unmasked(i0, QT, j0, KEYS, g);
#pragma unroll
            for (int m = 0; m < M; m++) {
                int64_t key0 = w0 + 16 * m + l / 4;
                if (whole) dkdv_scores<false, QT>(p[m], ds[m], key0, key0 + 8, i0, lrow, drow, g);
                else dkdv_scores<true, QT>(p[m], ds[m], key0, key0 + 8, i0, lrow, drow, g);
            }
            probs_times_tile<T, D, M, QT>(dva, p, gs);
            probs_times_tile<T, D, M, QT>(dka, ds, qs);
        }
        __syncthreads();
    }
#pragma unroll
    for (int m = 0; m < M; m++) {
        store_rows<T, D>(dk, b, kh, w0 + 16 * m, g.Tk, dka[m], g.scale, g.scale);
        store_rows<T, D>(dv, b, kh, w0 + 16 * m, g.Tk, dva[m], 1.f, 1.f);
    }
}

/* ---- launch sizes: the host side's and the CPU emulation test's ---- */

static inline mma_geom mma_geom_of(const ds_kview &q, const ds_kview &k, double scale, int causal) {
    mma_geom g = { q.shape[0], q.shape[1], q.shape[2], k.shape[2], causal, (float)scale, (float)scale * LOG2E,
                   k.shape[1] ? q.shape[1] / k.shape[1] : 1 };
    return g;
}

/* One block per block_rows of `rows` (queries or keys) per batch and head of H. */
static inline unsigned mma_blocks_of(const mma_geom &g, int64_t H, int64_t rows, int block_rows) {
    return (unsigned)(g.B * H * ((rows + block_rows - 1) / block_rows));
}

/* The same per query head. */
static inline unsigned mma_blocks(const mma_geom &g, int64_t rows, int block_rows) {
    return mma_blocks_of(g, g.H, rows, block_rows);
}

/* The forward's blocks, and the dQ kernel's. */
static inline unsigned mma_query_blocks(const mma_geom &g) {
    return mma_blocks(g, g.Tq, MMA_BLOCK_ROWS(MMA_Q_FRAGS));
}

template <typename T> static inline unsigned mma_dq_blocks(const mma_geom &g, int D) {
    return mma_blocks(g, g.Tq, MMA_BLOCK_ROWS(MMA_DQ_FRAGS(T, D)));
}

static inline unsigned mma_dkdv_blocks(const mma_geom &g, int D) {    /* per kv head */
    return mma_blocks_of(g, g.H / g.G, g.Tk, MMA_BLOCK_ROWS(MMA_DKDV_FRAGS(D)));
}

#define MMA_STATS_THREADS 256

static inline unsigned mma_stats_blocks(const mma_geom &g) {
    return (unsigned)((g.B * g.H * g.Tq * 32 + MMA_STATS_THREADS - 1) / MMA_STATS_THREADS);
}

/* mma_stats_kernel's output: lse in base 2 and delta, per query row. */
static inline size_t mma_stats_bytes(const mma_geom &g) { return (size_t)(2 * g.B * g.H * g.Tq) * sizeof(float); }

/* Dynamic shared memory: rows of D elements of T, each padded. */
template <typename T> static inline size_t mma_rows_bytes(int D, int rows) {
    return (size_t)rows * (D + mma_chunk<T>()) * sizeof(T);
}

template <typename T> static inline size_t mma_forward_smem(int D) {   /* the block's Q; K and V tiles twice */
    return mma_rows_bytes<T>(D, MMA_BLOCK_ROWS(MMA_Q_FRAGS) + 4 * MMA_FWD_KEYS(D));
}

template <typename T> static inline size_t mma_dq_smem(int D) {   /* the block's Q and dO; K and V tiles twice */
    return mma_rows_bytes<T>(D, 2 * MMA_BLOCK_ROWS(MMA_DQ_FRAGS(T, D)) + 4 * MMA_DQ_KEYS(T));
}

/* the block's K and V; Q and dO tiles, lse and delta twice */
template <typename T> static inline size_t mma_dkdv_smem(int D) {
    int qt = MMA_DKDV_QUERIES(T, D);
    return mma_rows_bytes<T>(D, 2 * MMA_BLOCK_ROWS(MMA_DKDV_FRAGS(D)) + 4 * qt) + 4 * qt * sizeof(float);
}

#endif
