/* Flash-style attention on the CPU. Forward: one task per (batch, head,
 * block of BQ query rows); it streams over tiles of BK keys, keeping each
 * row's running max and sum (online softmax), so only a BQ x BK tile of
 * scores exists at a time, and saves the output and each row's
 * log-sum-exp. Backward (FlashAttention-2): one task per (batch, kv head),
 * for each query head of its group walking key tiles; for each it
 * recomputes the probabilities of the query blocks that see it from q, k
 * and the log-sum-exp, finishes that head's share of the tile's dK and dV,
 * and adds its share of dQ.
 * Grouped-query attention: k and v may have fewer heads than q (KV
 * dividing H); query head h reads kv head h / (H/KV). A kv head's dK and
 * dV are its group's per-head tiles, each rounded to the dtype and summed
 * in head order as an add does, so they match repeating k and v then
 * attending bit for bit.
 * f32, bf16 and f16 compute in f32 on tiles packed from any strides and
 * zero-padded to whole register blocks, so the tile products below need no
 * edge cases; a partial tile (a short sequence, the last keys) multiplies
 * only the register blocks its rows and keys reach. f64 takes a plain row-at-a-time path in double, kept for
 * gradient checks. */
#include "cpu_kernels.h"
#include "cpu_iter.h"
#include "../ds_attention.h"
#include "../ds_elem.h"

#include <stdlib.h>
#include <string.h>

#define BQ 64   /* query rows per tile */
#define BK 64   /* keys per tile */
#define MR 4    /* register block of the tile products: MR rows x NR columns */
#define NR 16

typedef struct { int64_t B, H, KV, G, Tq, Tk, D, Dv, Dp, Dvp; } attn_dims;    /* G = H / KV */

static int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

static attn_dims dims_of(const ds_kview *q, const ds_kview *k, const ds_kview *v) {
    attn_dims d = { q->shape[0], q->shape[1], k->shape[1], k->shape[1] ? q->shape[1] / k->shape[1] : 1, q->shape[2],
                    k->shape[2], q->shape[3], v->shape[3], round_up(q->shape[3], NR), round_up(v->shape[3], NR) };
    return d;
}

/* Element offset of row t of (b, h) in a [B,H,T,*] or [B,H,T] view. */
static inline int64_t row_at(const ds_kview *x, int64_t b, int64_t h, int64_t t) {
    return b * x->stride[0] + h * x->stride[1] + t * x->stride[2];
}

static inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

/* ---- f32 tiles ---- */

/* Rows [t0, t0+n) of x[b,h] times mul, as f32 rows of ld floats; columns
 * past x's and rows up to `rows` are zero. */
static void pack_rows(float *dst, int64_t ld, int64_t rows, const ds_kview *x, int64_t b, int64_t h, int64_t t0,
                      int64_t n, float mul) {
    int64_t cols = x->shape[3], cs = x->stride[3];
    memset(dst, 0, sizeof(float) * (size_t)(rows * ld));
    for (int64_t r = 0; r < n; r++) {
        int64_t base = row_at(x, b, h, t0 + r);
        float *o = dst + r * ld;
        if (x->dtype == DS_F32) {
            const float *src = (const float *)x->data + base;
            for (int64_t c = 0; c < cols; c++) o[c] = mul * src[c * cs];
        } else {
            for (int64_t c = 0; c < cols; c++) o[c] = mul * (float)ds_load(x->dtype, x->data, base + c * cs);
        }
    }
}

/* The same rows transposed, dst[c * BK + r] for c < ncols (zero-padded),
 * so the keys of a tile lie along a row. */
static void pack_cols(float *dst, int64_t ncols, const ds_kview *x, int64_t b, int64_t h, int64_t t0, int64_t n) {
    int64_t cols = x->shape[3], cs = x->stride[3];
    memset(dst, 0, sizeof(float) * (size_t)(ncols * BK));
    for (int64_t r = 0; r < n; r++) {
        int64_t base = row_at(x, b, h, t0 + r);
        if (x->dtype == DS_F32) {
            const float *src = (const float *)x->data + base;
            for (int64_t c = 0; c < cols; c++) dst[c * BK + r] = src[c * cs];
        } else {
            for (int64_t c = 0; c < cols; c++) dst[c * BK + r] = (float)ds_load(x->dtype, x->data, base + c * cs);
        }
    }
}

/* Rows [t0, t0+n) of x[b,h] = mul * src (rows of ld floats), in x's dtype. */
static void store_rows(const ds_kview *x, int64_t b, int64_t h, int64_t t0, int64_t n, const float *src,
                       int64_t ld, float mul) {
    int64_t cols = x->shape[3], cs = x->stride[3];
    for (int64_t r = 0; r < n; r++) {
        int64_t base = row_at(x, b, h, t0 + r);
        const float *s = src + r * ld;
        if (x->dtype == DS_F32) {
            float *o = (float *)x->data + base;
            for (int64_t c = 0; c < cols; c++) o[c * cs] = mul * s[c];
        } else {
            for (int64_t c = 0; c < cols; c++) ds_store(x->dtype, x->data, base + c * cs, mul * s[c]);
        }
    }
}

/* Rows [t0, t0+n) of x[b,h] += src rounded to x's dtype, the sum rounded
 * again: an add of a gradient stored in that dtype. */
static void add_rows(const ds_kview *x, int64_t b, int64_t h, int64_t t0, int64_t n, const float *src, int64_t ld) {
    int64_t cols = x->shape[3], cs = x->stride[3];
    for (int64_t r = 0; r < n; r++) {
        int64_t base = row_at(x, b, h, t0 + r);
        const float *s = src + r * ld;
        for (int64_t c = 0; c < cols; c++) {
            float sum = (float)ds_load(x->dtype, x->data, base + c * cs) + (float)ds_round_to(x->dtype, s[c]);
            ds_store(x->dtype, x->data, base + c * cs, sum);
        }
    }
}

/* C[M][N] = A[M][K] B[K][N] (+ C when accumulate), row-major with leading
 * dims; M is a multiple of MR and N of NR. Each MR x NR block of C stays in
 * registers for the whole walk over K. */
static void tile_gemm(int64_t M, int64_t N, int64_t K, const float *restrict A, int64_t lda,
                      const float *restrict B, int64_t ldb, float *restrict C, int64_t ldc, int accumulate) {
    for (int64_t i = 0; i < M; i += MR)
        for (int64_t j = 0; j < N; j += NR) {
            float c[MR][NR] = {{0}};
            for (int64_t k = 0; k < K; k++) {
                const float *b = B + k * ldb + j;
                for (int r = 0; r < MR; r++) {
                    float a = A[(i + r) * lda + k];
                    #pragma omp simd
                    for (int x = 0; x < NR; x++) c[r][x] += a * b[x];
                }
            }
            for (int r = 0; r < MR; r++) {
                float *o = C + (i + r) * ldc + j;
                #pragma omp simd
                for (int x = 0; x < NR; x++) o[x] = accumulate ? o[x] + c[r][x] : c[r][x];
            }
        }
}

/* dst[j][r] = src[r][j] for the first rows x cols of a BQ x BK tile */
static void transpose_tile(float *restrict dst, const float *restrict src, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cols; j++) dst[j * BQ + r] = src[r * BK + j];
}

static size_t forward_floats(attn_dims d) {
    return (size_t)(BQ * d.Dp + d.Dp * BK + BK * d.Dvp + BQ * d.Dvp + BQ * BK);
}

/* Query rows [i0, i0+n) of head (b, h). */
static void forward_block(const ds_kview *out, const ds_kview *lse, const ds_kview *q, const ds_kview *k,
                          const ds_kview *v, attn_dims d, int64_t b, int64_t h, int64_t i0, int64_t n,
                          float scale, int causal, float *buf) {
    float *qs = buf, *kt = qs + BQ * d.Dp, *vv = kt + d.Dp * BK, *acc = vv + BK * d.Dvp, *s = acc + BQ * d.Dvp;
    ds_attn_state st[BQ];
    pack_rows(qs, d.Dp, BQ, q, b, h, i0, n, scale);     /* scaled once: S = (scale q) k^T */
    memset(acc, 0, sizeof(float) * (size_t)(BQ * d.Dvp));
    for (int64_t r = 0; r < n; r++) st[r] = ds_attn_start();
    int64_t kend = ds_attn_keys_visible(i0 + n - 1, d.Tk, causal), mq = round_up(n, MR);
    for (int64_t j0 = 0; j0 < kend; j0 += BK) {
        int64_t nk = kend - j0 < BK ? kend - j0 : BK, nkp = round_up(nk, NR);
        pack_cols(kt, d.Dp, k, b, h / d.G, j0, nk);
        pack_rows(vv, d.Dvp, BK, v, b, h / d.G, j0, nk, 1.0f);
        tile_gemm(mq, nkp, d.Dp, qs, d.Dp, kt, BK, s, BK, 0);
        /* scores to probabilities under each row's running max; keys a row
         * does not see (and padding) get 0 */
        for (int64_t r = 0; r < mq; r++) {
            float *sr = s + r * BK;
            int64_t m = r < n ? clamp64(ds_attn_keys_visible(i0 + r, d.Tk, causal) - j0, 0, nk) : 0;
            if (m == 0) { memset(sr, 0, sizeof(float) * (size_t)nkp); continue; }
            float mb = -INFINITY;
            #pragma omp simd reduction(max:mb)
            for (int64_t j = 0; j < m; j++) mb = sr[j] > mb ? sr[j] : mb;
            float alpha = ds_attn_rescale(&st[r], mb), mx = st[r].max, sum = 0;
            float *a = acc + r * d.Dvp;
            for (int64_t c = 0; c < d.Dv; c++) a[c] *= alpha;
            #pragma omp simd reduction(+:sum)
            for (int64_t j = 0; j < nkp; j++) {
                sr[j] = j < m ? ds_expf(sr[j] - mx) : 0.0f;
                sum += sr[j];
            }
            st[r].sum += sum;
        }
        tile_gemm(mq, d.Dvp, nkp, s, BK, vv, d.Dvp, acc, d.Dvp, 1);
    }
    for (int64_t r = 0; r < n; r++) {
        float inv = 1.0f / st[r].sum;
        for (int64_t c = 0; c < d.Dv; c++) acc[r * d.Dvp + c] *= inv;
        ((float *)lse->data)[row_at(lse, b, h, i0 + r)] = ds_attn_lse(st[r]);
    }
    store_rows(out, b, h, i0, n, acc, d.Dvp, 1.0f);
}

static size_t backward_floats(attn_dims d) {
    int64_t tq = round_up(d.Tq, BQ);
    return (size_t)(tq * (2 * d.Dp + d.Dvp + 2) + BK * (3 * d.Dp + 2 * d.Dvp) + 3 * BQ * BK + d.Dvp);
}

/* Query head (b, h): dq, and its share of kv head h / G's dk, dv one key
 * tile at a time (stored by the group's first head, added by the rest). */
static void backward_head(const ds_kview *dq, const ds_kview *dk, const ds_kview *dv, const ds_kview *dout,
                          const ds_kview *q, const ds_kview *k, const ds_kview *v, const ds_kview *out,
                          const ds_kview *lse, attn_dims d, int64_t b, int64_t h, float scale, int causal,
                          float *buf) {
    int64_t tq = round_up(d.Tq, BQ), kv = h / d.G;
    float *qs = buf, *go = qs + tq * d.Dp, *dqa = go + tq * d.Dvp, *delta = dqa + tq * d.Dp, *lrow = delta + tq;
    float *kk = lrow + tq, *kt = kk + BK * d.Dp, *vt = kt + d.Dp * BK, *dka = vt + d.Dvp * BK;
    float *dva = dka + BK * d.Dp, *p = dva + BK * d.Dvp, *ds = p + BQ * BK, *tr = ds + BQ * BK, *orow = tr + BQ * BK;
    pack_rows(qs, d.Dp, tq, q, b, h, 0, d.Tq, scale);
    pack_rows(go, d.Dvp, tq, dout, b, h, 0, d.Tq, 1.0f);
    memset(dqa, 0, sizeof(float) * (size_t)(tq * d.Dp));
    for (int64_t i = 0; i < tq; i++) {
        float sum = 0;
        if (i < d.Tq) {
            pack_rows(orow, d.Dvp, 1, out, b, h, i, 1, 1.0f);
            const float *g = go + i * d.Dvp;
            #pragma omp simd reduction(+:sum)
            for (int64_t c = 0; c < d.Dvp; c++) sum += g[c] * orow[c];
        }
        delta[i] = sum;
        lrow[i] = i < d.Tq ? ((const float *)lse->data)[row_at(lse, b, h, i)] : 0.0f;
    }
    for (int64_t j0 = 0; j0 < d.Tk; j0 += BK) {
        int64_t nk = d.Tk - j0 < BK ? d.Tk - j0 : BK, nkp = round_up(nk, NR);
        pack_rows(kk, d.Dp, BK, k, b, kv, j0, nk, 1.0f);
        pack_cols(kt, d.Dp, k, b, kv, j0, nk);
        pack_cols(vt, d.Dvp, v, b, kv, j0, nk);
        memset(dka, 0, sizeof(float) * (size_t)(BK * d.Dp));
        memset(dva, 0, sizeof(float) * (size_t)(BK * d.Dvp));
        /* causal query blocks before the tile see none of it */
        for (int64_t i0 = causal ? j0 / BQ * BQ : 0; i0 < d.Tq; i0 += BQ) {
            float *qi = qs + i0 * d.Dp, *gi = go + i0 * d.Dvp;
            int64_t mq = round_up(d.Tq - i0 < BQ ? d.Tq - i0 : BQ, MR);
            tile_gemm(mq, nkp, d.Dp, qi, d.Dp, kt, BK, p, BK, 0);      /* S */
            tile_gemm(mq, nkp, d.Dvp, gi, d.Dvp, vt, BK, ds, BK, 0);   /* dP = dO V^T */
            for (int64_t r = 0; r < mq; r++) {
                int64_t i = i0 + r, m = i < d.Tq ? clamp64(ds_attn_keys_visible(i, d.Tk, causal) - j0, 0, nk) : 0;
                float li = lrow[i], di = delta[i], *pr = p + r * BK, *dr = ds + r * BK;
                #pragma omp simd
                for (int64_t j = 0; j < nkp; j++) {
                    pr[j] = j < m ? ds_attn_prob(pr[j], li) : 0.0f;
                    dr[j] = ds_attn_dscore(pr[j], dr[j], di);
                }
            }
            transpose_tile(tr, p, mq, nkp);
            tile_gemm(nkp, d.Dvp, mq, tr, BQ, gi, d.Dvp, dva, d.Dvp, 1);   /* dV += P^T dO */
            transpose_tile(tr, ds, mq, nkp);
            tile_gemm(nkp, d.Dp, mq, tr, BQ, qi, d.Dp, dka, d.Dp, 1);      /* dK += dS^T (scale Q) */
            tile_gemm(mq, d.Dp, nkp, ds, BK, kk, d.Dp, dqa + i0 * d.Dp, d.Dp, 1);   /* dQ/scale += dS K */
        }
        if (h % d.G == 0) {
            store_rows(dk, b, kv, j0, nk, dka, d.Dp, 1.0f);
            store_rows(dv, b, kv, j0, nk, dva, d.Dvp, 1.0f);
        } else {
            add_rows(dk, b, kv, j0, nk, dka, d.Dp);
            add_rows(dv, b, kv, j0, nk, dva, d.Dvp);
        }
    }
    store_rows(dq, b, h, 0, d.Tq, dqa, d.Dp, scale);
}

/* ---- f64, a row at a time ---- */

static inline double at64(const ds_kview *x, int64_t b, int64_t h, int64_t t, int64_t c) {
    return ((const double *)x->data)[row_at(x, b, h, t) + c * x->stride[3]];
}

static inline double *ref64(const ds_kview *x, int64_t b, int64_t h, int64_t t, int64_t c) {
    return (double *)x->data + row_at(x, b, h, t) + c * x->stride[3];
}

/* Row xt of x[b,h] dot row yt of y[b,hy]. */
static double dot64(const ds_kview *x, int64_t xt, const ds_kview *y, int64_t yt, int64_t b, int64_t h, int64_t hy) {
    double s = 0;
    for (int64_t c = 0; c < x->shape[3]; c++) s += at64(x, b, h, xt, c) * at64(y, b, hy, yt, c);
    return s;
}

/* Query row i of head (b, h); s holds Tk doubles. */
static void forward_row64(const ds_kview *out, const ds_kview *lse, const ds_kview *q, const ds_kview *k,
                          const ds_kview *v, attn_dims d, int64_t b, int64_t h, int64_t i, double scale,
                          int causal, double *s) {
    int64_t m = ds_attn_keys_visible(i, d.Tk, causal);
    double mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < m; j++) {
        s[j] = scale * dot64(q, i, k, j, b, h, h / d.G);
        if (s[j] > mx) mx = s[j];
    }
    for (int64_t j = 0; j < m; j++) sum += s[j] = exp(s[j] - mx);
    for (int64_t c = 0; c < d.Dv; c++) {
        double o = 0;
        for (int64_t j = 0; j < m; j++) o += s[j] * at64(v, b, h / d.G, j, c);
        *ref64(out, b, h, i, c) = o / sum;
    }
    ((double *)lse->data)[row_at(lse, b, h, i)] = mx + log(sum);
}

static void zero64(const ds_kview *x) {
    for (int64_t i = 0, n = ds_kview_numel(x); i < n; i++) ((double *)x->data)[ds_kview_offset(x, i)] = 0;
}

/* Query head (b, h); kv head h / G's dk and dv must start at zero and take
 * no other task's adds meanwhile. p and dp hold Tk doubles. */
static void backward_head64(const ds_kview *dq, const ds_kview *dk, const ds_kview *dv, const ds_kview *dout,
                            const ds_kview *q, const ds_kview *k, const ds_kview *v, const ds_kview *out,
                            const ds_kview *lse, attn_dims d, int64_t b, int64_t h, double scale, int causal,
                            double *p, double *dp) {
    int64_t kv = h / d.G;
    for (int64_t i = 0; i < d.Tq; i++) {
        int64_t m = ds_attn_keys_visible(i, d.Tk, causal);
        double li = ((const double *)lse->data)[row_at(lse, b, h, i)];
        double di = dot64(dout, i, out, i, b, h, h);
        for (int64_t j = 0; j < m; j++) {
            p[j] = exp(scale * dot64(q, i, k, j, b, h, kv) - li);
            dp[j] = p[j] * (dot64(dout, i, v, j, b, h, kv) - di);       /* dS */
        }
        for (int64_t c = 0; c < d.D; c++) {
            double g = 0, qc = at64(q, b, h, i, c);
            for (int64_t j = 0; j < m; j++) {
                g += dp[j] * at64(k, b, kv, j, c);
                *ref64(dk, b, kv, j, c) += scale * dp[j] * qc;
            }
            *ref64(dq, b, h, i, c) = scale * g;
        }
        for (int64_t c = 0; c < d.Dv; c++) {
            double gc = at64(dout, b, h, i, c);
            for (int64_t j = 0; j < m; j++) *ref64(dv, b, kv, j, c) += p[j] * gc;
        }
    }
}

/* ---- entry points ---- */

static int64_t work_of(attn_dims d) { return d.B * d.H * d.Tq * d.Tk * (d.D + d.Dv); }

static int cpu_attention_forward(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v,
                                 double scale, int causal) {
    attn_dims d = dims_of(&q, &k, &v);
    if (d.Tk == 0 && d.Tq > 0) return ds_kernel_fail("no keys to attend to");
    int failed = 0;
    if (q.dtype == DS_F64) {
        int64_t rows = d.B * d.H * d.Tq;
        #pragma omp parallel if (work_of(d) > CPU_PARALLEL_MIN)
        {
            double *s = malloc(sizeof(double) * (size_t)(d.Tk + 1));
            if (!s) {
                #pragma omp atomic write
                failed = 1;
            }
            #pragma omp for schedule(dynamic, 16)
            for (int64_t r = 0; r < rows; r++)
                if (s) forward_row64(&out, &lse, &q, &k, &v, d, r / (d.H * d.Tq), r / d.Tq % d.H, r % d.Tq,
                                     scale, causal, s);
            free(s);
        }
    } else {
        int64_t nblk = (d.Tq + BQ - 1) / BQ, tasks = d.B * d.H * nblk;
        #pragma omp parallel if (work_of(d) > CPU_PARALLEL_MIN)
        {
            float *buf = malloc(sizeof(float) * forward_floats(d));
            if (!buf) {
                #pragma omp atomic write
                failed = 1;
            }
            /* the last query blocks of a causal head do the most work: hand them out first */
            #pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < tasks; t++) {
                int64_t heads = d.B * d.H, blk = causal ? nblk - 1 - t / heads : t / heads, bh = t % heads;
                int64_t i0 = blk * BQ;
                if (buf) forward_block(&out, &lse, &q, &k, &v, d, bh / d.H, bh % d.H, i0,
                                       d.Tq - i0 < BQ ? d.Tq - i0 : BQ, (float)scale, causal, buf);
            }
            free(buf);
        }
    }
    return failed ? ds_kernel_fail("out of memory for attention tiles") : 0;
}

static int cpu_attention_backward(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q,
                                  ds_kview k, ds_kview v, ds_kview out, ds_kview lse, double scale,
                                  int causal) {
    attn_dims d = dims_of(&q, &k, &v);
    int64_t heads = d.B * d.KV;    /* a task per kv head: its group's adds stay in one thread */
    int failed = 0;
    if (q.dtype == DS_F64) {
        zero64(&dk);
        zero64(&dv);
        #pragma omp parallel if (work_of(d) > CPU_PARALLEL_MIN)
        {
            double *p = malloc(sizeof(double) * (size_t)(2 * d.Tk + 1));
            if (!p) {
                #pragma omp atomic write
                failed = 1;
            }
            #pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < heads; t++)
                for (int64_t h = t % d.KV * d.G; p && h < (t % d.KV + 1) * d.G; h++)
                    backward_head64(&dq, &dk, &dv, &dout, &q, &k, &v, &out, &lse, d, t / d.KV, h, scale, causal,
                                    p, p + d.Tk);
            free(p);
        }
    } else {
        #pragma omp parallel if (work_of(d) > CPU_PARALLEL_MIN)
        {
            float *buf = malloc(sizeof(float) * backward_floats(d));
            if (!buf) {
                #pragma omp atomic write
                failed = 1;
            }
            #pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < heads; t++)
                for (int64_t h = t % d.KV * d.G; buf && h < (t % d.KV + 1) * d.G; h++)
                    backward_head(&dq, &dk, &dv, &dout, &q, &k, &v, &out, &lse, d, t / d.KV, h, (float)scale,
                                  causal, buf);
            free(buf);
        }
    }
    return failed ? ds_kernel_fail("out of memory for attention tiles") : 0;
}

/* The CPU's fused kernel is its best in every dtype. */
static bool cpu_attention_full_rate(ds_kview q, ds_kview k, ds_kview v) { return true; }

static bool cpu_attention_grouped(ds_kview q, ds_kview k, ds_kview v) { return true; }

const ds_kernels_attention ds_cpu_attention = { cpu_attention_full_rate, cpu_attention_grouped,
                                                cpu_attention_forward, cpu_attention_backward };
