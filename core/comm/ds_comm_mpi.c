/* The MPI backend: payloads of CPU tensors as MPI nonblocking collectives
 * on the group's communicator. bf16/f16 travel as 16-bit words; the comm
 * layer widens them to f32 before a reduction, so sums are f32 sums. */
#include "ds_comm_impl.h"
#include "ds_error.h"

#include <limits.h>
#include <stdlib.h>

typedef struct {
    MPI_Request r;
    int *ints;          /* counts and displacements: MPI reads them until completion */
    int recv_count;     /* a recv's elements, checked against what arrives; -1 otherwise */
    MPI_Datatype recv_type;
} mpi_req;

int ds_comm_mpi_check(int rc, const char *op) {
    if (rc == MPI_SUCCESS) return 0;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    return ds_fail(DS_ERR_STATE, "%s: MPI error: %s", op, msg), -1;
}

static MPI_Datatype mpi_type(ds_dtype t) {
    switch (t) {
    case DS_F32: return MPI_FLOAT;
    case DS_F64: return MPI_DOUBLE;
    case DS_BF16: case DS_F16: return MPI_UINT16_T;
    case DS_I32: return MPI_INT32_T;
    case DS_I64: return MPI_INT64_T;
    default: return MPI_UINT8_T;
    }
}

/* bool is a byte 0/1: its sum and max are OR, its product and min AND */
static MPI_Op mpi_op(ds_comm_op op, ds_dtype t) {
    if (t == DS_BOOL) return op == DS_COMM_SUM || op == DS_COMM_MAX ? MPI_LOR : MPI_LAND;
    switch (op) {
    case DS_COMM_MAX: return MPI_MAX;
    case DS_COMM_MIN: return MPI_MIN;
    case DS_COMM_PROD: return MPI_PROD;
    default: return MPI_SUM;
    }
}

static int to_int(int64_t n, const char *op, int *out) {
    if (n > INT_MAX) return ds_fail(DS_ERR_ARG, "%s: %lld elements exceed MPI's count limit", op, (long long)n), -1;
    *out = (int)n;
    return 0;
}

static mpi_req *new_req(int nints) {
    mpi_req *q = calloc(1, sizeof *q);
    if (q && nints) q->ints = malloc((size_t)nints * sizeof(int));
    if (!q || (nints && !q->ints)) {
        if (q) free(q);
        return ds_fail(DS_ERR_NOMEM, "comm: out of memory");
    }
    q->r = MPI_REQUEST_NULL;
    q->recv_count = -1;
    return q;
}

/* Ends a start: hands q out, or frees it when MPI refused. */
static int started(int rc, const char *op, mpi_req *q, void **req) {
    if (ds_comm_mpi_check(rc, op)) {
        free(q->ints);
        free(q);
        return -1;
    }
    *req = q;
    return 0;
}

/* counts and displacements (in elements) as ints, at q->ints and q->ints + n */
static mpi_req *v_req(const int64_t *counts, int n, const char *op) {
    mpi_req *q = new_req(2 * n);
    if (!q) return NULL;
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        if (to_int(counts[i], op, &q->ints[i]) || to_int(off, op, &q->ints[n + i])) {
            free(q->ints);
            free(q);
            return NULL;
        }
        off += counts[i];
    }
    return q;
}

static int mpi_barrier(ds_comm_group *g, void **req) {
    mpi_req *q = new_req(0);
    return q ? started(MPI_Ibarrier(g->comm, &q->r), "barrier", q, req) : -1;
}

static int mpi_send(const void *buf, int64_t count, ds_dtype dt, int peer, int tag, ds_comm_group *g, void **req) {
    int n;
    mpi_req *q = to_int(count, "send", &n) ? NULL : new_req(0);
    return q ? started(MPI_Isend(buf, n, mpi_type(dt), peer, tag, g->comm, &q->r), "send", q, req) : -1;
}

static int mpi_recv(void *buf, int64_t count, ds_dtype dt, int peer, int tag, ds_comm_group *g, void **req) {
    int n;
    mpi_req *q = to_int(count, "recv", &n) ? NULL : new_req(0);
    if (!q) return -1;
    q->recv_count = n;
    q->recv_type = mpi_type(dt);
    return started(MPI_Irecv(buf, n, q->recv_type, peer, tag, g->comm, &q->r), "recv", q, req);
}

static int mpi_broadcast(void *buf, int64_t count, ds_dtype dt, int root, ds_comm_group *g, void **req) {
    int n;
    mpi_req *q = to_int(count, "broadcast", &n) ? NULL : new_req(0);
    return q ? started(MPI_Ibcast(buf, n, mpi_type(dt), root, g->comm, &q->r), "broadcast", q, req) : -1;
}

static int mpi_reduce(const void *send, void *recv, int64_t count, ds_dtype dt, ds_comm_op op, int root,
                      ds_comm_group *g, void **req) {
    int n;
    mpi_req *q = to_int(count, "reduce", &n) ? NULL : new_req(0);
    if (!q) return -1;
    const void *s = g->rank == root && send == recv ? MPI_IN_PLACE : send;
    return started(MPI_Ireduce(s, recv, n, mpi_type(dt), mpi_op(op, dt), root, g->comm, &q->r), "reduce", q, req);
}

static int mpi_all_reduce(void *buf, int64_t count, ds_dtype dt, ds_comm_op op, ds_comm_group *g, void **req) {
    int n;
    mpi_req *q = to_int(count, "all_reduce", &n) ? NULL : new_req(0);
    if (!q) return -1;
    return started(MPI_Iallreduce(MPI_IN_PLACE, buf, n, mpi_type(dt), mpi_op(op, dt), g->comm, &q->r),
                   "all_reduce", q, req);
}

static int mpi_gather(const void *send, void *recv, const int64_t *counts, ds_dtype dt, int root,
                      ds_comm_group *g, void **req) {
    mpi_req *q = v_req(counts, g->size, "gather");
    if (!q) return -1;
    MPI_Datatype t = mpi_type(dt);
    return started(MPI_Igatherv(send, q->ints[g->rank], t, recv, q->ints, q->ints + g->size, t, root, g->comm, &q->r),
                   "gather", q, req);
}

static int mpi_scatter(const void *send, void *recv, const int64_t *counts, ds_dtype dt, int root,
                       ds_comm_group *g, void **req) {
    mpi_req *q = v_req(counts, g->size, "scatter");
    if (!q) return -1;
    MPI_Datatype t = mpi_type(dt);
    return started(MPI_Iscatterv(send, q->ints, q->ints + g->size, t, recv, q->ints[g->rank], t, root, g->comm, &q->r),
                   "scatter", q, req);
}

static int mpi_all_gather(const void *send, void *recv, const int64_t *counts, ds_dtype dt,
                          ds_comm_group *g, void **req) {
    mpi_req *q = v_req(counts, g->size, "all_gather");
    if (!q) return -1;
    MPI_Datatype t = mpi_type(dt);
    return started(MPI_Iallgatherv(send, q->ints[g->rank], t, recv, q->ints, q->ints + g->size, t, g->comm, &q->r),
                   "all_gather", q, req);
}

static int mpi_reduce_scatter(const void *send, void *recv, const int64_t *counts, ds_dtype dt, ds_comm_op op,
                              ds_comm_group *g, void **req) {
    mpi_req *q = v_req(counts, g->size, "reduce_scatter");
    if (!q) return -1;
    return started(MPI_Ireduce_scatter(send, recv, q->ints, mpi_type(dt), mpi_op(op, dt), g->comm, &q->r),
                   "reduce_scatter", q, req);
}

static int mpi_all_to_all(const void *send, void *recv, int64_t count, ds_dtype dt, ds_comm_group *g, void **req) {
    int n;
    mpi_req *q = to_int(count, "all_to_all", &n) ? NULL : new_req(0);
    if (!q) return -1;
    MPI_Datatype t = mpi_type(dt);
    return started(MPI_Ialltoall(send, n, t, recv, n, t, g->comm, &q->r), "all_to_all", q, req);
}

static int mpi_test(void *req, bool *done) {
    mpi_req *q = req;
    int flag = 0, got = 0;
    MPI_Status st;
    if (ds_comm_mpi_check(MPI_Test(&q->r, &flag, &st), "comm")) return -1;
    *done = flag != 0;
    /* a shorter message fits a recv's buffer: MPI takes it and leaves the rest as it was */
    if (*done && q->recv_count >= 0 && MPI_Get_count(&st, q->recv_type, &got) == MPI_SUCCESS && got != q->recv_count)
        return ds_fail(DS_ERR_ARG, "recv: rank %d sent %d elements, the receiving tensor holds %d: a recv takes "
                       "exactly what its send sends", st.MPI_SOURCE, got, q->recv_count), -1;
    return 0;
}

static void mpi_free_req(void *req) {
    mpi_req *q = req;
    if (!q) return;
    free(q->ints);
    free(q);
}

const ds_comm_backend ds_comm_mpi_backend = {
    .name = "mpi",
    .reduces_half = false,
    .barrier = mpi_barrier,
    .send = mpi_send,
    .recv = mpi_recv,
    .broadcast = mpi_broadcast,
    .reduce = mpi_reduce,
    .all_reduce = mpi_all_reduce,
    .gather = mpi_gather,
    .scatter = mpi_scatter,
    .all_gather = mpi_all_gather,
    .reduce_scatter = mpi_reduce_scatter,
    .all_to_all = mpi_all_to_all,
    .test = mpi_test,
    .free_req = mpi_free_req,
};
