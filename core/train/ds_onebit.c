#include "ds_onebit.h"
#include "ds_autograd.h"
#include "ds_comm.h"
#include "ds_error.h"
#include "ds_ops.h"

#include <math.h>
#include <stdlib.h>

/* One compressed all-reduce's buffers, n elements padded to N (see ds_onebit.h). */
typedef struct {
    int64_t n, padded, chunk;
    ds_tensor *x;              /* f32 [N]: the buffer being reduced, padded with zeros */
    ds_tensor *worker_error;   /* f32 [N] */
    ds_tensor *server_error;   /* f32 [N / W] */
    ds_tensor *bits;           /* u8 [N / 8]: this rank's signs */
    ds_tensor *server;         /* f32 [N / W]: this rank's chunk, averaged */
    ds_tensor *server_bits;    /* u8 [N / 8W] */
} onebit_buf;

typedef struct {
    int64_t n;
    onebit_buf *bufs;          /* OnebitAdam, ZeroOneAdam: one per piece (parameter), as DeepSpeed compresses each */
    ds_tensor *acc;            /* ZeroOneAdam: f32 [n], the local updates since the last sync */
    double lrs;                /* ZeroOneAdam: the lrs summed over those steps */
    /* OnebitLamb: f32 [n] each; per piece (ds_optim_group's seg) on the host */
    ds_tensor *fresh_v, *last_m;
    double *coeff_freeze, *last_factor, *scaling;
} onebit_group;

struct ds_onebit {
    ds_onebit_config c;
    ds_optim *o;
    int world, rank;
    onebit_group *g;
    onebit_buf lamb;             /* OnebitLamb: every group's momenta in one buffer, as DeepSpeed's */
    int64_t steps;
    bool reduce_next;            /* the next step's gradients are all-reduced */
    /* ZeroOneAdam's schedule */
    int64_t var_interval, var_counter, local_interval, local_counter;
    bool var_frozen, errors_reset;
    int64_t lamb_loaded;         /* OnebitLamb: the step its loaded state is of (0: none loaded) */
    ds_onebit_stats stats;
};

static int64_t gcd64(int64_t a, int64_t b) { return b ? gcd64(b, a % b) : a; }

static ds_tensor *zeros(int64_t n, ds_dtype dt, ds_device dev) { return ds_tensor_full(1, &n, dt, dev, 0.0); }

static ds_tensor *elements(ds_tensor *t, int64_t lo, int64_t n) {
    return ds_tensor_view_of(t, 1, &n, (int64_t[]){ 1 }, t->offset + lo);
}

static void buf_free(onebit_buf *cb) {
    ds_tensor *all[] = { cb->x, cb->worker_error, cb->server_error, cb->bits, cb->server, cb->server_bits };
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) ds_tensor_release(all[i]);
}

/* Buffers for n elements on dev, padded to a multiple of unit. */
static int buf_init(onebit_buf *cb, int64_t n, int64_t unit, int world, ds_device dev) {
    cb->n = n;
    cb->padded = (n + unit - 1) / unit * unit;
    cb->chunk = cb->padded / world;
    return (cb->x = zeros(cb->padded, DS_F32, dev)) && (cb->worker_error = zeros(cb->padded, DS_F32, dev)) &&
           (cb->server_error = zeros(cb->chunk, DS_F32, dev)) && (cb->bits = zeros(cb->padded / 8, DS_U8, dev)) &&
           (cb->server = zeros(cb->chunk, DS_F32, dev)) && (cb->server_bits = zeros(cb->chunk / 8, DS_U8, dev))
           ? 0 : -1;
}

static void group_free(onebit_group *gr, int n_bufs) {
    for (int k = 0; gr->bufs && k < n_bufs; k++) buf_free(&gr->bufs[k]);
    free(gr->bufs);
    ds_tensor *all[] = { gr->acc, gr->fresh_v, gr->last_m };
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) ds_tensor_release(all[i]);
    free(gr->coeff_freeze);
    free(gr->last_factor);
    free(gr->scaling);
}

/* OnebitLamb's per-piece state: frozen trust ratios 0, last factors 1. */
static int lamb_state(onebit_group *gr, const ds_optim_group *og, ds_device dev) {
    size_t k = (size_t)og->n_seg + 1;
    if (!(gr->fresh_v = zeros(gr->n, DS_F32, dev)) || !(gr->last_m = zeros(gr->n, DS_F32, dev))) return -1;
    gr->coeff_freeze = calloc(k, sizeof *gr->coeff_freeze);
    gr->last_factor = calloc(k, sizeof *gr->last_factor);
    gr->scaling = calloc(k, sizeof *gr->scaling);
    if (!gr->coeff_freeze || !gr->last_factor || !gr->scaling)
        return ds_fail(DS_ERR_NOMEM, "OneBitLamb: out of memory for %d pieces", og->n_seg), -1;
    for (size_t i = 0; i < k; i++) gr->last_factor[i] = 1;
    return 0;
}

void ds_onebit_free(ds_onebit *b) {
    if (!b) return;
    for (int g = 0; b->g && g < b->o->n_groups; g++) group_free(&b->g[g], b->o->groups[g].n_seg);
    buf_free(&b->lamb);
    free(b->g);
    free(b);
}

ds_onebit *ds_onebit_new(const ds_onebit_config *c, ds_optim *o) {
    ds_optim_kind over = c->kind == DS_ONEBIT_LAMB ? DS_OPTIM_LAMB : DS_OPTIM_ADAMW;
    if (o->kind != over)
        return ds_fail(DS_ERR_ARG, "1-bit optimizers: %s steps over %s, got %s",
                       c->kind == DS_ONEBIT_LAMB ? "OneBitLamb" : c->kind == DS_ZERO_ONE_ADAM ? "ZeroOneAdam" : "OneBitAdam",
                       ds_optim_name(over), ds_optim_name(o->kind)), NULL;
    if (c->kind == DS_ZERO_ONE_ADAM && (c->var_update_scaler < 1 || c->local_step_scaler < 1 || c->local_step_clipper < 1))
        return ds_fail(DS_ERR_ARG, "ZeroOneAdam: var_update_scaler, local_step_scaler and local_step_clipper must be "
                       ">= 1"), NULL;
    ds_onebit *b = calloc(1, sizeof *b);
    if (!b || !(b->g = calloc((size_t)o->n_groups, sizeof *b->g))) {
        free(b);
        return ds_fail(DS_ERR_NOMEM, "1-bit optimizers: out of memory"), NULL;
    }
    b->c = *c;
    b->o = o;
    b->world = ds_comm_size(NULL);
    b->rank = ds_comm_rank(NULL);
    b->reduce_next = true;
    b->var_interval = b->local_interval = 1;
    /* DeepSpeed's divider: chunks of whole bytes on every rank */
    int64_t w = b->world, unit = w * (w * 8 / gcd64(w, 8)), total = 0;
    bool lamb = c->kind == DS_ONEBIT_LAMB;
    int rc = 0;
    for (int g = 0; g < o->n_groups && rc == 0; g++) {
        onebit_group *gr = &b->g[g];
        const ds_optim_group *og = &o->groups[g];
        ds_device dev = ds_tensor_device(og->flat_params);
        gr->n = ds_tensor_numel(og->flat_params);
        total += gr->n;
        if (!lamb && !(gr->bufs = calloc((size_t)og->n_seg, sizeof *gr->bufs))) {
            ds_fail(DS_ERR_NOMEM, "1-bit optimizers: out of memory for group %d's %d pieces", g + 1, og->n_seg);
            rc = -1;
        }
        for (int k = 0; !lamb && k < og->n_seg && rc == 0; k++)
            rc = buf_init(&gr->bufs[k], og->seg[k + 1] - og->seg[k], unit, b->world, dev);
        if (rc == 0 && ((c->kind == DS_ZERO_ONE_ADAM && !(gr->acc = zeros(gr->n, DS_F32, dev))) ||
                        (lamb && lamb_state(gr, og, dev))))
            rc = -1;
    }
    if (rc == 0 && lamb && o->n_groups > 0)
        rc = buf_init(&b->lamb, total, unit, b->world, ds_tensor_device(o->groups[0].flat_params));
    if (rc) {
        ds_onebit_free(b);
        return NULL;
    }
    return b;
}

void ds_onebit_stats_get(const ds_onebit *b, ds_onebit_stats *out) { *out = b->stats; }

/* ---------------------------------------------------------------- compression */

static int kernel_failed(const char *what) {
    return ds_fail(DS_ERR_STATE, "1-bit optimizers: %s: %s", what, ds_kernel_error()), -1;
}

/* |x| / sqrt(len): DeepSpeed's scale of a compressed buffer. */
static int rms(ds_tensor *x, double *out) {
    ds_tensor *acc = ds_tensor_full(1, (int64_t[]){ 2 }, DS_F64, ds_tensor_device(x), 0.0);
    if (!acc) return -1;
    int rc = ds_tensor_kernels(x)->reduce->sum_squares(ds_tensor_kview(acc), ds_tensor_kview(x));
    if (rc) kernel_failed("norm");
    ds_tensor *host = rc == 0 ? ds_to_device(acc, DS_CPU_DEVICE) : NULL;
    if (host) *out = sqrt(ds_tensor_get(host, 0) / (double)ds_tensor_numel(x));
    ds_tensor_release(host);
    ds_tensor_release(acc);
    return host ? 0 : -1;
}

/* x += err, then its signs into bits and what they miss into err; the
 * scale is returned in a one-element f32 tensor on x's device (to gather). */
static ds_tensor *compress(ds_tensor *x, ds_tensor *err, ds_tensor *bits) {
    double scale;
    if (ds_add_(x, err) || rms(x, &scale)) return NULL;
    if (ds_tensor_kernels(x)->optim->onebit_pack(ds_tensor_kview(x), ds_tensor_kview(err), ds_tensor_kview(bits), scale))
        return kernel_failed("pack"), NULL;
    return ds_tensor_full(1, (int64_t[]){ 1 }, DS_F32, ds_tensor_device(x), scale);
}

/* w waited for, or NULL; the bytes of t it sent to other ranks counted
 * (an all-to-all keeps this rank's piece). */
static ds_comm_work *done(ds_comm_work *w, ds_tensor *t, int world, bool all_to_all, int64_t *bytes) {
    if (w && ds_comm_work_wait(w)) {
        ds_comm_work_release(w);
        return NULL;
    }
    int64_t n = ds_tensor_numel(t) * (int64_t)ds_dtype_size(t->dtype);
    *bytes += all_to_all ? n - n / world : n;
    return w;
}

static ds_comm_work *gather(ds_tensor *t, int world, int64_t *bytes) {
    return done(ds_comm_all_gather(t, NULL), t, world, false, bytes);
}

static int unpack(ds_tensor *out, ds_tensor *bits, double scale, bool accumulate) {
    if (ds_tensor_kernels(out)->optim->onebit_unpack(ds_tensor_kview(out), ds_tensor_kview(bits), scale, accumulate))
        return kernel_failed("unpack");
    return 0;
}

/* The scales of a gathered one-element f32 result per rank, in host memory. */
static int scales_of(ds_comm_work *w, double *out, int n) {
    for (int r = 0; r < n; r++) {
        ds_tensor *t = ds_comm_work_result(w, r);
        ds_tensor *host = t ? ds_to_device(t, DS_CPU_DEVICE) : NULL;
        if (host) out[r] = ds_tensor_get(host, 0);
        ds_tensor_release(host);
        ds_tensor_release(t);
        if (!host) return -1;
    }
    return 0;
}

/* Elements [lo, lo + n) of w's result r. */
static ds_tensor *result_part(ds_comm_work *w, int r, int64_t lo, int64_t n) {
    ds_tensor *t = ds_comm_work_result(w, r);
    ds_tensor *v = t ? elements(t, lo, n) : NULL;
    ds_tensor_release(t);
    return v;
}

/* parts (contiguous f32, cb->n elements in all) replaced by their
 * compressed average over the ranks, through cb's buffers and errors. */
static int reduce_parts(ds_onebit *b, onebit_buf *cb, ds_tensor *const *parts, int n_parts) {
    int W = b->world;
    double scale[W], server_scale[W];
    int64_t off = 0;
    int rc = 0;
    for (int i = 0; i < n_parts && rc == 0; off += ds_tensor_numel(parts[i++])) {
        ds_tensor *dst = elements(cb->x, off, ds_tensor_numel(parts[i]));
        rc = dst ? ds_copy_(dst, parts[i]) : -1;
        ds_tensor_release(dst);
    }
    ds_tensor *tail = rc == 0 ? elements(cb->x, cb->n, cb->padded - cb->n) : NULL;
    if (!tail || ds_fill_(tail, 0)) rc = -1;
    ds_tensor_release(tail);
    ds_tensor *ws = NULL, *ss = NULL;
    ds_comm_work *wbits = NULL, *wscale = NULL, *sbits = NULL, *sscale = NULL;
    /* worker: each rank's signs of this rank's chunk (an all-to-all) and
     * every rank's scale; then this rank's chunk of their mean */
    int64_t *sent = &b->stats.bytes;
    if (rc == 0 && (!(ws = compress(cb->x, cb->worker_error, cb->bits)) ||
                    !(wbits = done(ds_comm_all_to_all(cb->bits, NULL), cb->bits, W, true, sent)) ||
                    !(wscale = gather(ws, W, sent)) || scales_of(wscale, scale, W)))
        rc = -1;
    for (int r = 0; r < W && rc == 0; r++) {
        ds_tensor *part = result_part(wbits, 0, r * cb->chunk / 8, cb->chunk / 8);
        rc = part ? unpack(cb->server, part, scale[r] / W, r > 0) : -1;
        ds_tensor_release(part);
    }
    /* server: the chunk compressed again, every chunk to every rank */
    if (rc == 0 && (!(ss = compress(cb->server, cb->server_error, cb->server_bits)) ||
                    !(sbits = gather(cb->server_bits, W, sent)) || !(sscale = gather(ss, W, sent)) ||
                    scales_of(sscale, server_scale, W)))
        rc = -1;
    for (int r = 0; r < W && rc == 0; r++) {
        ds_tensor *part = result_part(sbits, r, 0, cb->chunk / 8), *dst = elements(cb->x, r * cb->chunk, cb->chunk);
        rc = part && dst ? unpack(dst, part, server_scale[r], false) : -1;
        ds_tensor_release(part);
        ds_tensor_release(dst);
    }
    off = 0;
    for (int i = 0; i < n_parts && rc == 0; off += ds_tensor_numel(parts[i++])) {
        ds_tensor *src = elements(cb->x, off, ds_tensor_numel(parts[i]));
        rc = src ? ds_copy_(parts[i], src) : -1;
        ds_tensor_release(src);
    }
    ds_comm_work *works[] = { wbits, wscale, sbits, sscale };
    for (int i = 0; i < 4; i++) ds_comm_work_release(works[i]);
    ds_tensor_release(ws);
    ds_tensor_release(ss);
    return rc;
}

/* Group g's x, piece by piece (OnebitAdam, ZeroOneAdam). */
static int reduce_pieces(ds_onebit *b, int g, ds_tensor *x) {
    const ds_optim_group *og = &b->o->groups[g];
    int rc = 0;
    for (int k = 0; k < og->n_seg && rc == 0; k++) {
        int64_t n = og->seg[k + 1] - og->seg[k];
        if (n == 0) continue;
        ds_tensor *v = elements(x, og->seg[k], n);
        rc = v ? reduce_parts(b, &b->g[g].bufs[k], &v, 1) : -1;
        ds_tensor_release(v);
    }
    return rc;
}

int ds_onebit_allreduce(ds_onebit *b, int g, ds_tensor *x) {
    if (b->c.kind == DS_ONEBIT_LAMB)
        return ds_fail(DS_ERR_ARG, "1-bit optimizers: allreduce: OneBitLamb reduces every group's momenta at once; "
                       "this is OneBitAdam's and ZeroOneAdam's"), -1;
    if (g < 0 || g >= b->o->n_groups || x->dtype != DS_F32 || ds_tensor_numel(x) != b->g[g].n ||
        !ds_tensor_is_contiguous(x))
        return ds_fail(DS_ERR_ARG, "1-bit optimizers: allreduce: group %d of %d takes contiguous f32 of its elements, "
                       "got %s [%lld]", g + 1, b->o->n_groups, ds_dtype_name(x->dtype),
                       (long long)ds_tensor_numel(x)), -1;
    return b->world == 1 ? 0 : reduce_pieces(b, g, x);
}

/* ---------------------------------------------------------------- steps */

static ds_kview view_or_none(ds_tensor *t) {
    if (t) return ds_tensor_kview(t);
    ds_kview none = { 0 };
    return none;
}

static int update(ds_onebit *b, int g, ds_onebit_op op, const ds_optim_hparams *h, ds_tensor *grad, ds_tensor *acc) {
    ds_optim_group *og = &b->o->groups[g];
    ds_onebit_params p = { h->beta1, h->eps, h->lr, h->weight_decay, b->g[g].lrs };
    ds_kview params = ds_tensor_kview_w(og->flat_params, "the 1-bit optimizer's step");
    if (ds_tensor_kernels(og->flat_params)->optim->onebit_update(op, params, view_or_none(grad),
                                                                 ds_tensor_kview(og->state[0]),
                                                                 ds_tensor_kview(og->state[1]), view_or_none(acc), &p))
        return kernel_failed("update");
    return 0;
}

/* OnebitAdam past freeze_step: this rank's gradient into the momentum,
 * the momentum averaged compressed, the update with the frozen variance. */
static int onebit_adam_step(ds_onebit *b, int g, const ds_optim_hparams *h) {
    ds_optim_group *og = &b->o->groups[g];
    if (update(b, g, DS_ONEBIT_MOMENTUM, h, og->flat_grads, NULL) || ds_onebit_allreduce(b, g, og->state[0]))
        return -1;
    return update(b, g, DS_ONEBIT_APPLY, h, NULL, NULL);
}

/* ZeroOneAdam between full-precision steps: before the variance freezes
 * the gradient travels compressed; after, local steps accumulate their
 * updates and every local_interval-th step (DeepSpeed's count) syncs them. */
static int zero_one_step(ds_onebit *b, int g, const ds_optim_hparams *h, int64_t t) {
    ds_optim_group *og = &b->o->groups[g];
    onebit_group *gr = &b->g[g];
    if (!b->var_frozen) {
        if (ds_onebit_allreduce(b, g, og->flat_grads) || update(b, g, DS_ONEBIT_MOMENTUM, h, og->flat_grads, NULL))
            return -1;
        return update(b, g, DS_ONEBIT_APPLY, h, NULL, NULL);
    }
    gr->lrs += h->lr;
    if (update(b, g, DS_ONEBIT_MOMENTUM, h, og->flat_grads, NULL) || update(b, g, DS_ONEBIT_APPLY, h, NULL, gr->acc))
        return -1;
    if ((t + 1) % b->local_interval != 0) return 0;     /* DeepSpeed's step count (zero_one_schedule) */
    if (update(b, g, DS_ONEBIT_UNDO, h, NULL, gr->acc) || ds_onebit_allreduce(b, g, gr->acc) ||
        update(b, g, DS_ONEBIT_REDO, h, NULL, gr->acc))
        return -1;
    gr->lrs = 0;
    return 0;
}

/* ZeroOneAdam's schedule after step t (zoadam.py's counters). Its step
 * count s = t + 1 counts DeepSpeed's first call, which only makes buffers:
 * the full steps, the freeze and the syncs fall where DeepSpeed's do. */
static void zero_one_schedule(ds_onebit *b, int64_t t) {
    int64_t s = t + 1;
    if (!b->var_frozen) {
        if (s % b->var_interval == 0 && ++b->var_counter == b->c.var_update_scaler) {
            b->var_counter = 0;
            b->var_interval *= 2;
        }
        b->reduce_next = (s + 1) % b->var_interval == 0;
    } else if (++b->local_counter == b->c.local_step_scaler) {
        b->local_counter = 0;
        b->local_interval = b->local_interval * 2 < b->c.local_step_clipper ? b->local_interval * 2
                                                                            : b->c.local_step_clipper;
    }
    if (s > b->c.var_freeze_step) {
        b->var_frozen = true;
        b->reduce_next = false;
    }
}

static int zero_buf(onebit_buf *cb) {
    return cb->x && (ds_fill_(cb->worker_error, 0) || ds_fill_(cb->server_error, 0)) ? -1 : 0;
}

static int zero_errors(ds_onebit *b) {
    for (int g = 0; g < b->o->n_groups; g++)
        for (int k = 0; b->g[g].bufs && k < b->o->groups[g].n_seg; k++)
            if (zero_buf(&b->g[g].bufs[k])) return -1;
    return zero_buf(&b->lamb);
}

/* The optimizer's step count changed under b (a checkpoint was loaded):
 * the schedule as of that step, the errors zeroed (as DeepSpeed's
 * load_state_dict does: they are this rank's and were not saved), the
 * accumulated local updates dropped. OnebitLamb needs its own state of
 * that step loaded too. */
static int resync(ds_onebit *b) {
    int64_t step = b->o->groups[0].step;
    if (step == b->steps) return 0;
    if (b->c.kind == DS_ONEBIT_LAMB && step > 0 && step != b->lamb_loaded)
        return ds_fail(DS_ERR_STATE, "OneBitLamb: resuming at step %lld: its averaged trust ratios and fresh variance "
                       "were not loaded for that step (a checkpoint without onebit/ tensors: resume from step 0, or "
                       "use Lamb)", (long long)step), -1;
    b->steps = step;
    b->reduce_next = step < b->c.freeze_step;
    if (b->c.kind == DS_ZERO_ONE_ADAM) {
        b->reduce_next = true;
        b->var_interval = b->local_interval = 1;
        b->var_counter = b->local_counter = 0;
        b->var_frozen = false;
        for (int64_t t = 1; t <= step; t++) zero_one_schedule(b, t);
        b->errors_reset = b->var_frozen;
        for (int g = 0; g < b->o->n_groups; g++) {
            b->g[g].lrs = 0;
            if (ds_fill_(b->g[g].acc, 0)) return -1;
        }
    }
    return zero_errors(b);
}

/* ---------------------------------------------------------------- OnebitLamb */

static int scale_(ds_tensor *t, double f) {
    ds_tensor *k = ds_scalar_like(t, f);
    int rc = k ? ds_binary_(DS_BIN_MUL, t, k) : -1;
    ds_tensor_release(k);
    return rc;
}

/* y += a x */
static int axpy_(ds_tensor *y, double a, ds_tensor *x) {
    ds_tensor *t = ds_mul_scalar(x, a);
    int rc = t ? ds_add_(y, t) : -1;
    ds_tensor_release(t);
    return rc;
}

/* The 2-norm (max: the largest element) of elements [lo, lo + n) of t, on
 * the host; -1 with the error set. */
static int piece_stat(ds_tensor *t, int64_t lo, int64_t n, bool max, double *out) {
    ds_tensor *v = elements(t, lo, n);
    ds_tensor *r = v ? (max ? ds_amax(v, -1, NULL, false) : ds_norm(v, 2, -1, NULL, false)) : NULL;
    ds_tensor *host = r ? ds_to_device(r, DS_CPU_DEVICE) : NULL;
    if (host) *out = ds_tensor_get(host, 0);
    ds_tensor_release(host);
    ds_tensor_release(r);
    ds_tensor_release(v);
    return host ? 0 : -1;
}

/* Each piece's momentum times f[k] (or divided by it). */
static int scale_pieces(ds_tensor *m, const ds_optim_group *og, const double *f, bool divide) {
    for (int k = 0; k < og->n_seg; k++) {
        int64_t lo = og->seg[k], n = og->seg[k + 1] - lo;
        if (n == 0) continue;
        ds_tensor *v = elements(m, lo, n);
        int rc = v ? scale_(v, divide ? 1 / f[k] : f[k]) : -1;
        ds_tensor_release(v);
        if (rc) return -1;
    }
    return 0;
}

/* After a warm-up step: each piece's trust ratio into its average, and the
 * variance the fresh one starts from at the last warm-up step. */
static int lamb_warmup_done(ds_onebit *b, int g, int64_t t) {
    const ds_optim_group *og = &b->o->groups[g];
    onebit_group *gr = &b->g[g];
    for (int k = 0; k < og->n_seg; k++)
        if (og->lamb_coeffs[k] != 1.0)
            gr->coeff_freeze[k] = b->c.coeff_beta * gr->coeff_freeze[k] + (1 - b->c.coeff_beta) * og->lamb_coeffs[k];
    return t == b->c.freeze_step ? ds_copy_(gr->fresh_v, og->state[1]) : 0;
}

/* At the first compressed step: each piece's momentum is scaled to the
 * mean over every group's pieces of their sizes |m| / sqrt(n). */
static int lamb_scaling(ds_onebit *b) {
    double sum = 0;
    int count = 0;
    for (int g = 0; g < b->o->n_groups; g++) {
        const ds_optim_group *og = &b->o->groups[g];
        for (int k = 0; k < og->n_seg; k++) {
            int64_t n = og->seg[k + 1] - og->seg[k];
            double norm = 0;
            if (n > 0 && piece_stat(og->state[0], og->seg[k], n, false, &norm)) return -1;
            b->g[g].scaling[k] = n > 0 ? norm / sqrt((double)n) : 0;
            sum += b->g[g].scaling[k];
            count++;
        }
    }
    double united = count ? sum / count : 1;
    for (int g = 0; g < b->o->n_groups; g++)
        for (int k = 0; k < b->o->groups[g].n_seg; k++) {
            double s = b->g[g].scaling[k];
            b->g[g].scaling[k] = s > 0 ? united / s : 1;   /* a zero momentum stays as it is */
        }
    return 0;
}

/* The factor of piece k: the largest ratio of frozen to fresh denominator,
 * blended toward 1 by the share of weight decay in the update, clamped. */
static double lamb_factor(const ds_onebit *b, onebit_group *gr, int k, double ratio_max, double pre_norm,
                          double upd_norm, double wd) {
    double f = ratio_max;
    if (wd > 0 && upd_norm > 0) {
        double r = pre_norm / upd_norm < 1 ? pre_norm / upd_norm : 1;
        f = f * r + (1 - r);
    }
    f = f > b->c.factor_max ? b->c.factor_max : f < b->c.factor_min ? b->c.factor_min : f;
    double hi = gr->last_factor[k] * (1 + b->c.factor_threshold), lo = gr->last_factor[k] * (1 - b->c.factor_threshold);
    f = f > hi ? hi : f < lo ? lo : f;
    gr->last_factor[k] = f;
    return f;
}

/* OnebitLamb's compressed step begins: every group's momentum takes this
 * rank's gradient, is scaled piece by piece to the common size, and all
 * are averaged as one buffer (lamb.py's exp_avg_flat). */
static int lamb_momenta(ds_onebit *b, const ds_optim_hparams *h) {
    int G = b->o->n_groups;
    ds_tensor *parts[G];
    for (int g = 0; g < G; g++) {
        ds_optim_group *og = &b->o->groups[g];
        parts[g] = og->state[0];
        if (ds_copy_(b->g[g].last_m, parts[g]) || update(b, g, DS_ONEBIT_MOMENTUM, &h[g], og->flat_grads, NULL) ||
            scale_pieces(parts[g], og, b->g[g].scaling, false))
            return -1;
    }
    return b->world == 1 ? 0 : reduce_parts(b, &b->lamb, parts, G);
}

/* And goes on for group g, its momentum averaged (lamb.py's compression
 * stage). */
static int onebit_lamb_step(ds_onebit *b, int g, const ds_optim_hparams *h) {
    ds_optim_group *og = &b->o->groups[g];
    onebit_group *gr = &b->g[g];
    ds_tensor *m = og->state[0], *v = og->state[1], *p = og->flat_params;
    if (scale_pieces(m, og, gr->scaling, true)) return -1;
    /* the gradient the averaged momentum implies feeds the fresh variance */
    ds_tensor *rec = ds_mul_scalar(gr->last_m, -h->beta1), *sq = NULL, *denom = NULL, *real = NULL, *pre = NULL,
              *upd = NULL, *ratio = NULL, *eps = NULL;
    int rc = rec && ds_add_(rec, m) == 0 && scale_(rec, 1 / (1 - h->beta1)) == 0 && (sq = ds_mul(rec, rec)) &&
             scale_(gr->fresh_v, h->beta2) == 0 && axpy_(gr->fresh_v, 1 - h->beta2, sq) == 0 ? 0 : -1;
    if (rc == 0 && ((eps = ds_scalar_like(v, h->eps)) == NULL || (denom = ds_unary(DS_UN_SQRT, v, 0)) == NULL ||
                    ds_add_(denom, eps) || (real = ds_unary(DS_UN_SQRT, gr->fresh_v, 0)) == NULL || ds_add_(real, eps) ||
                    (pre = ds_div(m, denom)) == NULL || (ratio = ds_div(denom, real)) == NULL ||
                    (upd = ds_mul_scalar(p, h->weight_decay)) == NULL || ds_add_(upd, pre)))
        rc = -1;
    for (int k = 0; k < og->n_seg && rc == 0; k++) {
        int64_t lo = og->seg[k], n = og->seg[k + 1] - lo;
        double upd_norm = 0, pre_norm = 0, ratio_max = 0;
        if (n == 0) continue;
        if (piece_stat(upd, lo, n, false, &upd_norm) || piece_stat(pre, lo, n, false, &pre_norm) ||
            piece_stat(ratio, lo, n, true, &ratio_max)) {
            rc = -1;
            break;
        }
        double coeff = gr->coeff_freeze[k] * lamb_factor(b, gr, k, ratio_max, pre_norm, upd_norm, h->weight_decay);
        og->lamb_coeffs[k] = coeff;
        ds_tensor *pv = elements(p, lo, n), *uv = elements(upd, lo, n);
        rc = pv && uv ? axpy_(pv, -h->lr * coeff, uv) : -1;
        ds_tensor_release(pv);
        ds_tensor_release(uv);
    }
    ds_tensor *all[] = { rec, sq, denom, real, pre, upd, ratio, eps };
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) ds_tensor_release(all[i]);
    return rc;
}

static int lamb_group(const ds_onebit *b, int g, const char *what) {
    if (b->c.kind != DS_ONEBIT_LAMB)
        return ds_fail(DS_ERR_ARG, "1-bit optimizers: %s: only OneBitLamb has its own state", what), -1;
    if (g < 0 || g >= b->o->n_groups)
        return ds_fail(DS_ERR_ARG, "OneBitLamb: %s: group %d of %d", what, g + 1, b->o->n_groups), -1;
    return 0;
}

int ds_onebit_lamb_state(const ds_onebit *b, int g, ds_tensor **fresh_v, ds_tensor **pieces) {
    if (lamb_group(b, g, "state")) return -1;
    const onebit_group *gr = &b->g[g];
    int64_t k = b->o->groups[g].n_seg;
    *fresh_v = ds_clone(gr->fresh_v);
    *pieces = *fresh_v ? ds_tensor_new(1, (int64_t[]){ 3 * k }, DS_F64, DS_CPU_DEVICE) : NULL;
    if (!*pieces) {
        ds_tensor_release(*fresh_v);
        return -1;
    }
    double *d = ds_tensor_data(*pieces);
    for (int64_t i = 0; i < k; i++) {
        d[i] = gr->coeff_freeze[i];
        d[k + i] = gr->last_factor[i];
        d[2 * k + i] = gr->scaling[i];
    }
    return 0;
}

int ds_onebit_lamb_load(ds_onebit *b, int g, int64_t step, ds_tensor *fresh_v, ds_tensor *pieces) {
    if (lamb_group(b, g, "load")) return -1;
    onebit_group *gr = &b->g[g];
    int64_t k = b->o->groups[g].n_seg;
    if (fresh_v->dtype != DS_F32 || ds_tensor_numel(fresh_v) != gr->n)
        return ds_fail(DS_ERR_ARG, "OneBitLamb: load: group %d's fresh variance must be f32 of %lld elements, got %s of "
                       "%lld", g + 1, (long long)gr->n, ds_dtype_name(fresh_v->dtype),
                       (long long)ds_tensor_numel(fresh_v)), -1;
    if (pieces->dtype != DS_F64 || ds_tensor_numel(pieces) != 3 * k || !ds_tensor_is_contiguous(pieces) ||
        !ds_device_equal(ds_tensor_device(pieces), DS_CPU_DEVICE))
        return ds_fail(DS_ERR_ARG, "OneBitLamb: load: group %d's piece state must be contiguous f64 [%lld] on the CPU "
                       "(3 per piece), got %s [%lld]", g + 1, (long long)(3 * k), ds_dtype_name(pieces->dtype),
                       (long long)ds_tensor_numel(pieces)), -1;
    /* read from a file onto the host: to the group's device */
    ds_tensor *here = ds_to_device(fresh_v, ds_tensor_device(gr->fresh_v));
    int rc = here ? ds_copy_(gr->fresh_v, here) : -1;
    ds_tensor_release(here);
    if (rc) return -1;
    const double *d = ds_tensor_data(pieces);
    for (int64_t i = 0; i < k; i++) {
        gr->coeff_freeze[i] = d[i];
        gr->last_factor[i] = d[k + i];
        gr->scaling[i] = d[2 * k + i];
    }
    b->lamb_loaded = step;
    return 0;
}

bool ds_onebit_reduces(ds_onebit *b) {
    resync(b);     /* a failure is the step's to report */
    return b->reduce_next;
}

int ds_onebit_step(ds_onebit *b, const ds_optim_hparams *h) {
    if (resync(b)) return -1;
    int64_t t = b->steps + 1;
    bool full = b->reduce_next;
    b->stats.bytes = 0;
    bool prev = ds_set_grad_enabled(false);
    int rc = 0;
    if (!full && b->c.kind == DS_ONEBIT_LAMB) {
        if (t == b->c.freeze_step + 1) rc = lamb_scaling(b);
        if (rc == 0 && b->o->n_groups > 0) rc = lamb_momenta(b, h);
    }
    for (int g = 0; g < b->o->n_groups && rc == 0; g++) {
        if (full) {
            rc = ds_optim_step(b->o, g, &h[g]);
            if (rc == 0 && b->c.kind == DS_ONEBIT_LAMB) rc = lamb_warmup_done(b, g, t);
        } else {
            rc = b->c.kind == DS_ONEBIT_ADAM ? onebit_adam_step(b, g, &h[g])
               : b->c.kind == DS_ONEBIT_LAMB ? onebit_lamb_step(b, g, &h[g]) : zero_one_step(b, g, &h[g], t);
            b->o->groups[g].step++;
        }
    }
    ds_set_grad_enabled(prev);
    if (rc) return -1;
    b->steps = t;
    b->stats = (ds_onebit_stats){ t, !full, b->stats.bytes };
    if (b->c.kind != DS_ZERO_ONE_ADAM) {
        b->reduce_next = t < b->c.freeze_step;
        return 0;
    }
    zero_one_schedule(b, t);
    /* the errors held gradients so far; from here they hold updates */
    if (!b->var_frozen || b->errors_reset) return 0;
    b->errors_reset = true;
    return zero_errors(b);
}
