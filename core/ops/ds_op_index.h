/* Indexing and joining: embedding, index_select, gather, scatter_add,
 * cat, stack, split, chunk. Index tensors are i64 or i32 and hold 0-based
 * values, checked against their range before any kernel reads through
 * them. All record autograd; gradients never flow into index tensors. */
#ifndef DS_OP_INDEX_H
#define DS_OP_INDEX_H

#include "ds_tensor.h"

/* weight [V, D], ids of any shape: rows of weight, shaped ids.shape + [D]. */
ds_tensor *ds_embedding(ds_tensor *weight, ds_tensor *ids);
/* index 1-D (or 0-dim): x's slices along dim, in index order. */
ds_tensor *ds_index_select(ds_tensor *x, int64_t dim, ds_tensor *index);
/* out[p] = x[p with coordinate dim replaced by index[p]]; out has
 * index's shape, which must not exceed x's outside dim. */
ds_tensor *ds_gather(ds_tensor *x, int64_t dim, ds_tensor *index);
/* Out of place: x plus src[p] added at x[p with coordinate dim replaced
 * by index[p]]; duplicate indices accumulate. src is x's dtype and at
 * least index's shape; only the part that index covers is added. */
ds_tensor *ds_scatter_add(ds_tensor *x, int64_t dim, ds_tensor *index, ds_tensor *src);

/* Checks idx (dtype, device, values) for an op that reads x through it:
 * every value in [0, limit), a value equal to *skip let through when skip
 * is not NULL. On the CPU a value out of range fails here; on a GPU at the
 * first synchronisation after (core/tensor/ds_fault.h), the op's kernels
 * skipping it meanwhile. 0, or -1 with the error naming op, idx_name,
 * the value, its position and both shapes. */
int ds_check_index(const char *op, ds_tensor *idx, const char *idx_name, ds_tensor *x, const char *x_name,
                   int64_t limit, const int64_t *skip);

/* Joins n tensors along an existing dim (dtypes promote) or a new one. */
ds_tensor *ds_cat(int n, ds_tensor *const *ts, int64_t dim);
ds_tensor *ds_stack(int n, ds_tensor *const *ts, int64_t dim);
/* x with each slice along dim repeated rep times in a row (torch's
 * repeat_interleave by a number): one copy; the backward sums a slice's
 * rep gradients in order, as for a cat of rep views of it, to the bit. */
ds_tensor *ds_repeat_interleave(ds_tensor *x, int64_t rep, int64_t dim);

/* How split(split_size) and chunk(chunks) cut dim of t: the number of
 * pieces, with their sizes written to sizes when it is not NULL (call
 * once with NULL to size the array); -1 with the error set. */
int64_t ds_split_sizes(const ds_tensor *t, int64_t dim, int64_t split_size, int64_t *sizes);
int64_t ds_chunk_sizes(const ds_tensor *t, int64_t dim, int64_t chunks, int64_t *sizes);
/* n views of t along dim with the given sizes, which must add up to its
 * size there, into out (new references); 0, or -1 with nothing left. */
int ds_split(ds_tensor *t, int64_t dim, int64_t n, const int64_t *sizes, ds_tensor **out);

#endif
