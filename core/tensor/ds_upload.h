/* Batches sent to their device one step ahead. A loader gathers a batch
 * into the device's staging memory (ds_tensor_new_staging: page-locked on
 * a GPU), starts its upload when it hands out the batch before it, and
 * takes it when the step asks for it: the copy runs on the device's copy
 * stream while the compute stream works on the previous step, and the
 * compute stream waits for it only from the take on. A device whose
 * backend has no upload gets a plain copy at the start. */
#ifndef DS_UPLOAD_H
#define DS_UPLOAD_H

#include "ds_tensor.h"

#define DS_UPLOAD_MAX_TENSORS 8

typedef struct ds_upload ds_upload;

/* Starts copying src[0..n) (contiguous CPU tensors, held until the take)
 * to new tensors on dev. NULL with the error set. */
ds_upload *ds_upload_start(ds_tensor *const *src, int n, ds_device dev);
/* The tensors on dev (new references in out[0..n)), ordered before any
 * later work on dev; frees u. 0, or -1 with the error set (u freed). */
int ds_upload_take(ds_upload *u, ds_tensor **out);
/* Drops an upload never taken, after its copies have finished. NULL is fine. */
void ds_upload_free(ds_upload *u);

#endif
