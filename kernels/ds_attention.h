/* Per-row math of fused attention, shared by the CPU kernel and a CUDA
 * flash kernel: which keys a query row sees, the online softmax that
 * streams over key blocks (running max and sum), the log-sum-exp saved for
 * backward, and the FlashAttention-2 score gradient. */
#ifndef DS_ATTENTION_H
#define DS_ATTENTION_H

#include "ds_half.h"
#include <math.h>

/* Keys query `row` attends to: all tk, or (causal) those at or before it. */
DS_HOSTDEV int64_t ds_attn_keys_visible(int64_t row, int64_t tk, int causal) {
    return causal && row + 1 < tk ? row + 1 : tk;
}

/* exp(x) in f32 for softmax terms: Cody-Waite reduction to r in
 * [-ln2/2, ln2/2] and Cephes' polynomial, within 2 ulp of expf. Branch-free
 * so the loops over keys vectorise; below -88 (and at -inf) it gives 0,
 * NaN stays NaN. The rounding to n uses the 1.5*2^23 trick, so a NaN never
 * goes through a float-to-int conversion. */
DS_HOSTDEV float ds_attn_exp(float x) {
    const float magic = 12582912.0f;
    float xc = x < -88.0f ? -88.0f : x > 88.0f ? 88.0f : x;
    float t = xc * 1.44269504088896341f + magic;
    float n = t - magic;
    float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t e = ds_f32_bits(t) - ds_f32_bits(magic) + 127u;   /* n + 127; 0 at n = -127 gives 0.0f */
    return p * ds_bits_f32(e << 23);
}

/* A query row's softmax so far: max of its scores and sum of exp(score - max). */
typedef struct { float max, sum; } ds_attn_state;

DS_HOSTDEV ds_attn_state ds_attn_start(void) {
    ds_attn_state s = { -INFINITY, 0.0f };
    return s;
}

/* Raises the running max to cover a block whose largest score is
 * block_max; returns the factor that rescales the sum and output
 * accumulated under the old max (0 for the first block). */
DS_HOSTDEV float ds_attn_rescale(ds_attn_state *st, float block_max) {
    float m = st->max > block_max ? st->max : block_max;
    float alpha = ds_attn_exp(st->max - m);
    st->max = m;
    st->sum *= alpha;
    return alpha;
}

/* log sum_j exp(score_j): all backward needs to rebuild the probabilities. */
DS_HOSTDEV float ds_attn_lse(ds_attn_state st) { return st.max + logf(st.sum); }

DS_HOSTDEV float ds_attn_prob(float score, float lse) { return ds_attn_exp(score - lse); }

/* dS = P * (dP - D), D = rowsum(dO * O) = rowsum(P * dP): softmax's
 * Jacobian applied without the row's other probabilities. */
DS_HOSTDEV float ds_attn_dscore(float p, float dp, float delta) { return p * (dp - delta); }

#endif
