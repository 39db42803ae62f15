/* The tensor-core attention kernels (kernels/cuda/cuda_attention_mma.cuh)
 * on the CPU, through tests/warp_emulator.h: forward (out, lse) and
 * backward (dq, dk, dv) against attention computed in double from the
 * same inputs; bf16, f16 and f32 (in TF32 and in 3xTF32), head dims 64
 * and 128, causal or not, lengths that leave partial tiles, q/k/v as views
 * into one packed qkv buffer as GPT-2's attention passes them, and k and v
 * with fewer heads than q (grouped-query attention). f32 is
 * held to a bound derived for every element from TF32's unit roundoff, or
 * from what 3xTF32's split leaves, far tighter (plain TF32 exceeds it).
 * No GPU needed: what runs is the kernels' own code, with ldmatrix, mma,
 * cvt and cp.async emulated from the PTX ISA's definitions. */
#include "warp_emulator.h"
#include "cuda/cuda_attention_mma.cuh"

extern "C" {
#include "check.h"
}

#include <random>
#include <type_traits>

namespace {

/* KV: k and v's heads, each read by H / KV query heads (0: H) */
struct shape {
    int64_t B, H, Tq, Tk; int D; bool causal; int64_t KV = 0;
    int64_t kv() const { return KV ? KV : H; }
};

/* A [B, H, T, D] view with the given element strides. */
ds_kview heads_view(void *data, ds_dtype dt, const shape &s, int64_t H, int64_t T, int64_t sb, int64_t sh,
                    int64_t st) {
    int64_t sz[4] = { s.B, H, T, s.D }, sd[4] = { sb, sh, st, 1 };
    return emu::view(data, dt, 4, sz, sd);
}

/* An element of T from an f32 (NaN for the outputs before they are written). */
template <typename T> T elem(float x) {
    if constexpr (sizeof(T) == 4) return T{ x };
    else return T{ std::is_same<T, __nv_bfloat16>::value ? ds_f32_to_bf16(x) : ds_f32_to_f16(x) };
}

/* [B, T, H, D] memory seen as [B, H, T, D]: the fused op's layout. */
template <typename T> ds_kview heads_inner(std::vector<T> &buf, ds_dtype dt, const shape &s, int64_t H, int64_t T_) {
    buf.assign((size_t)(s.B * T_ * H * s.D), elem<T>(NAN));
    return heads_view(buf.data(), dt, s, H, T_, T_ * H * s.D, s.D, H * s.D);
}

template <typename T> float at(const ds_kview &v, int64_t b, int64_t h, int64_t t, int64_t d) {
    return (float)((const T *)v.data)[b * v.stride[0] + h * v.stride[1] + t * v.stride[2] + d];
}

/* One result's max |got - want| over max |want|, and its largest
 * |got - want| / bound where a bound is given. */
struct error {
    double worst = 0, scale = 0, over = 0;
    void add(double got, double want, double bound = INFINITY) {
        double e = fabs(got - want);
        if (!(e <= worst)) worst = e;                  /* NaN sticks */
        if (!(e <= over * bound)) over = e / bound;
        scale = fmax(scale, fabs(want));
    }
    double rel() const { return worst / fmax(scale, 1e-30); }
};

/* ---- the f32 error bounds ----
 * f32 roundings are e = 2^-24 each, and n of them on a sum or product
 * grow at most to gamma(n) = n e / (1 - n e). A product goes into the mma
 * one of two ways:
 * - TF32: u = 2^-11, TF32's unit roundoff: each factor x goes in as
 *   x (1 + t), |t| <= u, so a product is off by (1 + u)^2 - 1 relative.
 * - 3xTF32: x = X + xs + ex, X = rna(x) (|x - X| <= 2^-11 |x|), x - X
 *   exact in f32 (X is within a factor 2 of x), xs = rna(x - X), so
 *   |xs| <= 2^-11 (1 + 2^-11) |x| and |ex| <= 2^-11 |x - X| <= 2^-22 |x|
 *   (while x - X is a normal f32; below that the split is off by up to
 *   2^-137, within 2^-22 |x| for |x| >= 2^-115: the inputs are checked,
 *   and the probabilities' and dS's floors carry it). The kernel sums
 *   X Y + X ys + xs Y, which is x y - xs ys - (x - ex) ey - ex y: off by
 *   at most 2^-22 ((1 + 2^-11)^2 + 1 + 2^-22 + 1) |x y| <= pi |x y| with
 *   pi = (3 + 2^-9) 2^-22, relative. Plain TF32 is off by up to 2^-10.
 * The emulated mma sums its 8 products and c in double (exactly: TF32
 * products are 22 bits; the sum's double rounding is 2^-50 of the terms,
 * inside the slack below) and rounds to f32 once, so a dot product over n
 * terms costs one f32 rounding per mma: ceil(n / 8) in TF32, three times
 * that in 3xTF32. The bound is first derived for a dot product and then
 * carried through each step of the kernels, every other f32 rounding
 * counted (generously). A value x known up to ex times y known up to ey,
 * rounded with relative r, is off by at most
 * prod_err(|x|, ex, |y|, ey, r) = (|x| + ex)(|y| + ey)(1 + r) - |x||y|. */
const double U = 1.0 / 2048, E = 1.0 / 16777216, PI3 = (3 + 0x1p-9) * 0x1p-22;

double gamma_n(double n) { return n * E / (1 - n * E); }

double prod_err(double x, double ex, double y, double ey, double r) { return (x + ex) * (y + ey) * (1 + r) - x * y; }

/* How f32 products go into the mma: each one's relative error and the
 * mma (so f32 roundings) per 8 terms of a sum. */
struct f32_model {
    double prod, mmas;
    double roundings(double n) const { return mmas * ceil(n / 8); }
};

template <typename T> f32_model model_of() {
    if (std::is_same<T, tf32x3>::value) return { PI3, 3 };
    return { (1 + U) * (1 + U) - 1, 1 };
}

template <typename T, int D> void run_case(const shape &s, ds_dtype dt, std::mt19937 &rng) {
    const int64_t KV = s.kv(), G = s.H / KV, C = s.H * D, W = C + 2 * KV * D;
    const double scale = 1.0 / sqrt((double)D);
    /* q, k and v inside one [B, T, H + 2 KV, D] buffer, as qkv_attention
     * passes them when KV = H */
    int64_t Tmax = s.Tq > s.Tk ? s.Tq : s.Tk;
    std::vector<T> qkv((size_t)(s.B * Tmax * W));
    std::normal_distribution<float> normal(0.f, 1.f);
    for (T &x : qkv) x = elem<T>(normal(rng));
    ds_kview q = heads_view(qkv.data(), dt, s, s.H, s.Tq, Tmax * W, D, W);
    ds_kview k = heads_view(qkv.data() + C, dt, s, KV, s.Tk, Tmax * W, D, W);
    ds_kview v = heads_view(qkv.data() + C + KV * D, dt, s, KV, s.Tk, Tmax * W, D, W);
    std::vector<T> gbuf, obuf, dqb, dkb, dvb;
    ds_kview dout = heads_inner(gbuf, dt, s, s.H, s.Tq);
    for (T &x : gbuf) x = elem<T>(normal(rng));
    if (dt == DS_F32) {    /* the bound below takes every f32 input at least 2^-115 in magnitude */
        bool above = true;
        for (const std::vector<T> *buf : { &qkv, &gbuf })
            for (const T &x : *buf) above = above && fabsf((float)x) >= 0x1p-115f;
        check(above, "an f32 input below 2^-115, which the bound does not cover");
    }
    ds_kview out = heads_inner(obuf, dt, s, s.H, s.Tq), dq = heads_inner(dqb, dt, s, s.H, s.Tq);
    ds_kview dk = heads_inner(dkb, dt, s, KV, s.Tk), dv = heads_inner(dvb, dt, s, KV, s.Tk);
    std::vector<float> lsebuf((size_t)(s.B * s.H * s.Tq), NAN);
    int64_t lsz[3] = { s.B, s.H, s.Tq }, lst[3] = { s.H * s.Tq, s.Tq, 1 };
    ds_kview lse = emu::view(lsebuf.data(), DS_F32, 3, lsz, lst);

    mma_geom g = mma_geom_of(q, k, scale, s.causal);
    emu::launch("mma_forward_kernel", mma_query_blocks(g), MMA_THREADS, mma_forward_smem<T>(D),
                [&] { mma_forward_kernel<T, D>(out, lse, q, k, v, g); });
    std::vector<float> stats(mma_stats_bytes(g) / sizeof(float), NAN);
    emu::launch("mma_stats_kernel", mma_stats_blocks(g), MMA_STATS_THREADS, 0,
                [&] { mma_stats_kernel<T, D>(stats.data(), dout, out, lse, g); });
    emu::launch("mma_dq_kernel", mma_dq_blocks<T>(g, D), MMA_THREADS, mma_dq_smem<T>(D),
                [&] { mma_dq_kernel<T, D>(dq, dout, q, k, v, stats.data(), g); });
    emu::launch("mma_dkdv_kernel", mma_dkdv_blocks(g, D), MMA_THREADS, mma_dkdv_smem<T>(D),
                [&] { mma_dkdv_kernel<T, D>(dk, dv, dout, q, k, v, stats.data(), g); });

    /* the reference, in double, per (b, h), with each element's TF32
     * bound (used for f32; 16-bit inputs are checked against a tolerance) */
    error e_out, e_lse, e_dq, e_dk, e_dv;
    const size_t n = (size_t)(s.Tq * s.Tk);
    std::vector<double> S(n), P(n), dS(n), perr(n), dserr(n);
    /* a kv head's dK and dV (and their bounds), summed over its group */
    const size_t nk = (size_t)(s.Tk * D);
    std::vector<double> gk(nk), gv(nk), bk(nk), bv(nk);
    /* a sum of n products through the mma (and a few more operations in
     * f32) is off by sum_err(n) times the sum of its terms' magnitudes: a
     * dot product over the head dim by e_dot; exp2 is off by eta relative
     * (ex2.approx's 2^-22), and flushing results below 2^-126 (tau) to zero
     * costs tau each; a dS below f32's normal range goes in off by up to
     * 2^-137 (sub) */
    const f32_model fm = model_of<T>();
    auto sum_err = [&fm](double n_terms) { return (1 + fm.prod) * (1 + gamma_n(fm.roundings(n_terms) + 4)) - 1; };
    const double e_dot = sum_err(D + 4), eta = 4 * E, tau = FLT_MIN, sub = 0x1p-137;
    auto A = [](const ds_kview &x, int64_t b, int64_t h, int64_t t, int d) { return (double)at<T>(x, b, h, t, d); };
    for (int64_t b = 0; b < s.B; b++)
        for (int64_t h = 0; h < s.H; h++) {
            const int64_t kh = h / G;
            for (int64_t i = 0; i < s.Tq; i++) {
                double mx = -INFINITY, amax = 0;
                for (int64_t j = 0; j < s.Tk; j++) {
                    double dot = 0, mag = 0;
                    for (int d = 0; d < D; d++) {
                        dot += A(q, b, h, i, d) * A(k, b, kh, j, d);
                        mag += fabs(A(q, b, h, i, d) * A(k, b, kh, j, d));
                    }
                    bool hidden = s.causal && j > i;
                    S[i * s.Tk + j] = hidden ? -INFINITY : dot * scale;
                    if (!hidden) amax = fmax(amax, mag);
                    mx = fmax(mx, S[i * s.Tk + j]);
                }
                double sum = 0;
                for (int64_t j = 0; j < s.Tk; j++) sum += P[i * s.Tk + j] = exp(S[i * s.Tk + j] - mx);
                for (int64_t j = 0; j < s.Tk; j++) P[i * s.Tk + j] /= sum;
                double lse_i = mx + log(sum);
                /* every score of the row is off by at most delta (natural
                 * units): the dot's error, its scaling into base 2 and the
                 * subtraction of the row's max (within 2 scale amax) */
                double delta = scale * amax * (e_dot + 8 * E);
                /* so each probability is within exp(+-(2 delta + 2 eta)) of
                 * its value, and goes into P V (as does v) as the model
                 * says, summed over Tk keys with the tiles' rescaling (at
                 * most one per 8 keys) */
                double ratio = exp(2 * delta + 2 * eta) * (1 + fm.prod) *
                               (1 + gamma_n(fm.roundings((double)s.Tk) + ceil(s.Tk / 8.0) + 8)) - 1;
                /* lse = max + log(sum): the scores' delta, the sum's
                 * roundings, and the final f32 log, add and divide */
                double lam = delta + 2 * eta + gamma_n(2 * s.Tk + 8) + 8 * E * (fabs(lse_i) + log2((double)s.Tk) + 2) +
                             s.Tk * tau;
                double lse_k = lsebuf[(size_t)((b * s.H + h) * s.Tq + i)];
                e_lse.add(lse_k, lse_i, lam);
                double di = 0, kappa = 0;    /* delta = dO . O of the kernel's O, and its f32 dot's error */
                for (int d = 0; d < D; d++) {
                    double o = 0, po = 0, vmax = 0;
                    for (int64_t j = 0; j < s.Tk; j++) {
                        o += P[i * s.Tk + j] * A(v, b, kh, j, d);
                        po += P[i * s.Tk + j] * fabs(A(v, b, kh, j, d));
                        vmax = fmax(vmax, fabs(A(v, b, kh, j, d)));
                    }
                    e_out.add(A(out, b, h, i, d), o, ratio * po + 2 * s.Tk * tau * vmax);
                    di += A(out, b, h, i, d) * A(dout, b, h, i, d);
                    kappa += gamma_n(D + 2) * fabs(A(out, b, h, i, d) * A(dout, b, h, i, d));
                }
                /* The backward is held to its own inputs, the forward's out
                 * and lse as the kernel wrote them (checked above), so P is
                 * exp(s scale - lse_k) here, and each kernel answers for its
                 * own arithmetic. The kernel's P = exp2(s scale_log2 - lse_k
                 * log2 e) is off by the scores' delta (whose 8 e scale amax
                 * covers scale_log2's three roundings and the product's),
                 * exp2's eta, and lse_k's two roundings into base 2 and the
                 * subtraction's: within 4 e (|lse_k| + |ln P| + 1), natural
                 * units. */
                for (int64_t j = 0; j < s.Tk; j++) P[i * s.Tk + j] = exp(S[i * s.Tk + j] - lse_k);
                for (int64_t j = 0; j < s.Tk; j++) {
                    double dp = 0, mag = 0;
                    for (int d = 0; d < D; d++) {
                        dp += A(dout, b, h, i, d) * A(v, b, kh, j, d);
                        mag += fabs(A(dout, b, h, i, d) * A(v, b, kh, j, d));
                    }
                    double p = P[i * s.Tk + j], lnp = p > 0 ? fabs(log(p)) : 0;
                    double rho = exp(delta + eta + 4 * E * (fabs(lse_k) + lnp + 1)) - 1;
                    double x = dp - di, xerr = (e_dot * mag + kappa) * (1 + E) + E * fabs(x);
                    dS[i * s.Tk + j] = p * x;
                    perr[i * s.Tk + j] = rho * p + tau;
                    dserr[i * s.Tk + j] = prod_err(p, perr[i * s.Tk + j], fabs(x), xerr, E) + sub;
                }
            }
            for (int64_t i = 0; i < s.Tq; i++)
                for (int d = 0; d < D; d++) {
                    double a = 0, bound = 0;
                    for (int64_t j = 0; j < s.Tk; j++) {
                        a += dS[i * s.Tk + j] * A(k, b, kh, j, d);
                        bound += prod_err(fabs(dS[i * s.Tk + j]), dserr[i * s.Tk + j], fabs(A(k, b, kh, j, d)), 0,
                                          sum_err((double)s.Tk));
                    }
                    e_dq.add(A(dq, b, h, i, d), a * scale, bound * scale);
                }
            /* the kernel sums a key's terms over the group's G Tq queries */
            const double sk = sum_err((double)(G * s.Tq));
            if (h % G == 0) {
                std::fill(gk.begin(), gk.end(), 0.0), std::fill(gv.begin(), gv.end(), 0.0);
                std::fill(bk.begin(), bk.end(), 0.0), std::fill(bv.begin(), bv.end(), 0.0);
            }
            for (int64_t j = 0; j < s.Tk; j++)
                for (int d = 0; d < D; d++) {
                    size_t at_jd = (size_t)(j * D + d);
                    for (int64_t i = 0; i < s.Tq; i++) {
                        double qv = A(q, b, h, i, d), gv_ = A(dout, b, h, i, d);
                        gk[at_jd] += dS[i * s.Tk + j] * qv;
                        gv[at_jd] += P[i * s.Tk + j] * gv_;
                        bk[at_jd] += prod_err(fabs(dS[i * s.Tk + j]), dserr[i * s.Tk + j], fabs(qv), 0, sk);
                        bv[at_jd] += prod_err(P[i * s.Tk + j], perr[i * s.Tk + j], fabs(gv_), 0, sk);
                    }
                    if (h % G == G - 1) {
                        e_dk.add(A(dk, b, kh, j, d), gk[at_jd] * scale, bk[at_jd] * scale);
                        e_dv.add(A(dv, b, kh, j, d), gv[at_jd], bv[at_jd]);
                    }
                }
        }
    const char *name = dt == DS_BF16 ? "bf16" : dt == DS_F16 ? "f16" : mma_parts<T>() == 2 ? "f32 (3xtf32)" : "f32 (tf32)";
    struct { const char *what; const error &e; } rows[] = {
        { "out", e_out }, { "lse", e_lse }, { "dq", e_dq }, { "dk", e_dk }, { "dv", e_dv },
    };
    for (const auto &r : rows) {
        if (dt == DS_F32) {
            check(r.e.over <= 1, "%s D=%d B=%lld H=%lld KV=%lld Tq=%lld Tk=%lld causal=%d: %s off by %.3g times its "
                  "bound", name, D, (long long)s.B, (long long)s.H, (long long)KV, (long long)s.Tq, (long long)s.Tk,
                  s.causal, r.what, r.e.over);
            continue;
        }
        /* 16-bit inputs and outputs: a few units of the last place of the
         * largest value; a wrong fragment or mask is off by O(1) */
        double tol = dt == DS_BF16 ? 2e-2 : 4e-3;
        check(r.e.rel() <= tol, "%s D=%d B=%lld H=%lld KV=%lld Tq=%lld Tk=%lld causal=%d: %s off by %.3g of its "
              "largest %.3g", name, D, (long long)s.B, (long long)s.H, (long long)KV, (long long)s.Tq, (long long)s.Tk,
              s.causal, r.what, r.e.rel(), r.e.scale);
    }
    printf("%s D=%d H=%lld KV=%lld Tq=%lld Tk=%lld causal=%d: out %.1e lse %.1e dq %.1e dk %.1e dv %.1e", name, D,
           (long long)s.H, (long long)KV, (long long)s.Tq, (long long)s.Tk, s.causal, e_out.rel(), e_lse.rel(), e_dq.rel(), e_dk.rel(), e_dv.rel());
    if (dt == DS_F32)
        printf("; of the bound: out %.2f lse %.2f dq %.2f dk %.2f dv %.2f", e_out.over, e_lse.over, e_dq.over,
               e_dk.over, e_dv.over);
    printf("\n");
}

/* cvt.rna.tf32.f32 as the emulator runs it: to nearest, ties away from
 * zero (1 + 2^-11 lies halfway between 1 and 1 + 2^-10, and nearest-even
 * would give 1). */
void tf32_rounding() {
    struct { float x, want; } cases[] = {
        { 1 + 0x1p-11f, 1 + 0x1p-10f }, { -(1 + 0x1p-11f), -(1 + 0x1p-10f) }, { 1 + 0x1p-11f - 0x1p-23f, 1 },
        { 1 + 3 * 0x1p-11f, 1 + 0x1p-9f }, { 0x1p-130f, 0x1p-130f }, { 0x1p-140f, 0 }, { FLT_MAX, INFINITY },
    };
    for (const auto &c : cases) {
        float got = __uint_as_float(tf32_of(__float_as_uint(c.x)));
        check(got == c.want, "tf32_of(%a) = %a, want %a", c.x, got, c.want);
    }
    check(isnan(__uint_as_float(tf32_of(__float_as_uint(NAN)))), "tf32_of(NaN) is NaN");
}

} /* namespace */

int main() {
    std::mt19937 rng(7);
    /* partial last tiles, whole tiles off the diagonal, cross attention
     * with more keys than queries and the other way round */
    run_case<__nv_bfloat16, 64>({ 2, 2, 130, 130, 64, true }, DS_BF16, rng);
    run_case<__nv_bfloat16, 64>({ 1, 2, 130, 130, 64, false }, DS_BF16, rng);
    run_case<__nv_bfloat16, 64>({ 1, 1, 70, 150, 64, false }, DS_BF16, rng);
    run_case<__nv_bfloat16, 64>({ 1, 1, 300, 300, 64, false }, DS_BF16, rng);
    run_case<__nv_bfloat16, 64>({ 1, 3, 320, 320, 64, true }, DS_BF16, rng);
    run_case<__nv_bfloat16, 64>({ 1, 1, 150, 70, 64, true }, DS_BF16, rng);
    run_case<__half, 64>({ 1, 2, 100, 100, 64, true }, DS_F16, rng);
    run_case<__nv_bfloat16, 128>({ 1, 1, 128, 128, 128, true }, DS_BF16, rng);
    run_case<__half, 128>({ 1, 1, 90, 90, 128, false }, DS_F16, rng);
    /* grouped-query: 2 and 4 query heads per kv head, several key blocks */
    run_case<__nv_bfloat16, 64>({ 1, 4, 130, 130, 64, true, 2 }, DS_BF16, rng);
    run_case<__nv_bfloat16, 64>({ 2, 4, 150, 150, 64, false, 1 }, DS_BF16, rng);
    run_case<__half, 128>({ 1, 4, 140, 140, 128, true, 1 }, DS_F16, rng);
    tf32_rounding();
    run_case<float, 64>({ 1, 2, 130, 130, 64, true }, DS_F32, rng);
    run_case<float, 64>({ 1, 1, 77, 150, 64, false }, DS_F32, rng);
    run_case<float, 64>({ 1, 1, 150, 61, 64, false }, DS_F32, rng);
    run_case<float, 128>({ 1, 1, 129, 129, 128, true }, DS_F32, rng);
    run_case<float, 128>({ 1, 1, 90, 70, 128, false }, DS_F32, rng);
    run_case<float, 64>({ 1, 4, 130, 130, 64, true, 1 }, DS_F32, rng);
    run_case<tf32x3, 64>({ 1, 2, 130, 130, 64, true }, DS_F32, rng);
    run_case<tf32x3, 64>({ 1, 1, 77, 150, 64, false }, DS_F32, rng);
    run_case<tf32x3, 64>({ 1, 1, 150, 61, 64, true }, DS_F32, rng);
    run_case<tf32x3, 128>({ 1, 1, 129, 129, 128, true }, DS_F32, rng);
    run_case<tf32x3, 128>({ 1, 1, 90, 70, 128, false }, DS_F32, rng);
    run_case<tf32x3, 128>({ 1, 1, 61, 133, 128, false }, DS_F32, rng);
    run_case<tf32x3, 64>({ 1, 4, 130, 130, 64, true, 2 }, DS_F32, rng);
    run_case<tf32x3, 128>({ 1, 2, 100, 150, 128, false, 1 }, DS_F32, rng);
    return check_summary("test_attention_mma");
}
