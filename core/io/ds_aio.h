/* Asynchronous file I/O of tensor bytes, on POSIX AIO (glibc's aio_*).
 *
 * A file is opened at a fixed size; a request reads or writes a contiguous
 * CPU tensor's bytes at a byte offset and runs while the caller computes.
 * A request holds a reference to its tensor and to its file until it is
 * freed, so neither goes away under the transfer. Short transfers are
 * resubmitted until complete; errors (ENOSPC, EIO, end of file) name the
 * path, the offset, the byte count and strerror. */
#ifndef DS_AIO_H
#define DS_AIO_H

#include "ds_tensor.h"

typedef struct ds_aio_file ds_aio_file;
typedef struct ds_aio_req ds_aio_req;

/* Makes path a new file (mode 0600) of nbytes, replacing what was there:
 * created exclusively under a temporary name, never following a link, in a
 * directory this user owns and others cannot write (else an error naming
 * it). NULL with the error. */
ds_aio_file *ds_aio_open(const char *path, int64_t nbytes);
/* Finishes every pending request, closes the descriptor and drops the
 * caller's reference. 0, or -1 with the first error of a request that
 * nobody waited for or of close itself. */
int ds_aio_close(ds_aio_file *f);
const char *ds_aio_path(const ds_aio_file *f);
int64_t ds_aio_size(const ds_aio_file *f);

/* Starts moving t's bytes (t: contiguous, on the CPU) to / from the file
 * at byte offset; the range must lie inside the file. */
ds_aio_req *ds_aio_write(ds_aio_file *f, ds_tensor *t, int64_t offset);
ds_aio_req *ds_aio_read(ds_aio_file *f, ds_tensor *t, int64_t offset);
/* Blocks until the request is complete: 0, or -1 with its error (every
 * wait on a failed request reports it). */
int ds_aio_wait(ds_aio_req *r);
/* Whether the request is complete, without blocking. */
bool ds_aio_done(ds_aio_req *r);
int64_t ds_aio_req_bytes(const ds_aio_req *r);
/* Waits when still pending, then releases the tensor and the file. */
void ds_aio_req_free(ds_aio_req *r);

#endif
