/* Scaled dot-product attention, softmax(q k^T * scale [+ causal mask]) v,
 * by one of two backends. fused: one op that never holds the Tq x Tk
 * scores; backward recomputes them block-wise from the saved per-row
 * log-sum-exp. math: batched GEMMs, softmax and GEMMs again as ordinary
 * differentiable ops, the B*H*Tq*Tk scores in memory (torch's math
 * backend); on the GPU in f32/f64 it beats the fused kernel, which has
 * tensor cores only for bf16/f16. */
#ifndef DS_OP_ATTENTION_H
#define DS_OP_ATTENTION_H

#include "ds_tensor.h"

/* auto: math on a GPU where its fused kernel has no tensor-core path for
 * the inputs (f32, f64; bf16/f16 with head dims other than 64 and 128)
 * while one call's scores take at most 2 GiB, fused everywhere else. */
typedef enum { DS_ATTN_AUTO, DS_ATTN_FUSED, DS_ATTN_MATH } ds_attention_backend;

/* q [B,H,Tq,D], k [B,H,Tk,D], v [B,H,Tk,Dv], one float dtype, any strides;
 * returns [B,H,Tq,Dv] in that dtype (bf16/f16 compute in f32), laid out
 * [B,Tq,H,Dv] in memory so that transpose(1, 2) then a view merges the
 * heads without a copy. causal hides
 * key j from query i when j > i and needs Tq == Tk. scale NAN means
 * 1/sqrt(D), as torch's scaled_dot_product_attention. */
ds_tensor *ds_scaled_dot_product_attention(ds_tensor *q, ds_tensor *k, ds_tensor *v, bool causal, double scale,
                                           ds_attention_backend backend);

/* The same over the heads of a fused projection: qkv [B,T,3*C] holds q, k
 * and v side by side, each n_head heads of C/n_head; returns [B,T,C], the
 * heads merged. The fused backward writes the gradient of qkv in one
 * buffer, with no split, transpose or concatenation around the op. */
ds_tensor *ds_qkv_attention(ds_tensor *qkv, int64_t n_head, bool causal, double scale,
                            ds_attention_backend backend);

#endif
