/* Elementwise ops with NumPy broadcasting and type promotion. */
#ifndef DS_OP_ELEMENTWISE_H
#define DS_OP_ELEMENTWISE_H

#include "ds_tensor.h"

/* The dtype two operands compute in: floats beat integers, wider beats
 * narrower, bf16 with f16 meets at f32. */
ds_dtype ds_promote(ds_dtype a, ds_dtype b);
/* The broadcast shape of a and b into shape/ndim; -1 and the error if the
 * shapes do not broadcast (op names the caller in the message). */
int ds_broadcast_shape(const char *op, const ds_tensor *a, const ds_tensor *b, int *ndim, int64_t *shape);
/* A view of t expanded to shape (stride 0 along new and size-1 dims). */
ds_tensor *ds_expand(ds_tensor *t, int ndim, const int64_t *shape);
/* A 0-dim tensor holding v, on t's device, in t's dtype. */
ds_tensor *ds_scalar_like(const ds_tensor *t, double v);

ds_tensor *ds_binary(ds_binary_op op, ds_tensor *a, ds_tensor *b);
ds_tensor *ds_add(ds_tensor *a, ds_tensor *b);
ds_tensor *ds_sub(ds_tensor *a, ds_tensor *b);
ds_tensor *ds_mul(ds_tensor *a, ds_tensor *b);
ds_tensor *ds_div(ds_tensor *a, ds_tensor *b);
ds_tensor *ds_mul_scalar(ds_tensor *a, double s);
/* In place, no autograd: dst op= src (src broadcast to dst). 0 or -1. */
int ds_binary_(ds_binary_op op, ds_tensor *dst, ds_tensor *src);
int ds_add_(ds_tensor *dst, ds_tensor *src);

ds_tensor *ds_unary(ds_unary_op op, ds_tensor *x, double param);
ds_tensor *ds_where(ds_tensor *cond, ds_tensor *a, ds_tensor *b);

#endif
