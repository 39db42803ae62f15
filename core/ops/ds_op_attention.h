/* Scaled dot-product attention as one fused op:
 * softmax(q k^T * scale [+ causal mask]) v, without ever holding the
 * Tq x Tk scores. Backward recomputes them block-wise from the saved
 * per-row log-sum-exp. */
#ifndef DS_OP_ATTENTION_H
#define DS_OP_ATTENTION_H

#include "ds_tensor.h"

/* q [B,H,Tq,D], k [B,H,Tk,D], v [B,H,Tk,Dv], one float dtype, any strides;
 * returns [B,H,Tq,Dv] in that dtype (bf16/f16 compute in f32). causal hides
 * key j from query i when j > i and needs Tq == Tk. scale NAN means
 * 1/sqrt(D), as torch's scaled_dot_product_attention. */
ds_tensor *ds_scaled_dot_product_attention(ds_tensor *q, ds_tensor *k, ds_tensor *v, bool causal, double scale);

/* The same over the heads of a fused projection: qkv [B,T,3*C] holds q, k
 * and v side by side, each n_head heads of C/n_head; returns [B,T,C], the
 * heads merged. Backward writes the gradient of qkv in one buffer, with
 * no split, transpose or concatenation around the op. */
ds_tensor *ds_qkv_attention(ds_tensor *qkv, int64_t n_head, bool causal, double scale);

#endif
