/* 2-D convolution and pooling on NCHW tensors with PyTorch's semantics:
 * weights [O, C/groups, kh, kw], floor-mode output sizes, and for average
 * pooling PyTorch's count_include_pad. Parameter structs come from
 * ds_kernels.h. */
#ifndef DS_OP_CONV_H
#define DS_OP_CONV_H

#include "ds_tensor.h"

/* bias [O] or NULL */
ds_tensor *ds_conv2d(ds_tensor *x, ds_tensor *w, ds_tensor *bias, const ds_conv2d_params *p);
/* padding at most half the kernel, as PyTorch requires */
ds_tensor *ds_max_pool2d(ds_tensor *x, const ds_pool2d_params *p);
ds_tensor *ds_avg_pool2d(ds_tensor *x, const ds_pool2d_params *p);

#endif
