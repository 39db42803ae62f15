/* Collectives between ranks (processes): barrier, send/recv, broadcast,
 * reduce, all_reduce, gather, scatter, all_gather, reduce_scatter, on
 * all_to_all, on tensors of any dtype, blocking or asynchronous, on the world or on a
 * group of ranks.
 *
 * MPI starts the ranks and carries the control plane (start-up, groups,
 * shapes, checks, exit notices). The payload goes through a backend picked
 * by the tensor's device: MPI for CPU tensors; for CUDA tensors NCCL, or
 * MPI through page-locked host memory where ranks share a GPU or where
 * the job asks for it (ds_comm_set_device_backend, ds_comm_impl.h). Without mpirun there is one rank, MPI is
 * never started, and every primitive is a local no-op or copy.
 *
 * Nothing waits forever: every wait polls with a deadline (the timeout,
 * DSLUA_COMM_TIMEOUT seconds, default 300) and notices ranks that have
 * exited without joining; it fails with an error naming the collective, its
 * size, the rank and the seconds waited, and at a timeout which ranks did
 * not arrive and where each rank was (they answer from their own waits).
 * The exit waits for the other ranks with the same deadline.
 *
 * Before any byte of a collective moves, the ranks agree on it: the same
 * primitive, dtype, element count, root and reduce op (one small exchange,
 * folded into the shape exchange where there is one); a mismatch fails on
 * every rank naming both calls. DSLUA_COMM_CHECK=0 turns this off (ranks
 * that then disagree overrun each other's buffers). After a failed wait the layer is
 * broken: later calls fail at once, and the process leaves without
 * MPI_Finalize, so mpirun ends every rank.
 *
 * Ranks given to these functions (src, dst, group members) are world ranks,
 * as in torch.distributed. Works belong to the caller (ds_comm_work_release);
 * groups live until the process ends. */
#ifndef DS_COMM_H
#define DS_COMM_H

#include "ds_tensor.h"

#include <stdbool.h>

typedef enum { DS_COMM_SUM, DS_COMM_AVG, DS_COMM_MAX, DS_COMM_MIN, DS_COMM_PROD, DS_COMM_NOPS } ds_comm_op;

typedef struct ds_comm_group ds_comm_group;     /* NULL means the world */
typedef struct ds_comm_work ds_comm_work;       /* one collective in flight */

int ds_comm_op_parse(const char *name);          /* -1 if unknown */

/* Started by mpirun (OMPI_COMM_WORLD_SIZE or PMIX_RANK set)? */
bool ds_comm_launched(void);
/* Starts MPI when launched and not yet started; 0, or -1 with the error. */
int ds_comm_init(void);
bool ds_comm_is_initialized(void);
/* This rank in g (-1 when not a member) and g's size. The world's answers
 * come from the launcher's environment without starting MPI. */
int ds_comm_rank(const ds_comm_group *g);
int ds_comm_size(const ds_comm_group *g);

void ds_comm_set_timeout(double seconds);
double ds_comm_timeout(void);
/* The agreement before every collective: on unless DSLUA_COMM_CHECK=0. */
void ds_comm_set_check(bool on);
bool ds_comm_check_enabled(void);
/* The backend of device tensors: name "nccl", "mpi" (MPI through
 * page-locked host memory), "gloo" (the same: PyTorch's name for it),
 * "auto", or PyTorch's "cpu:gloo,cuda:nccl" (its cuda part counts);
 * source names the setting in errors ("dist_backend"). It wins over
 * DSLUA_COMM_BACKEND, which wins over auto: MPI where ranks share a GPU,
 * NCCL elsewhere. 0, or -1 with the error: an unknown name, or another
 * backend than the one device tensors have already moved on. */
int ds_comm_set_device_backend(const char *name, const char *source);
/* "nccl" or "mpi", chosen now if not yet; where ranks share a GPU, the
 * first of them says so once on stderr. NULL with the error (a bad
 * DSLUA_COMM_BACKEND). */
const char *ds_comm_device_backend(void);
/* Ends the whole job now: MPI_Abort when MPI runs, else exit(code). */
_Noreturn void ds_comm_abort(int code);

/* Every rank calls it with the same list (as torch.distributed.new_group);
 * non-members get a group in which their rank is -1. */
ds_comm_group *ds_comm_new_group(const int *ranks, int n);
/* World rank of group rank i, and the group's name ("world", "[0,2]"). */
int ds_comm_group_world_rank(const ds_comm_group *g, int i);
const char *ds_comm_group_name(const ds_comm_group *g);

/* Starting a primitive returns its work (NULL with the error set). Tensors
 * are borrowed; the work keeps what it needs alive. In-place primitives
 * (broadcast, reduce, all_reduce, recv) write into t when the work
 * completes; reduce leaves t unchanged on ranks other than dst. gather,
 * scatter, all_gather and reduce_scatter deliver new tensors as results;
 * first dims may differ between ranks (trailing dims and dtype may not). */
ds_comm_work *ds_comm_barrier(ds_comm_group *g);
ds_comm_work *ds_comm_send(ds_tensor *t, int dst, int tag, ds_comm_group *g);
ds_comm_work *ds_comm_recv(ds_tensor *t, int src, int tag, ds_comm_group *g);
ds_comm_work *ds_comm_broadcast(ds_tensor *t, int src, ds_comm_group *g);
ds_comm_work *ds_comm_reduce(ds_tensor *t, int dst, ds_comm_op op, ds_comm_group *g);
ds_comm_work *ds_comm_all_reduce(ds_tensor *t, ds_comm_op op, ds_comm_group *g);
/* results: one tensor per group rank on dst, none elsewhere */
ds_comm_work *ds_comm_gather(ds_tensor *t, int dst, ds_comm_group *g);
/* list: one tensor per group rank, read on src only (NULL elsewhere) */
ds_comm_work *ds_comm_scatter(ds_tensor **list, int n, int src, ds_comm_group *g);
ds_comm_work *ds_comm_all_gather(ds_tensor *t, ds_comm_group *g);
/* list: one tensor per group rank; result: the reduction of list[rank] */
ds_comm_work *ds_comm_reduce_scatter(ds_tensor **list, int n, ds_comm_op op, ds_comm_group *g);
/* t's elements in g's size equal pieces, piece i for group rank i; result:
 * t's shape, piece j from group rank j (torch's all_to_all_single). */
ds_comm_work *ds_comm_all_to_all(ds_tensor *t, ds_comm_group *g);

/* Blocks until done (or the timeout): 0, or -1 with the error. */
int ds_comm_work_wait(ds_comm_work *w);
/* One poll: *done set when complete; -1 with the error on failure. */
int ds_comm_work_test(ds_comm_work *w, bool *done);
int ds_comm_work_nresults(const ds_comm_work *w);
ds_tensor *ds_comm_work_result(ds_comm_work *w, int i);    /* new reference */
/* Drops the caller's hold; a work still in flight completes in the
 * background (polled by later calls, waited for at exit). */
void ds_comm_work_release(ds_comm_work *w);
/* Polls every work in flight once. */
void ds_comm_progress(void);

/* The flight recorder: this rank's last collectives (up to 16), i 0 the
 * oldest. state: "agreeing", "in flight", "done" or "failed"; age: seconds
 * since it began; seconds: how long it took (so far). Strings live until
 * the entry is reused. */
typedef struct {
    const char *what, *group, *state;
    double age, seconds;
} ds_comm_flight;
int ds_comm_flight_count(void);
int ds_comm_flight_get(int i, ds_comm_flight *out);   /* 0, or -1 out of range */

#endif
