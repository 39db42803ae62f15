/* The public op API: every op a model can call, forward with its backward
 * recorded on the autograd tape. One header per op family. */
#ifndef DS_OPS_H
#define DS_OPS_H

#include "ds_tensor.h"
#include "ds_autograd.h"
#include "ds_op_elementwise.h"
#include "ds_op_shape.h"
#include "ds_op_reduce.h"
#include "ds_op_linalg.h"
#include "ds_op_mlp.h"
#include "ds_op_conv.h"
#include "ds_op_nn.h"
#include "ds_op_index.h"
#include "ds_op_attention.h"
#include "ds_op_fp8.h"
#include "ds_rng.h"

#endif
