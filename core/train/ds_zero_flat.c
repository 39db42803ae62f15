/* The flat layout: fp32 stage 0, plain data parallel. The optimizer steps
 * the model's own parameters; each parameter's gradient is its view into
 * the optimizer's flat gradients, which the buckets all-reduce in place. */
#include "ds_zero_impl.h"
#include "ds_error.h"
#include "ds_ops.h"

#include <math.h>
#include <stdlib.h>

/* Each parameter's gradient is its view into the optimizer's flat
 * gradients; the step reads those. */
static int build(ds_zero *z, ds_optim *o) {
    if (z->c.stage != 0 || !o)
        return ds_fail(DS_ERR_ARG, "step engine: without masters only stage 0 runs, over its optimizer"), -1;
    z->parts = 1;
    for (int i = 0; i < z->n; i++) {
        zparam *q = &z->p[i];
        ds_optim_group *g = q->group < o->n_groups ? &o->groups[q->group] : NULL;
        int k = 0;
        while (g && k < g->n_params && g->params[k] != q->param) k++;
        if (!g || k == g->n_params)
            return ds_fail(DS_ERR_ARG, "step engine: parameter %d is not in group %d of the optimizer", i + 1,
                           q->group + 1), -1;
        q->shard = q->numel;
        q->offset = g->offsets[k];
        q->view = g->grads[k];
        ds_tensor_retain(q->view);
    }
    z->n_grads = o->n_groups;
    z->grads = calloc((size_t)o->n_groups, sizeof *z->grads);
    if (!z->grads) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    for (int g = 0; g < o->n_groups; g++) z->grads[g] = o->groups[g].flat_grads;
    return 0;
}

static void free_layout(ds_zero *z) {
    for (int i = 0; z->p && i < z->n; i++) ds_tensor_release(z->p[i].view);
    free(z->grads);
}

/* One rank has nothing to reduce with. */
static bool reduces(const ds_zero *z, bool boundary) { return boundary && z->world > 1; }

/* Before a backward. In a fresh window each gradient that is its view is
 * dropped (the view keeps its zeros): autograd takes the first gradient
 * as it comes, not as an add per parameter, and add_grads adds it to the
 * zeros, the same sums. Later in a window autograd adds into the views,
 * in the order it always has. Before a reduced backward a gradient
 * dropped (zeros) or replaced by another tensor (copied in) goes back to
 * its view, where the bucket reads it. */
static int arm(ds_zero *z, bool reduce) {
    for (int i = 0; i < z->n; i++) {
        zparam *q = &z->p[i];
        ds_tensor *g = q->param->grad;
        if (g == q->view && z->fresh) {
            q->param->grad = NULL;
            ds_tensor_release(g);
        }
        if (g == q->view || !reduce) continue;
        if (g ? ds_copy_(q->view, g) : ds_fill_(q->view, 0)) return -1;
        ds_tensor_retain(q->view);
        ds_tensor_release(q->param->grad);
        q->param->grad = q->view;
    }
    return 0;
}

/* Parameters first .. first + count - 1: each gradient not in its view
 * added into it, one kernel, and the view its gradient again. */
static int add_grads(ds_zero *z, int first, int count) {
    ds_tensor *held[count];
    zpieces c = { 0 };
    int rc = 0;
    for (int i = first; i < first + count; i++) {
        zparam *q = &z->p[i];
        ds_tensor *g = q->param->grad;
        held[i - first] = g && g != q->view && rc == 0 ? ds_contiguous(g) : NULL;
        if (held[i - first]) rc = ds_zero_piece(&c, q->view, 0, held[i - first], 0, q->numel);
        else if (g && g != q->view) rc = -1;
    }
    rc = ds_zero_pieces_run(&c, rc, true);
    for (int i = first; i < first + count; i++) {
        zparam *q = &z->p[i];
        ds_tensor_release(held[i - first]);
        if (rc || q->param->grad == q->view) continue;
        ds_tensor_release(q->param->grad);
        ds_tensor_retain(q->view);
        q->param->grad = q->view;
    }
    return rc;
}

/* After a backward: the gradients no bucket took. */
static int after(ds_zero *z) {
    z->fresh = false;
    return add_grads(z, 0, z->n);
}

/* The bucket's view of the flat gradients, all-reduced in place after
 * DeepSpeed's pre-scaling. */
static ds_comm_work *launch(ds_zero *z, zbucket *b, ds_tensor **buf) {
    if (add_grads(z, b->first, b->count)) return NULL;
    ds_tensor *v = ds_zero_elements(z->optim->groups[b->group].flat_grads, b->offset, b->width);
    if (!v) return NULL;
    double f = z->c.prescale ? 1.0 / z->world : z->c.predivide != 1 ? 1.0 / z->c.predivide : 1;
    ds_comm_work *w = f == 1 || ds_zero_scale(v, f) == 0 ? ds_comm_all_reduce(v, DS_COMM_SUM, z->c.group) : NULL;
    if (!w) { ds_tensor_release(v); return NULL; }
    *buf = v;
    return w;
}

/* DeepSpeed's post-scaling, where pre-scaling did not average. */
static int land(ds_zero *z, zflight *f) {
    bool post = !z->c.prescale && z->c.predivide != z->world;
    return post ? ds_zero_scale(f->buf, z->c.predivide / z->world) : 0;
}

static const char *collective(const ds_zero *z) { (void)z; return "all_reduce"; }

/* The flat gradients, every view in them at once. */
static int scale(ds_zero *z, double f) { return ds_zero_scale_all(z->n_grads, z->grads, f); }

static ds_tensor *param_grad(ds_zero *z, int i) {
    ds_tensor_retain(z->p[i].view);
    return z->p[i].view;
}

/* The reduced gradients are the same on every rank, so clipping needs no
 * agreement over them (torch's clip_grad_norm_), only over a pipeline's
 * stages; no overflow check skips the step. */
static int step(ds_zero *z, const ds_optim_hparams *h, double loss_scale, double clip, bool check_overflow,
                ds_zero_result *out) {
    (void)loss_scale;
    (void)check_overflow;
    double coef = 1, sq = 0, bad = 0;
    int rc = 0;
    if (clip > 0) {
        rc = ds_zero_grad_stats(z, false, &sq, &bad);
        double total = sqrt(sq), c = clip / (total + 1e-6);
        if (c < 1) coef = c;
        out->grad_norm = total;
    }
    if (rc == 0) rc = ds_zero_optimizer_step(z, h, z->n_grads, z->grads, coef, NULL);
    return rc == 0 ? ds_zero_zero_grads(z) : rc;
}

static int zero_grad(ds_zero *z) {
    z->fresh = true;
    return ds_optim_zero_grad(z->optim);
}

const zlayout ds_zero_flat_layout = {
    .holds = DS_ZERO_HOLDS_PARAMS, .build = build, .free = free_layout, .reduces = reduces, .arm = arm,
    .after = after, .launch = launch, .land = land, .collective = collective, .scale = scale, .param_grad = param_grad,
    .step = step, .zero_grad = zero_grad,
};
