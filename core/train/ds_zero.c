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

int ds_zero_scale(ds_tensor *t, double f) {
    ds_tensor *k = ds_scalar_like(t, f);
    int rc = k ? ds_binary_(DS_BIN_MUL, t, k) : -1;
    ds_tensor_release(k);
    return rc;
}

int ds_zero_scale_all(int n, ds_tensor *const *t, double f) {
    for (int i = 0; i < n && f != 1; i++)
        if (ds_zero_scale(t[i], f)) return -1;
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

static bool piece_dtype(ds_dtype t) { return t == DS_F32 || t == DS_BF16 || t == DS_F16; }

int ds_zero_piece(zpieces *c, ds_tensor *dst, int64_t lo, ds_tensor *src, int64_t at, int64_t n) {
    if (n <= 0) return 0;
    ds_tensor *on = c->on ? c->on : dst;
    bool fits = lo >= 0 && lo + n <= ds_tensor_numel(dst) && (!src || (at >= 0 && at + n <= ds_tensor_numel(src)));
    if (!fits || !ds_tensor_is_contiguous(dst) || (src && !ds_tensor_is_contiguous(src)) || dst->dtype != on->dtype ||
        !piece_dtype(dst->dtype) || (src && !piece_dtype(src->dtype)) ||
        !ds_device_equal(ds_tensor_device(dst), ds_tensor_device(on)) ||
        (src && !ds_device_equal(ds_tensor_device(src), ds_tensor_device(on))))
        return ds_fail(DS_ERR_ARG, "step engine: a multi-tensor copy's piece of %lld %s elements from %s does not fit",
                       (long long)n, ds_dtype_name(dst->dtype), src ? ds_dtype_name(src->dtype) : "zeros"), -1;
    if (c->n == c->cap) {
        int cap = c->cap ? 2 * c->cap : 16;
        ds_copy_piece *p = realloc(c->p, sizeof *p * (size_t)cap);
        if (!p) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
        c->p = p;
        c->cap = cap;
    }
    c->on = on;
    c->p[c->n++] = (ds_copy_piece){
        .dst = (char *)ds_tensor_data_w(dst, "copy_") + lo * (int64_t)ds_dtype_size(dst->dtype),
        .src = src ? (const char *)ds_tensor_data(src) + at * (int64_t)ds_dtype_size(src->dtype) : NULL,
        .n = n, .src_dtype = src ? src->dtype : dst->dtype };
    return 0;
}

int ds_zero_pieces_run(zpieces *c, int rc, bool accumulate) {
    if (rc == 0 && c->n > 0 && ds_tensor_kernels(c->on)->core->copy_pieces(c->on->dtype, c->p, c->n, accumulate))
        rc = (ds_fail(DS_ERR_STATE, "step engine: multi-tensor copy: %s", ds_kernel_error()), -1);
    free(c->p);
    *c = (zpieces){ 0 };
    return rc;
}

ds_device ds_zero_param_device(const ds_zero *z) { return ds_tensor_device(z->p[0].param); }

/* One copy, which may cast and cross devices. From a device to the host
 * (an offloaded gradient) it lands in the device's page-locked memory,
 * which the copy fills directly. */
ds_tensor *ds_zero_copy_out(ds_tensor *src, int64_t at, int64_t n, ds_dtype dtype, ds_device dev) {
    ds_device from = ds_tensor_device(src);
    ds_tensor *t = dev.type == DS_DEV_CPU && from.type != DS_DEV_CPU ? ds_tensor_new_staging(1, &n, dtype, from)
                                                                     : ds_tensor_new(1, &n, dtype, dev);
    if (t && ds_zero_copy_elements(t, 0, src, at, n)) {
        ds_tensor_release(t);
        return NULL;
    }
    return t;
}

/* ---------------------------------------------------------------- buckets */

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
    if (check_params(n, params)) return NULL;
    ds_zero *z = calloc(1, sizeof *z);
    if (!z) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory");
    z->c = *c;
    z->layout = c->masters ? &ds_zero_masters_layout : &ds_zero_flat_layout;     /* asked from here on */
    z->rank = ds_comm_rank(c->group);
    z->world = ds_comm_size(c->group);
    if (z->rank < 0) {
        free(z);
        return ds_fail(DS_ERR_ARG, "step engine: rank %d is not in its group %s", ds_comm_rank(NULL),
                       ds_comm_group_name(c->group));
    }
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
            q->owner = -1;
        }
    }
    if (flat) z->optim = flat;
    if (ds_zero_check_shards(z) || z->layout->build(z, flat)) {
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
    int rc = c->stage == 3 ? ds_zero_partition(z) : 0;
    z->c.shards = NULL;     /* borrowed until here */
    if (rc) {
        ds_zero_free(z);
        return NULL;
    }
    return z;
}

static void drop_flights(ds_zero *z) {
    for (int k = 0; k < z->n_flights; k++) {
        ds_comm_work_release(z->flights[k].work);
        ds_tensor_release(z->flights[k].buf);
        ds_tensor_release(z->flights[k].down);
    }
    z->n_flights = 0;
}

void ds_zero_free(ds_zero *z) {
    if (!z) return;
    ds_zero_free_stage3(z);
    ds_zero_offload_settle(z);      /* the rows still coming down write into the flights' buffers */
    drop_flights(z);
    for (int i = 0; z->p && i < z->n; i++) {
        zparam *q = &z->p[i];
        if (!q->param) continue;
        ds_autograd_set_leaf_hook(q->param, NULL, q);
    }
    z->layout->free(z);
    for (int i = 0; z->p && i < z->n; i++) ds_tensor_release(z->p[i].param);
    free(z->log);
    free(z->p);
    free(z->b);
    free(z->flights);
    free(z);
}

/* ---------------------------------------------------------------- backward */

static void add_stats_flight(ds_zero *z, const zflight *f) {
    double comm = f->done - f->launched, hidden = (f->done < z->backward_end ? f->done : z->backward_end) - f->launched;
    z->stats.comm_ms += 1000 * comm;
    z->stats.hidden_ms += 1000 * (hidden > 0 ? hidden : 0);
}

static int launch(ds_zero *z, int bi) {
    zbucket *b = &z->b[bi];
    if (z->layout->local && z->layout->local(z)) {
        z->stats.buckets++;
        z->have_stats = true;
        return z->layout->fold(z, b);
    }
    if (z->n_flights == z->nb)
        return ds_fail(DS_ERR_STATE, "step engine: bucket %d launched with all %d buckets in flight", bi + 1, z->nb), -1;
    zflight *f = &z->flights[z->n_flights];
    *f = (zflight){ .bucket = bi, .launched = ds_zero_now() };
    f->work = z->layout->launch(z, b, &f->buf);
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

/* A flight seen complete: noted for the stats, its row on its way. */
static int arrive(ds_zero *z, zflight *f) {
    if (!f->done) f->done = ds_zero_now();
    if (f->arrived || !z->layout->arrive) return 0;
    f->arrived = true;
    return z->layout->arrive(z, f);
}

/* Moves the buckets in flight along, each as it completes. */
static int poll(ds_zero *z) {
    for (int k = 0; k < z->n_flights; k++) {
        zflight *f = &z->flights[k];
        if (f->done) continue;
        bool done = false;
        if (ds_comm_work_test(f->work, &done)) return -1;
        if (done && arrive(z, f)) return -1;
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
        for (int i = 0; i < z->n; i++) z->p[i].done = false;
        for (int b = 0; b < z->nb; b++) z->b[b].pending = z->b[b].count;
        z->next = 0;
        z->leaves_after = 0;
        z->armed = true;
    }
    if (z->layout->arm && z->layout->arm(z, reduce)) {
        z->armed = false;
        return -1;
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
        if (rc == 0) rc = poll(z);
        z->armed = false;
    }
    if (rc == 0 && z->layout->after) rc = z->layout->after(z);
    if (z->c.stage == 3 && ds_zero_after_backward(z)) rc = -1;
    return rc;
}

int ds_zero_scale_grads(ds_zero *z, double f) {
    if (f == 1) return 0;
    /* reductions still in flight belong to what is scaled */
    if (drain(z)) return -1;
    if (z->layout->scale(z, f)) return -1;
    /* a flat view was scaled with its buffer */
    for (int i = 0; i < z->n; i++) {
        ds_tensor *g = z->p[i].param->grad;
        if (g && g != z->p[i].view && ds_zero_scale(g, f)) return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- step */

/* Waits for every bucket in flight, each landing where the step reads it:
 * the ones not yet seen complete start on their way as they are, then
 * the copies still running are waited for, once. */
static int drain(ds_zero *z) {
    double t0 = ds_zero_now();
    int rc = 0;
    for (int k = 0; k < z->n_flights && rc == 0; k++) {
        zflight *f = &z->flights[k];
        rc = ds_comm_work_wait(f->work);
        if (rc == 0) rc = arrive(z, f);
    }
    if (ds_zero_offload_settle(z)) rc = -1;
    for (int k = 0; k < z->n_flights && rc == 0; k++) {
        zflight *f = &z->flights[k];
        rc = z->layout->land(z, f);
        if (rc == 0) {
            add_stats_flight(z, f);
            ds_zero_log(z, z->layout->collective(z), f->buf, f->launched);
        }
    }
    if (z->n_flights) {
        z->stats.wait_ms += 1000 * (ds_zero_now() - t0);
        z->have_stats = true;
    }
    drop_flights(z);
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

/* This rank's sum of squares and inf/nan count of the gradients the step
 * reads, less the excluded parameters', into acc: one pass each. */
static int local_squares(ds_zero *z, ds_tensor *acc) {
    ds_tensor *out = ds_tensor_full(1, (int64_t[]){ 2 }, DS_F64, ds_tensor_device(acc), 0.0);
    int rc = out ? 0 : -1;
    bool excluded = false;
    for (int g = 0; g < z->n_grads && rc == 0; g++) rc = sum_squares(acc, z->grads[g]);
    for (int i = 0; i < z->n && rc == 0; i++) {
        if (!z->p[i].no_norm) continue;
        excluded = true;
        ds_tensor *g = z->layout->param_grad(z, i);
        rc = sum_squares(out, g);
        ds_tensor_release(g);
    }
    if (rc == 0 && excluded) rc = ds_zero_scale(out, -1);
    if (rc == 0 && excluded) rc = ds_add_(acc, out);
    ds_tensor_release(out);
    return rc;
}

/* The sums over every rank whose gradients are others than this one's:
 * the data-parallel group's when sharded, a pipeline's stages'. */
static int agree(ds_zero *z, ds_tensor *acc, bool sharded) {
    if (sharded && sum_over(acc, z->c.group)) return -1;
    return z->c.stages ? sum_over(acc, z->c.stages) : 0;
}

int ds_zero_grad_stats(ds_zero *z, bool sharded, double *sq, double *bad) {
    ds_tensor *acc = ds_tensor_full(1, (int64_t[]){ 2 }, DS_F64, ds_tensor_device(z->grads[0]), 0.0);
    int rc = acc ? local_squares(z, acc) : -1;
    if (rc == 0) rc = agree(z, acc, sharded);
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
bool ds_zero_fused_step(const ds_zero *z) { return !z->step_fn && z->optim->kind != DS_OPTIM_LAMB; }

/* In its kernels' pass where they can take f, else by scaling the
 * buffers first. */
int ds_zero_optimizer_step(ds_zero *z, const ds_optim_hparams *h, int n, ds_tensor *const *grads, double f,
                           ds_tensor *const *written) {
    bool fused = ds_zero_fused_step(z);
    if (!fused && ds_zero_scale_all(n, grads, f)) return -1;
    if (z->step_fn) return z->step_fn(z->step_ud, h);
    for (int g = 0; g < z->optim->n_groups; g++) {
        if (ds_optim_check_hparams(z->optim->kind, &h[g], g)) return -1;
        bool shared = z->parts > 1 && z->world > 1;
        if (ds_optim_step_shared(z->optim, g, &h[g], fused ? f : 1, written ? written[g] : NULL,
                                 shared ? sum_over_ranks : NULL, z))
            return -1;
    }
    return 0;
}

/* The next reduced backward opens a new window. */
int ds_zero_zero_grads(ds_zero *z) {
    z->in_window = false;
    return z->layout->zero_grad(z);
}

int ds_zero_step(ds_zero *z, const ds_optim_hparams *h, double loss_scale, double clip, bool check_overflow,
                 ds_zero_result *out) {
    *out = (ds_zero_result){ false, NAN };
    if (drain(z)) return -1;
    bool prev = ds_set_grad_enabled(false);
    int rc = z->layout->step(z, h, loss_scale, clip, check_overflow, out);
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

ds_zero_holding ds_zero_holds(const ds_zero *z) { return z->streamed ? DS_ZERO_HOLDS_STREAMED : z->layout->holds; }

bool ds_zero_reduces(const ds_zero *z, bool boundary) { return z->layout->reduces(z, boundary); }

int ds_zero_parts(const ds_zero *z) { return z->parts; }

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
