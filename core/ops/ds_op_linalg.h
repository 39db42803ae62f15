/* Matrix products, forward and backward as GEMMs through the blas kernels.
 * Operands share one float dtype and one device; transposed and other
 * strided views go to the kernel as they are, without copies. */
#ifndef DS_OP_LINALG_H
#define DS_OP_LINALG_H

#include "ds_tensor.h"

/* torch.matmul: 1-D x 1-D is a dot product, a 1-D operand is promoted to a
 * matrix (and its dim dropped from the result), N-D operands multiply
 * their last two dims and broadcast the batch dims before them. */
ds_tensor *ds_matmul(ds_tensor *a, ds_tensor *b);
/* Strict forms: mm 2-D x 2-D, bmm [B,m,k] x [B,k,n]. */
ds_tensor *ds_mm(ds_tensor *a, ds_tensor *b);
ds_tensor *ds_bmm(ds_tensor *a, ds_tensor *b);
/* x [..., in] @ weight^T with weight [out, in] (PyTorch's layout), plus
 * bias [out] (or NULL), which seeds the output so the GEMM adds onto it. */
ds_tensor *ds_linear(ds_tensor *x, ds_tensor *weight, ds_tensor *bias);

#endif
