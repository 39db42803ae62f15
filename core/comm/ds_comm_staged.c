/* The staged backend: collectives of device tensors over MPI, for ranks
 * that share a GPU (NCCL takes one GPU per rank) or that ask for it. A
 * call copies its device bytes into page-locked host memory on the
 * device's communication stream (after the work queued so far), the MPI
 * backend moves them between the ranks' host buffers, and the results go
 * back to the device on the same stream. all_reduce, broadcast and reduce
 * go in chunks (DSLUA_COMM_CHUNK bytes, default 4 MiB), each chunk's MPI
 * call starting once its copy has arrived, so the copies of the later
 * chunks overlap the MPI of the earlier ones; the other primitives move in
 * one piece. The request completes when its last copy back has passed.
 *
 * MPI calls start in the order the collectives were made, across every
 * request of the process (a queue), so ranks whose copies finish at
 * different times still start them in one order; they travel on each
 * group's communicator of their own, apart from the CPU tensors' calls,
 * which start at once. Every wait of the comm layer starts what is due,
 * so a staged send starts while its rank waits for something else. */
#include "ds_comm_impl.h"
#include "ds_env.h"
#include "ds_error.h"

#include <stdlib.h>
#include <string.h>

typedef enum { K_SEND, K_RECV, K_BROADCAST, K_REDUCE, K_ALL_REDUCE, K_GATHER, K_SCATTER, K_ALL_GATHER,
               K_REDUCE_SCATTER, K_ALL_TO_ALL } kind;

enum { IN_COPY, IN_MPI, OUT_COPY, DONE };

/* One piece: bytes in (device to host) before its MPI call, out after. */
typedef struct {
    size_t in_off, in_nb, out_off, out_nb;
    int64_t count;                  /* elements of a chunked call */
    void *fence, *mpi;
    int stage;
} chunk;

typedef struct staged_req {
    const ds_comm_stager *st;
    void *stream;
    kind k;
    ds_dtype dt;
    ds_comm_op op;
    int root, peer, tag;
    int64_t count;                  /* all_to_all: per rank; send, recv: all */
    int64_t *counts;                /* the variable-count primitives: per rank */
    ds_comm_group g;                /* the caller's group on its staged communicator */
    const char *dsend;              /* device bytes read, and written */
    char *drecv;
    char *hsend, *hrecv;            /* page-locked; hrecv == hsend in place */
    size_t hsend_nb, hrecv_nb;
    int nchunks, started;
    chunk *chunks;
    struct staged_req *next;
} staged_req;

/* requests with MPI calls not yet started, oldest first */
static staged_req *queue, **queue_tail = &queue;

static const ds_comm_stager host_stager;

static const ds_comm_stager *stager_of(const void *ptr) {
#ifdef DSLUA_CUDA
    if (ds_cuda_stager.owns(ptr)) return &ds_cuda_stager;
#endif
    (void)ptr;
    return &host_stager;
}

/* DSLUA_COMM_CHUNK bytes (default 4 MiB) as whole elements of size es */
static int64_t chunk_elems(size_t es) {
    int64_t b = ds_env_int("DSLUA_COMM_CHUNK", 4 << 20);
    int64_t n = b / (int64_t)es;
    return n > 0 ? n : 1;
}

static void req_free(staged_req *q) {
    if (!q) return;
    for (int i = 0; q->chunks && i < q->nchunks; i++) {
        if (q->chunks[i].fence) q->st->fence_free(q->chunks[i].fence);
        if (q->chunks[i].mpi) ds_comm_mpi_backend.free_req(q->chunks[i].mpi);
    }
    if (q->hrecv && q->hrecv != q->hsend) q->st->host_free(q->hrecv, q->hrecv_nb);
    if (q->hsend) q->st->host_free(q->hsend, q->hsend_nb);
    free(q->chunks);
    free(q->counts);
    free(q);
}

static size_t sum_bytes(const int64_t *counts, int n, ds_dtype dt) {
    int64_t s = 0;
    for (int i = 0; i < n; i++) s += counts[i];
    return (size_t)s * ds_dtype_size(dt);
}

/* A request for g with nothing set but its stream, stager and group. */
static staged_req *req_new(kind k, const void *dev_ptr, ds_dtype dt, ds_comm_group *g, const char *op) {
    staged_req *q = calloc(1, sizeof *q);
    if (!q) return ds_fail(DS_ERR_NOMEM, "%s: out of memory", op);
    q->k = k;
    q->dt = dt;
    q->st = stager_of(dev_ptr);
    q->g = *g;
    q->g.comm = g->staged;
    q->root = q->peer = -1;
    if (!(q->stream = q->st->begin(dev_ptr, op))) { free(q); return NULL; }
    return q;
}

static void *host_buffer(staged_req *q, size_t nb, const char *op) {
    void *p = q->st->host_alloc(nb);
    if (!p) ds_fail(DS_ERR_NOMEM, "%s: no page-locked host memory for %zu bytes", op, nb);
    return p;
}

/* The host buffers (send_nb, and recv_nb unless in place) and the pieces:
 * one, or chunks of whole elements over count elements when chunked. */
static int req_layout(staged_req *q, size_t send_nb, size_t recv_nb, bool in_place, int64_t count, bool chunked,
                      const char *op) {
    q->hsend_nb = send_nb ? send_nb : 1;        /* an empty piece still has a buffer */
    q->hrecv_nb = in_place ? q->hsend_nb : recv_nb ? recv_nb : 1;
    if (!(q->hsend = host_buffer(q, q->hsend_nb, op))) return -1;
    if (in_place) q->hrecv = q->hsend;
    else if (!(q->hrecv = host_buffer(q, q->hrecv_nb, op))) return -1;
    size_t es = ds_dtype_size(q->dt);
    int64_t per = chunked ? chunk_elems(es) : (count > 0 ? count : 1);
    q->nchunks = count > per ? (int)((count + per - 1) / per) : 1;
    if (!(q->chunks = calloc((size_t)q->nchunks, sizeof *q->chunks)))
        return ds_fail(DS_ERR_NOMEM, "%s: out of memory", op), -1;
    for (int i = 0; i < q->nchunks; i++) {
        chunk *c = &q->chunks[i];
        if (!chunked) {
            c->in_nb = send_nb;
            c->out_nb = in_place ? send_nb : recv_nb;
            c->count = count;
            continue;
        }
        int64_t first = (int64_t)i * per, n = count - first < per ? count - first : per;
        c->in_off = c->out_off = (size_t)first * es;
        c->in_nb = c->out_nb = (size_t)n * es;
        c->count = n;
    }
    return 0;
}

/* The copies in, queued now; which pieces copy in and out is set by the
 * caller (in_nb or out_nb 0: none). */
static int req_copy_in(staged_req *q) {
    for (int i = 0; i < q->nchunks; i++) {
        chunk *c = &q->chunks[i];
        if (c->in_nb && q->st->copy(q->hsend + c->in_off, q->dsend + c->in_off, c->in_nb, q->stream, &c->fence))
            return -1;
    }
    return 0;
}

static void no_in(staged_req *q) { for (int i = 0; i < q->nchunks; i++) q->chunks[i].in_nb = 0; }
static void no_out(staged_req *q) { for (int i = 0; i < q->nchunks; i++) q->chunks[i].out_nb = 0; }

/* Queued behind the earlier requests' MPI calls; the request out. */
static int req_start(staged_req *q, void **req) {
    if (req_copy_in(q)) { req_free(q); return -1; }
    *queue_tail = q;
    queue_tail = &q->next;
    *req = q;
    return 0;
}

/* Chunk i's MPI call on the host buffers. */
static int start_mpi(staged_req *q, int i) {
    const ds_comm_backend *m = &ds_comm_mpi_backend;
    chunk *c = &q->chunks[i];
    char *s = q->hsend + c->in_off, *r = q->hrecv + c->out_off;
    ds_comm_group *g = &q->g;
    switch (q->k) {
    case K_SEND: return m->send(s, q->count, q->dt, q->peer, q->tag, g, &c->mpi);
    case K_RECV: return m->recv(r, q->count, q->dt, q->peer, q->tag, g, &c->mpi);
    case K_BROADCAST: return m->broadcast(s, c->count, q->dt, q->root, g, &c->mpi);
    case K_REDUCE: return m->reduce(s, g->rank == q->root ? s : NULL, c->count, q->dt, q->op, q->root, g, &c->mpi);
    case K_ALL_REDUCE: return m->all_reduce(s, c->count, q->dt, q->op, g, &c->mpi);
    case K_GATHER: return m->gather(s, g->rank == q->root ? r : NULL, q->counts, q->dt, q->root, g, &c->mpi);
    case K_SCATTER: return m->scatter(g->rank == q->root ? s : NULL, r, q->counts, q->dt, q->root, g, &c->mpi);
    case K_ALL_GATHER: return m->all_gather(s, r, q->counts, q->dt, g, &c->mpi);
    case K_REDUCE_SCATTER: return m->reduce_scatter(s, r, q->counts, q->dt, q->op, g, &c->mpi);
    case K_ALL_TO_ALL: return m->all_to_all(s, r, q->count, q->dt, g, &c->mpi);
    }
    return ds_fail(DS_ERR_STATE, "comm: staged call of unknown kind %d", (int)q->k), -1;
}

/* A piece's fence: passed (and freed), or still on its way. */
static int fence_passed(staged_req *q, chunk *c, bool *done) {
    *done = true;
    if (!c->fence) return 0;
    if (q->st->passed(c->fence, done)) return -1;
    if (*done) {
        q->st->fence_free(c->fence);
        c->fence = NULL;
    }
    return 0;
}

/* Starts the MPI calls whose copies in have arrived, in queue order. */
int ds_comm_staged_pump(void) {
    while (queue) {
        staged_req *q = queue;
        while (q->started < q->nchunks) {
            chunk *c = &q->chunks[q->started];
            bool arrived;
            if (fence_passed(q, c, &arrived)) return -1;
            if (!arrived) return 0;
            if (start_mpi(q, q->started)) return -1;
            c->stage = IN_MPI;
            q->started++;
        }
        queue = q->next;
        if (!queue) queue_tail = &queue;
        q->next = NULL;
    }
    return 0;
}

/* Moves q's started pieces on: MPI done, then the copy out, then done. */
static int advance(staged_req *q, bool *done) {
    *done = true;
    for (int i = 0; i < q->nchunks; i++) {
        chunk *c = &q->chunks[i];
        if (c->stage == IN_MPI) {
            bool d = false;
            if (ds_comm_mpi_backend.test(c->mpi, &d)) return -1;
            if (d) {
                ds_comm_mpi_backend.free_req(c->mpi);
                c->mpi = NULL;
                if (c->out_nb &&
                    q->st->copy(q->drecv + c->out_off, q->hrecv + c->out_off, c->out_nb, q->stream, &c->fence))
                    return -1;
                c->stage = OUT_COPY;
            }
        }
        if (c->stage == OUT_COPY) {
            bool d;
            if (fence_passed(q, c, &d)) return -1;
            if (d) c->stage = DONE;
        }
        *done = *done && c->stage == DONE;
    }
    return 0;
}

static int staged_test(void *req, bool *done) {
    *done = false;
    if (ds_comm_staged_pump()) return -1;
    return advance(req, done);
}

static void staged_free_req(void *req) { req_free(req); }

/* The comm layer sends barriers to the MPI backend; this one serves the
 * table. */
static int staged_barrier(ds_comm_group *g, void **req) { return ds_comm_mpi_backend.barrier(g, req); }

static int staged_p2p(kind k, void *buf, int64_t count, ds_dtype dt, int peer, int tag, ds_comm_group *g,
                      void **req) {
    const char *op = k == K_SEND ? "send" : "recv";
    staged_req *q = req_new(k, buf, dt, g, op);
    if (!q) return -1;
    q->count = count;
    q->peer = peer;
    q->tag = tag;
    q->dsend = buf;
    q->drecv = buf;
    if (req_layout(q, (size_t)count * ds_dtype_size(dt), 0, true, count, false, op)) { req_free(q); return -1; }
    if (k == K_SEND) no_out(q);
    else no_in(q);
    return req_start(q, req);
}

static int staged_send(const void *buf, int64_t count, ds_dtype dt, int peer, int tag, ds_comm_group *g, void **req) {
    return staged_p2p(K_SEND, (void *)buf, count, dt, peer, tag, g, req);
}

static int staged_recv(void *buf, int64_t count, ds_dtype dt, int peer, int tag, ds_comm_group *g, void **req) {
    return staged_p2p(K_RECV, buf, count, dt, peer, tag, g, req);
}

/* broadcast, reduce and all_reduce: in place, in chunks */
static int staged_chunked(kind k, const void *send, void *recv, int64_t count, ds_dtype dt, ds_comm_op op, int root,
                          ds_comm_group *g, void **req) {
    static const char *names[] = { [K_BROADCAST] = "broadcast", [K_REDUCE] = "reduce", [K_ALL_REDUCE] = "all_reduce" };
    staged_req *q = req_new(k, send, dt, g, names[k]);
    if (!q) return -1;
    q->op = op;
    q->root = root;
    q->dsend = send;
    q->drecv = recv;
    if (req_layout(q, (size_t)count * ds_dtype_size(dt), 0, true, count, true, names[k])) { req_free(q); return -1; }
    bool is_root = g->rank == root;
    if (k == K_BROADCAST && !is_root) no_in(q);
    if ((k == K_BROADCAST && is_root) || (k == K_REDUCE && !is_root)) no_out(q);
    return req_start(q, req);
}

static int staged_broadcast(void *buf, int64_t count, ds_dtype dt, int root, ds_comm_group *g, void **req) {
    return staged_chunked(K_BROADCAST, buf, buf, count, dt, DS_COMM_SUM, root, g, req);
}

static int staged_reduce(const void *send, void *recv, int64_t count, ds_dtype dt, ds_comm_op op, int root,
                         ds_comm_group *g, void **req) {
    return staged_chunked(K_REDUCE, send, recv, count, dt, op, root, g, req);
}

static int staged_all_reduce(void *buf, int64_t count, ds_dtype dt, ds_comm_op op, ds_comm_group *g, void **req) {
    return staged_chunked(K_ALL_REDUCE, buf, buf, count, dt, op, -1, g, req);
}

/* gather, scatter, all_gather, reduce_scatter: one piece of send_nb bytes
 * in and recv_nb out (0: this rank has none) */
static int staged_v(kind k, const void *send, void *recv, const int64_t *counts, ds_dtype dt, ds_comm_op op, int root,
                    ds_comm_group *g, const char *name, void **req) {
    size_t mine = (size_t)counts[g->rank] * ds_dtype_size(dt), all = sum_bytes(counts, g->size, dt);
    bool is_root = g->rank == root;
    size_t in = k == K_SCATTER ? (is_root ? all : 0) : k == K_REDUCE_SCATTER ? all : mine;
    size_t out = k == K_GATHER ? (is_root ? all : 0) : k == K_ALL_GATHER ? all : mine;
    staged_req *q = req_new(k, send ? send : recv, dt, g, name);
    if (!q) return -1;
    q->op = op;
    q->root = root;
    q->dsend = send;
    q->drecv = recv;
    q->counts = malloc((size_t)g->size * sizeof *q->counts);
    if (!q->counts) { req_free(q); return ds_fail(DS_ERR_NOMEM, "%s: out of memory", name), -1; }
    memcpy(q->counts, counts, (size_t)g->size * sizeof *q->counts);
    if (req_layout(q, in, out, false, 1, false, name)) { req_free(q); return -1; }
    return req_start(q, req);
}

static int staged_gather(const void *send, void *recv, const int64_t *counts, ds_dtype dt, int root, ds_comm_group *g,
                         void **req) {
    return staged_v(K_GATHER, send, recv, counts, dt, DS_COMM_SUM, root, g, "gather", req);
}

static int staged_scatter(const void *send, void *recv, const int64_t *counts, ds_dtype dt, int root, ds_comm_group *g,
                          void **req) {
    return staged_v(K_SCATTER, send, recv, counts, dt, DS_COMM_SUM, root, g, "scatter", req);
}

static int staged_all_gather(const void *send, void *recv, const int64_t *counts, ds_dtype dt, ds_comm_group *g,
                             void **req) {
    return staged_v(K_ALL_GATHER, send, recv, counts, dt, DS_COMM_SUM, -1, g, "all_gather", req);
}

static int staged_reduce_scatter(const void *send, void *recv, const int64_t *counts, ds_dtype dt, ds_comm_op op,
                                 ds_comm_group *g, void **req) {
    return staged_v(K_REDUCE_SCATTER, send, recv, counts, dt, op, -1, g, "reduce_scatter", req);
}

static int staged_all_to_all(const void *send, void *recv, int64_t count, ds_dtype dt, ds_comm_group *g, void **req) {
    staged_req *q = req_new(K_ALL_TO_ALL, send, dt, g, "all_to_all");
    if (!q) return -1;
    size_t nb = (size_t)count * (size_t)g->size * ds_dtype_size(dt);
    q->count = count;
    q->dsend = send;
    q->drecv = recv;
    if (req_layout(q, nb, nb, false, 1, false, "all_to_all")) { req_free(q); return -1; }
    return req_start(q, req);
}

const ds_comm_backend ds_comm_staged_backend = {
    .name = "mpi (staged)",
    .reduces_half = false,
    .barrier = staged_barrier,
    .send = staged_send,
    .recv = staged_recv,
    .broadcast = staged_broadcast,
    .reduce = staged_reduce,
    .all_reduce = staged_all_reduce,
    .gather = staged_gather,
    .scatter = staged_scatter,
    .all_gather = staged_all_gather,
    .reduce_scatter = staged_reduce_scatter,
    .all_to_all = staged_all_to_all,
    .test = staged_test,
    .free_req = staged_free_req,
};

/* ---- the host stager: memcpy, its fences passing at the second look ---- */

static bool host_owns(const void *ptr) { (void)ptr; return true; }

static void *host_begin(const void *ptr, const char *op) {
    (void)ptr;
    (void)op;
    return (void *)&host_stager;        /* no stream: any non-NULL word */
}

static void *host_alloc(size_t nb) { return malloc(nb); }
static void host_free(void *p, size_t nb) { (void)nb; free(p); }

/* A fence that has not passed at its first look, so that every stage of
 * a request is seen waiting once. */
static int host_copy(void *dst, const void *src, size_t nb, void *stream, void **fence) {
    (void)stream;
    memcpy(dst, src, nb);
    int *looks = calloc(1, sizeof *looks);
    if (!looks) return ds_fail(DS_ERR_NOMEM, "comm: out of memory"), -1;
    *fence = looks;
    return 0;
}

static int host_passed(void *fence, bool *done) {
    int *looks = fence;
    *done = ++*looks > 1;
    return 0;
}

static void host_fence_free(void *fence) { free(fence); }

static const ds_comm_stager host_stager = {
    .name = "host",
    .owns = host_owns,
    .begin = host_begin,
    .host_alloc = host_alloc,
    .host_free = host_free,
    .copy = host_copy,
    .passed = host_passed,
    .fence_free = host_fence_free,
};
