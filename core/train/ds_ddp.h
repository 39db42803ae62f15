/* Data-parallel gradient buckets.
 *
 * The gradients of a model's parameters, cut into buckets: runs of
 * neighbouring parameters whose gradients lie back to back in one flat
 * buffer (the optimizer's, or one made here for parameters without one),
 * taken from the last parameter to the first, since backward delivers the
 * last layers' gradients first. A bucket takes parameters until it holds
 * at least bucket_size elements (DeepSpeed's reduce_bucket_size), so a
 * parameter larger than that has a bucket of its own.
 *
 * While armed for one backward, a leaf hook per parameter notes when its
 * gradient is complete. A bucket whose parameters are all complete goes to
 * the launch callback (which starts its all-reduce) once every earlier
 * bucket has gone, so all ranks launch the same buckets in the same order
 * while backward is still running. After each completed parameter the poll
 * callback runs, a chance to move collectives in flight along. Buckets of
 * parameters that got no gradient are launched by ds_ddp_flush, after
 * backward. The callbacks return 0, or -1 with the error set, which fails
 * the backward. */
#ifndef DS_DDP_H
#define DS_DDP_H

#include "ds_tensor.h"

#include <stdbool.h>

typedef struct ds_ddp ds_ddp;

/* bucket: 0-based; flat: a 1-D contiguous view of its gradients (borrowed) */
typedef int (*ds_ddp_launch_fn)(int bucket, ds_tensor *flat, void *ud);
typedef int (*ds_ddp_poll_fn)(void *ud);

/* params: borrowed leaves that require grad, no tensor twice. A gradient
 * a parameter has as a contiguous tensor of its dtype and shape stays
 * where it is; the others get views into a buffer made here (zeros, or
 * their old values). Sets the leaf hooks. NULL with the error set. */
ds_ddp *ds_ddp_new(int n, ds_tensor *const *params, int64_t bucket_size);
/* Removes the hooks and drops every reference. */
void ds_ddp_free(ds_ddp *d);

int ds_ddp_n_buckets(const ds_ddp *d);
/* Bucket b's gradients, a 1-D view (new reference). */
ds_tensor *ds_ddp_bucket(ds_ddp *d, int b);
/* Bucket b holds parameters first .. first + count - 1 (0-based). */
void ds_ddp_bucket_params(const ds_ddp *d, int b, int *first, int *count);

/* Before the backward whose gradients are reduced: puts back as .grad the
 * bucket views of parameters whose gradient was dropped (zeros) or
 * replaced (copied in), then arms the hooks. */
int ds_ddp_arm(ds_ddp *d, ds_ddp_launch_fn launch, ds_ddp_poll_fn poll, void *ud);

typedef struct {
    int launched_in_backward;      /* buckets launched before backward returned */
    int leaves_after_first_launch; /* gradients completed after the first launch */
} ds_ddp_counts;

/* After that backward: launches the buckets left, in order, and disarms.
 * counts (may be NULL) says how much happened during backward. */
int ds_ddp_flush(ds_ddp *d, ds_ddp_counts *counts);
/* Disarms without launching (after a failed backward). */
void ds_ddp_disarm(ds_ddp *d);

#endif
