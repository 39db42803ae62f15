/* Neural-network row ops with torch.nn.functional semantics: softmax,
 * log_softmax, cross_entropy, mse_loss, layer_norm, rms_norm, dropout.
 * Each is one fused kernel forward and one backward; bf16/f16 inputs are
 * computed in higher precision and returned in their own dtype, but for a
 * loss reduced by mean or sum: that is f32, as under PyTorch's autocast,
 * the gradients still in the input's dtype. */
#ifndef DS_OP_NN_H
#define DS_OP_NN_H

#include "ds_tensor.h"
#include "ds_rng.h"

typedef enum { DS_NN_NONE, DS_NN_MEAN, DS_NN_SUM } ds_nn_reduction;

/* "none", "mean" or "sum"; -1 if unknown */
int ds_nn_reduction_parse(const char *name);

/* Over dim (0-based, negative from the end); backward uses the output. */
ds_tensor *ds_softmax(ds_tensor *x, int64_t dim);
ds_tensor *ds_log_softmax(ds_tensor *x, int64_t dim);

/* logits [..., C] with the class dim LAST (PyTorch puts it at dim 1 for
 * more than 2 dims), target [...] i64 or i32 0-based class ids: [N, C]
 * with [N], [B, T, C] with [B, T], [C] with a 0-dim target. Rows whose
 * target is ignore_index contribute 0 and are not counted by the mean.
 * label_smoothing in [0, 1] mixes the one-hot target with uniform.
 * classes (0: all) counts only the first classes columns of the class dim,
 * for a vocab padded to a round size (llm.c): the others never enter the
 * softmax and get a zero gradient. */
ds_tensor *ds_cross_entropy(ds_tensor *logits, ds_tensor *target, int64_t ignore_index, double label_smoothing,
                            int64_t classes, ds_nn_reduction reduction);
/* (input - target)^2, broadcast, reduced */
ds_tensor *ds_mse_loss(ds_tensor *input, ds_tensor *target, ds_nn_reduction reduction);

/* Normalises over the last norm_ndim dims of x; weight and bias (NULL when
 * absent) have exactly those dims. */
ds_tensor *ds_layer_norm(ds_tensor *x, int norm_ndim, ds_tensor *weight, ds_tensor *bias, double eps);
/* The residual add and the norm after it in one kernel each way: *sum =
 * x + res (same shape, dtype and device) and the result is
 * ds_layer_norm(*sum, ...). Backward gives x and res one gradient (the
 * sum's other gradients added inside the norm's backward kernel). NULL
 * with *sum NULL on error. */
ds_tensor *ds_add_layer_norm(ds_tensor *x, ds_tensor *res, int norm_ndim, ds_tensor *weight, ds_tensor *bias,
                             double eps, ds_tensor **sum);
/* x rsqrt(mean(x^2) + eps) weight; eps NAN means the machine epsilon of
 * the compute type (f32 for f32/bf16/f16 inputs, f64 for f64), as
 * torch.nn.functional.rms_norm with eps=None. */
ds_tensor *ds_rms_norm(ds_tensor *x, int norm_ndim, ds_tensor *weight, double eps);
/* ds_rms_norm(*sum, ...) with *sum = x + res, as ds_add_layer_norm. */
ds_tensor *ds_add_rms_norm(ds_tensor *x, ds_tensor *res, int norm_ndim, ds_tensor *weight, double eps,
                           ds_tensor **sum);

/* Rotary position embedding in Hugging Face's rotate_half form: x cos +
 * cat(-x2, x1) sin over x's last dim (even; x1, x2 its halves), cos and
 * sin of x's dtype and device, broadcast to x's shape, taking no
 * gradient. One kernel each way, rounding as those composed ops do: the
 * same bits forward and backward. */
ds_tensor *ds_rope(ds_tensor *x, ds_tensor *cos, ds_tensor *sin);

/* SwiGLU, silu(gate) up, gate and up of one shape and float dtype (any
 * strides, no broadcast): one kernel forward (in f32 for f32, bf16 and
 * f16, in f64 for f64) keeping only gate and up, one backward writing
 * both gradients (in f64, as SiLU's). */
ds_tensor *ds_swiglu(ds_tensor *gate, ds_tensor *up);

/* Zeroes each element with probability p and scales the rest by 1/(1-p);
 * the mask comes from g (NULL: the default generator) and is the same at
 * any thread count. Not training, or p = 0, returns x itself. */
ds_tensor *ds_dropout(ds_tensor *x, double p, bool training, ds_generator *g);

#endif
