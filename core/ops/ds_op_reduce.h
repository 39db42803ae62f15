/* Reductions over any set of dims; keepdim keeps reduced dims as size 1.
 * Integer sums give i64, argmax/argmin give i64 indices. */
#ifndef DS_OP_REDUCE_H
#define DS_OP_REDUCE_H

#include "ds_tensor.h"

/* ndims < 0 or dims == NULL: all dims */
ds_tensor *ds_reduce(ds_reduce_op op, ds_tensor *t, int ndims, const int64_t *dims, bool keepdim, double param);
ds_tensor *ds_sum(ds_tensor *t, int ndims, const int64_t *dims, bool keepdim);
ds_tensor *ds_mean(ds_tensor *t, int ndims, const int64_t *dims, bool keepdim);
ds_tensor *ds_amax(ds_tensor *t, int ndims, const int64_t *dims, bool keepdim);
/* correction 1 is the unbiased estimator (PyTorch's default) */
ds_tensor *ds_var(ds_tensor *t, int ndims, const int64_t *dims, double correction, bool keepdim);
ds_tensor *ds_norm(ds_tensor *t, double p, int ndims, const int64_t *dims, bool keepdim);

#endif
