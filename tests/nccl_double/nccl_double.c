/* A test double of NCCL: the entry points core/comm/ds_comm_nccl.c calls,
 * over MPI, so that file runs unchanged with 2-4 ranks on one GPU (NCCL
 * refuses two ranks on a GPU). Preloaded in place of libnccl
 * (LD_PRELOAD=build/libnccl_double.so); never installed. README.md says
 * what it shows and what it cannot.
 *
 * Stream order as NCCL keeps it: a call (or a group of calls, between
 * ncclGroupStart and ncclGroupEnd) becomes a batch. On each of its streams
 * it records a "ready" event and then a gate (a host function that holds
 * the stream until the batch is released). The batch's bytes move when
 * every ready event has passed: copied to the host, moved by nonblocking
 * MPI calls (a group's sends and receives posted together, so they
 * complete together), copied back, and the gates released; later work on
 * those streams runs after. Batches post their MPI calls in the order
 * they were made. The host side moves on whenever dslua calls in: every
 * entry point, and ncclCommGetAsyncError, which dslua's wait for a
 * collective polls. */
#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <limits.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* dslua's check that no two ranks share a GPU looks for this symbol */
int dslua_nccl_double = 1;

struct ncclComm {
    MPI_Comm comm;
    int rank, size;
};

typedef enum { O_ALL_REDUCE, O_BROADCAST, O_REDUCE, O_ALL_GATHER, O_REDUCE_SCATTER, O_SEND, O_RECV } op_kind;

typedef struct {
    op_kind k;
    const void *send;
    void *recv;
    size_t count;               /* elements: per rank for all_gather and reduce_scatter */
    ncclDataType_t dt;
    ncclRedOp_t op;
    int peer;                   /* root, or the send/recv peer */
    ncclComm_t comm;
    cudaStream_t stream;
    cudaEvent_t ready;
    void *hsend, *hrecv;
    size_t send_nb, recv_nb;    /* recv_nb 0: nothing comes back here */
} work;

enum { B_WAITING, B_IN_MPI, B_RELEASED };

typedef struct batch {
    work *ops;
    int n;
    int state;
    MPI_Request *reqs;
    atomic_int released, gates_left;
    struct batch *next;
} batch;

static struct {
    int depth;                  /* ncclGroupStart nesting */
    work *grouped;                /* the calls of the open group */
    int ngrouped, cap;
    batch *head, **tail;
    cudaStream_t copies;        /* the double's own copies */
    ncclResult_t error;         /* the first failure, reported by every later call */
} D = { .tail = &D.head };

static size_t type_size(ncclDataType_t t) {
    switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
    }
}

/* ---- 16-bit floats: MPI has no such type; reduced through float ---- */

static float bf16_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t float_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);     /* NaN stays NaN */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);                     /* to nearest even */
}

static float f16_float(uint16_t u) {
    _Float16 h;
    memcpy(&h, &u, 2);
    return (float)h;
}

static uint16_t float_f16(float f) {
    _Float16 h = (_Float16)f;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}

static float combine(ncclRedOp_t op, float a, float b) {
    switch (op) {
    case ncclMax: return a > b ? a : b;
    case ncclMin: return a < b ? a : b;
    case ncclProd: return a * b;
    default: return a + b;
    }
}

/* One MPI_Op per 16-bit type and reduction; the type is in the user
 * function, the reduction in the table index. */
#define HALF_OP(name, op, to, from)                                                                   \
    static void name(void *in, void *inout, int *len, MPI_Datatype *t) {                             \
        (void)t;                                                                                      \
        const uint16_t *a = in;                                                                       \
        uint16_t *b = inout;                                                                          \
        for (int i = 0; i < *len; i++) b[i] = from(combine(op, to(a[i]), to(b[i])));                 \
    }
HALF_OP(bf16_sum, ncclSum, bf16_float, float_bf16)
HALF_OP(bf16_prod, ncclProd, bf16_float, float_bf16)
HALF_OP(bf16_max, ncclMax, bf16_float, float_bf16)
HALF_OP(bf16_min, ncclMin, bf16_float, float_bf16)
HALF_OP(f16_sum, ncclSum, f16_float, float_f16)
HALF_OP(f16_prod, ncclProd, f16_float, float_f16)
HALF_OP(f16_max, ncclMax, f16_float, float_f16)
HALF_OP(f16_min, ncclMin, f16_float, float_f16)

static MPI_Op half_op(ncclDataType_t t, ncclRedOp_t op) {
    static MPI_Op made[2][4];
    static MPI_User_function *fns[2][4] = { { bf16_sum, bf16_prod, bf16_max, bf16_min },
                                            { f16_sum, f16_prod, f16_max, f16_min } };
    int k = t == ncclBfloat16 ? 0 : 1;
    if (!made[k][op]) MPI_Op_create(fns[k][op], 1, &made[k][op]);
    return made[k][op];
}

static MPI_Datatype mpi_type(ncclDataType_t t) {
    switch (t) {
    case ncclInt8: return MPI_INT8_T;
    case ncclUint8: return MPI_UINT8_T;
    case ncclInt32: return MPI_INT32_T;
    case ncclUint32: return MPI_UINT32_T;
    case ncclInt64: return MPI_INT64_T;
    case ncclUint64: return MPI_UINT64_T;
    case ncclFloat32: return MPI_FLOAT;
    case ncclFloat64: return MPI_DOUBLE;
    default: return MPI_UINT16_T;
    }
}

static MPI_Op mpi_op(ncclDataType_t t, ncclRedOp_t op) {
    if (t == ncclFloat16 || t == ncclBfloat16) return half_op(t, op);
    switch (op) {
    case ncclProd: return MPI_PROD;
    case ncclMax: return MPI_MAX;
    case ncclMin: return MPI_MIN;
    default: return MPI_SUM;
    }
}

/* ---- batches ---- */

static ncclResult_t fail(ncclResult_t r, const char *why) {
    fprintf(stderr, "nccl double: %s\n", why);
    if (D.error == ncclSuccess) D.error = r;
    return r;
}

static int cuda_ok(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return 1;
    char msg[256];
    snprintf(msg, sizeof msg, "%s: %s", what, cudaGetErrorString(e));
    fail(ncclUnhandledCudaError, msg);
    return 0;
}

/* The gate on a batch's stream: holds it until the batch is released. */
static void CUDART_CB gate(void *arg) {
    batch *b = arg;
    struct timespec ts = { 0, 20000 };
    while (!atomic_load(&b->released)) nanosleep(&ts, NULL);
    atomic_fetch_sub(&b->gates_left, 1);
}

static int copy(void *dst, const void *src, size_t nb) {
    return !nb || (cuda_ok(cudaMemcpyAsync(dst, src, nb, cudaMemcpyDefault, D.copies), "cudaMemcpyAsync") &&
                   cuda_ok(cudaStreamSynchronize(D.copies), "cudaStreamSynchronize"));
}

/* The bytes in, and the op's MPI call posted. */
static int post(work *o, MPI_Request *r) {
    size_t es = type_size(o->dt);
    if (o->count > INT_MAX) return fail(ncclInvalidArgument, "a count past INT_MAX"), 0;
    int n = (int)o->count;
    int size = o->comm->size, me = o->comm->rank;
    MPI_Comm c = o->comm->comm;
    MPI_Datatype t = mpi_type(o->dt);
    bool root = me == o->peer;
    o->send_nb = o->k == O_RECV || (o->k == O_BROADCAST && !root) ? 0
               : o->k == O_REDUCE_SCATTER ? o->count * es * size : o->count * es;
    o->recv_nb = o->k == O_SEND || (o->k == O_REDUCE && !root) ? 0
               : o->k == O_ALL_GATHER ? o->count * es * size : o->count * es;
    o->hsend = malloc(o->send_nb ? o->send_nb : 1);
    o->hrecv = malloc(o->recv_nb ? o->recv_nb : 1);
    if (!o->hsend || !o->hrecv) return fail(ncclSystemError, "out of memory"), 0;
    if (!copy(o->hsend, o->send, o->send_nb)) return 0;
    int rc;
    switch (o->k) {
    case O_ALL_REDUCE: rc = MPI_Iallreduce(o->hsend, o->hrecv, n, t, mpi_op(o->dt, o->op), c, r); break;
    case O_BROADCAST:
        if (root) memcpy(o->hrecv, o->hsend, o->send_nb);
        rc = MPI_Ibcast(o->hrecv, n, t, o->peer, c, r);
        break;
    case O_REDUCE: rc = MPI_Ireduce(o->hsend, root ? o->hrecv : NULL, n, t, mpi_op(o->dt, o->op), o->peer, c, r); break;
    case O_ALL_GATHER: rc = MPI_Iallgather(o->hsend, n, t, o->hrecv, n, t, c, r); break;
    case O_REDUCE_SCATTER: rc = MPI_Ireduce_scatter_block(o->hsend, o->hrecv, n, t, mpi_op(o->dt, o->op), c, r); break;
    case O_SEND: rc = MPI_Isend(o->hsend, n, t, o->peer, 0, c, r); break;
    default: rc = MPI_Irecv(o->hrecv, n, t, o->peer, 0, c, r); break;
    }
    return rc == MPI_SUCCESS ? 1 : (fail(ncclSystemError, "an MPI call failed"), 0);
}

static void batch_free(batch *b) {
    for (int i = 0; i < b->n; i++) {
        cudaEventDestroy(b->ops[i].ready);
        free(b->ops[i].hsend);
        free(b->ops[i].hrecv);
    }
    free(b->ops);
    free(b->reqs);
    free(b);
}

/* One step of b: its MPI calls posted once its inputs are ready (only
 * when every earlier batch has posted, so MPI sees them in order), then
 * the results copied back and the gates opened. */
static void step(batch *b, bool may_post) {
    if (b->state == B_WAITING && may_post) {
        for (int i = 0; i < b->n; i++) {
            cudaError_t e = cudaEventQuery(b->ops[i].ready);
            if (e == cudaErrorNotReady) return;
            if (!cuda_ok(e, "cudaEventQuery")) return;
        }
        for (int i = 0; i < b->n; i++)
            if (!post(&b->ops[i], &b->reqs[i])) return;
        b->state = B_IN_MPI;
    }
    if (b->state == B_IN_MPI) {
        int done = 0;
        if (MPI_Testall(b->n, b->reqs, &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) {
            fail(ncclSystemError, "an MPI call failed");
            return;
        }
        if (!done) return;
        for (int i = 0; i < b->n; i++)
            if (!copy(b->ops[i].recv, b->ops[i].hrecv, b->ops[i].recv_nb)) return;
        b->state = B_RELEASED;
        atomic_store(&b->released, 1);
    }
}

/* Moves every batch on; frees those whose gates have all passed. */
static void progress(void) {
    bool may_post = true;
    for (batch **p = &D.head; *p;) {
        batch *b = *p;
        step(b, may_post);
        may_post = may_post && b->state != B_WAITING;
        if (b->state == B_RELEASED && atomic_load(&b->gates_left) == 0) {
            *p = b->next;
            if (D.tail == &b->next) D.tail = p;
            batch_free(b);
        } else {
            p = &b->next;
        }
    }
}

/* The calls of a group (or one call) as a batch, gated on their streams. */
static ncclResult_t launch(work *ops, int n) {
    if (!D.copies && !cuda_ok(cudaStreamCreateWithFlags(&D.copies, cudaStreamNonBlocking), "cudaStreamCreate"))
        return D.error;
    batch *b = calloc(1, sizeof *b);
    if (!b || !(b->reqs = malloc((size_t)n * sizeof *b->reqs))) {
        free(b);
        return fail(ncclSystemError, "out of memory");
    }
    b->ops = ops;
    b->n = n;
    atomic_init(&b->released, 0);
    atomic_init(&b->gates_left, n);
    /* every ready event before any gate: a gate ahead of a ready event on
     * one stream would wait for a batch that waits for that event */
    for (int i = 0; i < n; i++) {
        b->reqs[i] = MPI_REQUEST_NULL;
        work *o = &ops[i];
        if (!cuda_ok(cudaEventCreateWithFlags(&o->ready, cudaEventDisableTiming), "cudaEventCreate") ||
            !cuda_ok(cudaEventRecord(o->ready, o->stream), "cudaEventRecord"))
            return D.error;         /* b leaks: the job is failing */
    }
    for (int i = 0; i < n; i++)
        if (!cuda_ok(cudaLaunchHostFunc(ops[i].stream, gate, b), "cudaLaunchHostFunc")) return D.error;
    *D.tail = b;
    D.tail = &b->next;
    progress();
    return ncclSuccess;
}

static ncclResult_t call(work o) {
    progress();
    if (D.error != ncclSuccess) return D.error;
    if (!o.comm) return fail(ncclInvalidArgument, "no communicator");
    if (D.depth == 0) {
        work *one = malloc(sizeof *one);
        if (!one) return fail(ncclSystemError, "out of memory");
        *one = o;
        return launch(one, 1);
    }
    if (D.ngrouped == D.cap) {
        int cap = D.cap ? 2 * D.cap : 8;
        work *g = realloc(D.grouped, (size_t)cap * sizeof *g);
        if (!g) return fail(ncclSystemError, "out of memory");
        D.grouped = g;
        D.cap = cap;
    }
    D.grouped[D.ngrouped++] = o;
    return ncclSuccess;
}

/* ---- the entry points ---- */

ncclResult_t ncclGroupStart(void) {
    D.depth++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
    if (D.depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--D.depth > 0 || D.ngrouped == 0) return D.error;
    work *ops = D.grouped;
    int n = D.ngrouped;
    D.grouped = NULL;
    D.ngrouped = D.cap = 0;
    return launch(ops, n);
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
    if (op > ncclMin) return fail(ncclInvalidArgument, "only sum, prod, max and min");
    return call((work){ .k = O_ALL_REDUCE, .send = send, .recv = recv, .count = count, .dt = dt, .op = op,
                             .comm = comm, .stream = stream });
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t dt, int root, ncclComm_t comm,
                           cudaStream_t stream) {
    return call((work){ .k = O_BROADCAST, .send = send, .recv = recv, .count = count, .dt = dt, .peer = root,
                      .comm = comm, .stream = stream });
}

ncclResult_t ncclReduce(const void *send, void *recv, size_t count, ncclDataType_t dt, ncclRedOp_t op, int root,
                        ncclComm_t comm, cudaStream_t stream) {
    if (op > ncclMin) return fail(ncclInvalidArgument, "only sum, prod, max and min");
    return call((work){ .k = O_REDUCE, .send = send, .recv = recv, .count = count, .dt = dt, .op = op, .peer = root,
                      .comm = comm, .stream = stream });
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t dt, ncclComm_t comm,
                           cudaStream_t stream) {
    return call((work){ .k = O_ALL_GATHER, .send = send, .recv = recv, .count = count, .dt = dt, .comm = comm,
                      .stream = stream });
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
    if (op > ncclMin) return fail(ncclInvalidArgument, "only sum, prod, max and min");
    return call((work){ .k = O_REDUCE_SCATTER, .send = send, .recv = recv, .count = count, .dt = dt, .op = op,
                      .comm = comm, .stream = stream });
}

ncclResult_t ncclSend(const void *send, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    return call((work){ .k = O_SEND, .send = send, .count = count, .dt = dt, .peer = peer, .comm = comm,
                      .stream = stream });
}

ncclResult_t ncclRecv(void *recv, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm, cudaStream_t stream) {
    return call((work){ .k = O_RECV, .recv = recv, .count = count, .dt = dt, .peer = peer, .comm = comm,
                      .stream = stream });
}

/* The id: the world rank that made it (the hub of the communicator's
 * start) and a serial number, so two communicators' starts never meet. */
typedef struct {
    uint32_t magic;
    int32_t hub;
    uint64_t serial;
} id_info;

enum { MAGIC = 0x4e434444, TAG_BASE = 23000 };

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    static uint64_t serial;
    id_info info = { MAGIC, 0, ++serial };
    MPI_Comm_rank(MPI_COMM_WORLD, &info.hub);
    memset(id, 0, sizeof *id);
    memcpy(id->internal, &info, sizeof info);
    return ncclSuccess;
}

/* The members learn each other's world ranks through the hub, then make
 * an MPI communicator of their own, ordered by NCCL rank. */
ncclResult_t ncclCommInitRank(ncclComm_t *out, int nranks, ncclUniqueId id, int rank) {
    id_info info;
    memcpy(&info, id.internal, sizeof info);
    if (info.magic != MAGIC || nranks < 1 || rank < 0 || rank >= nranks)
        return fail(ncclInvalidArgument, "ncclCommInitRank: not an id of this double, or a bad rank");
    int me, tag = TAG_BASE + (int)((info.serial * 131 + (uint64_t)info.hub) % 4000);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    int *members = malloc((size_t)nranks * sizeof *members);
    ncclComm_t c = calloc(1, sizeof *c);
    if (!members || !c) {
        free(members);
        free(c);
        return fail(ncclSystemError, "out of memory");
    }
    if (me == info.hub) {
        members[rank] = me;
        for (int i = 1; i < nranks; i++) {
            int pair[2];
            MPI_Recv(pair, 2, MPI_INT, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            members[pair[0]] = pair[1];
        }
        for (int i = 0; i < nranks; i++)
            if (members[i] != me) MPI_Send(members, nranks, MPI_INT, members[i], tag, MPI_COMM_WORLD);
    } else {
        int pair[2] = { rank, me };
        MPI_Send(pair, 2, MPI_INT, info.hub, tag, MPI_COMM_WORLD);
        MPI_Recv(members, nranks, MPI_INT, info.hub, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
    MPI_Group world, sub;
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    MPI_Group_incl(world, nranks, members, &sub);
    int rc = MPI_Comm_create_group(MPI_COMM_WORLD, sub, tag, &c->comm);
    MPI_Group_free(&sub);
    MPI_Group_free(&world);
    free(members);
    if (rc != MPI_SUCCESS) {
        free(c);
        return fail(ncclSystemError, "MPI_Comm_create_group failed");
    }
    c->rank = rank;
    c->size = nranks;
    *out = c;
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *state) {
    (void)comm;
    progress();
    *state = D.error;
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
    free(comm);             /* its MPI communicator goes with the job */
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (comm) MPI_Comm_free(&comm->comm);
    free(comm);
    return ncclSuccess;
}

ncclResult_t ncclGetVersion(int *version) {
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error (nccl double)";
    case ncclUnhandledCudaError: return "unhandled cuda error (nccl double)";
    case ncclSystemError: return "unhandled system error (nccl double)";
    case ncclInvalidArgument: return "invalid argument (nccl double)";
    case ncclInvalidUsage: return "invalid usage (nccl double)";
    default: return "error (nccl double)";
    }
}
