/* Tensors: a strided, typed view of a storage, plus what autograd needs.
 *
 * Ownership: every function returning ds_tensor* returns a new reference
 * (refcount already counted for the caller) or NULL with the error set.
 * Arguments are borrowed. Release what you own with ds_tensor_release. */
#ifndef DS_TENSOR_H
#define DS_TENSOR_H

#include "ds_storage.h"
#include "ds_kview.h"

#include <stdbool.h>

typedef struct ds_node ds_node;

typedef struct ds_tensor {
    _Atomic int refcount;
    ds_storage *storage;
    int64_t offset;                 /* in elements */
    ds_dtype dtype;
    int ndim;
    int64_t shape[DS_MAX_DIMS];
    int64_t stride[DS_MAX_DIMS];    /* in elements */
    bool requires_grad;
    struct ds_tensor *grad;         /* accumulated gradient of a leaf */
    ds_node *grad_fn;               /* the op that made it; NULL for leaves */
} ds_tensor;

const char *ds_dtype_name(ds_dtype t);
int ds_dtype_parse(const char *name);      /* -1 if unknown */

/* Contiguous, uninitialised. */
ds_tensor *ds_tensor_new(int ndim, const int64_t *shape, ds_dtype dtype, ds_device dev);
/* A contiguous CPU tensor in the host memory dev uploads from fastest
 * (ds_storage_new_staging): what a loader gathers batches for dev into. */
ds_tensor *ds_tensor_new_staging(int ndim, const int64_t *shape, ds_dtype dtype, ds_device dev);
ds_tensor *ds_tensor_new_like(const ds_tensor *t);
ds_tensor *ds_tensor_full(int ndim, const int64_t *shape, ds_dtype dtype, ds_device dev, double v);
/* A view sharing t's storage with new geometry; no autograd history. */
ds_tensor *ds_tensor_view_of(const ds_tensor *t, int ndim, const int64_t *shape,
                             const int64_t *stride, int64_t offset);
/* Moves t's elements into storage s at element offset (contiguous, t's
 * dtype) and makes t a view of them there: how an optimizer gathers its
 * parameters into one flat buffer. Other views of t's old storage keep the
 * old bytes. 0, or -1 with the error set. */
int ds_tensor_reseat(ds_tensor *t, ds_storage *s, int64_t offset);

/* Partitioned parameters (ZeRO stage 3) live whole only while in use.
 * release_data points a leaf at an empty storage (its bytes go when no
 * view holds them); set_data makes it a contiguous view of src's data (src:
 * contiguous, same dtype, device and element count), no copy. A released
 * tensor keeps its shape and dtype; the binding faults its data back in
 * (lua_zero.c) before an op reads it. */
bool ds_tensor_is_released(const ds_tensor *t);
int ds_tensor_release_data(ds_tensor *t);
int ds_tensor_set_data(ds_tensor *t, const ds_tensor *src);

void ds_tensor_retain(ds_tensor *t);
void ds_tensor_release(ds_tensor *t);

int64_t ds_tensor_numel(const ds_tensor *t);
bool ds_tensor_is_contiguous(const ds_tensor *t);
ds_device ds_tensor_device(const ds_tensor *t);
ds_kview ds_tensor_kview(const ds_tensor *t);
/* The view or bytes of t for a writer in place (a kernel, a transfer, a
 * collective, a reader): t's storage's version moves, naming op, so a graph
 * that saved t refuses its backward. Every in-place writer takes its
 * destination here, so none can forget. */
ds_kview ds_tensor_kview_w(ds_tensor *t, const char *op);
void *ds_tensor_data_w(ds_tensor *t, const char *op);
const ds_kernels *ds_tensor_kernels(const ds_tensor *t);
/* Kernel calls made so far by this process (every ds_tensor_kernels). */
uint64_t ds_kernel_calls(void);
/* The same table, uncounted: for asking which entries a device has (an
 * epilogue, attention's full-rate shapes) without calling one. */
const ds_kernels *ds_tensor_kernel_table(const ds_tensor *t);
void *ds_tensor_data(const ds_tensor *t);    /* element 0, CPU address */
/* "[3,4]" into buf, for error messages */
const char *ds_shape_str(const ds_tensor *t, char *buf, size_t n);
/* ndim values joined by commas ("8,1024"), no brackets: a shape or a
 * coordinate kept apart from its tensor. */
const char *ds_dims_str(int ndim, const int64_t *dims, char *buf, size_t n);
bool ds_tensor_same_shape(const ds_tensor *a, const ds_tensor *b);
/* Normalises a possibly negative dim; -1 and the error if out of range. */
int ds_tensor_dim(const ds_tensor *t, const char *op, int64_t dim);
/* A 0-based dim or position as messages name it: 1-based, as the Lua API
 * counts, and a negative one (from the end) as given. */
long long ds_api_pos(int64_t i);

/* Raw element access for small tensors (printing, item, tests). */
double ds_tensor_get(const ds_tensor *t, int64_t flat_index);
void ds_tensor_set(ds_tensor *t, int64_t flat_index, double v);

void ds_tensor_set_category(ds_tensor *t, ds_mem_category cat);

/* Argument checks shared by the ops: 0, or -1 with an error naming op.
 * A NULL b (an optional argument left out) passes. */
int ds_check_same_device(const char *op, const ds_tensor *a, const ds_tensor *b);
int ds_check_same_dtype(const char *op, const ds_tensor *a, const ds_tensor *b);

#endif
