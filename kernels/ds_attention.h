/* Per-row math of fused attention, shared by the CPU kernel and a CUDA
 * flash kernel: which keys a query row sees, the online softmax that
 * streams over key blocks (running max and sum), the log-sum-exp saved for
 * backward, and the FlashAttention-2 score gradient. */
#ifndef DS_ATTENTION_H
#define DS_ATTENTION_H

#include "ds_expf.h"
#include <math.h>

/* Keys query `row` attends to: all tk, or (causal) those at or before it. */
DS_HOSTDEV int64_t ds_attn_keys_visible(int64_t row, int64_t tk, int causal) {
    return causal && row + 1 < tk ? row + 1 : tk;
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
    float alpha = ds_expf(st->max - m);
    st->max = m;
    st->sum *= alpha;
    return alpha;
}

/* log sum_j exp(score_j): all backward needs to rebuild the probabilities. */
DS_HOSTDEV float ds_attn_lse(ds_attn_state st) { return st.max + logf(st.sum); }

DS_HOSTDEV float ds_attn_prob(float score, float lse) { return ds_expf(score - lse); }

/* dS = P * (dP - D), D = rowsum(dO * O) = rowsum(P * dP): softmax's
 * Jacobian applied without the row's other probabilities. */
DS_HOSTDEV float ds_attn_dscore(float p, float dp, float delta) { return p * (dp - delta); }

#endif
