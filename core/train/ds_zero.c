#include "ds_zero_impl.h"
#include "ds_autograd.h"
#include "ds_error.h"
#include "ds_ops.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

double ds_zero_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void ds_zero_log(ds_zero *z, const char *name, const ds_tensor *t, double since) {
    if (!z->logging) return;
    if (z->n_log == z->cap_log) {
        int cap = z->cap_log ? 2 * z->cap_log : 64;
        ds_zero_comm_record *r = realloc(z->log, sizeof *r * (size_t)cap);
        if (!r) return;     /* a record lost to memory pressure, not the step */
        z->log = r;
        z->cap_log = cap;
    }
    z->log[z->n_log++] = (ds_zero_comm_record){ name, ds_tensor_numel(t) * (int64_t)ds_dtype_size(t->dtype),
                                                1000 * (ds_zero_now() - since) };
}

void ds_zero_set_logging(ds_zero *z, bool on) { z->logging = on; }

const ds_zero_comm_record *ds_zero_comm_records(ds_zero *z, int *n) {
    *n = z->n_log;
    z->n_log = 0;       /* the records stay readable until the next one is logged */
    return z->log;
}

int ds_zero_param_index(const ds_zero *z, const ds_tensor *t) {
    for (int i = 0; i < z->n; i++)
        if (z->p[i].param == t) return i;
    return -1;
}

ds_tensor *ds_zero_elements(ds_tensor *t, int64_t lo, int64_t n) {
    return ds_tensor_view_of(t, 1, (int64_t[]){ n }, (int64_t[]){ 1 }, t->offset + lo);
}

int64_t ds_zero_shard_len(const zparam *q, int r) {
    int64_t len = q->numel - (int64_t)r * q->shard;
    return len < 0 ? 0 : len < q->shard ? len : q->shard;
}

static int scale_(ds_tensor *t, double f) {
    ds_tensor *k = ds_scalar_like(t, f);
    int rc = k ? ds_binary_(DS_BIN_MUL, t, k) : -1;
    ds_tensor_release(k);
    return rc;
}

static int scale_all(int n, ds_tensor *const *t, double f) {
    for (int i = 0; i < n && f != 1; i++)
        if (scale_(t[i], f)) return -1;
    return 0;
}

int ds_zero_copy_elements(ds_tensor *dst, int64_t lo, ds_tensor *src, int64_t at, int64_t n) {
    if (n <= 0) return 0;
    ds_tensor *d = ds_zero_elements(dst, lo, n), *s = ds_zero_elements(src, at, n);
    int rc = d && s ? ds_copy_(d, s) : -1;
    ds_tensor_release(d);
    ds_tensor_release(s);
    return rc;
}

static ds_device param_device(const ds_zero *z) { return ds_tensor_device(z->p[0].param); }

/* n elements of src from at, as a new 1-D tensor of dtype on dev (one
 * copy, which may cast and cross devices). */
static ds_tensor *copy_out(ds_tensor *src, int64_t at, int64_t n, ds_dtype dtype, ds_device dev) {
    ds_tensor *t = ds_tensor_new(1, &n, dtype, dev);
    if (t && ds_zero_copy_elements(t, 0, src, at, n)) {
        ds_tensor_release(t);
        return NULL;
    }
    return t;
}

/* ---------------------------------------------------------------- layout */

/* From the last parameter back, a parameter joins the bucket being filled
 * when it is of the same group, its elements end where the bucket's begin
 * and the bucket holds fewer than bucket_size elements. */
static void make_buckets(ds_zero *z) {
    for (int i = z->n - 1; i >= 0; i--) {
        zparam *q = &z->p[i];
        zbucket *b = z->nb ? &z->b[z->nb - 1] : NULL;
        if (b && b->group == q->group && q->offset + q->shard == b->offset && b->numel < z->c.bucket_size) {
            b->first = i;
            b->count++;
            b->offset = q->offset;
            b->width += q->shard;
            b->numel += q->numel;
        } else {
            b = &z->b[z->nb++];
            *b = (zbucket){ .first = i, .count = 1, .group = q->group, .offset = q->offset, .width = q->shard,
                            .numel = q->numel };
        }
        q->bucket = z->nb - 1;
    }
}

/* Flat mode: each parameter's gradient is its view into the optimizer's
 * flat gradients. */
static int place_flat(ds_zero *z, ds_optim *o) {
    for (int i = 0; i < z->n; i++) {
        zparam *q = &z->p[i];
        ds_optim_group *g = q->group < o->n_groups ? &o->groups[q->group] : NULL;
        int k = 0;
        while (g && k < g->n_params && g->params[k] != q->param) k++;
        if (!g || k == g->n_params)
            return ds_fail(DS_ERR_ARG, "step engine: parameter %d is not in group %d of the optimizer", i + 1,
                           q->group + 1), -1;
        q->offset = g->offsets[k];
        q->view = g->grads[k];
        ds_tensor_retain(q->view);
    }
    return 0;
}

/* Stage 0 (and 1-2 on one rank): each group's parameters moved into one
 * buffer laid out as its master. A parameter that cannot move (pinned by a
 * transfer, say) leaves its group on per-parameter copies. */
static int make_flat_params(ds_zero *z) {
    z->flat_params = calloc((size_t)z->n_groups, sizeof *z->flat_params);
    if (!z->flat_params) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    for (int g = 0; g < z->n_groups; g++) {
        int64_t n = z->group_len[g];
        z->flat_params[g] = n > 0 ? ds_tensor_new(1, &n, z->dtype, param_device(z)) : NULL;
        if (n > 0 && !z->flat_params[g]) return -1;
    }
    for (int i = 0; i < z->n; i++) {
        zparam *q = &z->p[i];
        ds_tensor *flat = z->flat_params[q->group];
        if (flat && (q->param->dtype != z->dtype || ds_tensor_reseat(q->param, flat->storage, q->offset))) {
            ds_error_clear();
            ds_tensor_release(flat);
            z->flat_params[q->group] = NULL;
        }
    }
    return 0;
}

/* Masters mode: this rank's shards of each group's parameters. */
static int make_masters(ds_zero *z) {
    int r = z->parts > 1 ? z->rank : 0;
    z->masters = calloc((size_t)z->n_groups, sizeof *z->masters);
    z->master_grads = calloc((size_t)z->n_groups, sizeof *z->master_grads);
    if (!z->masters || !z->master_grads) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    int64_t *len = z->group_len = calloc((size_t)z->n_groups, sizeof *len);
    if (!len) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    for (int i = 0; i < z->n; i++) {
        zparam *q = &z->p[i];
        q->offset = len[q->group];
        len[q->group] += q->shard;
    }
    int rc = 0;
    for (int g = 0; g < z->n_groups && rc == 0; g++) {
        int64_t n = len[g] > 0 ? len[g] : 1;
        z->masters[g] = ds_tensor_full(1, &n, DS_F32, z->c.master_device, 0.0);
        z->master_grads[g] = ds_tensor_full(1, &n, DS_F32, z->c.master_device, 0.0);
        if (!z->masters[g] || !z->master_grads[g]) rc = -1;
        else {
            ds_tensor_set_category(z->masters[g], DS_MEM_MASTER);
            z->masters[g]->requires_grad = true;       /* the optimizer takes leaves that need grad */
            ds_tensor_set_category(z->master_grads[g], DS_MEM_GRAD);
        }
    }
    bool prev = ds_set_grad_enabled(false);
    for (int i = 0; i < z->n && rc == 0; i++) {
        zparam *q = &z->p[i];
        rc = ds_zero_copy_elements(z->masters[q->group], q->offset, q->param, (int64_t)r * q->shard, ds_zero_shard_len(q, r));
    }
    ds_set_grad_enabled(prev);
    return rc == 0 && z->parts == 1 && z->c.stage != 3 ? make_flat_params(z) : rc;
}

/* ---------------------------------------------------------------- building */

static int on_gradient(ds_tensor *leaf, void *ud);

static int check_params(int n, ds_tensor *const *params) {
    for (int i = 0; i < n; i++) {
        ds_tensor *t = params[i];
        char s[96];
        if (!t->requires_grad || t->grad_fn)
            return ds_fail(DS_ERR_ARG, "step engine: parameter %d is not a leaf that requires grad", i + 1), -1;
        if (!ds_tensor_is_contiguous(t))
            return ds_fail(DS_ERR_ARG, "step engine: parameter %d (%s) is not contiguous", i + 1,
                           ds_shape_str(t, s, sizeof s)), -1;
        if (t->dtype != params[0]->dtype || !ds_device_equal(ds_tensor_device(t), ds_tensor_device(params[0])))
            return ds_fail(DS_ERR_ARG, "step engine: parameter %d is %s on another device or dtype than parameter 1 "
                           "(%s)", i + 1, ds_dtype_name(t->dtype), ds_dtype_name(params[0]->dtype)), -1;
        for (int j = 0; j < i; j++)
            if (params[j] == t)
                return ds_fail(DS_ERR_ARG, "step engine: parameter %d is the same tensor as parameter %d", i + 1,
                               j + 1), -1;
    }
    return 0;
}

ds_zero *ds_zero_new(const ds_zero_config *c, int n_groups, const int *counts, ds_tensor *const *params,
                     ds_optim *flat) {
    int n = 0;
    for (int g = 0; g < n_groups; g++) n += counts[g];
    if (n_groups < 1 || n < 1) return ds_fail(DS_ERR_ARG, "step engine: no parameters");
    if (c->stage < 0 || c->stage > 3) return ds_fail(DS_ERR_ARG, "step engine: stage %d is not 0-3", c->stage);
    if (!c->masters && (c->stage != 0 || !flat))
        return ds_fail(DS_ERR_ARG, "step engine: without masters only stage 0 runs, over its optimizer");
    if (check_params(n, params)) return NULL;
    ds_zero *z = calloc(1, sizeof *z);
    if (!z) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory");
    z->c = *c;
    z->rank = ds_comm_rank(c->group);
    z->world = ds_comm_size(c->group);
    if (z->rank < 0) {
        free(z);
        return ds_fail(DS_ERR_ARG, "step engine: rank %d is not in its group %s", ds_comm_rank(NULL),
                       ds_comm_group_name(c->group));
    }
    z->parts = c->masters && c->stage > 0 ? z->world : 1;
    z->dtype = params[0]->dtype;
    z->n_groups = n_groups;
    z->n = n;
    z->p = calloc((size_t)n, sizeof *z->p);
    z->b = calloc((size_t)n, sizeof *z->b);
    if (!z->p || !z->b) {
        ds_zero_free(z);
        return ds_fail(DS_ERR_NOMEM, "step engine: out of memory");
    }
    for (int g = 0, i = 0; g < n_groups; g++) {
        for (int k = 0; k < counts[g]; k++, i++) {
            zparam *q = &z->p[i];
            ds_tensor_retain(params[i]);
            q->z = z;
            q->param = params[i];
            q->group = g;
            q->numel = ds_tensor_numel(params[i]);
            q->shard = (q->numel + z->parts - 1) / z->parts;
            q->owner = -1;
        }
    }
    if (flat) z->optim = flat;
    if (flat ? place_flat(z, flat) : make_masters(z)) {
        ds_zero_free(z);
        return NULL;
    }
    make_buckets(z);
    /* each bucket is in flight at most once: an armed backward drains the
     * last one's reductions before it launches its own */
    z->flights = calloc((size_t)z->nb, sizeof *z->flights);
    if (!z->flights) {
        ds_zero_free(z);
        return ds_fail(DS_ERR_NOMEM, "step engine: out of memory");
    }
    for (int i = 0; i < n; i++) {
        if (ds_autograd_set_leaf_hook(z->p[i].param, on_gradient, &z->p[i])) {
            ds_zero_free(z);
            return NULL;
        }
    }
    if (c->stage == 3 && ds_zero_partition(z)) {
        ds_zero_free(z);
        return NULL;
    }
    return z;
}

void ds_zero_free(ds_zero *z) {
    if (!z) return;
    ds_zero_free_stage3(z);
    for (int f = 0; f < z->n_flights; f++) {
        ds_comm_work_release(z->flights[f].work);
        ds_tensor_release(z->flights[f].buf);
    }
    for (int i = 0; z->p && i < z->n; i++) {
        zparam *q = &z->p[i];
        if (!q->param) continue;
        ds_autograd_set_leaf_hook(q->param, NULL, q);
        ds_tensor_release(q->view);
        ds_tensor_release(q->param);
    }
    for (int g = 0; z->masters && g < z->n_groups; g++) {
        ds_tensor_release(z->masters[g]);
        ds_tensor_release(z->master_grads[g]);
        if (z->flat_params) ds_tensor_release(z->flat_params[g]);
    }
    free(z->flat_params);
    free(z->masters);
    free(z->master_grads);
    free(z->group_len);
    free(z->log);
    free(z->p);
    free(z->b);
    free(z->flights);
    free(z);
}

ds_tensor *ds_zero_master(ds_zero *z, int g) {
    if (!z->masters || g < 0 || g >= z->n_groups || !z->masters[g])
        return ds_fail(DS_ERR_ARG, "step engine: no master %d", g + 1);
    ds_tensor_retain(z->masters[g]);
    return z->masters[g];
}

ds_tensor *ds_zero_master_grad(ds_zero *z, int g) {
    if (!z->masters || g < 0 || g >= z->n_groups)
        return ds_fail(DS_ERR_ARG, "step engine: no master gradient %d", g + 1);
    ds_tensor_retain(z->master_grads[g]);
    return z->master_grads[g];
}

static void swap_in(ds_tensor **slot, ds_tensor *t) {
    ds_tensor_retain(t);
    ds_tensor_release(*slot);
    *slot = t;
}

int ds_zero_stream(ds_zero *z) {
    if (!z->c.masters || z->optim) return ds_fail(DS_ERR_STATE, "step engine: an optimizer is attached already"), -1;
    for (int g = 0; g < z->n_groups; g++) {
        ds_tensor_release(z->masters[g]);
        z->masters[g] = NULL;
    }
    return 0;
}

int ds_zero_attach(ds_zero *z, ds_optim *o) {
    if (!z->c.masters || z->optim) return ds_fail(DS_ERR_STATE, "step engine: an optimizer is attached already"), -1;
    if (o->n_groups != z->n_groups)
        return ds_fail(DS_ERR_ARG, "step engine: the optimizer has %d param groups, the model %d", o->n_groups,
                       z->n_groups), -1;
    for (int g = 0; g < z->n_groups; g++) {
        ds_optim_group *og = &o->groups[g];
        if (og->n_params != 1 || og->params[0] != z->masters[g])
            return ds_fail(DS_ERR_ARG, "step engine: group %d of the optimizer is not over master %d alone", g + 1,
                           g + 1), -1;
    }
    for (int g = 0; g < z->n_groups; g++) {
        int nseg = 0;
        int64_t *seg = malloc(sizeof *seg * (size_t)(z->n + 1));
        if (!seg) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
        for (int i = 0; i < z->n; i++)
            if (z->p[i].group == g) seg[nseg++] = z->p[i].offset;
        seg[nseg] = ds_tensor_numel(o->groups[g].flat_params);
        int rc = ds_optim_set_segments(o, g, nseg, seg);
        free(seg);
        if (rc) return -1;
        ds_tensor_set_category(o->groups[g].flat_params, DS_MEM_MASTER);
        swap_in(&z->masters[g], o->groups[g].flat_params);
        swap_in(&z->master_grads[g], o->groups[g].flat_grads);
    }
    z->optim = o;
    return 0;
}

/* ---------------------------------------------------------------- backward */

static void add_stats_flight(ds_zero *z, const zflight *f) {
    double comm = f->done - f->launched, hidden = (f->done < z->backward_end ? f->done : z->backward_end) - f->launched;
    z->stats.comm_ms += 1000 * comm;
    z->stats.hidden_ms += 1000 * (hidden > 0 ? hidden : 0);
}

/* Gradient g of parameter q into its columns of rows [P, width]: row r
 * gets shard r. Two copies: the full rows, then the short one. */
static int copy_to_rows(ds_tensor *rows, int64_t col, const zparam *q, ds_tensor *g) {
    if (q->numel == 0) return 0;     /* no columns, and a shard of 0 to divide by */
    int64_t s = q->shard, width = rows->shape[1];
    int64_t full = q->numel / s, rem = q->numel % s;
    int rc = 0;
    if (full > 0) {
        ds_tensor *src = ds_tensor_view_of(g, 2, (int64_t[]){ full, s }, (int64_t[]){ s, 1 }, g->offset);
        ds_tensor *dst = ds_tensor_view_of(rows, 2, (int64_t[]){ full, s }, (int64_t[]){ width, 1 }, rows->offset + col);
        rc = src && dst ? ds_copy_(dst, src) : -1;
        ds_tensor_release(src);
        ds_tensor_release(dst);
    }
    if (rc == 0 && rem > 0) {
        ds_tensor *src = ds_zero_elements(g, full * s, rem);
        ds_tensor *dst = ds_zero_elements(rows, full * width + col, rem);
        rc = src && dst ? ds_copy_(dst, src) : -1;
        ds_tensor_release(src);
        ds_tensor_release(dst);
    }
    return rc;
}

/* Whether the copies of bucket b's gradients fill every element of its
 * rows: each parameter has a gradient, and its P shards are of equal
 * length (a short or empty last shard leaves padding, which must reduce
 * as zeros). */
static bool rows_covered(const ds_zero *z, const zbucket *b) {
    for (int i = b->first; i < b->first + b->count; i++) {
        const zparam *q = &z->p[i];
        if (!q->param->grad || q->numel != (int64_t)z->parts * q->shard) return false;
    }
    return true;
}

/* Masters: bucket b's gradients as rows, dropped from the parameters,
 * reduced (reduce-scatter, or all-reduce when nothing is partitioned). */
static ds_comm_work *launch_rows(ds_zero *z, zbucket *b, ds_tensor **buf) {
    int P = z->parts;
    int64_t shape[2] = { P, b->width };
    ds_device dev = param_device(z);
    ds_tensor *rows = rows_covered(z, b) ? ds_tensor_new(2, shape, z->c.comm_dtype, dev)
                                         : ds_tensor_full(2, shape, z->c.comm_dtype, dev, 0.0);
    if (!rows) return NULL;
    for (int i = b->first; i < b->first + b->count; i++) {
        zparam *q = &z->p[i];
        ds_tensor *g = q->param->grad;
        if (!g) continue;
        ds_tensor *c = ds_contiguous(g);
        int rc = c ? copy_to_rows(rows, q->offset - b->offset, q, c) : -1;
        ds_tensor_release(c);
        if (rc) { ds_tensor_release(rows); return NULL; }
        q->param->grad = NULL;
        ds_tensor_release(g);
    }
    ds_comm_work *w;
    if (P == 1) {
        ds_tensor *v = ds_zero_elements(rows, 0, b->width);
        w = v ? ds_comm_all_reduce(v, DS_COMM_SUM, z->c.group) : NULL;
        ds_tensor_release(v);
    } else {
        ds_tensor *list[P];
        int made = 0;
        for (; made < P; made++)
            if (!(list[made] = ds_zero_elements(rows, made * b->width, b->width))) break;
        w = made == P ? ds_comm_reduce_scatter(list, P, DS_COMM_SUM, z->c.group) : NULL;
        for (int r = 0; r < made; r++) ds_tensor_release(list[r]);
    }
    if (!w) { ds_tensor_release(rows); return NULL; }
    *buf = rows;
    return w;
}

/* Flat: the bucket's view of the flat gradients, all-reduced in place
 * after DeepSpeed's pre-scaling. */
static ds_comm_work *launch_flat(ds_zero *z, zbucket *b, ds_tensor **buf) {
    ds_tensor *v = ds_zero_elements(z->optim->groups[b->group].flat_grads, b->offset, b->width);
    if (!v) return NULL;
    double f = z->c.prescale ? 1.0 / z->world : z->c.predivide != 1 ? 1.0 / z->c.predivide : 1;
    ds_comm_work *w = f == 1 || scale_(v, f) == 0 ? ds_comm_all_reduce(v, DS_COMM_SUM, z->c.group) : NULL;
    if (!w) { ds_tensor_release(v); return NULL; }
    *buf = v;
    return w;
}

static int launch(ds_zero *z, int bi) {
    zbucket *b = &z->b[bi];
    if (z->n_flights == z->nb)
        return ds_fail(DS_ERR_STATE, "step engine: bucket %d launched with all %d buckets in flight", bi + 1, z->nb), -1;
    zflight *f = &z->flights[z->n_flights];
    *f = (zflight){ .bucket = bi, .launched = ds_zero_now() };
    f->work = z->c.masters ? launch_rows(z, b, &f->buf) : launch_flat(z, b, &f->buf);
    if (!f->work) return -1;
    z->n_flights++;
    z->stats.buckets++;
    z->stats.bytes += ds_tensor_numel(f->buf) * (int64_t)ds_dtype_size(f->buf->dtype);
    return 0;
}

static int launch_ready(ds_zero *z) {
    while (z->next < z->nb && z->b[z->next].pending == 0)
        if (launch(z, z->next++)) return -1;
    return 0;
}

/* Notes when each bucket in flight completes (for the stats), moving them along. */
static int poll(ds_zero *z) {
    for (int k = 0; k < z->n_flights; k++) {
        zflight *f = &z->flights[k];
        if (f->done) continue;
        bool done = false;
        if (ds_comm_work_test(f->work, &done)) return -1;
        if (done) f->done = ds_zero_now();
    }
    return 0;
}

static int on_gradient(ds_tensor *leaf, void *ud) {
    zparam *q = ud;
    ds_zero *z = q->z;
    if (!z->armed || q->done) return 0;
    q->done = true;
    if (z->next > 0) z->leaves_after++;
    z->b[q->bucket].pending--;
    if (z->c.stage == 3) ds_zero_release(z, (int)(q - z->p));
    if (launch_ready(z)) return -1;
    return z->n_flights ? poll(z) : 0;
}

/* Flat: a gradient dropped (zeros) or replaced by another tensor (copied
 * in) goes back to its view, where the bucket reads it. */
static int restore_views(ds_zero *z) {
    for (int i = 0; i < z->n; i++) {
        zparam *q = &z->p[i];
        ds_tensor *g = q->param->grad;
        if (g == q->view) continue;
        if (g ? ds_copy_(q->view, g) : ds_fill_(q->view, 0)) return -1;
        swap_in(&q->param->grad, q->view);
    }
    return 0;
}

static int drain(ds_zero *z);

int ds_zero_backward(ds_zero *z, ds_tensor *loss, bool reduce) {
    if (z->armed) return ds_fail(DS_ERR_STATE, "step engine: backward inside backward"), -1;
    if (z->c.stage == 3 && z->recording && ds_zero_finish_recording(z)) return -1;
    int rc = 0;
    if (reduce) {
        if (!z->in_window) z->stats = (ds_zero_stats){ 0 };
        z->in_window = true;
        /* the last micro step's reductions (stage >= 2 reduces every one)
         * land before this one launches the same buckets again */
        if (drain(z)) return -1;
        if (!z->c.masters && restore_views(z)) return -1;
        for (int i = 0; i < z->n; i++) z->p[i].done = false;
        for (int b = 0; b < z->nb; b++) z->b[b].pending = z->b[b].count;
        z->next = 0;
        z->leaves_after = 0;
        z->armed = true;
    }
    z->in_backward = true;
    if (loss) rc = ds_backward(loss, NULL, false);
    z->in_backward = false;
    if (reduce) {
        z->backward_end = ds_zero_now();
        z->stats.launched_in_backward += z->next;
        z->stats.leaves_after_first_launch += z->leaves_after;
        if (rc == 0) {
            /* buckets of parameters that got no gradient go now, in order */
            for (int b = z->next; b < z->nb; b++) z->b[b].pending = 0;
            rc = launch_ready(z);
        }
        z->armed = false;
    }
    if (z->c.stage == 3 && ds_zero_after_backward(z)) rc = -1;
    return rc;
}

int ds_zero_scale_grads(ds_zero *z, double f) {
    if (f == 1) return 0;
    /* reductions still in flight belong to what is scaled */
    if (drain(z)) return -1;
    if (z->c.masters && scale_all(z->n_groups, z->master_grads, f)) return -1;
    for (int i = 0; i < z->n; i++) {
        ds_tensor *g = z->p[i].param->grad;
        if (g && scale_(g, f)) return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- step */

/* Waits for every bucket in flight: masters add their row into the master
 * gradient; flat buckets get DeepSpeed's post-scaling. */
static int drain(ds_zero *z) {
    double t0 = ds_zero_now();
    bool post = !z->c.prescale && z->c.predivide != z->world;
    int rc = 0;
    for (int k = 0; k < z->n_flights; k++) {
        zflight *f = &z->flights[k];
        zbucket *b = &z->b[f->bucket];
        if (rc == 0) rc = ds_comm_work_wait(f->work);
        if (rc == 0 && !f->done) f->done = ds_zero_now();
        if (rc == 0 && z->c.masters) {
            ds_tensor *row = z->parts == 1 ? ds_zero_elements(f->buf, 0, b->width) : ds_comm_work_result(f->work, 0);
            /* offload: the reduced row comes to the masters' memory first */
            ds_tensor *here = row && !ds_device_equal(ds_tensor_device(row), z->c.master_device)
                              ? copy_out(row, 0, b->width, row->dtype, z->c.master_device) : NULL;
            ds_tensor *seg = ds_zero_elements(z->master_grads[b->group], b->offset, b->width);
            rc = row && seg && (here || ds_device_equal(ds_tensor_device(row), z->c.master_device))
                 ? ds_add_(seg, here ? here : row) : -1;
            ds_tensor_release(here);
            ds_tensor_release(seg);
            ds_tensor_release(row);
        } else if (rc == 0 && post) {
            rc = scale_(f->buf, z->c.predivide / z->world);
        }
        if (rc == 0) {
            add_stats_flight(z, f);
            ds_zero_log(z, !z->c.masters ? "all_reduce" : z->parts == 1 ? "zero_all_reduce" : "zero_reduce_scatter",
                        f->buf, f->launched);
        }
        ds_comm_work_release(f->work);
        ds_tensor_release(f->buf);
    }
    if (z->n_flights) {
        z->stats.wait_ms += 1000 * (ds_zero_now() - t0);
        z->have_stats = true;
    }
    z->n_flights = 0;
    return rc;
}

static int sum_squares(ds_tensor *acc, ds_tensor *t) {
    int rc = t ? ds_tensor_kernels(t)->reduce->sum_squares(ds_tensor_kview(acc), ds_tensor_kview(t)) : -1;
    if (rc && t) ds_fail(DS_ERR_STATE, "step engine: gradient norm: %s", ds_kernel_error());
    return rc;
}

static int sum_over(ds_tensor *acc, ds_comm_group *g) {
    ds_comm_work *w = ds_comm_all_reduce(acc, DS_COMM_SUM, g);
    int rc = w ? ds_comm_work_wait(w) : -1;
    ds_comm_work_release(w);
    return rc;
}

/* Sum of squares and inf/nan count over tensors, less the excluded
 * parameters' gradients, summed over the group when agree and over a
 * pipeline's stages: one pass each, one host synchronisation in all. */
static int grad_stats(ds_zero *z, int n, ds_tensor *const *t, bool agree, double *sq, double *bad) {
    ds_device dev = ds_tensor_device(t[0]);
    ds_tensor *acc = ds_tensor_full(1, (int64_t[]){ 2 }, DS_F64, dev, 0.0);
    ds_tensor *out = ds_tensor_full(1, (int64_t[]){ 2 }, DS_F64, dev, 0.0);
    int rc = acc && out ? 0 : -1;
    bool excluded = false;
    for (int i = 0; i < n && rc == 0; i++) rc = sum_squares(acc, t[i]);
    for (int i = 0; i < z->n && rc == 0; i++) {
        zparam *q = &z->p[i];
        if (!q->no_norm) continue;
        excluded = true;
        if (!z->c.masters) {
            rc = sum_squares(out, q->view);
            continue;
        }
        ds_tensor *g = ds_zero_elements(z->master_grads[q->group], q->offset, q->shard);
        rc = sum_squares(out, g);
        ds_tensor_release(g);
    }
    if (rc == 0 && excluded) rc = scale_(out, -1);
    if (rc == 0 && excluded) rc = ds_add_(acc, out);
    if (rc == 0 && agree) rc = sum_over(acc, z->c.group);
    if (rc == 0 && z->c.stages) rc = sum_over(acc, z->c.stages);
    ds_tensor_release(out);
    ds_tensor *host = rc == 0 ? ds_to_device(acc, DS_CPU_DEVICE) : NULL;
    if (host) {
        *sq = ds_tensor_get(host, 0);
        *bad = ds_tensor_get(host, 1);
    }
    ds_tensor_release(host);
    ds_tensor_release(acc);
    return host ? 0 : -1;
}

/* Lamb's per-piece squares summed over the ranks holding the other shards. */
static int sum_over_ranks(double *values, int n, void *ud) {
    ds_zero *z = ud;
    ds_tensor *t = ds_tensor_new(1, (int64_t[]){ n }, DS_F64, DS_CPU_DEVICE);
    if (!t) return -1;
    memcpy(ds_tensor_data(t), values, sizeof *values * (size_t)n);
    int rc = sum_over(t, z->c.group);
    if (rc == 0) memcpy(values, ds_tensor_data(t), sizeof *values * (size_t)n);
    ds_tensor_release(t);
    return rc;
}

int ds_zero_set_step_fn(ds_zero *z, ds_zero_step_fn fn, void *ud) {
    if (z->c.stage != 0) return ds_fail(DS_ERR_STATE, "step engine: a step function replaces the optimizer at stage 0 only"), -1;
    z->step_fn = fn;
    z->step_ud = ud;
    return 0;
}

/* Whether the optimizer's kernels do more in their own pass (the
 * gradients' factor, the 16-bit parameters): not a step function's (it
 * reads the gradients itself) nor Lamb's (its grad_scale divides, in
 * numerics of its own, and its update takes two passes). */
static bool fused_step(const ds_zero *z) { return !z->step_fn && z->optim->kind != DS_OPTIM_LAMB; }

/* Group g's 16-bit parameters where the optimizer's pass writes them along
 * with the master (refresh leaves them then), else NULL: back to back in
 * flat_params, bf16 or f16, on the masters' device. flat_params[g] holds
 * group_len[g] elements, the master's length (make_masters pads only an
 * empty group's master, and that group has no flat_params). */
static ds_tensor *written_by_step(const ds_zero *z, int g) {
    ds_tensor *t = z->flat_params ? z->flat_params[g] : NULL;
    if (!t || !fused_step(z) || (t->dtype != DS_BF16 && t->dtype != DS_F16)) return NULL;
    return ds_device_equal(ds_tensor_device(t), ds_tensor_device(z->masters[g])) ? t : NULL;
}

/* The optimizer's step on the n gradient buffers times f: in its kernels'
 * pass where they can take it, else by scaling the buffers first. */
static int optimizer_step(ds_zero *z, const ds_optim_hparams *h, int n, ds_tensor *const *grads, double f) {
    bool fused = fused_step(z);
    if (!fused && scale_all(n, grads, f)) return -1;
    if (z->step_fn) return z->step_fn(z->step_ud, h);
    for (int g = 0; g < z->optim->n_groups; g++) {
        if (ds_optim_check_hparams(z->optim->kind, &h[g], g)) return -1;
        bool shared = z->parts > 1 && z->world > 1;
        if (ds_optim_step_shared(z->optim, g, &h[g], fused ? f : 1, written_by_step(z, g),
                                 shared ? sum_over_ranks : NULL, z))
            return -1;
    }
    return 0;
}

/* The end of an accumulation window: the next reduced backward opens a new one. */
static int zero_grads(ds_zero *z) {
    z->in_window = false;
    if (!z->c.masters) return ds_optim_zero_grad(z->optim);
    for (int g = 0; g < z->n_groups; g++)
        if (ds_fill_(z->master_grads[g], 0)) return -1;
    for (int i = 0; i < z->n; i++) {
        ds_tensor_release(z->p[i].param->grad);
        z->p[i].param->grad = NULL;
    }
    return 0;
}

/* Parameters from masters: stage 0 copies (casting), but for the groups
 * the optimizer's pass has written when stepped; otherwise each bucket's
 * updated shards are all-gathered (one rank: a copy) into the parameters
 * kept whole, and stage 3's own shards are refreshed. */
static int refresh(ds_zero *z, ds_tensor *const *masters, bool stepped) {
    int rc = 0;
    if (z->parts == 1 && z->c.stage != 3) {
        for (int g = 0; g < z->n_groups && rc == 0; g++) {
            if (z->flat_params[g] && !(stepped && written_by_step(z, g)))
                rc = ds_zero_copy_elements(z->flat_params[g], 0, masters[g], 0, z->group_len[g]);
        }
        for (int i = 0; i < z->n && rc == 0; i++) {
            zparam *q = &z->p[i];
            if (!z->flat_params[q->group]) rc = ds_zero_copy_elements(q->param, 0, masters[q->group], q->offset, q->numel);
        }
        return rc;
    }
    ds_comm_work **works = calloc((size_t)z->nb, sizeof *works);
    ds_tensor **sent = calloc((size_t)z->nb, sizeof *sent);
    if (!works || !sent) {
        free(works);
        free(sent);
        return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    }
    double t0 = ds_zero_now();
    for (int bi = 0; bi < z->nb && rc == 0; bi++) {
        zbucket *b = &z->b[bi];
        bool whole = false;
        for (int i = b->first; i < b->first + b->count && rc == 0; i++) {
            zparam *q = &z->p[i];
            if (q->own) rc = ds_zero_store_shard(z, q, masters[b->group], q->offset);
            else whole = true;
        }
        if (rc || !whole) continue;
        ds_tensor *send = copy_out(masters[b->group], b->offset, b->width, z->dtype, param_device(z));
        works[bi] = send ? ds_comm_all_gather(send, z->c.group) : NULL;
        if (!works[bi]) rc = -1;
        sent[bi] = send;
    }
    for (int bi = 0; bi < z->nb; bi++) {
        if (!works[bi]) continue;
        zbucket *b = &z->b[bi];
        if (rc == 0) rc = ds_comm_work_wait(works[bi]);
        if (rc == 0) ds_zero_log(z, "zero_all_gather", sent[bi], t0);
        for (int r = 0; r < z->parts && rc == 0; r++) {
            ds_tensor *got = ds_comm_work_result(works[bi], r);
            if (!got) { rc = -1; break; }
            for (int i = b->first; i < b->first + b->count && rc == 0; i++) {
                zparam *q = &z->p[i];
                if (!q->own) rc = ds_zero_copy_elements(q->param, (int64_t)r * q->shard, got, q->offset - b->offset, ds_zero_shard_len(q, r));
            }
            ds_tensor_release(got);
        }
        ds_comm_work_release(works[bi]);
    }
    for (int bi = 0; bi < z->nb; bi++) ds_tensor_release(sent[bi]);
    free(works);
    free(sent);
    return rc;
}

int ds_zero_step(ds_zero *z, const ds_optim_hparams *h, double loss_scale, double clip, bool check_overflow,
                 ds_zero_result *out) {
    *out = (ds_zero_result){ false, NAN };
    if (drain(z)) return -1;
    bool prev = ds_set_grad_enabled(false);
    int rc = 0;
    double sq = 0, bad = 0;
    if (!z->c.masters) {
        /* plain data parallel: the reduced gradients are the same on every
         * rank, so clipping needs no agreement (torch's clip_grad_norm_)
         * but over a pipeline's stages */
        int n = z->optim->n_groups;
        ds_tensor *grads[n];
        for (int g = 0; g < n; g++) grads[g] = z->optim->groups[g].flat_grads;
        double coef = 1;
        if (clip > 0) {
            rc = grad_stats(z, n, grads, false, &sq, &bad);
            double total = sqrt(sq), c = clip / (total + 1e-6);
            if (c < 1) coef = c;
            out->grad_norm = total;
        }
        if (rc == 0) rc = optimizer_step(z, h, n, grads, coef);
        if (rc == 0) rc = zero_grads(z);
        ds_set_grad_enabled(prev);
        return rc;
    }
    /* shards differ between ranks: their squares are summed; with P = 1
     * every rank holds the same reduced gradients */
    rc = grad_stats(z, z->n_groups, z->master_grads, z->parts > 1 && z->world > 1, &sq, &bad);
    if (rc == 0 && check_overflow && bad > 0) {
        out->overflow = true;
        rc = zero_grads(z);
    } else if (rc == 0) {
        /* the sums over ranks become means; the norm is of the scaled mean */
        double n = z->world, norm = sqrt(sq) / n, combined = loss_scale;
        if (clip > 0) {
            double c = ((norm / loss_scale) + 1e-6) / clip;
            if (c > 1) combined = c * loss_scale;
        }
        double f = 1 / (n * combined);
        out->grad_norm = norm / loss_scale;
        if (!z->optim) {
            /* streamed: its optimizer reads the master gradients next */
            rc = scale_all(z->n_groups, z->master_grads, f);
        } else {
            rc = optimizer_step(z, h, z->n_groups, z->master_grads, f);
            if (rc == 0) rc = refresh(z, z->masters, true);
            if (rc == 0) rc = zero_grads(z);
        }
    }
    ds_set_grad_enabled(prev);
    return rc;
}

int ds_zero_refresh(ds_zero *z, int n, ds_tensor *const *masters) {
    if (!z->c.masters || z->optim) return ds_fail(DS_ERR_STATE, "step engine: refresh is for a streamed optimizer"), -1;
    if (n != z->n_groups)
        return ds_fail(DS_ERR_ARG, "step engine: refresh: %d masters for %d param groups", n, z->n_groups), -1;
    for (int g = 0; g < n; g++) {
        ds_tensor *m = masters[g];
        char s[96];
        if (m->dtype != DS_F32 || m->ndim != 1 || !ds_tensor_is_contiguous(m) || ds_tensor_numel(m) < z->group_len[g])
            return ds_fail(DS_ERR_ARG, "step engine: refresh: master %d is %s %s, not a contiguous 1-D f32 tensor of "
                           "%lld elements", g + 1, ds_dtype_name(m->dtype), ds_shape_str(m, s, sizeof s),
                           (long long)z->group_len[g]), -1;
    }
    bool prev = ds_set_grad_enabled(false);
    int rc = refresh(z, masters, false);
    if (rc == 0) rc = zero_grads(z);
    ds_set_grad_enabled(prev);
    return rc;
}

int ds_zero_sync_params(ds_zero *z) {
    if (!z->c.masters || !z->optim)
        return ds_fail(DS_ERR_STATE, "step engine: sync_params needs masters with an optimizer attached"), -1;
    bool prev = ds_set_grad_enabled(false);
    int rc = refresh(z, z->masters, false);
    ds_set_grad_enabled(prev);
    return rc;
}

/* ---------------------------------------------------------------- reports */

bool ds_zero_stats_get(const ds_zero *z, ds_zero_stats *out) {
    if (!z->have_stats) return false;
    *out = z->stats;
    return true;
}

int ds_zero_n_buckets(const ds_zero *z) { return z->nb; }

int ds_zero_n_params(const ds_zero *z) { return z->n; }

int ds_zero_exclude_from_norm(ds_zero *z, const ds_tensor *param) {
    for (int i = 0; i < z->n; i++) {
        if (z->p[i].param == param) {
            z->p[i].no_norm = true;
            return 0;
        }
    }
    return ds_fail(DS_ERR_ARG, "step engine: exclude_from_norm: the tensor is not one of its parameters"), -1;
}

ds_optim *ds_zero_optimizer(const ds_zero *z) { return z->optim; }

void ds_zero_bucket(const ds_zero *z, int b, int *first, int *count, int64_t *numel) {
    *first = z->b[b].first;
    *count = z->b[b].count;
    *numel = z->b[b].numel;
}

bool ds_zero_persistent(const ds_zero *z, int i) { return z->c.stage == 3 && !z->p[i].own; }

int64_t ds_zero_shard(const ds_zero *z, int i) { return z->p[i].shard; }
