/* Inside the comm layer (ds_comm*.c only): groups, works, and the
 * backends, who move the payload of a collective for tensors on one
 * device type. ds_comm.c does everything else (arguments,
 * shapes, checks, waiting, copies in and out) and calls a backend with
 * contiguous buffers of `count` elements of a wire dtype, ranks given as
 * group ranks, ops never AVG (it is a SUM then a division).
 *
 * MPI serves CPU tensors (ds_comm_mpi.c); in a CUDA build NCCL serves CUDA
 * tensors (ds_comm_nccl.c), or the staged backend does (ds_comm_staged.c,
 * MPI through host memory) where ranks share a GPU or the job asks for it
 * (ds_comm_set_device_backend). NCCL's per-group communicator lives in
 * ds_comm_group.backend[DS_DEV_CUDA], made on first use from the group's
 * MPI control communicator. */
#ifndef DS_COMM_IMPL_H
#define DS_COMM_IMPL_H

#include "ds_comm.h"

#include <mpi.h>

struct ds_comm_group {
    int rank, size;                 /* rank -1: this rank is not a member */
    int *ranks;                     /* world rank of each group rank */
    int64_t seq;                    /* collectives called so far */
    int index;                      /* 0 the world, then in creation order (the same on every rank) */
    char name[64];                  /* "world" or "[0,2]" */
    MPI_Comm comm;                  /* MPI payload; MPI_COMM_NULL without MPI */
    MPI_Comm ctl;                   /* shapes and checks, never payload */
    MPI_Comm staged;                /* the staged backend's payload: its calls start later than they are made */
    void *backend[DS_NDEVICE_TYPES];
    struct ds_comm_group *next;
};

/* Each start function returns 0 with *req set (the request in flight), or
 * -1 with the error set. counts: elements per group rank; the buffers are
 * packed in rank order. reduce: send == recv means in place (on root). */
typedef struct ds_comm_backend {
    const char *name;
    bool reduces_half;              /* else bf16/f16 reductions travel as f32 */
    int (*barrier)(ds_comm_group *g, void **req);
    int (*send)(const void *buf, int64_t count, ds_dtype dt, int peer, int tag, ds_comm_group *g, void **req);
    int (*recv)(void *buf, int64_t count, ds_dtype dt, int peer, int tag, ds_comm_group *g, void **req);
    int (*broadcast)(void *buf, int64_t count, ds_dtype dt, int root, ds_comm_group *g, void **req);
    int (*reduce)(const void *send, void *recv, int64_t count, ds_dtype dt, ds_comm_op op, int root,
                  ds_comm_group *g, void **req);
    int (*all_reduce)(void *buf, int64_t count, ds_dtype dt, ds_comm_op op, ds_comm_group *g, void **req);
    int (*gather)(const void *send, void *recv, const int64_t *counts, ds_dtype dt, int root,
                  ds_comm_group *g, void **req);
    int (*scatter)(const void *send, void *recv, const int64_t *counts, ds_dtype dt, int root,
                   ds_comm_group *g, void **req);
    int (*all_gather)(const void *send, void *recv, const int64_t *counts, ds_dtype dt,
                      ds_comm_group *g, void **req);
    int (*reduce_scatter)(const void *send, void *recv, const int64_t *counts, ds_dtype dt, ds_comm_op op,
                          ds_comm_group *g, void **req);
    /* count: elements to (and from) each group rank */
    int (*all_to_all)(const void *send, void *recv, int64_t count, ds_dtype dt, ds_comm_group *g, void **req);
    int (*test)(void *req, bool *done);
    void (*free_req)(void *req);    /* only after test said done */
} ds_comm_backend;

extern const ds_comm_backend ds_comm_mpi_backend;
#ifdef DSLUA_CUDA
extern const ds_comm_backend ds_comm_nccl_backend;
#endif

/* The staged backend (ds_comm_staged.c): a device tensor's bytes copied
 * to page-locked host memory, moved by the MPI backend there, copied
 * back. A stager moves the bytes: ds_cuda_stager (ds_comm_cuda.c) for
 * device memory, and a host one (memcpy) that DSLUA_TEST_STAGE_CPU=1 puts
 * under CPU tensors, so every step but the copies runs without a GPU. */
typedef struct ds_comm_stager {
    const char *name;
    bool (*owns)(const void *ptr);
    /* ptr's device made current; the stream the copies go on, ordered
     * after the work queued so far on the device. NULL with the error. */
    void *(*begin)(const void *ptr, const char *op);
    void *(*host_alloc)(size_t nb);
    void (*host_free)(void *p, size_t nb);
    /* Queues nb bytes src -> dst on stream; *fence passes once they are
     * there (NULL: already). 0, or -1 with the error. */
    int (*copy)(void *dst, const void *src, size_t nb, void *stream, void **fence);
    int (*passed)(void *fence, bool *done);
    void (*fence_free)(void *fence);
} ds_comm_stager;

#ifdef DSLUA_CUDA
/* ds_comm_cuda.c: ptr's device (made current) into *dev, 0 or -1 with
 * the error naming op; and the communication stream (a cudaStream_t) of
 * ptr's device, ordered after the work queued so far on its compute
 * stream, NULL with the error. */
int ds_comm_cuda_device_of(const void *ptr, const char *op, int *dev);
void *ds_comm_cuda_begin(const void *ptr, const char *op, int *dev);
#endif

extern const ds_comm_backend ds_comm_staged_backend;
/* Starts the staged calls whose bytes have reached the host: 0, or -1
 * with the error (which the request's test reports again). */
int ds_comm_staged_pump(void);
#ifdef DSLUA_CUDA
extern const ds_comm_stager ds_cuda_stager;
#endif

/* The backend for t's device, or NULL with the error naming op. */
const ds_comm_backend *ds_comm_backend_of(const ds_tensor *t, const char *op);

/* An MPI return code as 0, or -1 with the error naming op. */
int ds_comm_mpi_check(int rc, const char *op);

/* A primitive in flight. When it completes, buf is divided by `divide`
 * (avg) and copied into target (a non-contiguous or narrower user tensor);
 * keep only stays alive until then. */
struct ds_comm_work {
    const ds_comm_backend *be;
    void *req;                      /* the backend request; NULL once done */
    ds_comm_group *g;
    int peer;                       /* world rank of a send/recv peer, else -1 */
    bool sending;
    int64_t ordinal;                /* g's collective number, or the n-th send/recv with peer */
    int state;                      /* 0 in flight, 1 done, -1 failed */
    bool orphan;                    /* released by its owner while in flight */
    bool pinned;                    /* its tensors' storages pinned while in flight */
    char what[160];                 /* "all_reduce(f32, 10 elements) #7", for errors */
    int64_t flight;                 /* its flight recorder entry (ds_comm_begin), 0 for send/recv */
    ds_tensor *target, *buf, *keep;
    double divide;
    int nresults;
    ds_tensor **results;
    struct ds_comm_work *next;      /* the in-flight list */
};

/* What a rank says about a collective before any byte of it moves: every
 * rank of the group exchanges one (a small allgather on g->ctl), so a rank
 * that calls another primitive, dtype, count, root or reduce op fails on
 * every rank instead of overrunning a buffer. gather and all_gather carry
 * their shape in it (no exchange of their own); reduce_scatter a hash of
 * its piece counts. */
typedef struct {
    char op[16];
    int32_t dtype, root, rop;       /* -1 where they do not apply */
    int32_t strict;                 /* counts must match across ranks */
    int64_t count, seq;             /* count -1: not known here (scatter off the root) */
    int64_t detail;                 /* reduce_scatter: hash of the piece counts, -1: invalid list */
    int32_t ndim, pad;
    int64_t shape[DS_MAX_DIMS];     /* gather, all_gather */
} ds_comm_sig;

/* A signature with op set and the rest "does not apply". */
ds_comm_sig ds_comm_sig_of(const char *op, int dtype, int64_t count, int root, bool strict);

/* Before a primitive on *g (NULL: the world, set on return): starts MPI,
 * checks membership, and for a collective (p2p false) counts the call,
 * records it (the flight recorder) and exchanges signatures: always when
 * all is given (the caller reads every rank's, freed by the caller), else
 * unless the check is off (DSLUA_COMM_CHECK=0). Describes the call into
 * what. */
int ds_comm_begin(ds_comm_group **g, ds_comm_sig *sig, bool p2p, ds_comm_sig **all, char *what, size_t n);
/* Control-plane exchanges on g->ctl, waited for with the deadline. */
int ds_comm_ctl_allgather(ds_comm_group *g, const void *mine, void *all, int bytes, const char *what);
int ds_comm_ctl_bcast(ds_comm_group *g, void *buf, int bytes, int root, const char *what);
/* dst = src converted to dst's dtype, any strides: 0, or -1 naming op. */
int ds_comm_copy(ds_tensor *dst, ds_tensor *src, const char *op);

/* Counts a send to (or receive from) a world rank; the count. */
int64_t ds_comm_p2p_count(int peer, bool sending);

ds_comm_work *ds_comm_work_new(ds_comm_group *g, const char *what, int peer, int nresults);
/* After a backend start: puts w in flight, or frees it when rc != 0. */
ds_comm_work *ds_comm_work_launch(ds_comm_work *w, const ds_comm_backend *be, int rc, void *req);
/* A work with nothing to send (one rank): finishes it now. */
ds_comm_work *ds_comm_work_local(ds_comm_work *w);
void ds_comm_work_free(ds_comm_work *w);

#endif
