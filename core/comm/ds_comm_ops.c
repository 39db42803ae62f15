/* The primitives on tensors: arguments checked, shapes agreed between
 * ranks, a contiguous wire buffer made when the tensor is not one (or is
 * bf16/f16 under a reduction the backend cannot do in 16 bits), the
 * backend started, results and copies back arranged for completion. */
#include "ds_comm_impl.h"
#include "ds_error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What ranks tell each other about a tensor before moving it. */
typedef struct {
    int32_t dtype;          /* -1: this rank's arguments were invalid */
    int32_t ndim;
    int64_t shape[DS_MAX_DIMS];
} meta;

static meta meta_of(const ds_tensor *t) {
    meta m;
    memset(&m, 0, sizeof m);
    m.dtype = t ? (int32_t)t->dtype : -1;
    m.ndim = t ? t->ndim : 0;
    for (int i = 0; t && i < t->ndim; i++) m.shape[i] = t->shape[i];
    return m;
}

static int64_t meta_numel(const meta *m) {
    int64_t n = 1;
    for (int i = 0; i < m->ndim; i++) n *= m->shape[i];
    return n;
}

static const char *meta_str(const meta *m, char *buf, size_t n) {
    size_t len = (size_t)snprintf(buf, n, "%s[", m->dtype >= 0 ? ds_dtype_name((ds_dtype)m->dtype) : "?");
    for (int i = 0; i < m->ndim && len < n; i++)
        len += (size_t)snprintf(buf + len, n - len, "%s%lld", i ? "," : "", (long long)m->shape[i]);
    if (len < n) snprintf(buf + len, n - len, "]");
    return buf;
}

static ds_comm_op wire_op(ds_comm_op op) { return op == DS_COMM_AVG ? DS_COMM_SUM : op; }

static int check_op(const char *name, ds_comm_op op, ds_dtype dt) {
    if (op < 0 || op >= DS_COMM_NOPS) return ds_fail(DS_ERR_ARG, "%s: unknown reduce op %d", name, (int)op), -1;
    if (op == DS_COMM_AVG && !ds_dtype_is_float(dt))
        return ds_fail(DS_ERR_ARG, "%s: op avg needs a floating dtype, got %s", name, ds_dtype_name(dt)), -1;
    return 0;
}

/* bf16/f16 sums in 16 bits round at every step; f32 gives the right sum */
static ds_dtype reduce_wire(const ds_comm_backend *be, ds_dtype dt) {
    return (dt == DS_BF16 || dt == DS_F16) && !be->reduces_half ? DS_F32 : dt;
}

/* A world rank as a rank of g, or -1 with the error. */
static int group_rank(const ds_comm_group *g, int world_rank, const char *op, const char *arg) {
    for (int i = 0; i < g->size; i++)
        if (g->ranks[i] == world_rank) return i;
    if (strcmp(ds_comm_group_name(g), "world") == 0)
        return ds_fail(DS_ERR_ARG, "%s: %s %d out of range for a world of %d rank%s", op, arg, world_rank, g->size,
                       g->size == 1 ? "" : "s"), -1;
    return ds_fail(DS_ERR_ARG, "%s: %s %d is not a rank of group %s", op, arg, world_rank, g->name), -1;
}

/* A contiguous tensor of dtype wire shaped like t: t itself (retained)
 * when it is one, else a new one, holding t's values when fill. */
static ds_tensor *wire_buffer(ds_tensor *t, ds_dtype wire, bool fill, const char *op) {
    if (t->dtype == wire && ds_tensor_is_contiguous(t)) {
        ds_tensor_retain(t);
        return t;
    }
    ds_tensor *b = ds_tensor_new(t->ndim, t->shape, wire, ds_tensor_device(t));
    if (b && fill && ds_comm_copy(b, t, op)) {
        ds_tensor_release(b);
        return NULL;
    }
    return b;
}

static ds_tensor *copy_of(ds_tensor *t, const char *op) {
    ds_tensor *c = ds_tensor_new(t->ndim, t->shape, t->dtype, ds_tensor_device(t));
    if (c && ds_comm_copy(c, t, op)) {
        ds_tensor_release(c);
        return NULL;
    }
    return c;
}

/* A contiguous view of flat with m's shape, at element offset off. */
static ds_tensor *piece_of(ds_tensor *flat, const meta *m, int64_t off) {
    int64_t shape[DS_MAX_DIMS], stride[DS_MAX_DIMS], s = 1;
    for (int i = m->ndim - 1; i >= 0; i--) {
        shape[i] = m->shape[i];
        stride[i] = s;
        s *= m->shape[i];
    }
    return ds_tensor_view_of(flat, m->ndim, shape, stride, flat->offset + off);
}

static ds_tensor *flat_new(int64_t n, ds_dtype dt, ds_device dev) { return ds_tensor_new(1, &n, dt, dev); }

static ds_comm_work *fail_work(ds_comm_work *w) {
    ds_comm_work_free(w);
    return NULL;
}

ds_comm_work *ds_comm_barrier(ds_comm_group *g) {
    char what[160];
    ds_comm_sig sig = ds_comm_sig_of("barrier", -1, 0, -1, true);
    if (ds_comm_begin(&g, &sig, false, NULL, what, sizeof what)) return NULL;
    ds_comm_work *w = ds_comm_work_new(g, what, -1, 0);
    if (!w || g->size == 1) return w ? ds_comm_work_local(w) : NULL;
    void *req = NULL;
    int rc = ds_comm_mpi_backend.barrier(g, &req);
    return ds_comm_work_launch(w, &ds_comm_mpi_backend, rc, req);
}

/* send and recv: tag >= 0, the peer another rank of g */
static ds_comm_work *p2p(ds_tensor *t, int peer, int tag, ds_comm_group *g, bool sending) {
    const char *op = sending ? "send" : "recv";
    char what[160];
    const ds_comm_backend *be = ds_comm_backend_of(t, op);
    ds_comm_sig sig = ds_comm_sig_of(op, t->dtype, ds_tensor_numel(t), -1, true);
    if (!be || ds_comm_begin(&g, &sig, true, NULL, what, sizeof what)) return NULL;
    int pr = group_rank(g, peer, op, sending ? "dst" : "src");
    if (pr < 0) return NULL;
    if (pr == g->rank) return ds_fail(DS_ERR_ARG, "%s: %s %d is this rank", op, sending ? "dst" : "src", peer);
    if (tag < 0) return ds_fail(DS_ERR_ARG, "%s: tag %d must be >= 0", op, tag);
    size_t len = strlen(what);
    snprintf(what + len, sizeof what - len, " %s rank %d", sending ? "to" : "from", peer);
    ds_comm_work *w = ds_comm_work_new(g, what, peer, 0);
    ds_tensor *buf = w ? wire_buffer(t, t->dtype, sending, op) : NULL;
    if (!buf) return fail_work(w);
    w->sending = sending;
    w->ordinal = ds_comm_p2p_count(peer, sending);
    void *req = NULL;
    int rc;
    if (sending) {
        w->keep = buf;
        rc = be->send(ds_tensor_data(buf), ds_tensor_numel(buf), buf->dtype, pr, tag, g, &req);
    } else {
        w->buf = buf;
        if (buf != t) { ds_tensor_retain(t); w->target = t; }
        ds_storage_bump_version(t->storage, "recv");
        rc = be->recv(ds_tensor_data(buf), ds_tensor_numel(buf), buf->dtype, pr, tag, g, &req);
    }
    return ds_comm_work_launch(w, be, rc, req);
}

ds_comm_work *ds_comm_send(ds_tensor *t, int dst, int tag, ds_comm_group *g) { return p2p(t, dst, tag, g, true); }
ds_comm_work *ds_comm_recv(ds_tensor *t, int src, int tag, ds_comm_group *g) { return p2p(t, src, tag, g, false); }

ds_comm_work *ds_comm_broadcast(ds_tensor *t, int src, ds_comm_group *g) {
    char what[160];
    const ds_comm_backend *be = ds_comm_backend_of(t, "broadcast");
    ds_comm_sig sig = ds_comm_sig_of("broadcast", t->dtype, ds_tensor_numel(t), src, true);
    if (!be || ds_comm_begin(&g, &sig, false, NULL, what, sizeof what)) return NULL;
    int root = group_rank(g, src, "broadcast", "src");
    ds_comm_work *w = root < 0 ? NULL : ds_comm_work_new(g, what, -1, 0);
    if (!w || g->size == 1) return w ? ds_comm_work_local(w) : NULL;
    bool is_root = g->rank == root;
    ds_tensor *buf = wire_buffer(t, t->dtype, is_root, "broadcast");
    if (!buf) return fail_work(w);
    w->buf = buf;
    if (buf != t && !is_root) { ds_tensor_retain(t); w->target = t; }
    if (!is_root) ds_storage_bump_version(t->storage, "broadcast");
    void *req = NULL;
    int rc = be->broadcast(ds_tensor_data(buf), ds_tensor_numel(buf), buf->dtype, root, g, &req);
    return ds_comm_work_launch(w, be, rc, req);
}

ds_comm_work *ds_comm_reduce(ds_tensor *t, int dst, ds_comm_op op, ds_comm_group *g) {
    char what[160];
    const ds_comm_backend *be = ds_comm_backend_of(t, "reduce");
    ds_comm_sig sig = ds_comm_sig_of("reduce", t->dtype, ds_tensor_numel(t), dst, true);
    sig.rop = (int32_t)op;
    if (!be || check_op("reduce", op, t->dtype) || ds_comm_begin(&g, &sig, false, NULL, what, sizeof what))
        return NULL;
    int root = group_rank(g, dst, "reduce", "dst");
    ds_comm_work *w = root < 0 ? NULL : ds_comm_work_new(g, what, -1, 0);
    if (!w || g->size == 1) return w ? ds_comm_work_local(w) : NULL;
    bool is_root = g->rank == root;
    ds_tensor *buf = wire_buffer(t, reduce_wire(be, t->dtype), true, "reduce");
    if (!buf) return fail_work(w);
    if (is_root) {
        w->buf = buf;
        if (buf != t) { ds_tensor_retain(t); w->target = t; }
        if (op == DS_COMM_AVG) w->divide = g->size;
        ds_storage_bump_version(t->storage, "reduce");
    } else {
        w->keep = buf;
    }
    void *data = ds_tensor_data(buf), *req = NULL;
    int rc = be->reduce(data, is_root ? data : NULL, ds_tensor_numel(buf), buf->dtype, wire_op(op), root, g, &req);
    return ds_comm_work_launch(w, be, rc, req);
}

ds_comm_work *ds_comm_all_reduce(ds_tensor *t, ds_comm_op op, ds_comm_group *g) {
    char what[160];
    const ds_comm_backend *be = ds_comm_backend_of(t, "all_reduce");
    ds_comm_sig sig = ds_comm_sig_of("all_reduce", t->dtype, ds_tensor_numel(t), -1, true);
    sig.rop = (int32_t)op;
    if (!be || check_op("all_reduce", op, t->dtype) || ds_comm_begin(&g, &sig, false, NULL, what, sizeof what))
        return NULL;
    ds_comm_work *w = ds_comm_work_new(g, what, -1, 0);
    if (!w || g->size == 1) return w ? ds_comm_work_local(w) : NULL;
    ds_tensor *buf = wire_buffer(t, reduce_wire(be, t->dtype), true, "all_reduce");
    if (!buf) return fail_work(w);
    w->buf = buf;
    if (buf != t) { ds_tensor_retain(t); w->target = t; }
    if (op == DS_COMM_AVG) w->divide = g->size;
    ds_storage_bump_version(t->storage, "all_reduce");
    void *req = NULL;
    int rc = be->all_reduce(ds_tensor_data(buf), ds_tensor_numel(buf), buf->dtype, wire_op(op), g, &req);
    return ds_comm_work_launch(w, be, rc, req);
}

/* Every rank's shape (from the signatures), checked to differ at most in
 * the first dim. */
static meta *agree_shapes(ds_comm_group *g, const ds_comm_sig *sigs, const char *op) {
    meta *all = malloc((size_t)g->size * sizeof *all);
    if (!all) return ds_fail(DS_ERR_NOMEM, "%s: out of memory", op);
    for (int r = 0; r < g->size; r++) {
        memset(&all[r], 0, sizeof all[r]);
        all[r].dtype = sigs[r].dtype;
        all[r].ndim = sigs[r].ndim;
        memcpy(all[r].shape, sigs[r].shape, sizeof all[r].shape);
    }
    for (int r = 0; r < g->size; r++) {
        const meta *a = &all[r], *b = &all[0];
        bool ok = a->dtype == b->dtype && a->ndim == b->ndim;
        for (int d = 1; ok && d < a->ndim; d++) ok = a->shape[d] == b->shape[d];
        if (!ok) {
            char sa[96], sb[96];
            ds_fail(DS_ERR_ARG, "%s: rank %d has %s but rank %d has %s; tensors may differ only in their first dim",
                    op, g->ranks[r], meta_str(a, sa, sizeof sa), g->ranks[0], meta_str(b, sb, sizeof sb));
            free(all);
            return NULL;
        }
    }
    return all;
}

/* gather (root >= 0: results on root only) and all_gather (root -1) */
static ds_comm_work *gather_any(ds_tensor *t, int dst, ds_comm_group *g, bool all_ranks) {
    const char *op = all_ranks ? "all_gather" : "gather";
    char what[160];
    const ds_comm_backend *be = ds_comm_backend_of(t, op);
    ds_comm_sig sig = ds_comm_sig_of(op, t->dtype, ds_tensor_numel(t), all_ranks ? -1 : dst, false), *sigs = NULL;
    sig.ndim = t->ndim;
    memcpy(sig.shape, t->shape, sizeof sig.shape);
    if (!be || ds_comm_begin(&g, &sig, false, &sigs, what, sizeof what)) return NULL;
    int root = all_ranks ? -1 : group_rank(g, dst, op, "dst");
    bool receives = all_ranks || g->rank == root;
    if ((!all_ranks && root < 0) || g->size == 1) {
        free(sigs);
        if (root < 0 && !all_ranks) return NULL;
        ds_comm_work *w = ds_comm_work_new(g, what, -1, 1);
        if (w && !(w->results[0] = copy_of(t, op))) return fail_work(w);
        return w ? ds_comm_work_local(w) : NULL;
    }
    meta *all = sigs ? agree_shapes(g, sigs, op) : NULL;
    free(sigs);
    int64_t *counts = all ? malloc((size_t)g->size * sizeof *counts) : NULL;
    ds_comm_work *w = counts ? ds_comm_work_new(g, what, -1, receives ? g->size : 0) : NULL;
    ds_tensor *send = w ? wire_buffer(t, t->dtype, true, op) : NULL;
    int64_t total = 0;
    for (int r = 0; counts && r < g->size; r++) total += counts[r] = meta_numel(&all[r]);
    ds_tensor *out = send && receives ? flat_new(total, t->dtype, ds_tensor_device(t)) : NULL;
    bool ok = send && (out || !receives);
    for (int64_t r = 0, off = 0; ok && out && r < g->size; off += counts[r++])
        ok = (w->results[r] = piece_of(out, &all[r], off)) != NULL;
    if (!ok) {
        if (send) ds_tensor_release(send);
        if (out) ds_tensor_release(out);
        free(all);
        free(counts);
        return fail_work(w);
    }
    w->keep = send;
    w->buf = out;
    void *req = NULL, *recv = out ? ds_tensor_data(out) : NULL;
    int rc = all_ranks ? be->all_gather(ds_tensor_data(send), recv, counts, t->dtype, g, &req)
                       : be->gather(ds_tensor_data(send), recv, counts, t->dtype, root, g, &req);
    free(all);
    free(counts);
    return ds_comm_work_launch(w, be, rc, req);
}

ds_comm_work *ds_comm_gather(ds_tensor *t, int dst, ds_comm_group *g) { return gather_any(t, dst, g, false); }
ds_comm_work *ds_comm_all_gather(ds_tensor *t, ds_comm_group *g) { return gather_any(t, -1, g, true); }

/* A list of n tensors, one per rank of g, of one dtype and device: 0, or
 * -1 with the error. */
static int check_list(ds_tensor **list, int n, const ds_comm_group *g, const char *op) {
    if (!list || n != g->size)
        return ds_fail(DS_ERR_ARG, "%s: needs a list of %d tensor%s (one per rank of %s), got %d", op, g->size,
                       g->size == 1 ? "" : "s", g->name, list ? n : 0), -1;
    for (int i = 0; i < n; i++) {
        if (!list[i]) return ds_fail(DS_ERR_ARG, "%s: list entry %d is not a tensor", op, i + 1), -1;
        if (list[i]->dtype != list[0]->dtype)
            return ds_fail(DS_ERR_ARG, "%s: list entry %d is %s but entry 1 is %s", op, i + 1,
                           ds_dtype_name(list[i]->dtype), ds_dtype_name(list[0]->dtype)), -1;
        if (!ds_device_equal(ds_tensor_device(list[i]), ds_tensor_device(list[0])))
            return ds_fail(DS_ERR_ARG, "%s: list entries are on different devices", op), -1;
    }
    return 0;
}

/* list packed in rank order into one contiguous buffer of dtype wire */
static ds_tensor *pack(ds_tensor **list, int n, ds_dtype wire, const char *op) {
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += ds_tensor_numel(list[i]);
    ds_tensor *flat = flat_new(total, wire, ds_tensor_device(list[0]));
    for (int64_t i = 0, off = 0; flat && i < n; off += ds_tensor_numel(list[i++])) {
        meta m = meta_of(list[i]);
        ds_tensor *p = piece_of(flat, &m, off);
        int rc = p ? ds_comm_copy(p, list[i], op) : -1;
        if (p) ds_tensor_release(p);
        if (rc) { ds_tensor_release(flat); return NULL; }
    }
    return flat;
}

ds_comm_work *ds_comm_scatter(ds_tensor **list, int n, int src, ds_comm_group *g) {
    char what[160];
    ds_comm_sig sig = ds_comm_sig_of("scatter", -1, -1, src, false);
    if (ds_comm_begin(&g, &sig, false, NULL, what, sizeof what)) return NULL;
    int root = group_rank(g, src, "scatter", "src");
    if (root < 0) return NULL;
    bool is_root = g->rank == root;
    if (is_root && (check_list(list, n, g, "scatter") || !ds_comm_backend_of(list[0], "scatter"))) {
        if (g->size == 1) return NULL;
        /* tell the others, who wait for shapes, that there will be none */
        char err[1024];
        snprintf(err, sizeof err, "%s", ds_error_message());
        meta *bad = calloc((size_t)g->size, sizeof *bad);
        for (int r = 0; bad && r < g->size; r++) bad[r].dtype = -1;
        if (bad) ds_comm_ctl_bcast(g, bad, (int)(g->size * sizeof *bad), root, what);
        free(bad);
        return ds_fail(DS_ERR_ARG, "%s", err);
    }
    if (g->size == 1) {
        ds_comm_work *w = ds_comm_work_new(g, what, -1, 1);
        if (w && !(w->results[0] = copy_of(list[0], "scatter"))) return fail_work(w);
        return w ? ds_comm_work_local(w) : NULL;
    }
    meta *all = calloc((size_t)g->size, sizeof *all);
    if (!all) return ds_fail(DS_ERR_NOMEM, "scatter: out of memory");
    for (int r = 0; is_root && r < g->size; r++) all[r] = meta_of(list[r]);
    if (ds_comm_ctl_bcast(g, all, (int)(g->size * sizeof *all), root, what)) { free(all); return NULL; }
    if (all[0].dtype < 0) {
        free(all);
        return ds_fail(DS_ERR_ARG, "scatter: the tensor list on rank %d (src) was not valid", src);
    }
    int64_t *counts = malloc((size_t)g->size * sizeof *counts);
    for (int r = 0; counts && r < g->size; r++) counts[r] = meta_numel(&all[r]);
    meta *mine = &all[g->rank];
    ds_dtype dt = (ds_dtype)mine->dtype;
    ds_device dev = is_root ? ds_tensor_device(list[0]) : DS_CPU_DEVICE;
    ds_comm_work *w = counts ? ds_comm_work_new(g, what, -1, 1) : NULL;
    ds_tensor *out = w ? ds_tensor_new(mine->ndim, mine->shape, dt, dev) : NULL;
    ds_tensor *send = out && is_root ? pack(list, n, dt, "scatter") : NULL;
    const ds_comm_backend *be = out ? ds_comm_backend_of(out, "scatter") : NULL;
    if (!be || (is_root && !send)) {
        if (out) ds_tensor_release(out);
        if (send) ds_tensor_release(send);
        free(all);
        free(counts);
        return fail_work(w);
    }
    w->results[0] = out;
    w->keep = send;
    void *req = NULL;
    int rc = be->scatter(send ? ds_tensor_data(send) : NULL, ds_tensor_data(out), counts, dt, root, g, &req);
    free(all);
    free(counts);
    return ds_comm_work_launch(w, be, rc, req);
}

ds_comm_work *ds_comm_all_to_all(ds_tensor *t, ds_comm_group *g) {
    char what[160];
    const ds_comm_backend *be = ds_comm_backend_of(t, "all_to_all");
    ds_comm_sig sig = ds_comm_sig_of("all_to_all", t->dtype, ds_tensor_numel(t), -1, true);
    if (!be || ds_comm_begin(&g, &sig, false, NULL, what, sizeof what)) return NULL;
    /* the counts agreed: every rank refuses alike */
    int64_t n = ds_tensor_numel(t);
    if (n % g->size)
        return ds_fail(DS_ERR_ARG, "all_to_all: rank %d's %lld elements do not split into %d equal pieces (one per "
                       "rank of %s)", ds_comm_group_world_rank(g, g->rank), (long long)n, g->size, g->name);
    ds_comm_work *w = ds_comm_work_new(g, what, -1, 1);
    if (w && g->size == 1) {
        if (!(w->results[0] = copy_of(t, "all_to_all"))) return fail_work(w);
        return ds_comm_work_local(w);
    }
    ds_tensor *send = w ? wire_buffer(t, t->dtype, true, "all_to_all") : NULL;
    ds_tensor *out = send ? ds_tensor_new(t->ndim, t->shape, t->dtype, ds_tensor_device(t)) : NULL;
    if (!out) {
        if (send) ds_tensor_release(send);
        return fail_work(w);
    }
    w->results[0] = out;
    w->keep = send;
    ds_tensor_retain(out);
    w->buf = out;
    void *req = NULL;
    int rc = be->all_to_all(ds_tensor_data(send), ds_tensor_data(out), n / g->size, t->dtype, g, &req);
    return ds_comm_work_launch(w, be, rc, req);
}

/* FNV-1a over what a reduce_scatter list is (length, op, dtype, device,
 * each piece's count): ranks with equal hashes passed equal lists. -1: an
 * entry is not a tensor. */
static int64_t list_hash(ds_tensor **list, int n, ds_comm_op op) {
    if (!list) return -1;
    uint64_t h = 1469598103934665603ull;
    int64_t words[4] = { n, op, n > 0 && list[0] ? (int64_t)list[0]->dtype : -1,
                         n > 0 && list[0] ? (int64_t)ds_tensor_device(list[0]).type : -1 };
    for (int i = 0; i < 4 + n; i++) {
        if (i >= 4 && !list[i - 4]) return -1;
        uint64_t v = (uint64_t)(i < 4 ? words[i] : ds_tensor_numel(list[i - 4]));
        for (int b = 0; b < 8; b++) h = (h ^ ((v >> (8 * b)) & 0xff)) * 1099511628211ull;
    }
    return (int64_t)(h >> 1);
}

ds_comm_work *ds_comm_reduce_scatter(ds_tensor **list, int n, ds_comm_op op, ds_comm_group *g) {
    char what[160];
    ds_dtype dt = list && n > 0 && list[0] ? list[0]->dtype : DS_F32;
    int64_t total = 0;
    for (int i = 0; list && i < n; i++) total += list[i] ? ds_tensor_numel(list[i]) : 0;
    /* the piece counts agree with the signatures when their hashes do;
     * count is not strict, so that the exchange below names the piece */
    ds_comm_sig sig = ds_comm_sig_of("reduce_scatter", dt, total, -1, false), *sigs = NULL;
    sig.rop = (int32_t)op;
    sig.detail = list_hash(list, n, op);
    if (ds_comm_begin(&g, &sig, false, &sigs, what, sizeof what)) return NULL;
    bool agreed = sig.detail >= 0;
    for (int r = 0; sigs && r < g->size; r++) agreed = agreed && sigs[r].detail == sig.detail;
    free(sigs);
    const ds_comm_backend *be = NULL;
    bool valid = check_list(list, n, g, "reduce_scatter") == 0 && check_op("reduce_scatter", op, dt) == 0 &&
                 (be = ds_comm_backend_of(list[0], "reduce_scatter")) != NULL;
    if (g->size == 1) {
        ds_comm_work *w = valid ? ds_comm_work_new(g, what, -1, 1) : NULL;
        if (w && !(w->results[0] = copy_of(list[0], "reduce_scatter"))) return fail_work(w);
        return w ? ds_comm_work_local(w) : NULL;
    }
    /* equal lists everywhere: every rank finds the same fault, if any */
    if (agreed && !valid) return NULL;
    /* every rank's element count per piece (or -1: its arguments were bad) */
    char err[1024];
    snprintf(err, sizeof err, "%s", valid ? "" : ds_error_message());
    int s = g->size;
    int64_t *mine = malloc((size_t)s * sizeof *mine), *all = malloc((size_t)s * s * sizeof *all);
    if (!mine || !all) {
        free(mine);
        free(all);
        return ds_fail(DS_ERR_NOMEM, "reduce_scatter: out of memory");
    }
    for (int r = 0; r < s; r++) mine[r] = valid ? ds_tensor_numel(list[r]) : -1;
    int rc = agreed ? 0 : ds_comm_ctl_allgather(g, mine, all, (int)(s * sizeof *mine), what);
    for (int q = 0; agreed && q < s; q++) memcpy(all + (size_t)q * s, mine, (size_t)s * sizeof *mine);
    for (int q = 0; rc == 0 && q < s; q++)
        for (int r = 0; rc == 0 && r < s; r++) {
            if (all[q * s + r] >= 0 && all[q * s + r] == all[r]) continue;
            if (!valid) rc = (ds_fail(DS_ERR_ARG, "%s", err), -1);
            else if (all[q * s + r] < 0)
                rc = (ds_fail(DS_ERR_ARG, "reduce_scatter: the tensor list on rank %d was not valid", g->ranks[q]), -1);
            else
                rc = (ds_fail(DS_ERR_ARG, "reduce_scatter: rank %d's piece for rank %d has %lld elements but rank %d's "
                             "has %lld", g->ranks[q], g->ranks[r], (long long)all[q * s + r], g->ranks[0],
                             (long long)all[r]), -1);
        }
    free(all);
    if (rc) { free(mine); return NULL; }
    ds_dtype wire = reduce_wire(be, dt);
    ds_tensor *me = list[g->rank];
    ds_comm_work *w = ds_comm_work_new(g, what, -1, 1);
    ds_tensor *send = w ? pack(list, n, wire, "reduce_scatter") : NULL;
    ds_tensor *out = send ? ds_tensor_new(me->ndim, me->shape, dt, ds_tensor_device(me)) : NULL;
    ds_tensor *recv = out && wire != dt ? ds_tensor_new(me->ndim, me->shape, wire, ds_tensor_device(me)) : out;
    if (!recv) {
        if (send) ds_tensor_release(send);
        if (out) ds_tensor_release(out);
        free(mine);
        return fail_work(w);
    }
    w->results[0] = out;
    w->keep = send;
    if (recv != out) {
        w->buf = recv;
        ds_tensor_retain(out);
        w->target = out;
    } else {
        ds_tensor_retain(out);
        w->buf = out;
    }
    if (op == DS_COMM_AVG) w->divide = s;
    void *req = NULL;
    rc = be->reduce_scatter(ds_tensor_data(send), ds_tensor_data(recv), mine, wire, wire_op(op), g, &req);
    free(mine);
    return ds_comm_work_launch(w, be, rc, req);
}
