#include "ds_ddp.h"
#include "ds_autograd.h"
#include "ds_error.h"
#include "ds_ops.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    ds_ddp *d;
    ds_tensor *param;
    ds_tensor *view;        /* where the parameter's gradient lives */
    int bucket;
    bool done;              /* complete in the armed backward */
} slot;

typedef struct {
    ds_tensor *flat;
    int first, count;       /* its parameters */
    int pending;            /* of them not complete yet */
} bucket;

struct ds_ddp {
    int n, nb;
    slot *slots;
    bucket *buckets;
    int n_owned;
    ds_tensor **owned;      /* gradient buffers made here */
    bool armed;
    int next;               /* the next bucket to launch */
    int leaves_after;       /* gradients completed after the first launch */
    ds_ddp_launch_fn launch;
    ds_ddp_poll_fn poll;
    void *ud;
};

/* A gradient that can stay where it is: contiguous, the parameter's dtype,
 * shape and device, not part of a graph. */
static bool usable(const ds_tensor *p, const ds_tensor *g) {
    return g && !g->grad_fn && g->dtype == p->dtype && ds_tensor_same_shape(g, p) && ds_tensor_is_contiguous(g) &&
           ds_device_equal(ds_tensor_device(g), ds_tensor_device(p));
}

/* The gradient of s's parameter is (a view of) its slot. */
static bool in_slot(const slot *s) {
    const ds_tensor *g = s->param->grad;
    return g == s->view ||
           (usable(s->param, g) && g->storage == s->view->storage && g->offset == s->view->offset);
}

static void set_grad(ds_tensor *p, ds_tensor *g) {
    ds_tensor_retain(g);
    ds_tensor_release(p->grad);
    p->grad = g;
}

static ds_tensor *contiguous_view(ds_tensor *base, const ds_tensor *like, int64_t offset) {
    int64_t stride[DS_MAX_DIMS], s = 1;
    for (int i = like->ndim - 1; i >= 0; i--) {
        stride[i] = s;
        s *= like->shape[i];
    }
    return ds_tensor_view_of(base, like->ndim, like->shape, stride, offset);
}

/* Parameters i .. j-1 (no usable gradient, one dtype and device) get views
 * into one new buffer, holding their old gradient or zeros. */
static int make_buffer(ds_ddp *d, int i, int j) {
    ds_tensor *p0 = d->slots[i].param;
    int64_t total = 0;
    for (int k = i; k < j; k++) total += ds_tensor_numel(d->slots[k].param);
    ds_tensor *buf = ds_tensor_full(1, &total, p0->dtype, ds_tensor_device(p0), 0.0);
    if (!buf) return -1;
    ds_tensor_set_category(buf, DS_MEM_GRAD);
    d->owned[d->n_owned++] = buf;
    int64_t off = 0;
    for (int k = i; k < j; k++) {
        slot *s = &d->slots[k];
        if (!(s->view = contiguous_view(buf, s->param, off))) return -1;
        if (s->param->grad && ds_copy_(s->view, s->param->grad)) return -1;
        set_grad(s->param, s->view);
        off += ds_tensor_numel(s->param);
    }
    return 0;
}

static int place_gradients(ds_ddp *d) {
    for (int i = 0; i < d->n;) {
        ds_tensor *p = d->slots[i].param;
        if (usable(p, p->grad)) {
            ds_tensor_retain(p->grad);
            d->slots[i++].view = p->grad;
            continue;
        }
        int j = i + 1;
        while (j < d->n) {
            ds_tensor *q = d->slots[j].param;
            if (usable(q, q->grad) || q->dtype != p->dtype ||
                !ds_device_equal(ds_tensor_device(q), ds_tensor_device(p)))
                break;
            j++;
        }
        if (make_buffer(d, i, j)) return -1;
        i = j;
    }
    return 0;
}

/* Last parameter first; a bucket grows downwards while the next gradient
 * ends where it starts and it holds fewer than bucket_size elements. */
static int make_buckets(ds_ddp *d, int64_t bucket_size) {
    int64_t lo = 0, hi = 0;
    for (int i = d->n - 1; i >= 0; i--) {
        ds_tensor *g = d->slots[i].view;
        int64_t m = ds_tensor_numel(g);
        bucket *b = d->nb ? &d->buckets[d->nb - 1] : NULL;
        ds_tensor *top = b ? d->slots[b->first].view : NULL;
        if (b && g->storage == top->storage && g->offset + m == lo && hi - lo < bucket_size) {
            b->first = i;
            b->count++;
            lo = g->offset;
        } else {
            if (b && !(b->flat = ds_tensor_view_of(top, 1, (int64_t[]){ hi - lo }, (int64_t[]){ 1 }, lo)))
                return -1;
            b = &d->buckets[d->nb++];
            b->first = i;
            b->count = 1;
            lo = g->offset;
            hi = lo + m;
        }
        d->slots[i].bucket = d->nb - 1;
    }
    bucket *b = &d->buckets[d->nb - 1];
    b->flat = ds_tensor_view_of(d->slots[b->first].view, 1, (int64_t[]){ hi - lo }, (int64_t[]){ 1 }, lo);
    return b->flat ? 0 : -1;
}

static int launch_ready(ds_ddp *d) {
    while (d->next < d->nb && d->buckets[d->next].pending == 0) {
        int b = d->next++;
        if (d->launch && d->launch(b, d->buckets[b].flat, d->ud)) return -1;
    }
    return 0;
}

static int on_gradient(ds_tensor *leaf, void *ud) {
    slot *s = ud;
    ds_ddp *d = s->d;
    if (!d->armed || s->done) return 0;
    s->done = true;
    if (d->next > 0) d->leaves_after++;
    d->buckets[s->bucket].pending--;
    if (launch_ready(d)) return -1;
    return d->poll ? d->poll(d->ud) : 0;
}

ds_ddp *ds_ddp_new(int n, ds_tensor *const *params, int64_t bucket_size) {
    if (n < 1) return ds_fail(DS_ERR_ARG, "ddp: no parameters");
    for (int i = 0; i < n; i++) {
        ds_tensor *p = params[i];
        if (!p->requires_grad || p->grad_fn)
            return ds_fail(DS_ERR_ARG, "ddp: parameter %d is not a leaf that requires grad", i + 1);
        for (int j = 0; j < i; j++)
            if (params[j] == p)
                return ds_fail(DS_ERR_ARG, "ddp: parameter %d is the same tensor as parameter %d", i + 1, j + 1);
    }
    ds_ddp *d = calloc(1, sizeof *d);
    if (!d) return ds_fail(DS_ERR_NOMEM, "ddp: out of memory");
    d->n = n;
    d->slots = calloc((size_t)n, sizeof *d->slots);
    d->buckets = calloc((size_t)n, sizeof *d->buckets);
    d->owned = calloc((size_t)n, sizeof *d->owned);
    if (!d->slots || !d->buckets || !d->owned) {
        ds_ddp_free(d);
        return ds_fail(DS_ERR_NOMEM, "ddp: out of memory");
    }
    for (int i = 0; i < n; i++) {
        ds_tensor_retain(params[i]);
        d->slots[i] = (slot){ .d = d, .param = params[i] };
    }
    if (place_gradients(d) || make_buckets(d, bucket_size)) {
        ds_ddp_free(d);
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        if (ds_autograd_set_leaf_hook(params[i], on_gradient, &d->slots[i])) {
            ds_ddp_free(d);
            return NULL;
        }
    }
    return d;
}

void ds_ddp_free(ds_ddp *d) {
    if (!d) return;
    for (int i = 0; d->slots && i < d->n; i++) {
        slot *s = &d->slots[i];
        if (!s->param) continue;
        ds_autograd_set_leaf_hook(s->param, NULL, s);
        ds_tensor_release(s->view);
        ds_tensor_release(s->param);
    }
    for (int b = 0; d->buckets && b < d->nb; b++) ds_tensor_release(d->buckets[b].flat);
    for (int k = 0; k < d->n_owned; k++) ds_tensor_release(d->owned[k]);
    free(d->slots);
    free(d->buckets);
    free(d->owned);
    free(d);
}

int ds_ddp_n_buckets(const ds_ddp *d) { return d->nb; }

ds_tensor *ds_ddp_bucket(ds_ddp *d, int b) {
    if (b < 0 || b >= d->nb) return ds_fail(DS_ERR_ARG, "ddp: bucket %d out of range [0, %d)", b, d->nb);
    ds_tensor_retain(d->buckets[b].flat);
    return d->buckets[b].flat;
}

void ds_ddp_bucket_params(const ds_ddp *d, int b, int *first, int *count) {
    *first = d->buckets[b].first;
    *count = d->buckets[b].count;
}

int ds_ddp_arm(ds_ddp *d, ds_ddp_launch_fn launch, ds_ddp_poll_fn poll, void *ud) {
    if (d->armed) return ds_fail(DS_ERR_STATE, "ddp: already armed for a backward"), -1;
    for (int i = 0; i < d->n; i++) {
        slot *s = &d->slots[i];
        if (in_slot(s)) continue;
        if (s->param->grad ? ds_copy_(s->view, s->param->grad) : ds_fill_(s->view, 0)) return -1;
        set_grad(s->param, s->view);
    }
    for (int i = 0; i < d->n; i++) d->slots[i].done = false;
    for (int b = 0; b < d->nb; b++) d->buckets[b].pending = d->buckets[b].count;
    d->next = 0;
    d->leaves_after = 0;
    d->launch = launch;
    d->poll = poll;
    d->ud = ud;
    d->armed = true;
    return 0;
}

int ds_ddp_flush(ds_ddp *d, ds_ddp_counts *counts) {
    if (!d->armed) return ds_fail(DS_ERR_STATE, "ddp: flush without arm"), -1;
    if (counts) *counts = (ds_ddp_counts){ d->next, d->leaves_after };
    for (int b = d->next; b < d->nb; b++) d->buckets[b].pending = 0;
    int rc = launch_ready(d);
    ds_ddp_disarm(d);
    return rc;
}

void ds_ddp_disarm(ds_ddp *d) {
    d->armed = false;
    d->launch = NULL;
    d->poll = NULL;
    d->ud = NULL;
}
