/* The optimizer core without Lua: re-seating tensors into a flat buffer
 * (or adopting a lone one that fills its storage), the errors Lua cannot
 * provoke (a grad of the wrong shape set from C, parameters on two
 * devices, a device without optimizer kernels), using a stand-in "cuda"
 * backend made of the CPU kernels; and Lamb over pieces of parameters,
 * with ZeRO's shards simulated by threads that all-reduce; the CPU loops
 * of every instruction set this CPU runs against a scalar loop of
 * ds_optim_elem.h, bit for bit (this file, like cpu_optim.c, is built
 * without contracted multiply-adds). */
#include "ds_ops.h"
#include "ds_optim.h"
#include "ds_error.h"
#include "ds_rng.h"
#include "ds_optim_elem.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern const ds_kernels ds_cpu_kernels;

#include "check.h"

static void check_error(int failed, const char *expect) {
    check(failed && strstr(ds_error_message(), expect) != NULL, "expected an error with \"%s\", got \"%s\"", expect,
          failed ? ds_error_message() : "(no error)");
}

static ds_tensor *param(int ndim, const int64_t *shape, ds_device dev) {
    ds_tensor *t = ds_tensor_new(ndim, shape, DS_F32, dev);
    for (int64_t i = 0; t && i < ds_tensor_numel(t); i++) ds_tensor_set(t, i, (double)i + 1);
    if (t) t->requires_grad = true;
    return t;
}

static ds_optim_hparams adam_hparams(void) {
    ds_optim_hparams h;
    memset(&h, 0, sizeof h);
    h.lr = 0.1;
    h.beta1 = 0.9;
    h.beta2 = 0.999;
    h.eps = 1e-8;
    h.bias_correction = true;
    return h;
}

static void test_reseat(void) {
    int64_t shape[2] = { 2, 3 };
    ds_tensor *t = param(2, shape, DS_CPU_DEVICE);
    ds_tensor *tt = ds_transpose(t, 0, 1);              /* [3,2], strided */
    ds_tensor *view = ds_detach(tt);
    ds_storage *s = ds_storage_new(16 * sizeof(float), DS_CPU_DEVICE, DS_MEM_PARAM);
    check(ds_tensor_reseat(view, s, 5) == 0, "reseat: %s", ds_error_message());
    check(view->storage == s && view->offset == 5 && ds_tensor_is_contiguous(view), "reseat: a contiguous view at 5");
    const float want[6] = { 1, 4, 2, 5, 3, 6 };
    for (int i = 0; i < 6; i++)
        check(((float *)s->data)[5 + i] == want[i], "reseat: element %d is %g", i, ((float *)s->data)[5 + i]);
    check_error(ds_tensor_reseat(view, s, 12) != 0, "do not fit");
    ds_tensor_release(view);
    ds_tensor_release(tt);
    ds_tensor_release(t);
    ds_storage_release(s);
}

/* A lone parameter that is the whole of its storage is the group's flat
 * buffer, its grad the flat gradient: same bytes, no copy. A parameter
 * that is part of a storage is copied into a new buffer. */
static void test_adopt(void) {
    int64_t n = 6, big = 8;
    ds_tensor *w = param(1, &n, DS_CPU_DEVICE), *g = ds_tensor_full(1, &n, DS_F32, DS_CPU_DEVICE, 0.5);
    ds_tensor *whole = param(1, &big, DS_CPU_DEVICE);
    ds_tensor *part = ds_tensor_view_of(whole, 1, &n, (int64_t[]){ 1 }, 2);
    part->requires_grad = true;
    w->grad = g;
    ds_storage *ws = w->storage, *gs = g->storage;
    ds_optim_hparams h = adam_hparams();
    ds_optim *o = ds_optim_new(DS_OPTIM_ADAMW);
    check(ds_optim_add_group(o, 1, &w, &h) == 0 && ds_optim_add_group(o, 1, &part, &h) == 0, "add: %s",
          ds_error_message());
    ds_optim_group *a = &o->groups[0], *b = &o->groups[1];
    check(a->flat_params->storage == ws && w->storage == ws && a->flat_grads->storage == gs &&
              w->grad->storage == gs && ds_tensor_get(w, 5) == 6 && ds_tensor_get(w->grad, 5) == 0.5,
          "the lone parameter and its grad are adopted, values kept");
    check(b->flat_params->storage != whole->storage && part->storage == b->flat_params->storage &&
              ds_tensor_get(part, 0) == 3 && ds_tensor_get(whole, 2) == 3,
          "a parameter that is part of a storage is copied out");
    ds_optim_free(o);
    ds_tensor_release(w);
    ds_tensor_release(part);
    ds_tensor_release(whole);
}

static void test_adam_step(void) {
    int64_t shape[1] = { 3 };
    ds_tensor *p = param(1, shape, DS_CPU_DEVICE);
    ds_optim *o = ds_optim_new(DS_OPTIM_ADAM);
    ds_optim_hparams h = adam_hparams();
    check(ds_optim_add_group(o, 1, &p, &h) == 0, "add_group: %s", ds_error_message());
    check(p->grad && p->grad->storage == o->groups[0].flat_grads->storage, "grad is a view of the flat buffer");
    ds_fill_(p->grad, -2);
    check(ds_optim_step(o, 0, &h) == 0, "step: %s", ds_error_message());
    /* first Adam step: p - lr sign(g) (up to eps) */
    for (int i = 0; i < 3; i++)
        check(fabs(ds_tensor_get(p, i) - (i + 1 + 0.1)) < 1e-6, "adam step element %d: %g", i, ds_tensor_get(p, i));
    ds_optim_free(o);
    check(ds_tensor_get(p, 0) > 1, "parameters outlive their optimizer");
    ds_tensor_release(p);
}

static void test_wrong_grad(void) {
    int64_t shape[2] = { 3, 4 }, other[2] = { 4, 3 };
    ds_tensor *p = param(2, shape, DS_CPU_DEVICE);
    ds_tensor *bad = ds_tensor_full(2, other, DS_F32, DS_CPU_DEVICE, 1);
    p->grad = bad;
    ds_tensor_retain(bad);
    ds_optim *o = ds_optim_new(DS_OPTIM_SGD);
    ds_optim_hparams h = adam_hparams();
    check_error(ds_optim_add_group(o, 1, &p, &h) != 0, "optim.SGD: parameter 1 of group 1 is [3,4] but its grad is f32 [4,3]");
    ds_tensor_release(p->grad);
    p->grad = NULL;
    check(ds_optim_add_group(o, 1, &p, &h) == 0, "add_group: %s", ds_error_message());
    /* replaced behind the optimizer's back, from C */
    ds_tensor_release(p->grad);
    p->grad = bad;
    check_error(ds_optim_step(o, 0, &h) != 0,
                "optim.SGD: parameter 1 of group 1 is [3,4] but its grad was replaced by f32 [4,3]");
    check(ds_tensor_get(p, 0) == 1, "a failed step leaves the parameters alone");
    ds_optim_free(o);
    ds_tensor_release(p);
}

static void test_devices(void) {
    ds_kernels no_optim = ds_cpu_kernels;
    no_optim.name = "fake cuda";
    no_optim.optim = NULL;
    ds_backend fake = { .kernels = &no_optim, .allocator = &ds_cpu_allocator, .count = 1 };
    ds_backend_register(DS_DEV_CUDA, &fake);
    ds_device cuda = { DS_DEV_CUDA, 0 };
    int64_t shape[1] = { 4 };
    ds_tensor *a = param(1, shape, DS_CPU_DEVICE), *b = param(1, shape, cuda);
    ds_tensor *both[2] = { a, b };
    ds_optim *o = ds_optim_new(DS_OPTIM_ADAMW);
    ds_optim_hparams h = adam_hparams();
    check_error(ds_optim_add_group(o, 2, both, &h) != 0, "optim.AdamW: parameter 2 of group 1 is on cuda:0, the others on cpu");
    check(ds_optim_add_group(o, 1, &b, &h) == 0, "add_group on cuda: %s", ds_error_message());
    check_error(ds_optim_add_group(o, 1, &a, &h) != 0, "optim.AdamW: parameter 1 of group 2 is on cpu, the others on cuda:0");
    check_error(ds_optim_step(o, 0, &h) != 0, "optim.AdamW: no optimizer kernels for device cuda:0");
    ds_optim_free(o);
    ds_tensor_release(a);
    ds_tensor_release(b);
}

/* ---- Lamb over pieces ---- */

/* A fixed value in [-1, 1) for (a, b, c): splitmix64 of their mix. */
static double noise(uint64_t a, uint64_t b, uint64_t c) {
    uint64_t z = a * 0x9e3779b97f4a7c15ull + b * 0xbf58476d1ce4e5b9ull + c + 0x94d049bb133111ebull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) / (double)(1ull << 52) - 1;
}

/* Parameters of every kind of cut: smaller than P (empty pieces), zeros
 * (trust ratio 1 at the first step), not a multiple of P, and large
 * enough for the threaded norms in every shard. */
#define LAMB_NP 6
static const int64_t lamb_sizes[LAMB_NP] = { 1, 2, 5, 1000, 100000, 7 };

static double init_value(int k, int64_t i) { return k == 2 ? 0 : noise(0, (uint64_t)k, (uint64_t)i); }
static double grad_value(int t, int k, int64_t i) { return (k + 1) * noise((uint64_t)t, (uint64_t)k, (uint64_t)i); }

/* FusedLamb's defaults, or (clipped) the spec's lamb_clipped: ratios held
 * to [0.3, 0.5], eps inside the root, no bias correction. */
static ds_optim_hparams lamb_hparams(bool clipped) {
    ds_optim_hparams h;
    memset(&h, 0, sizeof h);
    h.lr = clipped ? 0.02 : 0.01;
    h.beta1 = 0.9;
    h.beta2 = 0.999;
    h.eps = 1e-8;
    h.weight_decay = 0.01;
    h.bias_correction = !clipped;
    h.max_coeff = clipped ? 0.5 : 10;
    h.min_coeff = clipped ? 0.3 : 0.01;
    h.eps_inside_sqrt = clipped;
    return h;
}

static ds_tensor *vector(int64_t n) {
    ds_tensor *t = ds_tensor_full(1, &n, DS_F32, DS_CPU_DEVICE, 0);
    t->requires_grad = true;
    return t;
}

/* One optimizer over the parameters themselves: the reference. */
static ds_optim *lamb_reference(ds_tensor **ps, const ds_optim_hparams *h) {
    for (int k = 0; k < LAMB_NP; k++) {
        ps[k] = vector(lamb_sizes[k]);
        for (int64_t i = 0; i < lamb_sizes[k]; i++) ds_tensor_set(ps[k], i, init_value(k, i));
    }
    ds_optim *o = ds_optim_new(DS_OPTIM_LAMB);
    check(ds_optim_add_group(o, LAMB_NP, ps, h) == 0, "lamb reference: %s", ds_error_message());
    return o;
}

static void lamb_reference_grads(ds_tensor **ps, int t) {
    for (int k = 0; k < LAMB_NP; k++)
        for (int64_t i = 0; i < lamb_sizes[k]; i++) ds_tensor_set(ps[k]->grad, i, grad_value(t, k, i));
}

/* One flat group cut at the parameters' boundaries steps as the parameters
 * do, bit for bit. */
static void test_lamb_segments(void) {
    for (int clipped = 0; clipped <= 1; clipped++) {
        ds_optim_hparams h = lamb_hparams(clipped);
        ds_tensor *ps[LAMB_NP];
        ds_optim *ref = lamb_reference(ps, &h);
        int64_t seg[LAMB_NP + 1] = { 0 };
        for (int k = 0; k < LAMB_NP; k++) seg[k + 1] = seg[k] + lamb_sizes[k];
        ds_tensor *flat = vector(seg[LAMB_NP]);
        for (int k = 0; k < LAMB_NP; k++)
            for (int64_t i = 0; i < lamb_sizes[k]; i++) ds_tensor_set(flat, seg[k] + i, init_value(k, i));
        ds_optim *o = ds_optim_new(DS_OPTIM_LAMB);
        check(ds_optim_add_group(o, 1, &flat, &h) == 0, "lamb flat: %s", ds_error_message());
        check(o->groups[0].n_seg == 1, "a new group's pieces are its parameters: %d", o->groups[0].n_seg);
        check(ds_optim_set_segments(o, 0, LAMB_NP, seg) == 0, "set_segments: %s", ds_error_message());
        int64_t differ = 0;
        for (int t = 1; t <= 4; t++) {
            lamb_reference_grads(ps, t);
            for (int k = 0; k < LAMB_NP; k++)
                for (int64_t i = 0; i < lamb_sizes[k]; i++) ds_tensor_set(flat->grad, seg[k] + i, grad_value(t, k, i));
            check(ds_optim_step(ref, 0, &h) == 0, "lamb reference step: %s", ds_error_message());
            check(ds_optim_step(o, 0, &h) == 0, "lamb flat step: %s", ds_error_message());
            for (int k = 0; k < LAMB_NP; k++) {
                differ += o->groups[0].lamb_coeffs[k] != ref->groups[0].lamb_coeffs[k];
                for (int64_t i = 0; i < lamb_sizes[k]; i++)
                    differ += ds_tensor_get(flat, seg[k] + i) != ds_tensor_get(ps[k], i);
            }
        }
        check(differ == 0, "lamb (%s): a group cut at its parameters differs from them in %lld values",
              clipped ? "clipped" : "default", (long long)differ);
        ds_optim_free(o);
        ds_optim_free(ref);
        ds_tensor_release(flat);
        for (int k = 0; k < LAMB_NP; k++) ds_tensor_release(ps[k]);
    }
}

/* ZeRO's layout: parameter k (n elements) is cut into P shards of
 * s = ceil(n / P) and rank r holds shard r, either padded to s with zeros
 * (dslua.engine.zero) or unpadded: cut at the parameter's end, so possibly empty. */
#define LAMB_MAX_P 3

typedef struct {
    int P;
    pthread_barrier_t barrier;
    double *values[LAMB_MAX_P];        /* each rank's values during a sum */
    int n[LAMB_MAX_P];
} sim_world;

typedef struct {
    sim_world *w;
    int rank, calls, rc;
    ds_optim *o;
    ds_optim_hparams h;
    int64_t seg[LAMB_NP + 1], first[LAMB_NP];   /* first: the parameter's element at seg[k] */
    ds_tensor *master;
    char err[256];
} sim_rank;

/* The all-reduce: every rank posts its values, then each adds them up in
 * rank order, so all get the same bits. */
static int sim_sum(double *values, int n, void *ud) {
    sim_rank *r = ud;
    sim_world *w = r->w;
    r->calls++;
    w->values[r->rank] = values;
    w->n[r->rank] = n;
    pthread_barrier_wait(&w->barrier);
    for (int q = 0; q < w->P; q++)
        if (w->n[q] != n)
            return ds_fail(DS_ERR_ARG, "sum: rank %d has %d values, rank %d %d", q, w->n[q], r->rank, n), -1;
    double *total = calloc((size_t)n + 1, sizeof *total);
    for (int i = 0; i < n; i++)
        for (int q = 0; q < w->P; q++) total[i] += w->values[q][i];
    pthread_barrier_wait(&w->barrier);          /* everyone has read before anyone writes */
    memcpy(values, total, (size_t)n * sizeof *values);
    free(total);
    return 0;
}

static void *sim_step(void *arg) {
    sim_rank *r = arg;
    r->rc = ds_optim_step_shared(r->o, 0, &r->h, 1, NULL, sim_sum, r);
    if (r->rc) snprintf(r->err, sizeof r->err, "%s", ds_error_message());
    return NULL;
}

/* The parameter's element behind master element seg[k] + j, or -1 for padding. */
static int64_t sim_element(const sim_rank *r, int k, int64_t j) {
    int64_t i = r->first[k] + j;
    return i < lamb_sizes[k] ? i : -1;
}

static void sim_rank_init(sim_rank *r, sim_world *w, int rank, bool padded, const ds_optim_hparams *h) {
    memset(r, 0, sizeof *r);
    r->w = w;
    r->rank = rank;
    r->h = *h;
    for (int k = 0; k < LAMB_NP; k++) {
        int64_t n = lamb_sizes[k], s = (n + w->P - 1) / w->P;
        int64_t lo = rank * s < n ? rank * s : n, hi = (rank + 1) * s < n ? (rank + 1) * s : n;
        r->first[k] = padded ? rank * s : lo;
        r->seg[k + 1] = r->seg[k] + (padded ? s : hi - lo);
    }
    r->master = vector(r->seg[LAMB_NP]);
    for (int k = 0; k < LAMB_NP; k++)
        for (int64_t j = 0; j < r->seg[k + 1] - r->seg[k]; j++) {
            int64_t i = sim_element(r, k, j);
            ds_tensor_set(r->master, r->seg[k] + j, i < 0 ? 0 : init_value(k, i));
        }
    r->o = ds_optim_new(DS_OPTIM_LAMB);
    check(ds_optim_add_group(r->o, 1, &r->master, h) == 0, "rank %d: %s", rank, ds_error_message());
    check(ds_optim_set_segments(r->o, 0, LAMB_NP, r->seg) == 0, "rank %d set_segments: %s", rank, ds_error_message());
}

/* P ranks, each stepping its shards with the norms summed over them, end
 * where one unpartitioned Lamb does, and agree on every trust ratio. */
static void test_lamb_partitioned(int P, bool padded, bool clipped) {
    ds_optim_hparams h = lamb_hparams(clipped);
    ds_tensor *ps[LAMB_NP];
    ds_optim *ref = lamb_reference(ps, &h);
    sim_world w = { .P = P };
    pthread_barrier_init(&w.barrier, NULL, (unsigned)P);
    sim_rank ranks[LAMB_MAX_P];
    for (int r = 0; r < P; r++) sim_rank_init(&ranks[r], &w, r, padded, &h);
    const char *what = padded ? "padded" : "unpadded";
    double worst = 0, worst_coeff = 0;
    int64_t bad_padding = 0;
    for (int t = 1; t <= 5; t++) {
        lamb_reference_grads(ps, t);
        check(ds_optim_step(ref, 0, &h) == 0, "lamb reference step: %s", ds_error_message());
        pthread_t th[LAMB_MAX_P];
        for (int r = 0; r < P; r++) {
            sim_rank *sr = &ranks[r];
            for (int k = 0; k < LAMB_NP; k++)
                for (int64_t j = 0; j < sr->seg[k + 1] - sr->seg[k]; j++) {
                    int64_t i = sim_element(sr, k, j);
                    ds_tensor_set(sr->master->grad, sr->seg[k] + j, i < 0 ? 0 : grad_value(t, k, i));
                }
        }
        for (int r = 0; r < P; r++) pthread_create(&th[r], NULL, sim_step, &ranks[r]);
        for (int r = 0; r < P; r++) pthread_join(th[r], NULL);
        for (int r = 0; r < P; r++) {
            sim_rank *sr = &ranks[r];
            check(sr->rc == 0 && sr->calls == t, "P=%d %s rank %d step %d: rc %d, %d sums: %s", P, what, r, t, sr->rc,
                  sr->calls, sr->err);
            for (int k = 0; k < LAMB_NP; k++) {
                double want = ref->groups[0].lamb_coeffs[k], got = sr->o->groups[0].lamb_coeffs[k];
                worst_coeff = fmax(worst_coeff, fabs(got - want) / want);
                double scale = 0;       /* the parameter's largest magnitude */
                for (int64_t i = 0; i < lamb_sizes[k]; i++) scale = fmax(scale, fabs(ds_tensor_get(ps[k], i)));
                for (int64_t j = 0; j < sr->seg[k + 1] - sr->seg[k]; j++) {
                    int64_t i = sim_element(sr, k, j);
                    double v = ds_tensor_get(sr->master, sr->seg[k] + j);
                    if (i < 0) bad_padding += v != 0;
                    else worst = fmax(worst, fabs(v - ds_tensor_get(ps[k], i)) / scale);
                }
            }
        }
    }
    check(worst <= 1e-6, "P=%d %s %s: shards differ from whole parameters by %g of their largest value", P, what,
          clipped ? "clipped" : "default", worst);
    check(worst_coeff <= 1e-12, "P=%d %s %s: trust ratios differ by %g", P, what, clipped ? "clipped" : "default",
          worst_coeff);
    check(bad_padding == 0, "P=%d %s: %lld padding elements moved", P, what, (long long)bad_padding);
    for (int r = 0; r < P; r++) {
        ds_optim_free(ranks[r].o);
        ds_tensor_release(ranks[r].master);
    }
    pthread_barrier_destroy(&w.barrier);
    ds_optim_free(ref);
    for (int k = 0; k < LAMB_NP; k++) ds_tensor_release(ps[k]);
}

static int failing_sum(double *values, int n, void *ud) {
    (void)values;
    *(int *)ud = n;
    return ds_fail(DS_ERR_STATE, "comm: all_reduce timed out"), -1;
}

static void test_lamb_errors(void) {
    int64_t n = 10;
    ds_tensor *p = vector(n), *small = vector(3);
    ds_optim *o = ds_optim_new(DS_OPTIM_LAMB);
    ds_optim_hparams h = lamb_hparams(false);
    check(ds_optim_add_group(o, 1, &p, &h) == 0 && ds_optim_add_group(o, 1, &small, &h) == 0, "add_group: %s",
          ds_error_message());
    const int64_t falls[4] = { 0, 6, 4, 10 }, short_end[3] = { 0, 4, 9 }, late[3] = { 1, 4, 10 };
    const int64_t ok[4] = { 0, 0, 4, 10 };
    check_error(ds_optim_set_segments(o, 0, 3, falls) != 0,
                "optim.Lamb: group 1: segment offsets must not decrease, got 4 after 6 (offset 2)");
    check_error(ds_optim_set_segments(o, 1, 2, short_end) != 0,
                "optim.Lamb: group 2: segments end at 9, the group has 3 elements");
    check_error(ds_optim_set_segments(o, 0, 2, short_end) != 0,
                "optim.Lamb: group 1: segments end at 9, the group has 10 elements");
    check_error(ds_optim_set_segments(o, 0, 2, late) != 0, "optim.Lamb: group 1: segments must start at 0, got 1");
    check_error(ds_optim_set_segments(o, 0, -1, ok) != 0, "optim.Lamb: group 1: segments need nseg >= 0");
    check_error(ds_optim_set_segments(o, 2, 3, ok) != 0, "optim.Lamb: set_segments: group 3 out of range (2 groups)");
    check(o->groups[0].n_seg == 1, "a refused cut leaves the old one: %d pieces", o->groups[0].n_seg);
    check(ds_optim_set_segments(o, 0, 3, ok) == 0 && o->groups[0].n_seg == 3, "an empty first piece: %s",
          ds_error_message());
    /* a failed sum fails the step, names its cause, and counts no step */
    int got = -1;
    for (int64_t i = 0; i < n; i++) ds_tensor_set(p->grad, i, 1);
    check_error(ds_optim_step_shared(o, 0, &h, 1, NULL, failing_sum, &got) != 0, "comm: all_reduce timed out");
    check(got == 6 && o->groups[0].step == 0, "the sum got %d values (want 6); step %lld", got,
          (long long)o->groups[0].step);
    ds_optim_free(o);
    ds_tensor_release(p);
    ds_tensor_release(small);
    /* other kinds never call the sum */
    ds_tensor *q = vector(4);
    ds_optim *adam = ds_optim_new(DS_OPTIM_ADAM);
    ds_optim_hparams ha = adam_hparams();
    got = -1;
    check(ds_optim_add_group(adam, 1, &q, &ha) == 0 &&
          ds_optim_step_shared(adam, 0, &ha, 1, NULL, failing_sum, &got) == 0 && got == -1, "adam step_shared: %s",
          ds_error_message());
    ds_optim_free(adam);
    ds_tensor_release(q);
}

/* A 16-bit copy written in the update's pass holds the updated parameters
 * as a copy casts them, bf16 and f16, over the threaded path and a short
 * last block; an f32 copy is refused, and Lamb takes none. */
static void test_shadow(void) {
    int64_t n = 40007;
    const ds_dtype halves[2] = { DS_BF16, DS_F16 };
    ds_optim_hparams h = adam_hparams();
    for (int k = 0; k < 2; k++) {
        const char *name = ds_dtype_name(halves[k]);
        ds_tensor *p = ds_randn(1, &n, DS_F32, DS_CPU_DEVICE, NULL), *g = ds_randn(1, &n, DS_F32, DS_CPU_DEVICE, NULL);
        ds_tensor *m = ds_tensor_full(1, &n, DS_F32, DS_CPU_DEVICE, 0);
        ds_tensor *v = ds_tensor_full(1, &n, DS_F32, DS_CPU_DEVICE, 0);
        ds_tensor *shadow = ds_tensor_full(1, &n, halves[k], DS_CPU_DEVICE, 0);
        check(ds_optim_apply(DS_OPTIM_ADAMW, &h, 1, true, p, g, m, v, 0.37, shadow) == 0, "apply with a %s copy: %s",
              name, ds_error_message());
        ds_tensor *cast = ds_to_dtype(p, halves[k]);
        check(cast && memcmp(ds_tensor_data(cast), ds_tensor_data(shadow), (size_t)n * 2) == 0,
              "the %s copy is the updated parameters cast", name);
        if (k == 0)
            check_error(ds_optim_apply(DS_OPTIM_ADAMW, &h, 2, false, p, g, m, v, 1, g) != 0,
                        "optim.AdamW: apply: the 16-bit copy is f32 [40007]; expected a contiguous 1-D bf16 or f16");
        ds_tensor *all[] = { p, g, m, v, shadow, cast };
        for (int i = 0; i < 6; i++) ds_tensor_release(all[i]);
    }
    int64_t four = 4;
    ds_tensor *q = vector(4), *shadow = ds_tensor_full(1, &four, DS_BF16, DS_CPU_DEVICE, 0);
    ds_optim *lamb = ds_optim_new(DS_OPTIM_LAMB);
    check(ds_optim_add_group(lamb, 1, &q, &h) == 0, "lamb add_group: %s", ds_error_message());
    check_error(ds_optim_step_shared(lamb, 0, &h, 1, shadow, NULL, NULL) != 0,
                "optim.Lamb: group 1: Lamb's step takes neither a gradient scale (1) nor a 16-bit copy");
    ds_optim_free(lamb);
    ds_tensor_release(q);
    ds_tensor_release(shadow);
}

/* The 1-bit kernels: signs packed 8 to a byte (0 and -0 positive), the
 * error what scale times the sign misses, and unpacking gives scale times
 * the signs back (accumulated when asked). */
static void test_onebit_kernels(void) {
    const ds_kernels_optim *k = ds_cpu_kernels.optim;
    float xs[16] = { 1, -2, 0, -0.0f, 3, -1, 0.5f, -0.5f, -4, 4, -3, 3, 2, -2, 1, -1 };
    int64_t n = 16, nb = 2;
    ds_tensor *x = ds_tensor_new(1, &n, DS_F32, DS_CPU_DEVICE), *err = ds_tensor_full(1, &n, DS_F32, DS_CPU_DEVICE, 0);
    ds_tensor *bits = ds_tensor_new(1, &nb, DS_U8, DS_CPU_DEVICE), *out = ds_tensor_full(1, &n, DS_F32, DS_CPU_DEVICE, 1);
    for (int i = 0; i < 16; i++) ds_tensor_set(x, i, xs[i]);
    check(k->onebit_pack(ds_tensor_kview(x), ds_tensor_kview(err), ds_tensor_kview(bits), 2) == 0, "onebit_pack");
    const uint8_t *b = ds_tensor_data(bits);
    check(b[0] == 0x5d && b[1] == 0x5a, "onebit_pack: bytes %02x %02x, expected 5d 5a", b[0], b[1]);
    for (int i = 0; i < 16; i++) {
        double sign = xs[i] < 0 ? -1 : 1;
        check(ds_tensor_get(err, i) == xs[i] - 2 * sign, "onebit_pack: err[%d] = %g", i, ds_tensor_get(err, i));
    }
    check(k->onebit_unpack(ds_tensor_kview(out), ds_tensor_kview(bits), 0.5, 1) == 0, "onebit_unpack");
    for (int i = 0; i < 16; i++)
        check(ds_tensor_get(out, i) == 1 + (xs[i] < 0 ? -0.5 : 0.5), "onebit_unpack: out[%d] = %g", i,
              ds_tensor_get(out, i));
    int64_t seven = 7;
    ds_tensor *odd = ds_tensor_full(1, &seven, DS_F32, DS_CPU_DEVICE, 0);
    check(k->onebit_pack(ds_tensor_kview(odd), ds_tensor_kview(odd), ds_tensor_kview(bits), 1) != 0 &&
          strstr(ds_kernel_error(), "multiple of 8"), "onebit_pack: 7 elements refused");
    ds_tensor *all[] = { x, err, bits, out, odd };
    for (int i = 0; i < 5; i++) ds_tensor_release(all[i]);
}

/* One fused update of n elements by each CPU instruction set. */
enum { ISA_ADAM, ISA_ADAMW, ISA_SGD, ISA_ADAGRAD, ISA_LION, ISA_KINDS };
static const char *const isa_kind_names[ISA_KINDS] = { "adam", "adamw", "sgd", "adagrad", "lion" };

typedef struct {
    float *p, *g, *m, *v;
    uint16_t *shadow;
} isa_bufs;

static const ds_adam_params isa_adam = { .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01,
                                         .grad_scale = 0.37, .decay = 1 - 1e-3 * 0.01, .step_size = 1e-3 / 0.1,
                                         .sqrt_bc2 = 0.0316227766 };
static const ds_sgd_params isa_sgd = { .lr = 0.05, .weight_decay = 0.01, .momentum = 0.9, .dampening = 0.1,
                                       .grad_scale = 0.37, .nesterov = 1 };
static const ds_adagrad_params isa_adagrad = { .clr = 0.05, .eps = 1e-10, .weight_decay = 0.01, .grad_scale = 0.37 };
static const ds_lion_params isa_lion = { .lr = 1e-4, .beta1 = 0.9, .beta2 = 0.99, .decay = 1 - 1e-5, .grad_scale = 0.37 };

/* The scalar loop: the gradient scaled, the element's update, its bf16 copy. */
static void isa_reference(int kind, isa_bufs b, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (kind == ISA_ADAM || kind == ISA_ADAMW) {
            const ds_adam_params *h = &isa_adam;
            ds_adam_elem(&b.p[i], &b.m[i], &b.v[i], b.g[i] * (float)h->grad_scale, (float)h->beta1, (float)h->beta2,
                         (float)h->eps, (float)h->weight_decay, (float)h->decay, (float)h->step_size,
                         (float)h->sqrt_bc2, kind == ISA_ADAMW);
        } else if (kind == ISA_SGD) {
            const ds_sgd_params *h = &isa_sgd;
            ds_sgd_momentum_elem(&b.p[i], &b.m[i], b.g[i] * (float)h->grad_scale, (float)h->lr,
                                 (float)h->weight_decay, (float)h->momentum, (float)h->dampening, h->nesterov, 0);
        } else if (kind == ISA_ADAGRAD) {
            const ds_adagrad_params *h = &isa_adagrad;
            ds_adagrad_elem(&b.p[i], &b.m[i], b.g[i] * (float)h->grad_scale, (float)h->clr, (float)h->eps,
                            (float)h->weight_decay);
        } else {
            const ds_lion_params *h = &isa_lion;
            ds_lion_elem(&b.p[i], &b.m[i], b.g[i] * (float)h->grad_scale, (float)h->lr, (float)h->beta1,
                         (float)h->beta2, (float)h->decay);
        }
        b.shadow[i] = ds_optim_half(b.p[i], DS_BF16);
    }
}

static ds_kview isa_view(void *data, ds_dtype t, int64_t n) {
    ds_kview k = { .data = data, .dtype = t, .ndim = 1 };
    k.shape[0] = n;
    k.stride[0] = 1;
    return k;
}

static int isa_kernel(int kind, isa_bufs b, int64_t n) {
    const ds_kernels_optim *k = ds_cpu_kernels.optim;
    ds_kview p = isa_view(b.p, DS_F32, n), g = isa_view(b.g, DS_F32, n), m = isa_view(b.m, DS_F32, n);
    ds_kview v = isa_view(b.v, DS_F32, n), s = isa_view(b.shadow, DS_BF16, n);
    if (kind == ISA_ADAM || kind == ISA_ADAMW) {
        ds_adam_params h = isa_adam;
        h.decoupled = kind == ISA_ADAMW;
        return k->adam(p, g, m, v, s, &h);
    }
    if (kind == ISA_SGD) return k->sgd(p, g, m, s, &isa_sgd);
    if (kind == ISA_ADAGRAD) return k->adagrad(p, g, m, s, &isa_adagrad);
    return k->lion(p, g, m, s, &isa_lion);
}

/* n elements of each buffer: p and g normal with a few zeros and huge
 * values, m signed, v (a second moment, or Adagrad's sum) positive. */
static isa_bufs isa_fill(int64_t n, uint64_t seed) {
    isa_bufs b = { malloc(4 * (size_t)n), malloc(4 * (size_t)n), malloc(4 * (size_t)n), malloc(4 * (size_t)n),
                   malloc(2 * (size_t)n) };
    uint64_t x = seed;
    for (int64_t i = 0; i < n; i++) {
        float r[4];
        for (int k = 0; k < 4; k++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            r[k] = (float)((double)(x >> 11) / 9007199254740992.0 * 2 - 1);
        }
        b.p[i] = i % 97 == 0 ? 0 : i % 89 == 0 ? 3e30f * r[0] : r[0];
        b.g[i] = i % 83 == 0 ? 0 : r[1] * (i % 7 == 0 ? 1e-6f : 1);
        b.m[i] = r[2] * 0.1f;
        b.v[i] = r[3] * r[3] * 0.01f;
    }
    return b;
}

static void isa_free(isa_bufs b) {
    free(b.p);
    free(b.g);
    free(b.m);
    free(b.v);
    free(b.shadow);
}

static bool isa_same(isa_bufs a, isa_bufs b, int64_t n) {
    return memcmp(a.p, b.p, 4 * (size_t)n) == 0 && memcmp(a.m, b.m, 4 * (size_t)n) == 0 &&
           memcmp(a.v, b.v, 4 * (size_t)n) == 0 && memcmp(a.shadow, b.shadow, 2 * (size_t)n) == 0;
}

/* Every instruction set this CPU runs writes the scalar loop's bits, over
 * the threaded path with a short last block (40007) and a short buffer
 * (13); one the CPU lacks, or an unknown name, is refused. */
static void test_isa_agree(void) {
    const char *isas[] = { "avx512", "avx2", "sse2" };
    const char *best = ds_cpu_optim_isa();
    int ran = 0;
    for (int s = 0; s < 3; s++) {
        if (ds_cpu_optim_use(isas[s]) != 0) {
            check(strstr(ds_kernel_error(), "this CPU has no") != NULL, "%s refused: %s", isas[s], ds_kernel_error());
            continue;
        }
        ran++;
        for (int kind = 0; kind < ISA_KINDS; kind++) {
            const int64_t sizes[2] = { 40007, 13 };
            for (int z = 0; z < 2; z++) {
                int64_t n = sizes[z];
                isa_bufs want = isa_fill(n, 17 + (uint64_t)kind), got = isa_fill(n, 17 + (uint64_t)kind);
                isa_reference(kind, want, n);
                check(isa_kernel(kind, got, n) == 0, "%s %s: %s", isas[s], isa_kind_names[kind], ds_kernel_error());
                check(isa_same(want, got, n), "%s %s over %lld elements: the scalar loop's bits", isas[s],
                      isa_kind_names[kind], (long long)n);
                isa_free(want);
                isa_free(got);
            }
        }
    }
    check(ran >= 1 && strcmp(ds_cpu_optim_isa(), "sse2") == 0, "sse2 runs everywhere");
    check(ds_cpu_optim_use("neon") != 0 && strstr(ds_kernel_error(), "unknown instruction set \"neon\""),
          "an unknown instruction set is refused: %s", ds_kernel_error());
    check(ds_cpu_optim_use(best) == 0, "back to %s", best);
}

int main(void) {
    test_reseat();
    test_adopt();
    test_adam_step();
    test_wrong_grad();
    test_devices();
    test_lamb_segments();
    for (int P = 2; P <= LAMB_MAX_P; P++)
        for (int padded = 0; padded <= 1; padded++)
            for (int clipped = 0; clipped <= 1; clipped++) test_lamb_partitioned(P, padded, clipped);
    test_lamb_errors();
    test_onebit_kernels();
    test_isa_agree();
    test_shadow();
    return check_summary("test_optim");
}
