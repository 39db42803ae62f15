#include "ds_optim.h"
#include "ds_error.h"
#include "ds_ops.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const struct {
    const char *name;
    int n_state;
    const char *state[DS_OPTIM_MAX_STATE];
} kinds[DS_NOPTIM] = {
    [DS_OPTIM_SGD] = { "SGD", 1, { "momentum_buffer" } },
    [DS_OPTIM_ADAM] = { "Adam", 2, { "exp_avg", "exp_avg_sq" } },
    [DS_OPTIM_ADAMW] = { "AdamW", 2, { "exp_avg", "exp_avg_sq" } },
    [DS_OPTIM_ADAGRAD] = { "Adagrad", 1, { "sum" } },
    [DS_OPTIM_LAMB] = { "Lamb", 2, { "exp_avg", "exp_avg_sq" } },
    [DS_OPTIM_LION] = { "Lion", 1, { "exp_avg" } },
};

const char *ds_optim_name(ds_optim_kind k) { return kinds[k].name; }

int ds_optim_parse(const char *name) {
    for (int k = 0; k < DS_NOPTIM; k++)
        if (strcmp(name, kinds[k].name) == 0) return k;
    return -1;
}

int ds_optim_n_state(ds_optim_kind k) { return kinds[k].n_state; }

const char *ds_optim_state_name(ds_optim_kind k, int slot) { return kinds[k].state[slot]; }

int ds_optim_state_slot(ds_optim_kind k, const char *name) {
    for (int s = 0; s < kinds[k].n_state; s++)
        if (strcmp(name, kinds[k].state[s]) == 0) return s;
    return -1;
}

static bool uses_betas(ds_optim_kind k) { return k != DS_OPTIM_SGD && k != DS_OPTIM_ADAGRAD; }

/* ---- hyperparameters ---- */

static int bad(ds_optim_kind k, int g, const char *what, double v) {
    if (g < 0) ds_fail(DS_ERR_ARG, "optim.%s: %s, got %g", kinds[k].name, what, v);
    else ds_fail(DS_ERR_ARG, "optim.%s: group %d: %s, got %g", kinds[k].name, g + 1, what, v);
    return -1;
}

int ds_optim_check_hparams(ds_optim_kind k, const ds_optim_hparams *h, int g) {
    /* written as !(ok) so that NaN fails too; the kernels take lr as a
     * float, where past FLT_MAX it is inf */
    if (!(h->lr >= 0 && h->lr <= FLT_MAX))
        return bad(k, g, "lr must be >= 0 and finite in fp32 (at most 3.4e38)", h->lr);
    if (!(h->weight_decay >= 0)) return bad(k, g, "weight_decay must be >= 0", h->weight_decay);
    if (uses_betas(k)) {
        if (!(h->beta1 >= 0 && h->beta1 < 1)) return bad(k, g, "betas[1] must be in [0, 1)", h->beta1);
        if (!(h->beta2 >= 0 && h->beta2 < 1)) return bad(k, g, "betas[2] must be in [0, 1)", h->beta2);
    }
    if (k != DS_OPTIM_SGD && k != DS_OPTIM_LION && !(h->eps >= 0)) return bad(k, g, "eps must be >= 0", h->eps);
    if (k == DS_OPTIM_SGD) {
        if (!(h->momentum >= 0)) return bad(k, g, "momentum must be >= 0", h->momentum);
        if (!isfinite(h->dampening)) return bad(k, g, "dampening must be finite", h->dampening);
        if (h->nesterov && !(h->momentum > 0 && h->dampening == 0))
            return bad(k, g, "nesterov needs momentum > 0 and dampening 0; momentum", h->momentum);
    }
    if (k == DS_OPTIM_ADAGRAD) {
        if (!(h->lr_decay >= 0)) return bad(k, g, "lr_decay must be >= 0", h->lr_decay);
        if (!(h->initial_accumulator_value >= 0))
            return bad(k, g, "initial_accumulator_value must be >= 0", h->initial_accumulator_value);
    }
    if (k == DS_OPTIM_LAMB) {
        if (!(h->min_coeff >= 0)) return bad(k, g, "min_coeff must be >= 0", h->min_coeff);
        if (!(h->max_coeff >= h->min_coeff)) return bad(k, g, "max_coeff must be >= min_coeff", h->max_coeff);
    }
    return 0;
}

/* ---- groups ---- */

ds_optim *ds_optim_new(ds_optim_kind kind) {
    ds_optim *o = calloc(1, sizeof *o);
    if (!o) return ds_fail(DS_ERR_NOMEM, "out of memory for an optimizer");
    o->kind = kind;
    return o;
}

static void group_free(ds_optim_group *gr) {
    for (int i = 0; i < gr->n_params; i++) {
        if (gr->params) ds_tensor_release(gr->params[i]);
        if (gr->grads) ds_tensor_release(gr->grads[i]);
    }
    free(gr->params);
    free(gr->grads);
    free(gr->offsets);
    free(gr->seg);
    free(gr->lamb_coeffs);
    ds_tensor_release(gr->flat_params);
    ds_tensor_release(gr->flat_grads);
    for (int s = 0; s < DS_OPTIM_MAX_STATE; s++) ds_tensor_release(gr->state[s]);
}

void ds_optim_free(ds_optim *o) {
    if (!o) return;
    for (int g = 0; g < o->n_groups; g++) group_free(&o->groups[g]);
    free(o->groups);
    free(o);
}

static ds_tensor *flat_buffer(int64_t n, ds_device dev, ds_mem_category cat, double fill) {
    ds_tensor *t = ds_tensor_full(1, &n, DS_F32, dev, fill);
    if (t) ds_tensor_set_category(t, cat);
    return t;
}

/* A tensor that is the whole of its storage, f32 on dev, is already a flat
 * buffer: the group adopts it (no second copy, even for a moment: the step
 * engine's masters and master gradients). NULL when it is not one. */
static ds_tensor *adopt(ds_tensor *t, ds_device dev, ds_mem_category cat) {
    int64_t n = t ? ds_tensor_numel(t) : 0, one = 1;
    if (!t || t->dtype != DS_F32 || t->offset != 0 || !ds_tensor_is_contiguous(t) ||
        !ds_device_equal(ds_tensor_device(t), dev) || t->storage->nbytes != (size_t)n * sizeof(float))
        return NULL;
    ds_tensor *flat = ds_tensor_view_of(t, 1, &n, &one, 0);
    if (flat) ds_tensor_set_category(flat, cat);
    return flat;
}

/* A lone parameter filling its storage is stepped where it is, its
 * gradient too when that fills its own; otherwise a new buffer. */
static ds_tensor *group_buffer(ds_tensor *lone, int64_t n, ds_device dev, ds_mem_category cat) {
    ds_tensor *t = adopt(lone, dev, cat);
    return t ? t : flat_buffer(n, dev, cat, 0);
}

/* The state slots a group starts with; SGD's buffer waits for a momentum. */
static int alloc_state(ds_optim *o, ds_optim_group *gr, const ds_optim_hparams *h) {
    int64_t n = ds_tensor_numel(gr->flat_params);
    ds_device dev = ds_tensor_device(gr->flat_params);
    for (int s = 0; s < kinds[o->kind].n_state; s++) {
        if (o->kind == DS_OPTIM_SGD && h->momentum == 0) continue;
        double init = o->kind == DS_OPTIM_ADAGRAD ? h->initial_accumulator_value : 0;
        if (!(gr->state[s] = flat_buffer(n, dev, DS_MEM_OPTIM, init))) return -1;
    }
    return 0;
}

/* A contiguous view of buf shaped like p, at p's place in the group. */
static ds_tensor *slot_view(ds_tensor *buf, const ds_tensor *p, int64_t offset) {
    int64_t stride[DS_MAX_DIMS], n = 1;
    for (int d = p->ndim - 1; d >= 0; d--) {
        stride[d] = n;
        n *= p->shape[d];
    }
    return ds_tensor_view_of(buf, p->ndim, p->shape, stride, offset);
}

static int check_param(ds_optim *o, int g, int i, ds_tensor *p, ds_device dev) {
    const char *name = kinds[o->kind].name;
    char s[96];
    if (!ds_dtype_is_float(p->dtype))
        return ds_fail(DS_ERR_ARG, "optim.%s: parameter %d of group %d is %s %s; only floating point tensors "
                       "can be optimized", name, i + 1, g + 1, ds_dtype_name(p->dtype),
                       ds_shape_str(p, s, sizeof s)), -1;
    if (p->dtype != DS_F32)
        return ds_fail(DS_ERR_ARG, "optim.%s: parameter %d of group %d is %s %s; the fused optimizers keep f32 "
                       "parameters", name, i + 1, g + 1, ds_dtype_name(p->dtype), ds_shape_str(p, s, sizeof s)), -1;
    if (p->grad_fn)
        return ds_fail(DS_ERR_ARG, "optim.%s: parameter %d of group %d (%s) is not a leaf (made by %s); optimize "
                       "the tensor it came from", name, i + 1, g + 1, ds_shape_str(p, s, sizeof s),
                       p->grad_fn->name), -1;
    if (!p->requires_grad)
        return ds_fail(DS_ERR_ARG, "optim.%s: parameter %d of group %d (%s) does not require grad; leave frozen "
                       "tensors out of the optimizer", name, i + 1, g + 1, ds_shape_str(p, s, sizeof s)), -1;
    if (!ds_device_equal(ds_tensor_device(p), dev)) {
        char d1[16], d2[16];
        ds_device_name(ds_tensor_device(p), d1, sizeof d1);
        ds_device_name(dev, d2, sizeof d2);
        return ds_fail(DS_ERR_ARG, "optim.%s: parameter %d of group %d is on %s, the others on %s", name, i + 1,
                       g + 1, d1, d2), -1;
    }
    if (p->grad && (!ds_tensor_same_shape(p->grad, p) || !ds_dtype_is_float(p->grad->dtype))) {
        char s2[96];
        return ds_fail(DS_ERR_ARG, "optim.%s: parameter %d of group %d is %s but its grad is %s %s", name, i + 1,
                       g + 1, ds_shape_str(p, s, sizeof s), ds_dtype_name(p->grad->dtype),
                       ds_shape_str(p->grad, s2, sizeof s2)), -1;
    }
    /* the same tensor twice would be stepped twice (tied weights: pass it once) */
    for (int gg = 0; gg <= g; gg++) {
        const ds_optim_group *gr = &o->groups[gg];
        for (int j = 0; j < gr->n_params && gr->params; j++)
            if (gr->params[j] == p)
                return ds_fail(DS_ERR_ARG, "optim.%s: parameter %d of group %d is the same tensor as parameter %d "
                               "of group %d", name, i + 1, g + 1, j + 1, gg + 1), -1;
    }
    return 0;
}

int ds_optim_add_group(ds_optim *o, int n, ds_tensor *const *params, const ds_optim_hparams *h) {
    int g = o->n_groups;
    if (ds_optim_check_hparams(o->kind, h, g)) return -1;
    ds_device dev = o->n_groups ? ds_tensor_device(o->groups[0].flat_params)
                                : n ? ds_tensor_device(params[0]) : DS_CPU_DEVICE;
    ds_optim_group *grown = realloc(o->groups, (size_t)(g + 1) * sizeof *grown);
    if (!grown) return ds_fail(DS_ERR_NOMEM, "out of memory for an optimizer group"), -1;
    o->groups = grown;
    ds_optim_group *gr = &o->groups[g];
    memset(gr, 0, sizeof *gr);
    /* checked one at a time against the ones before, duplicates included */
    for (int i = 0; i < n; i++) {
        if (check_param(o, g, i, params[i], dev)) return -1;
        for (int j = 0; j < i; j++)
            if (params[j] == params[i])
                return ds_fail(DS_ERR_ARG, "optim.%s: parameter %d of group %d is the same tensor as parameter %d",
                               kinds[o->kind].name, i + 1, g + 1, j + 1), -1;
    }
    gr->params = calloc((size_t)n + 1, sizeof *gr->params);
    gr->grads = calloc((size_t)n + 1, sizeof *gr->grads);
    gr->offsets = calloc((size_t)n + 1, sizeof *gr->offsets);
    gr->seg = calloc((size_t)n + 1, sizeof *gr->seg);
    gr->lamb_coeffs = calloc((size_t)n + 1, sizeof *gr->lamb_coeffs);
    if (!gr->params || !gr->grads || !gr->offsets || !gr->seg || !gr->lamb_coeffs) {
        group_free(gr);
        return ds_fail(DS_ERR_NOMEM, "out of memory for an optimizer group"), -1;
    }
    for (int i = 0; i < n; i++) gr->offsets[i + 1] = gr->offsets[i] + ds_tensor_numel(params[i]);
    memcpy(gr->seg, gr->offsets, ((size_t)n + 1) * sizeof *gr->seg);
    gr->n_seg = n;
    int64_t total = gr->offsets[n];
    ds_tensor *lone = n == 1 ? params[0] : NULL;
    if (!(gr->flat_params = group_buffer(lone, total, dev, DS_MEM_PARAM)) ||
        !(gr->flat_grads = group_buffer(lone ? lone->grad : NULL, total, dev, DS_MEM_GRAD)) ||
        alloc_state(o, gr, h)) {
        group_free(gr);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (!(gr->grads[i] = slot_view(gr->flat_grads, params[i], gr->offsets[i]))) {
            gr->n_params = i + 1;
            group_free(gr);
            return -1;
        }
    }
    /* from here on the parameters change; nothing below fails short of a
     * kernel error, after which every parameter still holds its values */
    gr->n_params = n;
    o->n_groups = g + 1;
    for (int i = 0; i < n; i++) {
        ds_tensor *p = params[i];
        ds_tensor_retain(p);
        gr->params[i] = p;
        if (p->grad && p->grad->storage != gr->flat_grads->storage && ds_copy_(gr->grads[i], p->grad)) return -1;
        if (p->storage != gr->flat_params->storage && ds_tensor_reseat(p, gr->flat_params->storage, gr->offsets[i]))
            return -1;
        ds_tensor_retain(gr->grads[i]);
        ds_tensor_release(p->grad);
        p->grad = gr->grads[i];
    }
    return 0;
}

int ds_optim_set_segments(ds_optim *o, int g, int nseg, const int64_t *seg) {
    const char *name = kinds[o->kind].name;
    if (g < 0 || g >= o->n_groups)
        return ds_fail(DS_ERR_ARG, "optim.%s: set_segments: group %d out of range (%d groups)", name, g + 1,
                       o->n_groups), -1;
    ds_optim_group *gr = &o->groups[g];
    int64_t n = ds_tensor_numel(gr->flat_params);
    if (nseg < 0 || !seg)
        return ds_fail(DS_ERR_ARG, "optim.%s: group %d: segments need nseg >= 0 and nseg + 1 offsets, got %d%s",
                       name, g + 1, nseg, seg ? "" : " and no offsets"), -1;
    if (seg[0] != 0)
        return ds_fail(DS_ERR_ARG, "optim.%s: group %d: segments must start at 0, got %lld", name, g + 1,
                       (long long)seg[0]), -1;
    for (int k = 0; k < nseg; k++)
        if (seg[k + 1] < seg[k])
            return ds_fail(DS_ERR_ARG, "optim.%s: group %d: segment offsets must not decrease, got %lld after %lld "
                           "(offset %d)", name, g + 1, (long long)seg[k + 1], (long long)seg[k], k + 1), -1;
    if (seg[nseg] != n)
        return ds_fail(DS_ERR_ARG, "optim.%s: group %d: segments end at %lld, the group has %lld elements", name,
                       g + 1, (long long)seg[nseg], (long long)n), -1;
    int64_t *copy = malloc(((size_t)nseg + 1) * sizeof *copy);
    double *coeffs = calloc((size_t)nseg + 1, sizeof *coeffs);
    if (!copy || !coeffs) {
        free(copy);
        free(coeffs);
        return ds_fail(DS_ERR_NOMEM, "optim.%s: group %d: out of memory for %d segments", name, g + 1, nseg), -1;
    }
    memcpy(copy, seg, ((size_t)nseg + 1) * sizeof *copy);
    free(gr->seg);
    free(gr->lamb_coeffs);
    gr->seg = copy;
    gr->lamb_coeffs = coeffs;
    gr->n_seg = nseg;
    return 0;
}

/* ---- stepping ---- */

/* Parameter i must still live in the flat buffer, and its gradient in the
 * flat gradient buffer (copied back in if someone replaced it). */
static int sync_param(ds_optim *o, int g, int i) {
    ds_optim_group *gr = &o->groups[g];
    ds_tensor *p = gr->params[i], *view = gr->grads[i];
    const char *name = kinds[o->kind].name;
    char s1[96], s2[96];
    if (p->storage != gr->flat_params->storage || p->offset != gr->offsets[i] || !ds_tensor_is_contiguous(p))
        return ds_fail(DS_ERR_STATE, "optim.%s: parameter %d of group %d (%s) no longer lives in this optimizer's "
                       "flat buffer (did another optimizer take it?)", name, i + 1, g + 1,
                       ds_shape_str(p, s1, sizeof s1)), -1;
    if (p->grad == view) return 0;
    if (p->grad) {
        if (!ds_tensor_same_shape(p->grad, p) || !ds_dtype_is_float(p->grad->dtype))
            return ds_fail(DS_ERR_ARG, "optim.%s: parameter %d of group %d is %s but its grad was replaced by %s %s",
                           name, i + 1, g + 1, ds_shape_str(p, s1, sizeof s1), ds_dtype_name(p->grad->dtype),
                           ds_shape_str(p->grad, s2, sizeof s2)), -1;
        if (ds_check_same_device(name, p, p->grad) || ds_copy_(view, p->grad)) return -1;
    } else if (ds_fill_(view, 0)) {
        return -1;
    }
    ds_tensor_retain(view);
    ds_tensor_release(p->grad);
    p->grad = view;
    return 0;
}

static ds_kview opt_view(const ds_tensor *t) {
    ds_kview v = { 0 };
    return t ? ds_tensor_kview(t) : v;
}

/* The parameters a step writes (f32, or their 16-bit copy): a graph that
 * saved them must see them changed. */
#define STEP_WRITES "the optimizer's step"

static ds_kview written_view(ds_tensor *t) {
    ds_kview v = { 0 };
    return t ? ds_tensor_kview_w(t, STEP_WRITES) : v;
}

static const ds_kernels_optim *optim_kernels(ds_optim_kind kind, const ds_tensor *p) {
    const ds_kernels_optim *k = ds_tensor_kernels(p)->optim;
    if (!k) {
        char d[16];
        ds_device_name(ds_tensor_device(p), d, sizeof d);
        ds_fail(DS_ERR_STATE, "optim.%s: no optimizer kernels for device %s", kinds[kind].name, d);
    }
    return k;
}

/* apply's buffers: contiguous 1-D views of p's length on p's device, f32
 * (the 16-bit copy of p: bf16 or f16) */
static int check_flat(ds_optim_kind kind, const char *what, const ds_tensor *t, const ds_tensor *p, bool half) {
    char s[96];
    if (!t) return ds_fail(DS_ERR_ARG, "optim.%s: apply: %s is missing", kinds[kind].name, what), -1;
    bool dtype_ok = half ? t->dtype == DS_BF16 || t->dtype == DS_F16 : t->dtype == DS_F32;
    if (!dtype_ok || t->ndim != 1 || !ds_tensor_is_contiguous(t))
        return ds_fail(DS_ERR_ARG, "optim.%s: apply: %s is %s %s; expected a contiguous 1-D %s tensor",
                       kinds[kind].name, what, ds_dtype_name(t->dtype), ds_shape_str(t, s, sizeof s),
                       half ? "bf16 or f16" : "f32"), -1;
    if (ds_tensor_numel(t) != ds_tensor_numel(p))
        return ds_fail(DS_ERR_ARG, "optim.%s: apply: %s has %lld elements, p has %lld", kinds[kind].name, what,
                       (long long)ds_tensor_numel(t), (long long)ds_tensor_numel(p)), -1;
    if (!ds_device_equal(ds_tensor_device(t), ds_tensor_device(p))) {
        char d1[16], d2[16];
        ds_device_name(ds_tensor_device(t), d1, sizeof d1);
        ds_device_name(ds_tensor_device(p), d2, sizeof d2);
        return ds_fail(DS_ERR_ARG, "optim.%s: apply: %s is on %s, p on %s", kinds[kind].name, what, d1, d2), -1;
    }
    return 0;
}

int ds_optim_apply(ds_optim_kind kind, const ds_optim_hparams *h, int64_t t, bool first, ds_tensor *p,
                   ds_tensor *g, ds_tensor *s0, ds_tensor *s1, double grad_scale, ds_tensor *shadow) {
    const char *name = kinds[kind].name;
    if (kind == DS_OPTIM_LAMB)
        return ds_fail(DS_ERR_ARG, "optim.Lamb: apply: Lamb's trust ratio needs whole parameters, so it cannot "
                       "step a flat piece (use the Lamb optimizer)"), -1;
    if (t < 1) return ds_fail(DS_ERR_ARG, "optim.%s: apply: step must be >= 1, got %lld", name, (long long)t), -1;
    if (!isfinite(grad_scale))
        return ds_fail(DS_ERR_ARG, "optim.%s: apply: grad_scale must be finite, got %g", name, grad_scale), -1;
    if (ds_optim_check_hparams(kind, h, -1)) return -1;
    bool with_momentum = kind != DS_OPTIM_SGD || h->momentum != 0;
    int n_state = with_momentum ? kinds[kind].n_state : 0;
    if (check_flat(kind, "p", p, p, false) || check_flat(kind, "g", g, p, false) ||
        (n_state > 0 && check_flat(kind, kinds[kind].state[0], s0, p, false)) ||
        (n_state > 1 && check_flat(kind, kinds[kind].state[1], s1, p, false)) ||
        (shadow && check_flat(kind, "the 16-bit copy", shadow, p, true)))
        return -1;
    const ds_kernels_optim *k = optim_kernels(kind, p);
    if (!k) return -1;
    double bc1 = h->bias_correction ? 1 - pow(h->beta1, (double)t) : 1;
    double bc2 = h->bias_correction ? 1 - pow(h->beta2, (double)t) : 1;
    ds_kview pv = ds_tensor_kview_w(p, STEP_WRITES), gv = ds_tensor_kview(g);
    ds_kview v0 = n_state > 0 ? opt_view(s0) : opt_view(NULL), v1 = n_state > 1 ? opt_view(s1) : opt_view(NULL);
    ds_kview sv = written_view(shadow);
    int rc = 0;
    switch (kind) {
    case DS_OPTIM_SGD: {
        ds_sgd_params sp = { .lr = h->lr, .weight_decay = h->weight_decay, .momentum = h->momentum,
                             .dampening = h->dampening, .grad_scale = grad_scale, .nesterov = h->nesterov,
                             .first = with_momentum && first };
        rc = k->sgd(pv, gv, v0, sv, &sp);
        break;
    }
    case DS_OPTIM_ADAM:
    case DS_OPTIM_ADAMW: {
        ds_adam_params ap = { .beta1 = h->beta1, .beta2 = h->beta2, .eps = h->eps, .weight_decay = h->weight_decay,
                              .grad_scale = grad_scale, .decay = 1 - h->lr * h->weight_decay,
                              .step_size = h->lr / bc1, .sqrt_bc2 = sqrt(bc2), .decoupled = kind == DS_OPTIM_ADAMW };
        rc = k->adam(pv, gv, v0, v1, sv, &ap);
        break;
    }
    case DS_OPTIM_ADAGRAD: {
        ds_adagrad_params ap = { h->lr / (1 + (double)(t - 1) * h->lr_decay), h->eps, h->weight_decay, grad_scale };
        rc = k->adagrad(pv, gv, v0, sv, &ap);
        break;
    }
    case DS_OPTIM_LION: {
        ds_lion_params lp = { h->lr, h->beta1, h->beta2, 1 - h->lr * h->weight_decay, grad_scale };
        rc = k->lion(pv, gv, v0, sv, &lp);
        break;
    }
    default:
        break;
    }
    if (rc) return ds_fail(DS_ERR_STATE, "optim.%s: %s", name, ds_kernel_error()), -1;
    return 0;
}

/* FusedLamb's trust ratio |w| / |u|, clipped to [min, max]; 1 when either
 * norm is 0. */
static double lamb_coeff(double w_norm, double u_norm, double min_coeff, double max_coeff) {
    if (w_norm == 0 || u_norm == 0) return 1.0;
    double c = w_norm / u_norm;
    return c > max_coeff ? max_coeff : c < min_coeff ? min_coeff : c;
}

/* Lamb: the moments and each piece's squared norms, their sums over the
 * ranks sharing the pieces (when sum is given), then each piece's update
 * scaled by its trust ratio. */
static int lamb_step(ds_optim_group *gr, const ds_optim_hparams *h, int64_t t, ds_optim_sum_fn sum, void *ud) {
    const ds_kernels_optim *k = optim_kernels(DS_OPTIM_LAMB, gr->flat_params);
    if (!k) return -1;
    double bc1 = h->bias_correction ? 1 - pow(h->beta1, (double)t) : 1;
    double bc2 = h->bias_correction ? 1 - pow(h->beta2, (double)t) : 1;
    ds_lamb_params lp = { h->bias_correction ? h->lr * sqrt(bc2) / bc1 : h->lr, h->beta1, h->beta2, h->eps,
                          h->weight_decay, 1.0, h->eps_inside_sqrt };
    int nseg = gr->n_seg;
    double *sq = malloc((2 * (size_t)nseg + 1) * sizeof *sq);     /* |w|^2 of each piece, then |u|^2 */
    if (!sq) return ds_fail(DS_ERR_NOMEM, "optim.Lamb: out of memory for %d segments", nseg), -1;
    ds_kview p = ds_tensor_kview_w(gr->flat_params, STEP_WRITES);
    ds_kview m = opt_view(gr->state[0]), v = opt_view(gr->state[1]);
    int rc = -1;
    if (k->lamb_norms(p, ds_tensor_kview(gr->flat_grads), m, v, gr->seg, nseg, sq, sq + nseg, &lp)) {
        ds_fail(DS_ERR_STATE, "optim.Lamb: %s", ds_kernel_error());
    } else if (!sum || sum(sq, 2 * nseg, ud) == 0) {
        for (int i = 0; i < nseg; i++)
            gr->lamb_coeffs[i] = lamb_coeff(sqrt(sq[i]), sqrt(sq[nseg + i]), h->min_coeff, h->max_coeff);
        if (k->lamb_apply(p, m, v, gr->seg, nseg, gr->lamb_coeffs, &lp))
            ds_fail(DS_ERR_STATE, "optim.Lamb: %s", ds_kernel_error());
        else
            rc = 0;
    }
    free(sq);
    return rc;
}

int ds_optim_step(ds_optim *o, int g, const ds_optim_hparams *h) {
    return ds_optim_step_shared(o, g, h, 1, NULL, NULL, NULL);
}

int ds_optim_begin_pieces(ds_optim *o, int g, const ds_optim_hparams *h) {
    ds_optim_group *gr = &o->groups[g];
    if (ds_optim_check_hparams(o->kind, h, g)) return -1;
    for (int i = 0; i < gr->n_params; i++)
        if (sync_param(o, g, i)) return -1;
    if (o->kind == DS_OPTIM_SGD && h->momentum != 0 && !gr->state[0] && alloc_state(o, gr, h)) return -1;
    return 0;
}

/* n elements of flat buffer t from lo (NULL stays NULL). */
static ds_tensor *piece_of(ds_tensor *t, int64_t lo, int64_t n) {
    return t ? ds_tensor_view_of(t, 1, (int64_t[]){ n }, (int64_t[]){ 1 }, t->offset + lo) : NULL;
}

int ds_optim_step_piece(ds_optim *o, int g, const ds_optim_hparams *h, int64_t lo, int64_t n, double grad_scale,
                        ds_tensor *shadow) {
    ds_optim_group *gr = &o->groups[g];
    ds_tensor *v[4] = { piece_of(gr->flat_params, lo, n), piece_of(gr->flat_grads, lo, n),
                        piece_of(gr->state[0], lo, n), piece_of(gr->state[1], lo, n) };
    int rc = v[0] && v[1] && (v[2] || !gr->state[0]) && (v[3] || !gr->state[1])
             ? ds_optim_apply(o->kind, h, gr->step + 1, !gr->momentum_started, v[0], v[1], v[2], v[3], grad_scale,
                              shadow)
             : -1;
    for (int k = 0; k < 4; k++) ds_tensor_release(v[k]);
    return rc;
}

void ds_optim_end_pieces(ds_optim *o, int g, const ds_optim_hparams *h) {
    ds_optim_group *gr = &o->groups[g];
    gr->momentum_started |= o->kind == DS_OPTIM_SGD && h->momentum != 0;
    gr->step++;
}

int ds_optim_step_shared(ds_optim *o, int g, const ds_optim_hparams *h, double grad_scale, ds_tensor *shadow,
                         ds_optim_sum_fn sum, void *ud) {
    ds_optim_group *gr = &o->groups[g];
    /* FusedLamb's grad_scale divides, and its update takes two passes */
    if (o->kind == DS_OPTIM_LAMB && (grad_scale != 1 || shadow))
        return ds_fail(DS_ERR_ARG, "optim.Lamb: group %d: Lamb's step takes neither a gradient scale (%g) nor a "
                       "16-bit copy to write; scale the gradients and copy the parameters apart", g + 1,
                       grad_scale), -1;
    if (ds_optim_begin_pieces(o, g, h)) return -1;
    int64_t t = gr->step + 1;
    int rc = o->kind == DS_OPTIM_LAMB
        ? lamb_step(gr, h, t, sum, ud)
        : ds_optim_apply(o->kind, h, t, !gr->momentum_started, gr->flat_params, gr->flat_grads, gr->state[0],
                         gr->state[1], grad_scale, shadow);
    if (rc) return -1;
    ds_optim_end_pieces(o, g, h);
    return 0;
}

int ds_optim_move_flat(ds_optim *o, int g, ds_tensor *params, ds_tensor *grads) {
    ds_optim_group *gr = &o->groups[g];
    int64_t n = ds_tensor_numel(gr->flat_params);
    const ds_tensor *both[2] = { params, grads };
    for (int k = 0; k < 2; k++) {
        const ds_tensor *t = both[k];
        if (t->dtype != DS_F32 || t->ndim != 1 || !ds_tensor_is_contiguous(t) || ds_tensor_numel(t) != n ||
            ds_tensor_device(t).type != ds_tensor_device(gr->flat_params).type)
            return ds_fail(DS_ERR_ARG, "optim.%s: group %d's new %s buffer is not a contiguous f32 buffer of %lld "
                           "elements on its device", kinds[o->kind].name, g + 1, k ? "gradient" : "parameter",
                           (long long)n), -1;
    }
    if (ds_copy_(params, gr->flat_params) || ds_copy_(grads, gr->flat_grads)) return -1;
    for (int i = 0; i < gr->n_params; i++) {
        ds_tensor *p = gr->params[i], *view = slot_view(grads, p, grads->offset + gr->offsets[i]);
        if (!view || ds_tensor_reseat(p, params->storage, params->offset + gr->offsets[i])) {
            ds_tensor_release(view);
            return -1;
        }
        if (p->grad == gr->grads[i]) {
            ds_tensor_retain(view);
            ds_tensor_release(p->grad);
            p->grad = view;
        }
        ds_tensor_release(gr->grads[i]);
        gr->grads[i] = view;
    }
    ds_tensor_retain(params);
    ds_tensor_retain(grads);
    ds_tensor_release(gr->flat_params);
    ds_tensor_release(gr->flat_grads);
    gr->flat_params = params;
    gr->flat_grads = grads;
    return 0;
}

int ds_optim_zero_grad(ds_optim *o) {
    for (int g = 0; g < o->n_groups; g++) {
        ds_optim_group *gr = &o->groups[g];
        for (int i = 0; i < gr->n_params; i++) {
            ds_tensor *p = gr->params[i];
            if (p->grad == gr->grads[i]) continue;
            ds_tensor_retain(gr->grads[i]);
            ds_tensor_release(p->grad);
            p->grad = gr->grads[i];
        }
        if (ds_fill_(gr->flat_grads, 0)) return -1;
    }
    return 0;
}

/* ---- state, for state_dict and load_state_dict ---- */

ds_tensor *ds_optim_state_view(ds_optim *o, int g, int i, int slot) {
    ds_optim_group *gr = &o->groups[g];
    if (!gr->state[slot] || (o->kind == DS_OPTIM_SGD && !gr->momentum_started)) return NULL;
    return slot_view(gr->state[slot], gr->params[i], gr->offsets[i]);
}

int ds_optim_reset_state(ds_optim *o, int g, const ds_optim_hparams *h) {
    ds_optim_group *gr = &o->groups[g];
    double init = o->kind == DS_OPTIM_ADAGRAD ? h->initial_accumulator_value : 0;
    for (int s = 0; s < DS_OPTIM_MAX_STATE; s++)
        if (gr->state[s] && ds_fill_(gr->state[s], init)) return -1;
    gr->step = 0;
    gr->momentum_started = false;
    return 0;
}

int ds_optim_load_state(ds_optim *o, int g, int i, int slot, ds_tensor *src) {
    ds_optim_group *gr = &o->groups[g];
    ds_tensor *p = gr->params[i];
    char s1[96], s2[96];
    if (!ds_tensor_same_shape(src, p) || !ds_dtype_is_float(src->dtype))
        return ds_fail(DS_ERR_ARG, "optim.%s: load_state_dict: %s of parameter %d of group %d is %s %s, the "
                       "parameter is %s", kinds[o->kind].name, kinds[o->kind].state[slot], i + 1, g + 1,
                       ds_dtype_name(src->dtype), ds_shape_str(src, s1, sizeof s1),
                       ds_shape_str(p, s2, sizeof s2)), -1;
    if (!gr->state[slot]) {
        int64_t n = ds_tensor_numel(gr->flat_params);
        if (!(gr->state[slot] = flat_buffer(n, ds_tensor_device(p), DS_MEM_OPTIM, 0))) return -1;
    }
    ds_tensor *view = slot_view(gr->state[slot], p, gr->offsets[i]);
    int rc = view ? ds_copy_(view, src) : -1;
    ds_tensor_release(view);
    if (rc == 0 && o->kind == DS_OPTIM_SGD) gr->momentum_started = true;
    return rc;
}
