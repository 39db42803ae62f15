/* The transformer MLP as one op: linear, GELU, linear. Fused into one
 * autograd node so that, on the GPU, the GELU rides in the GEMMs'
 * cuBLASLt epilogues (forward and backward) instead of two extra passes
 * over the hidden activations. */
#ifndef DS_OP_MLP_H
#define DS_OP_MLP_H

#include "ds_tensor.h"

/* linear(gelu(linear(x, w1, b1)), w2, b2) with x [..., in], w1 [hidden, in],
 * b1 [hidden] or NULL, w2 [out, hidden], b2 [out] or NULL (PyTorch's
 * layouts), GELU's tanh form when approximate_tanh, else the erf form.
 * Values and gradients are those of the composed ops; on the GPU the tanh
 * form runs its GELU in the GEMM epilogues where cuBLASLt takes the views
 * (else the composed kernels run). */
ds_tensor *ds_gelu_mlp(ds_tensor *x, ds_tensor *w1, ds_tensor *b1, ds_tensor *w2, ds_tensor *b2,
                       int approximate_tanh);

#endif
