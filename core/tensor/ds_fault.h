/* Faults a device finds in its own time. An op that checks values on a
 * GPU (indices in range) does not wait for the answer, which would stall
 * the host on every call: the check writes what it found into a record,
 * and the first synchronisation with that device after it (a read back,
 * ds.cuda.synchronize(), the step engine's one a step) reports it as that
 * call's error. On the CPU the answer is there at once and the op that
 * checked closes its own record, so its error is its own. */
#ifndef DS_FAULT_H
#define DS_FAULT_H

#include "ds_device.h"

#include <stddef.h>

#define DS_FAULT_CTX_MAX 256

/* The error message of a check that hit, from what ds_fault_open kept. */
typedef void (*ds_fault_describe)(char *buf, size_t n, const void *ctx, ds_index_hit hit);

/* A record for one check on dev, for its kernel to write; ctx
 * (ctx_size <= DS_FAULT_CTX_MAX bytes) is copied for describe. NULL with
 * the error set when out of memory, or when making room (every 64 checks
 * without a synchronisation) settles an earlier check that hit. A check
 * that fails to start closes its record itself: hit->pos = -1. */
ds_index_hit *ds_fault_open(ds_device dev, ds_fault_describe describe, const void *ctx, size_t ctx_size);
/* Closes dev's records that their checks have written, once the device has
 * done the work queued before (the CPU always has): 0 when none hit, else
 * -1 with the error of the first opened that did. */
int ds_fault_settle(ds_device dev);
/* Closes one record of dev that its check has written (the CPU's, at
 * once), leaving the others: 0, or -1 with its error when it hit. */
int ds_fault_close(ds_device dev, ds_index_hit *hit);

#endif
