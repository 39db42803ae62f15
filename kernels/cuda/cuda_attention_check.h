/* The problem the Hopper attention forward is checked on against the
 * mma.sync one before it is trusted (cuda_attention_mma.cu), and the
 * bound their outputs must agree within: host C++, so
 * tests/test_wgmma_attention.cc holds the emulated kernels to the same
 * check. q, k and v are [1, CHECK_H, CHECK_T, D], contiguous. */
#ifndef CUDA_ATTENTION_CHECK_H
#define CUDA_ATTENTION_CHECK_H

#include "../ds_half.h"
#include "../ds_kview.h"

#include <float.h>
#include <math.h>

#include <vector>

#define CHECK_H 2
#define CHECK_T 200    /* two key tiles of the Hopper kernel, one partial */

/* q, k, v one after another: xorshift values in [-2.5, 2.5], exact in dt. */
static inline std::vector<float> attn_check_inputs(ds_dtype dt, int D) {
    std::vector<float> x((size_t)3 * CHECK_H * CHECK_T * D);
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

#endif
