/* The pieces of a linear layer that ops built from linears share (ds_linear
 * itself, ds_gelu_mlp): argument checks, the forward GEMM with its bias,
 * and the backward GEMMs with the bias gradient. Defined in
 * ds_op_linalg.c; internal to core/ops. */
#ifndef DS_OP_LINALG_IMPL_H
#define DS_OP_LINALG_IMPL_H

#include "ds_autograd.h"

/* The incoming gradient as a contiguous tensor of dtype dt. */
ds_tensor *ds_linalg_grad_input(ds_tensor *g, ds_dtype dt);

/* The shapes of x [..., in], weight w [out, in] and bias [out] (or NULL);
 * errors name op and the arguments as names[0..2] give them. */
int ds_linalg_check_linear(const char *op, const ds_tensor *x, const ds_tensor *w, const ds_tensor *bias,
                           const char *const names[3]);

/* x as [rows, in] without history: a view unless its leading dims cannot
 * merge (the op's own node has the history). */
ds_tensor *ds_linalg_rows(ds_tensor *x);

/* out (contiguous, rows * out elements) = x2 [rows, in] @ w^T + bias:
 * the bias rides in the GEMM's epilogue where the device has one (blas's
 * gemm_bias, cuBLASLt's), else it seeds out and the GEMM adds onto it.
 * 0, or -1 with the error. */
int ds_linalg_linear_into(const char *op, ds_tensor *out, ds_tensor *x2, ds_tensor *w, ds_tensor *bias);

/* The gradients of y = x2 w^T + bias from gc (contiguous, w's dtype, rows *
 * out elements) for those asked: gin[0] = gc @ w shaped xshape (xnd dims),
 * gin[1] = gc^T x2, gin[2] = the column sums of gc. New references; 0, or
 * -1 with the error. */
int ds_linalg_linear_grads(const char *op, ds_tensor *gc, ds_tensor *x2, ds_tensor *w, const bool want[3], int xnd,
                           const int64_t *xshape, ds_tensor **gin);

#endif
