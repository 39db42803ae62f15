/* The NCCL backend: payloads of CUDA tensors. Each group gets an NCCL
 * communicator on first use (rank 0 of the group makes the unique id and
 * broadcasts it over the group's MPI control communicator). A collective
 * runs on the device's communication stream after the work queued so far
 * on its compute stream (an event between them), so the compute stream
 * goes on with backward while gradients travel; its request is an event
 * that test() polls, so the comm layer's deadlines apply unchanged.
 * Variable counts (gather, scatter, uneven all_gather / reduce_scatter)
 * become grouped point-to-point calls or per-rank reductions. */
#define _GNU_SOURCE            /* RTLD_DEFAULT */
#include "ds_comm_impl.h"
#include "ds_cuda_impl.h"
#include "ds_error.h"

#include <dlfcn.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    ncclComm_t comm;
    int device;
} nccl_group;

typedef struct {
    cudaEvent_t done;
    ncclComm_t comm;
    void *scratch;          /* the barrier's word, freed with the request */
} nccl_req;

static int nccl_check(ncclResult_t r, const char *op, const char *call) {
    if (r == ncclSuccess) return 0;
    return ds_fail(DS_ERR_STATE, "%s: %s: %s", op, call, ncclGetErrorString(r)), -1;
}

static int cuda_check(cudaError_t e, const char *op, const char *call) {
    if (e == cudaSuccess) return 0;
    return ds_fail(DS_ERR_STATE, "%s: %s: %s", op, call, cudaGetErrorString(e)), -1;
}

static ncclDataType_t nccl_type(ds_dtype t) {
    switch (t) {
    case DS_F32: return ncclFloat32;
    case DS_F64: return ncclFloat64;
    case DS_BF16: return ncclBfloat16;
    case DS_F16: return ncclFloat16;
    case DS_I32: return ncclInt32;
    case DS_I64: return ncclInt64;
    default: return ncclUint8;
    }
}

/* bool is a byte 0/1: its sum and max are OR (max), its product and min AND (min) */
static ncclRedOp_t nccl_op(ds_comm_op op, ds_dtype t) {
    if (t == DS_BOOL) return op == DS_COMM_SUM || op == DS_COMM_MAX ? ncclMax : ncclMin;
    switch (op) {
    case DS_COMM_MAX: return ncclMax;
    case DS_COMM_MIN: return ncclMin;
    case DS_COMM_PROD: return ncclProd;
    default: return ncclSum;
    }
}

/* Where a rank's GPU is: its host and PCI bus id. */
typedef struct {
    char host[64];
    char bus[32];
    int device;
} placement;

/* NCCL refuses two ranks of a communicator on one GPU, saying only
 * "invalid usage": the ranks of g first learn where each other's GPU is,
 * and when two share one, every rank fails with the same message naming
 * them (ranks sharing a GPU by ds.device()'s choice go over MPI unless
 * NCCL is asked for; this is also DSLUA_DEVICE=cuda:0 on every rank, or
 * tensors moved by hand). 0, or -1 with the error set. */
static int check_placement(ds_comm_group *g, int dev, const char *op) {
    if (dlsym(RTLD_DEFAULT, "dslua_nccl_double")) return 0;     /* tests/nccl_double takes shared GPUs */
    placement mine = { .device = dev };
    if (gethostname(mine.host, sizeof mine.host - 1)) snprintf(mine.host, sizeof mine.host, "?");
    if (cudaDeviceGetPCIBusId(mine.bus, (int)sizeof mine.bus, dev) != cudaSuccess) {
        cudaGetLastError();
        snprintf(mine.bus, sizeof mine.bus, "cuda:%d", dev);
    }
    placement *all = calloc((size_t)g->size, sizeof *all);
    if (!all) return ds_fail(DS_ERR_NOMEM, "%s: out of memory", op), -1;
    char what[128];
    snprintf(what, sizeof what, "%s: GPUs of group %s", op, g->name);
    int rc = ds_comm_ctl_allgather(g, &mine, all, (int)sizeof mine, what);
    for (int i = 0; rc == 0 && i < g->size; i++)
        for (int j = i + 1; rc == 0 && j < g->size; j++)
            if (strcmp(all[i].host, all[j].host) == 0 && strcmp(all[i].bus, all[j].bus) == 0) {
                ds_fail(DS_ERR_STATE, "%s: ranks %d and %d both use the GPU at PCI %s on %s (cuda:%d and cuda:%d "
                        "there): NCCL needs a GPU of its own for each rank. Give each rank its own GPU "
                        "(DSLUA_DEVICE=cuda or unset: the one of its LOCAL_RANK), carry device tensors over MPI "
                        "(DSLUA_COMM_BACKEND=mpi), or run the ranks on the CPU (DSLUA_DEVICE=cpu)", op, g->ranks[i], g->ranks[j], all[i].bus,
                        all[i].host, all[i].device, all[j].device);
                rc = -1;
            }
    free(all);
    return rc;
}

/* g's communicator on dev, made on first use: a collective call on every
 * rank of g, as the first NCCL call on g is. */
static ncclComm_t group_comm(ds_comm_group *g, int dev, const char *op) {
    nccl_group *ng = g->backend[DS_DEV_CUDA];
    if (ng) {
        if (ng->device == dev) return ng->comm;
        return ds_fail(DS_ERR_ARG, "%s: group %s communicates on cuda:%d, this tensor is on cuda:%d", op, g->name,
                       ng->device, dev);
    }
    if (check_placement(g, dev, op)) return NULL;
    ncclUniqueId id;
    if (g->rank == 0 && nccl_check(ncclGetUniqueId(&id), op, "ncclGetUniqueId")) return NULL;
    char what[128];
    snprintf(what, sizeof what, "%s: NCCL unique id for group %s", op, g->name);
    if (ds_comm_ctl_bcast(g, &id, (int)sizeof id, 0, what)) return NULL;
    if (!(ng = calloc(1, sizeof *ng))) return ds_fail(DS_ERR_NOMEM, "%s: out of memory", op);
    if (nccl_check(ncclCommInitRank(&ng->comm, g->size, id, g->rank), op, "ncclCommInitRank")) {
        free(ng);
        return NULL;
    }
    ng->device = dev;
    g->backend[DS_DEV_CUDA] = ng;
    return ng->comm;
}

/* Before a call: the comm stream of ptr's device, after its compute
 * stream's work. Fills *dev and *comm and returns the stream, or NULL. */
static cudaStream_t begin(const void *ptr, ds_comm_group *g, const char *op, int *dev, ncclComm_t *comm) {
    if (ds_comm_cuda_device_of(ptr, op, dev) || !(*comm = group_comm(g, *dev, op))) return NULL;
    return ds_comm_cuda_begin(ptr, op, dev);
}

/* After the NCCL calls (r their result): the request, an event on ms. */
static int finish(ncclResult_t r, const char *op, cudaStream_t ms, ncclComm_t comm, void *scratch, void **req) {
    nccl_req *q = NULL;
    int rc = nccl_check(r, op, "NCCL");
    if (!rc && !(q = calloc(1, sizeof *q))) rc = (ds_fail(DS_ERR_NOMEM, "%s: out of memory", op), -1);
    if (!rc) rc = cuda_check(cudaEventCreateWithFlags(&q->done, cudaEventDisableTiming), op, "cudaEventCreateWithFlags");
    if (!rc && cuda_check(cudaEventRecord(q->done, ms), op, "cudaEventRecord")) {
        cudaEventDestroy(q->done);
        rc = -1;
    }
    if (rc) {
        free(q);
        if (scratch) {
            cudaStreamSynchronize(ms);
            ds_cuda_scratch_free(scratch);
        }
        return -1;
    }
    q->comm = comm;
    q->scratch = scratch;
    *req = q;
    return 0;
}

static int nccl_barrier(ds_comm_group *g, void **req) {
    int dev = ds_cuda_current_device() < 0 ? 0 : ds_cuda_current_device();
    if (ds_cuda_set_device(dev)) return ds_fail(DS_ERR_STATE, "barrier: %s", ds_kernel_error()), -1;
    void *word = ds_cuda_scratch(sizeof(float));
    if (!word) return ds_fail(DS_ERR_STATE, "barrier: %s", ds_kernel_error()), -1;
    ncclComm_t comm;
    cudaStream_t ms = begin(word, g, "barrier", &dev, &comm);
    if (!ms) { ds_cuda_scratch_free(word); return -1; }
    return finish(ncclAllReduce(word, word, 1, ncclFloat32, ncclSum, comm, ms), "barrier", ms, comm, word, req);
}

static int nccl_send(const void *buf, int64_t count, ds_dtype dt, int peer, int tag, ds_comm_group *g, void **req) {
    (void)tag;                     /* NCCL matches a pair's messages in order */
    int dev;
    ncclComm_t comm;
    cudaStream_t ms = begin(buf, g, "send", &dev, &comm);
    if (!ms) return -1;
    return finish(ncclSend(buf, (size_t)count, nccl_type(dt), peer, comm, ms), "send", ms, comm, NULL, req);
}

static int nccl_recv(void *buf, int64_t count, ds_dtype dt, int peer, int tag, ds_comm_group *g, void **req) {
    (void)tag;
    int dev;
    ncclComm_t comm;
    cudaStream_t ms = begin(buf, g, "recv", &dev, &comm);
    if (!ms) return -1;
    return finish(ncclRecv(buf, (size_t)count, nccl_type(dt), peer, comm, ms), "recv", ms, comm, NULL, req);
}

static int nccl_broadcast(void *buf, int64_t count, ds_dtype dt, int root, ds_comm_group *g, void **req) {
    int dev;
    ncclComm_t comm;
    cudaStream_t ms = begin(buf, g, "broadcast", &dev, &comm);
    if (!ms) return -1;
    return finish(ncclBroadcast(buf, buf, (size_t)count, nccl_type(dt), root, comm, ms), "broadcast", ms, comm, NULL,
                  req);
}

static int nccl_reduce(const void *send, void *recv, int64_t count, ds_dtype dt, ds_comm_op op, int root,
                       ds_comm_group *g, void **req) {
    int dev;
    ncclComm_t comm;
    cudaStream_t ms = begin(send, g, "reduce", &dev, &comm);
    if (!ms) return -1;
    return finish(ncclReduce(send, recv, (size_t)count, nccl_type(dt), nccl_op(op, dt), root, comm, ms), "reduce", ms,
                  comm, NULL, req);
}

static int nccl_all_reduce(void *buf, int64_t count, ds_dtype dt, ds_comm_op op, ds_comm_group *g, void **req) {
    int dev;
    ncclComm_t comm;
    cudaStream_t ms = begin(buf, g, "all_reduce", &dev, &comm);
    if (!ms) return -1;
    return finish(ncclAllReduce(buf, buf, (size_t)count, nccl_type(dt), nccl_op(op, dt), comm, ms), "all_reduce", ms,
                  comm, NULL, req);
}

static bool counts_equal(const int64_t *counts, int n) {
    for (int i = 1; i < n; i++)
        if (counts[i] != counts[0]) return false;
    return true;
}

/* The packed buffers' byte offset of rank r's part. */
static size_t offset_of(const int64_t *counts, int r, ds_dtype dt) {
    int64_t off = 0;
    for (int i = 0; i < r; i++) off += counts[i];
    return (size_t)off * ds_dtype_size(dt);
}

/* Root's own part moves with a device copy: NCCL needs no message to itself. */
static ncclResult_t own_part(void *dst, const void *src, size_t nb, cudaStream_t ms) {
    return nb && cudaMemcpyAsync(dst, src, nb, cudaMemcpyDeviceToDevice, ms) != cudaSuccess ? ncclUnhandledCudaError
                                                                                          : ncclSuccess;
}

static int nccl_gather(const void *send, void *recv, const int64_t *counts, ds_dtype dt, int root,
                       ds_comm_group *g, void **req) {
    int dev;
    ncclComm_t comm;
    cudaStream_t ms = begin(send, g, "gather", &dev, &comm);
    if (!ms) return -1;
    ncclDataType_t t = nccl_type(dt);
    ncclResult_t r = ncclGroupStart();
    if (g->rank != root) {
        if (r == ncclSuccess && counts[g->rank]) r = ncclSend(send, (size_t)counts[g->rank], t, root, comm, ms);
    } else {
        for (int i = 0; i < g->size && r == ncclSuccess; i++) {
            char *at = (char *)recv + offset_of(counts, i, dt);
            if (i == root) r = own_part(at, send, (size_t)counts[i] * ds_dtype_size(dt), ms);
            else if (counts[i]) r = ncclRecv(at, (size_t)counts[i], t, i, comm, ms);
        }
    }
    ncclResult_t e = ncclGroupEnd();
    return finish(r != ncclSuccess ? r : e, "gather", ms, comm, NULL, req);
}

static int nccl_scatter(const void *send, void *recv, const int64_t *counts, ds_dtype dt, int root,
                        ds_comm_group *g, void **req) {
    int dev;
    ncclComm_t comm;
    cudaStream_t ms = begin(recv, g, "scatter", &dev, &comm);
    if (!ms) return -1;
    ncclDataType_t t = nccl_type(dt);
    ncclResult_t r = ncclGroupStart();
    if (g->rank != root) {
        if (r == ncclSuccess && counts[g->rank]) r = ncclRecv(recv, (size_t)counts[g->rank], t, root, comm, ms);
    } else {
        for (int i = 0; i < g->size && r == ncclSuccess; i++) {
            const char *at = (const char *)send + offset_of(counts, i, dt);
            if (i == root) r = own_part(recv, at, (size_t)counts[i] * ds_dtype_size(dt), ms);
            else if (counts[i]) r = ncclSend(at, (size_t)counts[i], t, i, comm, ms);
        }
    }
    ncclResult_t e = ncclGroupEnd();
    return finish(r != ncclSuccess ? r : e, "scatter", ms, comm, NULL, req);
}

static int nccl_all_gather(const void *send, void *recv, const int64_t *counts, ds_dtype dt,
                           ds_comm_group *g, void **req) {
    int dev;
    ncclComm_t comm;
    cudaStream_t ms = begin(recv, g, "all_gather", &dev, &comm);
    if (!ms) return -1;
    ncclDataType_t t = nccl_type(dt);
    if (counts_equal(counts, g->size))
        return finish(ncclAllGather(send, recv, (size_t)counts[0], t, comm, ms), "all_gather", ms, comm, NULL, req);
    /* uneven: everyone broadcasts its part (NCCL's all_gatherv recipe) */
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < g->size && r == ncclSuccess; i++) {
        if (!counts[i]) continue;
        char *at = (char *)recv + offset_of(counts, i, dt);
        r = ncclBroadcast(i == g->rank ? send : at, at, (size_t)counts[i], t, i, comm, ms);
    }
    ncclResult_t e = ncclGroupEnd();
    return finish(r != ncclSuccess ? r : e, "all_gather", ms, comm, NULL, req);
}

static int nccl_reduce_scatter(const void *send, void *recv, const int64_t *counts, ds_dtype dt, ds_comm_op op,
                               ds_comm_group *g, void **req) {
    int dev;
    ncclComm_t comm;
    cudaStream_t ms = begin(send, g, "reduce_scatter", &dev, &comm);
    if (!ms) return -1;
    ncclDataType_t t = nccl_type(dt);
    ncclRedOp_t o = nccl_op(op, dt);
    if (counts_equal(counts, g->size))
        return finish(ncclReduceScatter(send, recv, (size_t)counts[0], t, o, comm, ms), "reduce_scatter", ms, comm,
                      NULL, req);
    /* uneven: rank i's part is reduced onto rank i */
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < g->size && r == ncclSuccess; i++) {
        if (!counts[i]) continue;
        const char *at = (const char *)send + offset_of(counts, i, dt);
        r = ncclReduce(at, i == g->rank ? recv : NULL, (size_t)counts[i], t, o, i, comm, ms);
    }
    ncclResult_t e = ncclGroupEnd();
    return finish(r != ncclSuccess ? r : e, "reduce_scatter", ms, comm, NULL, req);
}

/* A send and a receive per peer in one NCCL group, which posts them
 * together: no pair waits on the other's order. */
static int nccl_all_to_all(const void *send, void *recv, int64_t count, ds_dtype dt, ds_comm_group *g, void **req) {
    int dev;
    ncclComm_t comm;
    cudaStream_t ms = begin(send, g, "all_to_all", &dev, &comm);
    if (!ms) return -1;
    ncclDataType_t t = nccl_type(dt);
    size_t nb = (size_t)count * ds_dtype_size(dt);
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < g->size && r == ncclSuccess; i++) {
        const char *from = (const char *)send + (size_t)i * nb;
        char *to = (char *)recv + (size_t)i * nb;
        if (i == g->rank) {
            r = own_part(to, from, nb, ms);
        } else if (count) {
            r = ncclSend(from, (size_t)count, t, i, comm, ms);
            if (r == ncclSuccess) r = ncclRecv(to, (size_t)count, t, i, comm, ms);
        }
    }
    ncclResult_t e = ncclGroupEnd();
    return finish(r != ncclSuccess ? r : e, "all_to_all", ms, comm, NULL, req);
}

/* Done when the event has passed; a failed peer shows as the
 * communicator's asynchronous error. */
static int nccl_test(void *req, bool *done) {
    nccl_req *q = req;
    cudaError_t e = cudaEventQuery(q->done);
    if (e == cudaSuccess) {
        *done = true;
        return 0;
    }
    if (e != cudaErrorNotReady) return cuda_check(e, "comm", "cudaEventQuery");
    *done = false;
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(q->comm, &state) != ncclSuccess || (state != ncclSuccess && state != ncclInProgress))
        return nccl_check(state != ncclSuccess ? state : ncclInternalError, "comm", "NCCL");
    return 0;
}

static void nccl_free_req(void *req) {
    nccl_req *q = req;
    if (!q) return;
    cudaEventDestroy(q->done);
    ds_cuda_scratch_free(q->scratch);
    free(q);
}

const ds_comm_backend ds_comm_nccl_backend = {
    .name = "nccl",
    .reduces_half = true,
    .barrier = nccl_barrier,
    .send = nccl_send,
    .recv = nccl_recv,
    .broadcast = nccl_broadcast,
    .reduce = nccl_reduce,
    .all_reduce = nccl_all_reduce,
    .gather = nccl_gather,
    .scatter = nccl_scatter,
    .all_gather = nccl_all_gather,
    .reduce_scatter = nccl_reduce_scatter,
    .all_to_all = nccl_all_to_all,
    .test = nccl_test,
    .free_req = nccl_free_req,
};
