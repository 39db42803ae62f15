/* The masters layout: bf16/fp16, or ZeRO from stage 1. Each param group
 * has one fp32 master, this rank's shard of every parameter back to back
 * (ds_zero.h says how they are cut); buckets travel as [P, width] rows,
 * reduced into the master gradients; the step writes the parameters back
 * from the masters. */
#include "ds_zero_impl.h"
#include "ds_autograd.h"
#include "ds_error.h"
#include "ds_ops.h"

#include <math.h>
#include <stdlib.h>

int ds_zero_need_masters(const ds_zero *z, const char *what) {
    if (z->layout == &ds_zero_masters_layout) return 0;
    return ds_fail(DS_ERR_STATE, "step engine: %s needs fp32 masters (this engine steps the parameters flat)",
                   what), -1;
}

/* ---------------------------------------------------------------- building */

/* Stage 0 (and 1-2 on one rank): each group's parameters moved into one
 * buffer laid out as its master. A parameter that cannot move (pinned by a
 * transfer, say) leaves its group on per-parameter copies. */
static int make_flat_params(ds_zero *z) {
    z->flat_params = calloc((size_t)z->n_groups, sizeof *z->flat_params);
    if (!z->flat_params) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    for (int g = 0; g < z->n_groups; g++) {
        int64_t n = z->group_len[g];
        z->flat_params[g] = n > 0 ? ds_tensor_new(1, &n, z->dtype, ds_zero_param_device(z)) : NULL;
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

/* This rank's shards of each group's parameters, cut into P = the group's
 * size from stage 1, else 1. */
static int build(ds_zero *z, ds_optim *flat) {
    (void)flat;
    z->parts = z->c.stage > 0 ? z->world : 1;
    int r = z->parts > 1 ? z->rank : 0;
    z->masters = calloc((size_t)z->n_groups, sizeof *z->masters);
    z->master_grads = calloc((size_t)z->n_groups, sizeof *z->master_grads);
    if (!z->masters || !z->master_grads) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    z->n_grads = z->n_groups;
    z->grads = z->master_grads;
    int64_t *len = z->group_len = calloc((size_t)z->n_groups, sizeof *len);
    if (!len) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    for (int i = 0; i < z->n; i++) {
        zparam *q = &z->p[i];
        q->shard = (q->numel + z->parts - 1) / z->parts;
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
            ds_tensor_retain(z->master_grads[g]);      /* an optimizer over the master adopts both */
            z->masters[g]->grad = z->master_grads[g];
        }
    }
    bool prev = ds_set_grad_enabled(false);
    for (int i = 0; i < z->n && rc == 0; i++) {
        zparam *q = &z->p[i];
        ds_tensor *shard = z->c.shards ? z->c.shards[i] : NULL;     /* built partitioned: its shard is all there is */
        rc = ds_zero_copy_elements(z->masters[q->group], q->offset, shard ? shard : q->param,
                                   shard ? 0 : (int64_t)r * q->shard, ds_zero_shard_len(q, r));
    }
    ds_set_grad_enabled(prev);
    return rc == 0 && z->parts == 1 && z->c.stage != 3 ? make_flat_params(z) : rc;
}

static void free_layout(ds_zero *z) {
    ds_zero_offload_free(z);
    for (int g = 0; z->masters && g < z->n_groups; g++) {
        ds_tensor_release(z->masters[g]);
        ds_tensor_release(z->master_grads[g]);
        if (z->flat_params) ds_tensor_release(z->flat_params[g]);
    }
    free(z->flat_params);
    free(z->masters);
    free(z->master_grads);
    free(z->group_len);
}

ds_tensor *ds_zero_master(ds_zero *z, int g) {
    if (ds_zero_need_masters(z, "master")) return NULL;
    if (g < 0 || g >= z->n_groups || !z->masters[g]) return ds_fail(DS_ERR_ARG, "step engine: no master %d", g + 1);
    ds_tensor_retain(z->masters[g]);
    return z->masters[g];
}

ds_tensor *ds_zero_master_grad(ds_zero *z, int g) {
    if (ds_zero_need_masters(z, "master_grad")) return NULL;
    if (g < 0 || g >= z->n_groups) return ds_fail(DS_ERR_ARG, "step engine: no master gradient %d", g + 1);
    ds_tensor_retain(z->master_grads[g]);
    return z->master_grads[g];
}

static void swap_in(ds_tensor **slot, ds_tensor *t) {
    ds_tensor_retain(t);
    ds_tensor_release(*slot);
    *slot = t;
}

int ds_zero_stream(ds_zero *z) {
    if (ds_zero_need_masters(z, "stream")) return -1;
    if (z->optim) return ds_fail(DS_ERR_STATE, "step engine: an optimizer is attached already"), -1;
    for (int g = 0; g < z->n_groups; g++) {
        ds_tensor_release(z->masters[g]);
        z->masters[g] = NULL;
    }
    z->streamed = true;
    return 0;
}

int ds_zero_attach(ds_zero *z, ds_optim *o) {
    if (ds_zero_need_masters(z, "attach")) return -1;
    if (z->optim) return ds_fail(DS_ERR_STATE, "step engine: an optimizer is attached already"), -1;
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
    if (ds_zero_offload_attach(z, o)) return -1;
    z->optim = o;
    return 0;
}

/* ---------------------------------------------------------------- backward */

/* From stage 2 the gradients are partitioned: every micro step reduces. */
static bool reduces(const ds_zero *z, bool boundary) { return boundary || z->c.stage >= 2; }

/* Bucket b's gradients (contiguous, held) into rows [P, width] as one
 * kernel: row r gets each parameter's shard r at its column, and zeros
 * where a short or empty last shard, or a parameter without gradient,
 * leaves padding (it must reduce as zeros). */
static int fill_rows(ds_zero *z, const zbucket *b, ds_tensor *rows, ds_tensor *const *held) {
    zpieces c = { 0 };
    int rc = 0;
    for (int i = b->first; i < b->first + b->count && rc == 0; i++) {
        const zparam *q = &z->p[i];
        ds_tensor *g = held[i - b->first];
        for (int r = 0; r < z->parts && rc == 0; r++) {
            int64_t at = r * b->width + q->offset - b->offset, len = g ? ds_zero_shard_len(q, r) : 0;
            rc = ds_zero_piece(&c, rows, at, g, (int64_t)r * q->shard, len);
            if (rc == 0) rc = ds_zero_piece(&c, rows, at + len, NULL, 0, q->shard - len);
        }
    }
    rc = ds_zero_pieces_run(&c, rc, false);
    return rc;
}

/* Bucket b's gradients taken from the parameters, contiguous, into held
 * (NULL where none); as the rows' dtype where the add from it would not
 * be the add from them (a gradient narrowed on its way). */
static int take_grads(ds_zero *z, const zbucket *b, ds_tensor **held, bool as_rows) {
    int rc = 0;
    for (int i = b->first; i < b->first + b->count; i++) {
        zparam *q = &z->p[i];
        ds_tensor *g = q->param->grad, *c = NULL;
        if (g && rc == 0) {
            bool narrowed = as_rows && g->dtype != z->c.comm_dtype && z->c.comm_dtype != DS_F32;
            c = narrowed ? ds_to_dtype(g, z->c.comm_dtype) : ds_contiguous(g);
            if (!c) rc = -1;
        }
        held[i - b->first] = c;
        if (!g || rc) continue;
        q->param->grad = NULL;
        ds_tensor_release(g);
    }
    return rc;
}

static void release_all(int n, ds_tensor **t) {
    for (int k = 0; k < n; k++) ds_tensor_release(t[k]);
}

/* Nothing to communicate: one rank, its gradients on the masters' device,
 * no offload pipeline. */
static bool local(const ds_zero *z) {
    return z->world == 1 && !z->offload && ds_device_equal(ds_zero_param_device(z), z->c.master_device);
}

/* Bucket b's gradients added straight into their master gradients, one
 * kernel: per element the add a landed row makes (f32 += the row's value,
 * which holds the gradient exactly, or is given its rounding first). */
static int fold(ds_zero *z, zbucket *b) {
    ds_tensor *held[b->count];
    int rc = take_grads(z, b, held, true);
    zpieces c = { 0 };
    for (int i = b->first; i < b->first + b->count && rc == 0; i++) {
        const zparam *q = &z->p[i];
        rc = ds_zero_piece(&c, z->master_grads[b->group], q->offset, held[i - b->first], 0,
                           held[i - b->first] ? q->numel : 0);
    }
    rc = ds_zero_pieces_run(&c, rc, true);
    release_all(b->count, held);
    return rc;
}

/* Bucket b's gradients as rows, dropped from the parameters, reduced
 * (reduce-scatter, or all-reduce when nothing is partitioned). */
static ds_comm_work *launch(ds_zero *z, zbucket *b, ds_tensor **buf) {
    int P = z->parts;
    int64_t shape[2] = { P, b->width };
    ds_tensor *rows = ds_tensor_new(2, shape, z->c.comm_dtype, ds_zero_param_device(z));
    if (!rows) return NULL;
    ds_tensor *held[b->count];
    int rc = take_grads(z, b, held, false);
    if (rc == 0) rc = fill_rows(z, b, rows, held);
    release_all(b->count, held);
    if (rc) { ds_tensor_release(rows); return NULL; }
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

/* This rank's reduced row of f (new reference). */
static ds_tensor *reduced_row(ds_zero *z, zflight *f) {
    return z->parts == 1 ? ds_zero_elements(f->buf, 0, z->b[f->bucket].width) : ds_comm_work_result(f->work, 0);
}

/* Under ZeRO-Offload's pipeline the row starts down now, in backward. */
static int arrive(ds_zero *z, zflight *f) {
    ds_tensor *row = reduced_row(z, f);
    int rc = row ? ds_zero_offload_fetch(z, row, &f->down) : -1;
    ds_tensor_release(row);
    return rc;
}

/* This rank's reduced row added into the master gradient (under offload
 * it comes to the masters' memory first, or has come in backward). */
static int land(ds_zero *z, zflight *f) {
    zbucket *b = &z->b[f->bucket];
    ds_tensor *row = f->down ? f->down : reduced_row(z, f);
    if (f->down) ds_tensor_retain(row);
    ds_tensor *here = row && !ds_device_equal(ds_tensor_device(row), z->c.master_device)
                      ? ds_zero_copy_out(row, 0, b->width, row->dtype, z->c.master_device) : NULL;
    ds_tensor *seg = ds_zero_elements(z->master_grads[b->group], b->offset, b->width);
    int rc = row && seg && (here || ds_device_equal(ds_tensor_device(row), z->c.master_device))
             ? ds_add_(seg, here ? here : row) : -1;
    ds_tensor_release(here);
    ds_tensor_release(seg);
    ds_tensor_release(row);
    return rc;
}

static const char *collective(const ds_zero *z) { return z->parts == 1 ? "zero_all_reduce" : "zero_reduce_scatter"; }

static int scale(ds_zero *z, double f) { return ds_zero_scale_all(z->n_groups, z->master_grads, f); }

static ds_tensor *param_grad(ds_zero *z, int i) {
    zparam *q = &z->p[i];
    return ds_zero_elements(z->master_grads[q->group], q->offset, q->shard);
}

/* ---------------------------------------------------------------- step */

/* Group g's 16-bit parameters where the optimizer's pass writes them along
 * with the master (refresh leaves them then), else NULL: back to back in
 * flat_params, bf16 or f16, on the masters' device. flat_params[g] holds
 * group_len[g] elements, the master's length (build pads only an empty
 * group's master, and that group has no flat_params). */
static ds_tensor *written_by_step(const ds_zero *z, int g) {
    ds_tensor *t = z->flat_params ? z->flat_params[g] : NULL;
    if (!t || !ds_zero_fused_step(z) || (t->dtype != DS_BF16 && t->dtype != DS_F16)) return NULL;
    return ds_device_equal(ds_tensor_device(t), ds_tensor_device(z->masters[g])) ? t : NULL;
}

/* Where stage 3's shard q is refreshed from: the offload step's shards
 * where they are on q's own device, else the masters. */
static ds_tensor *shard_source(const zparam *q, ds_tensor *const *masters, ds_tensor *const *updated) {
    ds_tensor *t = updated ? updated[q->group] : NULL;
    return t && ds_device_equal(ds_tensor_device(t), ds_tensor_device(q->own)) ? t : masters[q->group];
}

/* Stage 3's own shards of bucket b from the masters (or updated), one
 * kernel for those on their source's device and held in memory, the
 * others one by one. */
static int store_shards(ds_zero *z, const zbucket *b, ds_tensor *const *masters, ds_tensor *const *updated) {
    zpieces c = { 0 };
    int rc = 0;
    for (int i = b->first; i < b->first + b->count && rc == 0; i++) {
        zparam *q = &z->p[i];
        if (!q->own) continue;
        ds_tensor *src = shard_source(q, masters, updated);
        if (!z->param_file && ds_device_equal(ds_tensor_device(src), ds_tensor_device(q->own)))
            rc = ds_zero_piece(&c, q->own, 0, src, q->offset, q->shard);
        else
            rc = ds_zero_store_shard(z, q, src, q->offset);
    }
    rc = ds_zero_pieces_run(&c, rc, false);
    return rc;
}

/* Bucket b's all-gathered shards (work w's P results) into the parameters
 * kept whole, one kernel. */
static int take_gathered(ds_zero *z, const zbucket *b, ds_comm_work *w) {
    ds_tensor *got[z->parts];
    zpieces c = { 0 };
    int made = 0, rc = 0;
    for (; made < z->parts; made++)
        if (!(got[made] = ds_comm_work_result(w, made))) break;
    if (made < z->parts) rc = -1;
    for (int r = 0; r < made && rc == 0; r++) {
        for (int i = b->first; i < b->first + b->count && rc == 0; i++) {
            zparam *q = &z->p[i];
            if (!q->own) rc = ds_zero_piece(&c, q->param, (int64_t)r * q->shard, got[r], q->offset - b->offset,
                                            ds_zero_shard_len(q, r));
        }
    }
    rc = ds_zero_pieces_run(&c, rc, false);
    release_all(made, got);
    return rc;
}

/* Parameters from masters: stage 0 copies (casting), but for the groups
 * the optimizer's pass has written when stepped, the parameters of groups
 * not moved into flat_params in one kernel; otherwise each bucket's
 * updated shards are all-gathered (one rank: a copy) into the parameters
 * kept whole, and stage 3's own shards are refreshed, from updated (the
 * offload step's shards on the device) where it is given. */
static int refresh(ds_zero *z, ds_tensor *const *masters, ds_tensor *const *updated, bool stepped) {
    int rc = 0;
    if (z->parts == 1 && z->c.stage != 3) {
        for (int g = 0; g < z->n_groups && rc == 0; g++) {
            if (z->flat_params[g] && !(stepped && written_by_step(z, g)))
                rc = ds_zero_copy_elements(z->flat_params[g], 0, masters[g], 0, z->group_len[g]);
        }
        zpieces c = { 0 };
        for (int i = 0; i < z->n && rc == 0; i++) {
            zparam *q = &z->p[i];
            ds_tensor *m = masters[q->group];
            if (z->flat_params[q->group]) continue;
            rc = ds_device_equal(ds_tensor_device(m), ds_tensor_device(q->param))
                 ? ds_zero_piece(&c, q->param, 0, m, q->offset, q->numel)
                 : ds_zero_copy_elements(q->param, 0, m, q->offset, q->numel);
        }
        rc = ds_zero_pieces_run(&c, rc, false);
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
        for (int i = b->first; i < b->first + b->count; i++) whole = whole || !z->p[i].own;
        rc = store_shards(z, b, masters, updated);
        if (rc || !whole) continue;
        ds_tensor *send = updated ? ds_zero_elements(updated[b->group], b->offset, b->width)
                               : ds_zero_copy_out(masters[b->group], b->offset, b->width, z->dtype, ds_zero_param_device(z));
        works[bi] = send ? ds_comm_all_gather(send, z->c.group) : NULL;
        if (!works[bi]) rc = -1;
        sent[bi] = send;
    }
    for (int bi = 0; bi < z->nb; bi++) {
        if (!works[bi]) continue;
        if (rc == 0) rc = ds_comm_work_wait(works[bi]);
        if (rc == 0) ds_zero_log(z, "zero_all_gather", sent[bi], t0);
        if (rc == 0) rc = take_gathered(z, &z->b[bi], works[bi]);
        ds_comm_work_release(works[bi]);
    }
    for (int bi = 0; bi < z->nb; bi++) ds_tensor_release(sent[bi]);
    free(works);
    free(sent);
    return rc;
}

/* ZeRO-Offload's pipeline: with nothing partitioned it writes the
 * parameters; else each group's updated shards go into a buffer on the
 * device for the refresh, which lives only as long as the step. */
static int offload_step(ds_zero *z, const ds_optim_hparams *h, double f) {
    if (z->parts == 1 && z->c.stage != 3) return ds_zero_offload_step(z, h, f, NULL);
    ds_tensor *updated[z->n_groups];
    int rc = 0;
    for (int g = 0; g < z->n_groups; g++) {
        int64_t n = z->group_len[g] > 0 ? z->group_len[g] : 1;
        updated[g] = rc == 0 ? ds_tensor_new(1, &n, z->dtype, ds_zero_param_device(z)) : NULL;
        if (!updated[g]) rc = -1;
    }
    if (rc == 0) rc = ds_zero_offload_step(z, h, f, updated);
    if (rc == 0) rc = refresh(z, z->masters, updated, true);
    for (int g = 0; g < z->n_groups; g++) ds_tensor_release(updated[g]);
    return rc;
}

/* Shards differ between ranks: their squares are summed; with P = 1 every
 * rank holds the same reduced gradients. The sums over ranks become
 * means; the norm is of the scaled mean. Streamed (no optimizer attached)
 * the step stops at the unscaled gradients. */
static int step(ds_zero *z, const ds_optim_hparams *h, double loss_scale, double clip, bool check_overflow,
                ds_zero_result *out) {
    double sq = 0, bad = 0;
    int rc = ds_zero_grad_stats(z, z->parts > 1 && z->world > 1, &sq, &bad);
    if (rc) return rc;
    if (check_overflow && bad > 0) {
        out->overflow = true;
        return ds_zero_zero_grads(z);
    }
    double n = z->world, norm = sqrt(sq) / n, combined = loss_scale;
    if (clip > 0) {
        double c = ((norm / loss_scale) + 1e-6) / clip;
        if (c > 1) combined = c * loss_scale;
    }
    double f = 1 / (n * combined);
    out->grad_norm = norm / loss_scale;
    if (!z->optim) return ds_zero_scale_all(z->n_groups, z->master_grads, f);
    if (ds_zero_offload_takes(z)) {
        rc = offload_step(z, h, f);
    } else {
        ds_tensor *written[z->n_groups];
        for (int g = 0; g < z->n_groups; g++) written[g] = written_by_step(z, g);
        rc = ds_zero_optimizer_step(z, h, z->n_groups, z->master_grads, f, written);
        if (rc == 0) rc = refresh(z, z->masters, NULL, true);
    }
    return rc == 0 ? ds_zero_zero_grads(z) : rc;
}

static int zero_grad(ds_zero *z) {
    for (int g = 0; g < z->n_groups; g++)
        if (ds_fill_(z->master_grads[g], 0)) return -1;
    for (int i = 0; i < z->n; i++) {
        ds_tensor_release(z->p[i].param->grad);
        z->p[i].param->grad = NULL;
    }
    return 0;
}

int ds_zero_refresh(ds_zero *z, int n, ds_tensor *const *masters) {
    if (ds_zero_need_masters(z, "refresh")) return -1;
    if (z->optim) return ds_fail(DS_ERR_STATE, "step engine: refresh is for a streamed optimizer"), -1;
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
    int rc = refresh(z, masters, NULL, false);
    if (rc == 0) rc = ds_zero_zero_grads(z);
    ds_set_grad_enabled(prev);
    return rc;
}

int ds_zero_sync_params(ds_zero *z) {
    if (ds_zero_need_masters(z, "sync_params")) return -1;
    if (!z->optim) return ds_fail(DS_ERR_STATE, "step engine: sync_params needs an optimizer attached"), -1;
    bool prev = ds_set_grad_enabled(false);
    int rc = refresh(z, z->masters, NULL, false);
    ds_set_grad_enabled(prev);
    return rc;
}

const zlayout ds_zero_masters_layout = {
    .holds = DS_ZERO_HOLDS_MASTERS, .build = build, .free = free_layout, .reduces = reduces, .local = local,
    .fold = fold, .launch = launch, .arrive = arrive, .land = land, .collective = collective, .scale = scale,
    .param_grad = param_grad, .step = step, .zero_grad = zero_grad,
};
