/* Stage 3: partitioned parameters gathered on use, prefetched along the
 * module order of the first forward, released after use. With the shards
 * in host memory (offload_param cpu) and a copier that can join, a
 * prefetch's shards go up on the copy stream beside the module computing
 * now, and its all-gather is launched at the next prefetch (or when a
 * parameter of it is needed), once the device's work waits for them. */
#include "ds_zero_impl.h"
#include "ds_autograd.h"
#include "ds_error.h"
#include "ds_ops.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* offload_param nvme: q's shard between the file and a host buffer */
static int shard_io(ds_zero *z, zparam *q, ds_tensor *host, bool write) {
    ds_aio_req *r = write ? ds_aio_write(z->param_file, host, q->home) : ds_aio_read(z->param_file, host, q->home);
    int rc = r ? ds_aio_wait(r) : -1;
    ds_aio_req_free(r);
    return rc;
}

static ds_tensor *host_shard(ds_zero *z, zparam *q) {
    return ds_tensor_new_staging(1, &q->shard, z->dtype, ds_tensor_device(q->param));
}

/* q's shard into dst's elements from at, from wherever it lives. */
static int load_shard(ds_zero *z, zparam *q, ds_tensor *dst, int64_t at) {
    if (!z->param_file) return ds_zero_copy_elements(dst, at, q->own, 0, q->shard);
    ds_tensor *host = host_shard(z, q);
    int rc = host && shard_io(z, q, host, false) == 0 ? ds_zero_copy_elements(dst, at, host, 0, q->shard) : -1;
    ds_tensor_release(host);
    return rc;
}

/* The listed parameters' shards into send, back to back: those in memory
 * on send's device as one kernel, the others one by one. */
static int load_shards(ds_zero *z, ds_tensor *send, int n, const int *list) {
    zpieces c = { 0 };
    int64_t at = 0;
    int rc = 0;
    for (int k = 0; k < n && rc == 0; k++) {
        zparam *q = &z->p[list[k]];
        if (!z->param_file && ds_device_equal(ds_tensor_device(q->own), ds_tensor_device(send)))
            rc = ds_zero_piece(&c, send, at, q->own, 0, q->shard);
        else
            rc = load_shard(z, q, send, at);
        at += q->shard;
    }
    rc = ds_zero_pieces_run(&c, rc, false);
    return rc;
}

int ds_zero_store_shard(ds_zero *z, zparam *q, ds_tensor *src, int64_t at) {
    if (!z->param_file) return ds_zero_copy_elements(q->own, 0, src, at, q->shard);
    ds_tensor *host = host_shard(z, q);
    int rc = host && ds_zero_copy_elements(host, 0, src, at, q->shard) == 0 ? shard_io(z, q, host, true) : -1;
    ds_tensor_release(host);
    return rc;
}

int ds_zero_offload_params(ds_zero *z, const char *file) {
    if (z->c.stage != 3) return ds_fail(DS_ERR_STATE, "step engine: offload_param is for stage 3"), -1;
    if (z->param_file) return ds_fail(DS_ERR_STATE, "step engine: the parameters are offloaded already"), -1;
    int64_t bytes = 0;
    for (int i = 0; i < z->n; i++) {
        zparam *q = &z->p[i];
        if (!q->own) continue;
        q->home = bytes;
        bytes += q->shard * (int64_t)ds_dtype_size(z->dtype);
    }
    if (file && !(z->param_file = ds_aio_open(file, bytes > 0 ? bytes : 1))) return -1;
    if (!file && ds_zero_offload_param_loads(z)) return -1;
    z->params_on_host = !file;
    bool prev = ds_set_grad_enabled(false);
    int rc = 0;
    for (int i = 0; i < z->n && rc == 0; i++) {
        zparam *q = &z->p[i];
        if (!q->own) continue;
        ds_tensor *host = host_shard(z, q);
        rc = host && ds_zero_copy_elements(host, 0, q->own, 0, q->shard) == 0 ? 0 : -1;
        if (rc == 0 && file) {
            /* the file holds it; own keeps its shape, without data */
            rc = shard_io(z, q, host, true);
            if (rc == 0) rc = ds_tensor_release_data(q->own);
        } else if (rc == 0) {
            ds_tensor_set_category(host, DS_MEM_PARAM);
            ds_tensor_release(q->own);
            q->own = host;
            host = NULL;
        }
        ds_tensor_release(host);
    }
    ds_set_grad_enabled(prev);
    return rc;
}

static bool waiting(const zparam *q) { return q->own && ds_tensor_is_released(q->param) && !q->in_flight; }

static int launch(ds_zero *z, zgather *g) {
    g->started = ds_zero_now();
    return (g->work = ds_comm_all_gather(g->send, z->c.group)) ? 0 : -1;
}

/* One all-gather of the listed parameters' shards, back to back; ahead (a
 * prefetch) with the shards in host memory and a copier that joins, the
 * shards only start up, the all-gather waiting for launch_loaded. */
static zgather *start_gather(ds_zero *z, int n, const int *list, bool ahead) {
    zgather *g = calloc(1, sizeof *g);
    if (g) g->params = malloc(sizeof *g->params * (size_t)n);
    if (!g || !g->params) {
        free(g);
        return ds_fail(DS_ERR_NOMEM, "step engine: out of memory");
    }
    g->n = n;
    int64_t width = 0;
    for (int k = 0; k < n; k++) width += z->p[list[k]].shard;
    int rc = (g->send = ds_tensor_new(1, &width, z->dtype, ds_tensor_device(z->p[0].param))) ? 0 : -1;
    memcpy(g->params, list, sizeof *list * (size_t)n);
    g->loading = ahead && z->params_on_host && ds_zero_offload_joins(z);
    if (rc == 0 && g->loading) rc = ds_zero_offload_load(z, g->send, n, list);
    if (rc == 0 && !g->loading) rc = load_shards(z, g->send, n, list);
    if (rc == 0 && !g->loading) rc = launch(z, g);
    if (rc) {
        if (g->loading) ds_zero_offload_settle_up(z);     /* the copies write into send */
        ds_tensor_release(g->send);
        free(g->params);
        free(g);
        return NULL;
    }
    for (int k = 0; k < n; k++) z->p[list[k]].in_flight = g;
    return g;
}

static void drop_gather(ds_zero *z, zgather *g) {
    for (int k = 0; k < g->n; k++) z->p[g->params[k]].in_flight = NULL;
    ds_comm_work_release(g->work);
    ds_tensor_release(g->send);
    free(g->params);
    free(g);
}

/* Waits for what g has started (its shards' copies, or its all-gather)
 * and drops it. */
static int let_go(ds_zero *z, zgather *g) {
    int rc = g->loading ? ds_zero_offload_settle_up(z) : ds_comm_work_wait(g->work);
    drop_gather(z, g);
    return rc;
}

/* The gathers whose shards are loading launch their all-gathers, after
 * one join: the device's work waits for the shards from here on. */
static int launch_loaded(ds_zero *z) {
    bool joined = false;
    for (int i = 0; i < z->n && z->params_on_host; i++) {
        zgather *g = z->p[i].in_flight;
        if (!g || !g->loading) continue;
        if (!joined && ds_zero_offload_join(z)) return -1;
        joined = true;
        if (launch(z, g)) {
            let_go(z, g);
            return -1;
        }
        g->loading = false;
    }
    return 0;
}

/* Each still-released parameter of g gets its rows of shards as its own
 * contiguous data, on its device. */
static int finish_gather(ds_zero *z, zgather *g) {
    if (g->loading && launch_loaded(z)) return -1;
    int rc = ds_comm_work_wait(g->work);
    if (rc == 0) ds_zero_log(z, "zero3_all_gather", g->send, g->started);
    ds_tensor *rows[z->parts];
    int got = 0;
    for (; rc == 0 && got < z->parts; got++)
        if (!(rows[got] = ds_comm_work_result(g->work, got))) rc = -1;
    ds_tensor **data = calloc((size_t)g->n, sizeof *data);
    if (!data && rc == 0) rc = (ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1);
    zpieces c = { 0 };
    int64_t at = 0;
    for (int k = 0; k < g->n && rc == 0; k++) {
        zparam *q = &z->p[g->params[k]];
        if (ds_tensor_is_released(q->param)) {
            data[k] = ds_tensor_new(q->param->ndim, q->param->shape, z->dtype, ds_tensor_device(q->param));
            rc = data[k] ? 0 : -1;
            for (int r = 0; r < z->parts && rc == 0; r++)
                rc = ds_zero_piece(&c, data[k], (int64_t)r * q->shard, rows[r], at, ds_zero_shard_len(q, r));
        }
        at += q->shard;
    }
    rc = ds_zero_pieces_run(&c, rc, false);
    for (int k = 0; k < g->n && data; k++) {
        zparam *q = &z->p[g->params[k]];
        if (rc == 0 && data[k]) rc = ds_tensor_set_data(q->param, data[k]);
        if (rc == 0 && data[k]) {
            ds_tensor_set_category(q->param, DS_MEM_PARAM);
            z->live += q->numel;
        }
        ds_tensor_release(data[k]);
    }
    free(data);
    for (int r = 0; r < got; r++) ds_tensor_release(rows[r]);
    drop_gather(z, g);
    return rc;
}

int ds_zero_gather_now(ds_zero *z, int n, const int *params) {
    /* parameters already on their way come first */
    for (int k = 0; k < n; k++) {
        zgather *g = z->p[params[k]].in_flight;
        if (g && finish_gather(z, g)) return -1;
    }
    int *list = malloc(sizeof *list * (size_t)(n > 0 ? n : 1)), m = 0;     /* n: up to every parameter */
    if (!list) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    for (int k = 0; k < n; k++)
        if (waiting(&z->p[params[k]])) list[m++] = params[k];
    zgather *g = m ? start_gather(z, m, list, false) : NULL;
    free(list);
    return m == 0 ? 0 : g ? finish_gather(z, g) : -1;
}

void ds_zero_release(ds_zero *z, int i) {
    zparam *q = &z->p[i];
    if (!q->own || ds_tensor_is_released(q->param)) return;
    ds_tensor_release_data(q->param);
    z->live -= q->numel;
}

/* After trace place k, gathering starts for the modules that come next (in
 * direction dir) until prefetch_bucket_size elements are on their way,
 * within max_live_parameters. */
static int prefetch(ds_zero *z, int k, int dir) {
    if (z->recording || !z->trace) return 0;
    if (launch_loaded(z)) return -1;
    int *list = malloc(sizeof *list * (size_t)z->n);
    if (!list) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    int m = 0;
    int64_t elements = 0;
    for (int j = k + dir; j >= 0 && j < z->trace_len && elements < z->c.prefetch_bucket_size; j += dir) {
        zmodule *md = &z->modules[z->trace[j]];
        for (int t = 0; t < md->n; t++) {
            int i = md->params[t];
            zparam *q = &z->p[i];
            bool listed = false;
            for (int s = 0; s < m && !listed; s++) listed = list[s] == i;
            if (listed || !waiting(q)) continue;
            if (z->live + elements + q->numel > z->c.max_live_parameters) break;
            list[m++] = i;
            elements += q->numel;
        }
    }
    int rc = m > 0 && !start_gather(z, m, list, true) ? -1 : 0;
    free(list);
    return rc;
}

/* The autograd fetch hook: an op or a backward node reads a released
 * parameter; its whole module comes, and in backward the module before. */
static int fetch(ds_tensor *t, void *ud) {
    ds_zero *z = ud;
    int i = ds_zero_param_index(z, t);
    if (i < 0) return 0;    /* another engine's, or nobody's */
    int m = z->p[i].owner;
    int rc = m >= 0 ? ds_zero_gather_now(z, z->modules[m].n, z->modules[m].params) : ds_zero_gather_now(z, 1, &i);
    if (rc == 0 && z->in_backward && m >= 0 && z->modules[m].position >= 0)
        rc = prefetch(z, z->modules[m].position, -1);
    return rc;
}

/* Before the layout is built: stage 3 cuts every parameter into world
 * shards of ceil(n / world). */
static int check_shard(ds_zero *z, int i, ds_tensor *shard) {
    zparam *q = &z->p[i];
    int64_t want = (q->numel + z->world - 1) / z->world;
    char s1[96], s2[96];
    if (z->c.stage != 3)
        return ds_fail(DS_ERR_ARG, "step engine: parameter %d was built partitioned, which only stage 3 takes "
                       "(this is stage %d)", i + 1, z->c.stage), -1;
    if (q->numel <= z->c.persistence_threshold)
        return ds_fail(DS_ERR_ARG, "step engine: parameter %d (%s) was built partitioned but its %lld elements are "
                       "within persistence_threshold %lld, so stage 3 keeps it whole: build and train with one "
                       "threshold", i + 1, ds_shape_str(q->param, s1, sizeof s1), (long long)q->numel,
                       (long long)z->c.persistence_threshold), -1;
    if (!ds_tensor_is_released(q->param) || shard->ndim != 1 || shard->shape[0] != want ||
        !ds_tensor_is_contiguous(shard) || shard->dtype != z->dtype ||
        !ds_device_equal(ds_tensor_device(shard), ds_tensor_device(q->param)))
        return ds_fail(DS_ERR_ARG, "step engine: parameter %d (%s) on %d ranks needs a released parameter and its "
                       "contiguous %s shard [%lld] on its device, got %s %s", i + 1,
                       ds_shape_str(q->param, s1, sizeof s1), z->world, ds_dtype_name(z->dtype),
                       (long long)want, ds_dtype_name(shard->dtype), ds_shape_str(shard, s2, sizeof s2)), -1;
    return 0;
}

int ds_zero_check_shards(ds_zero *z) {
    for (int i = 0; i < z->n; i++) {
        ds_tensor *shard = z->c.shards ? z->c.shards[i] : NULL;
        char s[96];
        if (shard && check_shard(z, i, shard)) return -1;
        if (!shard && ds_tensor_is_released(z->p[i].param))
            return ds_fail(DS_ERR_ARG, "step engine: parameter %d (%s) has no data and no shard", i + 1,
                           ds_shape_str(z->p[i].param, s, sizeof s)), -1;
    }
    return 0;
}

int ds_zero_partition(ds_zero *z) {
    bool prev = ds_set_grad_enabled(false);
    int rc = 0;
    for (int i = 0; i < z->n && rc == 0; i++) {
        zparam *q = &z->p[i];
        if (q->numel <= z->c.persistence_threshold) continue;
        if (z->c.shards && z->c.shards[i]) {    /* built partitioned: no whole to cut */
            ds_tensor_retain(q->own = z->c.shards[i]);
            ds_tensor_set_category(q->own, DS_MEM_PARAM);
            continue;
        }
        if (!(q->own = ds_tensor_full(1, &q->shard, z->dtype, ds_tensor_device(q->param), 0.0))) rc = -1;
        if (rc == 0) {
            ds_tensor_set_category(q->own, DS_MEM_PARAM);
            rc = ds_zero_copy_elements(q->own, 0, q->param, (int64_t)z->rank * q->shard, ds_zero_shard_len(q, z->rank));
        }
        if (rc == 0) rc = ds_tensor_release_data(q->param);
    }
    ds_set_grad_enabled(prev);
    if (rc) return -1;
    z->recording = true;
    return ds_autograd_add_fetch(fetch, z);
}

int ds_zero_add_module(ds_zero *z, int n, const int *params) {
    if (z->c.stage != 3) return ds_fail(DS_ERR_STATE, "step engine: modules are for stage 3"), -1;
    int *own = malloc(sizeof *own * (size_t)(n ? n : 1));
    zmodule *mods = realloc(z->modules, sizeof *mods * (size_t)(z->n_modules + 1));
    if (!own || !mods) {
        free(own);
        if (mods) z->modules = mods;
        return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    }
    z->modules = mods;
    int m = 0;
    for (int k = 0; k < n; k++) {
        if (params[k] < 0 || params[k] >= z->n) {
            free(own);
            return ds_fail(DS_ERR_ARG, "step engine: module parameter %d is not one of the %d", params[k] + 1, z->n), -1;
        }
        if (z->p[params[k]].own) own[m++] = params[k];
    }
    if (m == 0) {
        free(own);
        return -2;      /* nothing partitioned: no hooks needed */
    }
    int id = z->n_modules++;
    z->modules[id] = (zmodule){ .n = m, .params = own, .position = -1, .at = -1 };
    for (int k = 0; k < m; k++)
        if (z->p[own[k]].owner < 0) z->p[own[k]].owner = id;
    return id;
}

static zmodule *module_at(ds_zero *z, int m) {
    if (m < 0 || m >= z->n_modules) return ds_fail(DS_ERR_ARG, "step engine: no module %d", m + 1);
    return &z->modules[m];
}

int ds_zero_pre_forward(ds_zero *z, int m) {
    zmodule *md = module_at(z, m);
    if (!md) return -1;
    if (z->recording) {
        int *t = realloc(z->trace, sizeof *t * (size_t)(z->trace_len + 1));
        if (!t) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
        z->trace = t;
        z->trace[z->trace_len] = m;
        md->at = z->trace_len++;
    } else {
        md->at = md->position;
    }
    if (ds_zero_gather_now(z, md->n, md->params)) return -1;
    return md->at >= 0 ? prefetch(z, md->at, 1) : 0;
}

int ds_zero_post_forward(ds_zero *z, int m) {
    zmodule *md = module_at(z, m);
    if (!md) return -1;
    if (!z->recording && md->at >= 0 && z->keep_after_forward[md->at]) return 0;
    for (int k = 0; k < md->n; k++) ds_zero_release(z, md->params[k]);
    return 0;
}

/* The first forward's module order becomes the trace; a module stays
 * gathered after its forward when backward reaches it again within
 * max_reuse_distance elements (the modules after it). */
int ds_zero_finish_recording(ds_zero *z) {
    z->recording = false;
    if (z->trace_len == 0) return 0;
    z->keep_after_forward = calloc((size_t)z->trace_len, sizeof *z->keep_after_forward);
    if (!z->keep_after_forward) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    int64_t after = 0;
    for (int k = z->trace_len - 1; k >= 0; k--) {
        zmodule *md = &z->modules[z->trace[k]];
        if (md->position < 0 || k < md->position) md->position = k;
        z->keep_after_forward[k] = after <= z->c.max_reuse_distance;
        for (int t = 0; t < md->n; t++) after += z->p[md->params[t]].numel;
    }
    return 0;
}

/* Gathers still in flight would bring shards older than the coming step:
 * dropped; every partitioned parameter released. */
int ds_zero_after_backward(ds_zero *z) {
    int rc = 0;
    for (int i = 0; i < z->n; i++)
        if (z->p[i].in_flight && let_go(z, z->p[i].in_flight)) rc = -1;
    ds_zero_release_all(z);
    return rc;
}

int ds_zero_gather_all(ds_zero *z) {
    int *all = malloc(sizeof *all * (size_t)z->n);
    if (!all) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    for (int i = 0; i < z->n; i++) all[i] = i;
    int rc = ds_zero_gather_now(z, z->n, all);
    free(all);
    return rc;
}

int ds_zero_release_all(ds_zero *z) {
    for (int i = 0; i < z->n; i++) ds_zero_release(z, i);
    return 0;
}

void ds_zero_free_stage3(ds_zero *z) {
    if (z->c.stage != 3 || !z->p) return;
    ds_autograd_remove_fetch(fetch, z);
    for (int i = 0; i < z->n; i++) {
        if (z->p[i].in_flight) let_go(z, z->p[i].in_flight);
        ds_tensor_release(z->p[i].own);
        z->p[i].own = NULL;
    }
    if (z->param_file) {
        /* the shards were this job's alone */
        char *path = strdup(ds_aio_path(z->param_file));
        ds_aio_close(z->param_file);
        if (path) remove(path);     /* a path cut short could name another file: none removed then */
        free(path);
        z->param_file = NULL;
    }
    for (int m = 0; m < z->n_modules; m++) free(z->modules[m].params);
    free(z->modules);
    free(z->trace);
    free(z->keep_after_forward);
}
