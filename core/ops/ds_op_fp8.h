/* FP8 tensors as the fp8 linear layer uses them: a u8 tensor of codes in
 * one of kernels/ds_fp8.h's formats, read through a meta tensor of three
 * f32 on its device (scale, scale_inv, amax: Transformer Engine's per-tensor
 * scaling). No autograd: the layer's backward (lua/dslua/nn/fp8.lua) is
 * written of these ops. */
#ifndef DS_OP_FP8_H
#define DS_OP_FP8_H

#include "ds_tensor.h"
#include "ds_fp8.h"

/* The codes (u8, x's shape) of x * meta's scale in fmt; meta's amax becomes
 * max(amax, max |x|). current: meta's scale is first set from max |x|, or
 * from amax (f32 [1], NULL for none: the max over the ranks holding pieces
 * of one tensor, which then share one scale), by ds_fp8_scale with the
 * given margin (1 where that is 0), and scale_inv to its inverse. x float. */
ds_tensor *ds_fp8_cast(ds_tensor *x, ds_tensor *meta, ds_fp8_format fmt, int current, int margin, ds_tensor *amax);
/* ds_fp8_cast of x [m, k] into *q [m, k] and its transpose *qt [k, m] in
 * one pass: the same codes in both layouts (an fp8 GEMM's forward operand
 * and its backward's). 0, or -1 with both NULL after ds_fail. */
int ds_fp8_cast_transpose(ds_tensor *x, ds_tensor *meta, ds_fp8_format fmt, int current, int margin, ds_tensor *amax,
                          ds_tensor **q, ds_tensor **qt);
/* max |x| as f32 [1] on x's device (NaNs left out, as the cast's amax). */
ds_tensor *ds_fp8_amax(ds_tensor *x);
/* q's values times meta's scale_inv, in dtype (a float). */
ds_tensor *ds_fp8_uncast(ds_tensor *q, ds_tensor *meta, ds_fp8_format fmt, ds_dtype dtype);
/* c [m, n] = a [m, k] @ b [n, k]^T in values (each operand's codes times
 * its scale_inv) + bias [n] (NULL for none), in dtype, accumulated in f32:
 * the backend's fp8 GEMM where it applies, else the codes uncast to f32
 * (unscaled, so their products are exact), the f32 GEMM, and both
 * scale_invs applied to the result. */
ds_tensor *ds_fp8_gemm(ds_tensor *a, ds_tensor *a_meta, ds_fp8_format a_fmt, ds_tensor *b, ds_tensor *b_meta,
                       ds_fp8_format b_fmt, ds_tensor *bias, ds_dtype dtype);

#endif
