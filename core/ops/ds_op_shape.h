/* Views, reshapes, copies and casts. Views share storage with their input;
 * all of these record autograd so gradients flow back through them. */
#ifndef DS_OP_SHAPE_H
#define DS_OP_SHAPE_H

#include "ds_tensor.h"

/* One entry may be -1 (inferred). view requires compatible strides and
 * fails otherwise; reshape copies when it must. */
ds_tensor *ds_view(ds_tensor *t, int ndim, const int64_t *shape);
ds_tensor *ds_reshape(ds_tensor *t, int ndim, const int64_t *shape);
ds_tensor *ds_transpose(ds_tensor *t, int64_t d0, int64_t d1);
ds_tensor *ds_permute(ds_tensor *t, const int64_t *perm);     /* t->ndim entries */
ds_tensor *ds_narrow(ds_tensor *t, int64_t dim, int64_t start, int64_t length);
ds_tensor *ds_squeeze(ds_tensor *t, int64_t dim);
ds_tensor *ds_unsqueeze(ds_tensor *t, int64_t dim);
ds_tensor *ds_contiguous(ds_tensor *t);       /* t itself (retained) if already */
ds_tensor *ds_clone(ds_tensor *t);
ds_tensor *ds_to_dtype(ds_tensor *t, ds_dtype dtype);
ds_tensor *ds_to_device(ds_tensor *t, ds_device dev);
ds_tensor *ds_detach(ds_tensor *t);
/* In place, no autograd: dst = src (broadcast and cast). 0 or -1. */
int ds_copy_(ds_tensor *dst, ds_tensor *src);
int ds_fill_(ds_tensor *dst, double v);

/* An input's gradient in the input's layout, so that the views it came
 * from (a projection's [B, T, H, D] seen as heads) take it back with no
 * copy: ds_dims_by_stride writes x's dims from the largest stride to the
 * smallest (ties in dim order), and ds_new_in_order makes a new tensor of
 * g's shape and dtype, dense, its dims laid out in that order. */
void ds_dims_by_stride(const ds_tensor *x, int64_t *order);
ds_tensor *ds_new_in_order(const ds_tensor *g, const int64_t *order);

#endif
