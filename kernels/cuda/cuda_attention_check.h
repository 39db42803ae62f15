/* The problem the Hopper attention forward and backward are checked on
 * against the mma.sync ones before they are trusted
 * (cuda_attention_mma.cu), and the bounds their outputs must agree
 * within: host C++, so tests/test_wgmma_attention.cc and
 * tests/test_wgmma_backward.cc hold the emulated kernels to the same
 * checks. q, k, v (and dO) are [1, CHECK_H, CHECK_T, D], contiguous. */
#ifndef CUDA_ATTENTION_CHECK_H
#define CUDA_ATTENTION_CHECK_H

#include "../ds_half.h"
#include "../ds_kview.h"

#include <float.h>
#include <math.h>

#include <vector>

#define CHECK_H 2
#define CHECK_T 200    /* two key tiles of the Hopper kernel, one partial */

/* q, k, v (and dO, with 4 tensors) one after another: xorshift values
 * in [-2.5, 2.5], exact in dt. */
static inline std::vector<float> attn_check_inputs(ds_dtype dt, int D, int tensors = 3) {
    std::vector<float> x((size_t)tensors * CHECK_H * CHECK_T * D);
    uint32_t r = 12345;
    for (float &e : x) {
        r ^= r << 13, r ^= r >> 17, r ^= r << 5;
        float f = (float)(r % 2001) / 400.f - 2.5f;
        e = dt == DS_BF16 ? ds_bf16_to_f32(ds_f32_to_bf16(f)) : ds_f16_to_f32(ds_f32_to_f16(f));
    }
    return x;
}

/* Where two forwards' outputs (oa, ob; lse la, lb) may differ, element by
 * element: each is off from attention in exact arithmetic by at most
 * rho sum_j P_j |v_jd| plus its rounding to the dtype (unit roundoff u,
 * u |o|), rho from the scores' f32 sums (delta, natural units),
 * ex2.approx (eta) and the f32 sums of P and P V; lse by delta, eta, the
 * sum's roundings and the f32 log. Returns the largest |a - b| over its
 * bound, and in *at where (an element of out, or -1 - the row for lse). */
static inline double attn_check_compare(const std::vector<float> &x, int D, int causal, double scale, double u,
                                        const std::vector<float> &oa, const std::vector<float> &ob,
                                        const std::vector<float> &la, const std::vector<float> &lb, long *at) {
    const double E = 1.0 / 16777216, eta = 4 * E;
    auto gamma = [E](double n) { return n * E / (1 - n * E); };
    const size_t n = (size_t)CHECK_H * CHECK_T * D;
    const float *q = x.data(), *k = q + n, *v = k + n;
    double worst = 0;
    std::vector<double> P(CHECK_T);
    for (int h = 0; h < CHECK_H; h++)
        for (int i = 0; i < CHECK_T; i++) {
            const float *qi = q + ((size_t)h * CHECK_T + i) * D;
            double mx = -INFINITY, amax = 0, sum = 0;
            for (int j = 0; j < CHECK_T; j++) {
                const float *kj = k + ((size_t)h * CHECK_T + j) * D;
                double dot = 0, mag = 0;
                for (int d = 0; d < D; d++) dot += (double)qi[d] * kj[d], mag += fabs((double)qi[d] * kj[d]);
                bool hidden = causal && j > i;
                P[j] = hidden ? -INFINITY : dot * scale;
                if (!hidden) amax = fmax(amax, mag * scale);
                mx = fmax(mx, P[j]);
            }
            for (int j = 0; j < CHECK_T; j++) sum += P[j] = exp(P[j] - mx);
            double delta = amax * (gamma(D + 4) + 8 * E), g2 = gamma(2 * CHECK_T + 8);
            double rho = exp(4 * delta + 4 * eta) * (1 + u) * (1 + g2) * (1 + g2) - 1;
            size_t row = (size_t)h * CHECK_T + i;
            double lse = mx + log(sum), lam = delta + 2 * eta + g2 + 8 * E * (fabs(lse) + log2((double)CHECK_T) + 2);
            double e = fabs((double)la[row] - lb[row]) / (2 * lam);
            if (!(e <= worst)) worst = e, *at = -1 - (long)row;
            for (int d = 0; d < D; d++) {
                double o = 0, w = 0;
                for (int j = 0; j < CHECK_T; j++) {
                    double vj = v[((size_t)h * CHECK_T + j) * D + d];
                    o += P[j] / sum * vj, w += P[j] / sum * fabs(vj);
                }
                size_t el = row * D + d;
                double bound = 2 * (rho * w * (1 + u) + u * fabs(o)) + 2 * CHECK_T * FLT_MIN * w;
                e = fabs((double)oa[el] - ob[el]) / bound;
                if (!(e <= worst)) worst = e, *at = (long)el;
            }
        }
    return worst;
}

/* Where two backwards' gradients (ga, gb: dq, dk, dv) may differ, both run
 * on x's q, k, v and dO and the same forward out and lse, element by
 * element. Each is off from the exact gradient of those inputs (P = exp(s
 * - lse) with the lse given) by what test_attention_mma.cc's bound
 * carries: P by the scores' delta, exp2's eta and lse's roundings into
 * base 2 (rho), and its rounding to the dtype (u) as an mma operand;
 * dP - delta by the f32 dots over D; dS = P (dP - delta) by those and its
 * rounding to the dtype; each gradient by its terms' errors and the f32
 * sum over T keys or queries, then its rounding to the dtype. Returns the
 * largest |a - b| over twice that, and in *which (0 dq, 1 dk, 2 dv) and
 * *at the element. */
static inline double attn_check_backward_compare(const std::vector<float> &x, int D, int causal, double scale,
                                                 double u, const std::vector<float> &out,
                                                 const std::vector<float> &lse, const std::vector<float> ga[3],
                                                 const std::vector<float> gb[3], int *which, long *at) {
    const double E = 1.0 / 16777216, eta = 4 * E, tau = FLT_MIN, sub = 0x1p-137;
    auto gamma = [E](double n) { return n * E / (1 - n * E); };
    auto prod_err = [](double a, double ea, double b, double eb, double r) { return (a + ea) * (b + eb) * (1 + r) - a * b; };
    const int T = CHECK_T;
    const size_t n = (size_t)CHECK_H * T * D;
    const float *q = x.data(), *k = q + n, *v = k + n, *go = v + n;
    const double ru = (1 + E) * (1 + u) - 1, rsum = (1 + gamma(T + 5)) * (1 + u) - 1;
    double worst = 0;
    std::vector<double> P((size_t)T * T), perr(P.size()), dS(P.size()), dserr(P.size());
    auto compare = [&](int w, size_t el, double exact, double bound) {
        double e = fabs((double)ga[w][el] - gb[w][el]) / (2 * (bound * (1 + u) + u * fabs(exact)));
        if (!(e <= worst)) worst = e, *which = w, *at = (long)el;
    };
    for (int h = 0; h < CHECK_H; h++) {
        const size_t hb = (size_t)h * T * D;
        for (int i = 0; i < T; i++) {
            const float *qi = q + hb + (size_t)i * D, *gi = go + hb + (size_t)i * D, *oi = out.data() + hb + (size_t)i * D;
            double amax = 0, di = 0, kappa = 0, lk = lse[(size_t)h * T + i];
            for (int j = 0; j < T; j++) {
                double mag = 0;
                for (int d = 0; d < D; d++) mag += fabs((double)qi[d] * k[hb + (size_t)j * D + d]);
                if (!(causal && j > i)) amax = fmax(amax, mag * scale);
            }
            for (int d = 0; d < D; d++) di += (double)oi[d] * gi[d], kappa += gamma(D + 2) * fabs((double)oi[d] * gi[d]);
            double delta = amax * (gamma(D + 4) + 8 * E);
            for (int j = 0; j < T; j++) {
                const float *kj = k + hb + (size_t)j * D, *vj = v + hb + (size_t)j * D;
                double s = 0, dp = 0, mag = 0;
                for (int d = 0; d < D; d++)
                    s += (double)qi[d] * kj[d], dp += (double)gi[d] * vj[d], mag += fabs((double)gi[d] * vj[d]);
                size_t ij = (size_t)i * T + j;
                double p = causal && j > i ? 0 : exp(s * scale - lk), lnp = p > 0 ? fabs(log(p)) : 0;
                double rho = exp(delta + eta + 4 * E * (fabs(lk) + lnp + 1)) * (1 + u) - 1, xv = dp - di;
                double xerr = (gamma(D + 4) * mag + kappa) * (1 + E) + E * fabs(xv);
                P[ij] = p, perr[ij] = rho * p + tau, dS[ij] = p * xv;
                dserr[ij] = prod_err(p, perr[ij], fabs(xv), xerr, ru) + sub;
            }
        }
        for (int i = 0; i < T; i++)
            for (int d = 0; d < D; d++) {
                double a = 0, bound = 0;
                for (int j = 0; j < T; j++) {
                    double kv = k[hb + (size_t)j * D + d];
                    a += dS[(size_t)i * T + j] * kv;
                    bound += prod_err(fabs(dS[(size_t)i * T + j]), dserr[(size_t)i * T + j], fabs(kv), 0, rsum);
                }
                compare(0, hb + (size_t)i * D + d, a * scale, bound * scale);
            }
        for (int j = 0; j < T; j++)
            for (int d = 0; d < D; d++) {
                double a = 0, c = 0, ba = 0, bc = 0;
                for (int i = 0; i < T; i++) {
                    size_t ij = (size_t)i * T + j;
                    double qv = q[hb + (size_t)i * D + d], gv = go[hb + (size_t)i * D + d];
                    a += dS[ij] * qv, c += P[ij] * gv;
                    ba += prod_err(fabs(dS[ij]), dserr[ij], fabs(qv), 0, rsum);
                    bc += prod_err(P[ij], perr[ij], fabs(gv), 0, rsum);
                }
                compare(1, hb + (size_t)j * D + d, a * scale, ba * scale);
                compare(2, hb + (size_t)j * D + d, c, bc);
            }
    }
    return worst;
}

#endif
