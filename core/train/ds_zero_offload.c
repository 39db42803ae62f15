/* ZeRO-Offload's step from a GPU: the pipeline of chunks (ds_offload_run),
 * the host's stand-in copier, and the step engine's use of them. The
 * masters and their gradients move into page-locked host memory when the
 * optimizer is attached. In backward each bucket's reduced row starts
 * down to host memory on the copy stream as soon as it is seen complete;
 * the step waits for those still on their way, then runs the optimizer
 * over each group a chunk at a time, the 16-bit parameters (or f32 ones)
 * written in its pass into page-locked memory and sent up on the copy
 * stream while the next chunk steps: into the parameters themselves
 * where nothing is partitioned, else into a buffer of this rank's shards
 * on the device, which the refresh all-gathers (or stores, at stage 3).
 * With stage 3's shards in host memory, a prefetch loads them on the copy
 * stream too. */
#include "ds_zero_offload.h"
#include "ds_zero_impl.h"
#include "ds_cuda.h"
#include "ds_error.h"

#include <stdlib.h>
#include <string.h>

#define OFFLOAD_CHUNK (1 << 20)     /* elements: 4 MiB of f32 masters a step of the pipeline */

/* ---------------------------------------------------------------- the pipeline */

static int64_t chunk_len(const ds_offload_plan *p, int64_t i) {
    int64_t lo = i * p->chunk;
    return p->n - lo < p->chunk ? p->n - lo : p->chunk;
}

/* Chunk i's gradients on their way down, marked in slot i % 2. */
static int fetch(const ds_offload_copier *c, const ds_offload_plan *p, int64_t i) {
    if (!p->grad_src || i * p->chunk >= p->n) return 0;
    size_t at = (size_t)(i * p->chunk) * p->grad_size;
    if (c->copy(c->ud, 0, p->grad_dst + at, p->grad_src + at, (size_t)chunk_len(p, i) * p->grad_size)) return -1;
    return c->mark(c->ud, 0, (int)(i % 2));
}

/* Chunk i's parameters on their way up. */
static int send(const ds_offload_copier *c, const ds_offload_plan *p, int64_t i) {
    size_t at = (size_t)(i * p->chunk) * p->param_size;
    return c->copy(c->ud, 1, p->param_dst + at, p->param_src + at, (size_t)chunk_len(p, i) * p->param_size);
}

/* Waits for every copy started in one direction. */
static int settle(const ds_offload_copier *c, int up) { return c->mark(c->ud, up, 0) || c->wait(c->ud, up, 0) ? -1 : 0; }

int ds_offload_run(const ds_offload_copier *c, const ds_offload_plan *p) {
    int64_t chunks = (p->n + p->chunk - 1) / p->chunk;
    int rc = c->start(c->ud);
    if (rc == 0) rc = fetch(c, p, 0);
    for (int64_t i = 0; i < chunks && rc == 0; i++) {
        rc = fetch(c, p, i + 1);
        if (rc == 0 && p->grad_src) rc = c->wait(c->ud, 0, (int)(i % 2));
        if (rc == 0) rc = p->step(p->ud, i * p->chunk, chunk_len(p, i));
        if (rc == 0) rc = send(c, p, i);
    }
    /* the buffers may change once this returns, even after a failure */
    int down = p->grad_src ? settle(c, 0) : 0, up = settle(c, 1);
    return rc || down || up ? -1 : 0;
}

/* ---------------------------------------------------------------- the host's stand-in */

typedef struct {
    struct hcopy { void *dst; const void *src; size_t nb; } *q[2];
    int n[2], cap[2], done[2], marks[2][2];
} hqueue;

static int h_start(void *ud) { (void)ud; return 0; }

static int h_copy(void *ud, int up, void *dst, const void *src, size_t nb) {
    hqueue *h = ud;
    if (h->n[up] == h->cap[up]) {
        int cap = h->cap[up] ? 2 * h->cap[up] : 16;
        struct hcopy *q = realloc(h->q[up], sizeof *q * (size_t)cap);
        if (!q) return ds_fail(DS_ERR_NOMEM, "offload copies: out of memory"), -1;
        h->q[up] = q;
        h->cap[up] = cap;
    }
    h->q[up][h->n[up]++] = (struct hcopy){ dst, src, nb };
    return 0;
}

static int h_mark(void *ud, int up, int slot) {
    hqueue *h = ud;
    h->marks[up][slot] = h->n[up];
    return 0;
}

/* Every copy before the mark; once none is left the queue starts again. */
static int h_wait(void *ud, int up, int slot) {
    hqueue *h = ud;
    for (; h->done[up] < h->marks[up][slot]; h->done[up]++) {
        struct hcopy *c = &h->q[up][h->done[up]];
        memcpy(c->dst, c->src, c->nb);
    }
    if (h->done[up] == h->n[up]) h->n[up] = h->done[up] = h->marks[up][0] = h->marks[up][1] = 0;
    return 0;
}

/* The host is the device here: the copies before the join are made now. */
static int h_join(void *ud, int up) {
    hqueue *h = ud;
    h->marks[up][0] = h->n[up];
    return h_wait(ud, up, 0);
}

static void h_release(void *ud) {
    hqueue *h = ud;
    free(h->q[0]);
    free(h->q[1]);
    free(h);
}

int ds_offload_host_copier(ds_offload_copier *c) {
    hqueue *h = calloc(1, sizeof *h);
    if (!h) return ds_fail(DS_ERR_NOMEM, "offload copies: out of memory"), -1;
    *c = (ds_offload_copier){ h_start, h_copy, h_mark, h_wait, h, h_release, h_join };
    return 0;
}

/* ---------------------------------------------------------------- the step engine's */

struct zoffload {
    ds_offload_copier copier;
    int64_t chunk;
    ds_tensor **shadow;             /* per group: 16-bit parameters, page-locked; NULL for f32 models */
    int fetching, loading;          /* gradient rows started down, shards up, not yet waited for */
    int64_t chunks, rows, shards;   /* stepped, fetched and loaded since the engine began */
};

static int cuda_start(void *ud) { return ds_cuda_copier_start(ud); }
static int cuda_copy(void *ud, int up, void *dst, const void *src, size_t nb) {
    return ds_cuda_copier_copy(ud, up, dst, src, nb);
}
static int cuda_mark(void *ud, int up, int slot) { return ds_cuda_copier_mark(ud, up, slot); }
static int cuda_wait(void *ud, int up, int slot) { return ds_cuda_copier_wait(ud, up, slot); }
static void cuda_release(void *ud) { ds_cuda_copier_free(ud); }
static int cuda_join(void *ud, int up) { return ds_cuda_copier_join(ud, up); }

/* Whether the masters live on the host for parameters on a GPU. */
static bool from_gpu(const ds_zero *z) {
    return z->c.masters && z->n > 0 && z->c.master_device.type == DS_DEV_CPU &&
           ds_zero_param_device(z).type == DS_DEV_CUDA;
}

static void release_copier(zoffload *o) {
    if (o->copier.release) o->copier.release(o->copier.ud);
    o->copier.release = NULL;
}

int ds_zero_offload_use(ds_zero *z, const ds_offload_copier *c, int64_t chunk) {
    if (chunk < 1) return ds_fail(DS_ERR_ARG, "step engine: offload chunk of %lld elements", (long long)chunk), -1;
    zoffload *o = z->offload;
    if (!o && !(o = z->offload = calloc(1, sizeof *o))) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    if (!o->shadow && !(o->shadow = calloc((size_t)z->n_groups + 1, sizeof *o->shadow)))
        return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    if (o->fetching || o->loading)
        return ds_fail(DS_ERR_STATE, "step engine: offload copier changed with copies on their way"), -1;
    release_copier(o);
    o->copier = *c;
    o->chunk = chunk;
    return 0;
}

int ds_zero_offload_on_host(ds_zero *z, int64_t chunk) {
    if (ds_zero_need_masters(z, "offload_on_host")) return -1;
    if (z->c.master_device.type != DS_DEV_CPU || ds_zero_param_device(z).type != DS_DEV_CPU)
        return ds_fail(DS_ERR_STATE, "step engine: offload_on_host is for parameters and masters on the CPU"), -1;
    ds_offload_copier c;
    if (ds_offload_host_copier(&c)) return -1;
    if (ds_zero_offload_use(z, &c, chunk)) {
        c.release(c.ud);
        return -1;
    }
    return 0;
}

bool ds_zero_offload_counts(const ds_zero *z, int64_t *chunks, int64_t *rows, int64_t *shards) {
    if (!z->offload) return false;
    *chunks = z->offload->chunks;
    *rows = z->offload->rows;
    *shards = z->offload->shards;
    return true;
}

/* The GPU's copier, made once, where the device copies asynchronously (a
 * test's stand-in device does not: it steps the plain way). */
static int use_cuda(ds_zero *z) {
    const ds_backend *b = ds_backend_get(ds_zero_param_device(z));
    if ((z->offload && z->offload->copier.copy) || !b || !b->upload) return 0;
    ds_cuda_copier *cuda = ds_cuda_copier_new(ds_zero_param_device(z).index);
    ds_offload_copier c = { cuda_start, cuda_copy, cuda_mark, cuda_wait, cuda, cuda_release, cuda_join };
    if (!cuda || ds_zero_offload_use(z, &c, OFFLOAD_CHUNK)) {
        ds_cuda_copier_free(cuda);
        return -1;
    }
    return 0;
}

int ds_zero_offload_attach(ds_zero *z, ds_optim *o) {
    if (!from_gpu(z)) return 0;
    for (int g = 0; g < z->n_groups; g++) {
        int64_t n = ds_tensor_numel(z->masters[g]);
        ds_tensor *m = ds_tensor_new_staging(1, &n, DS_F32, ds_zero_param_device(z));
        ds_tensor *gr = ds_tensor_new_staging(1, &n, DS_F32, ds_zero_param_device(z));
        int rc = m && gr ? ds_optim_move_flat(o, g, m, gr) : -1;
        if (rc == 0) {
            ds_tensor_set_category(m, DS_MEM_MASTER);
            ds_tensor_set_category(gr, DS_MEM_GRAD);
            ds_tensor_release(z->masters[g]);
            ds_tensor_release(z->master_grads[g]);
            z->masters[g] = m;
            z->master_grads[g] = gr;
        } else {
            ds_tensor_release(m);
            ds_tensor_release(gr);
            return -1;
        }
    }
    return use_cuda(z);
}

int ds_zero_offload_param_loads(ds_zero *z) {
    return ds_zero_param_device(z).type == DS_DEV_CUDA ? use_cuda(z) : 0;
}

/* ---------------------------------------------------------------- gradients in backward */

/* The reduction that made row has completed (its work was seen done), so
 * the copy needs no event after it: it starts now, into page-locked
 * memory the step adds from. */
int ds_zero_offload_fetch(ds_zero *z, ds_tensor *row, ds_tensor **host) {
    zoffload *o = z->offload;
    *host = NULL;
    if (!o || z->c.master_device.type != DS_DEV_CPU) return 0;
    int64_t n = ds_tensor_numel(row);
    ds_tensor *t = ds_tensor_new_staging(1, &n, row->dtype, ds_tensor_device(row));
    if (!t) return -1;
    if (o->copier.copy(o->copier.ud, 0, ds_tensor_data_w(t, "offload gradients"), ds_tensor_data(row),
                       (size_t)n * ds_dtype_size(row->dtype))) {
        ds_tensor_release(t);
        return -1;
    }
    o->fetching++;
    o->rows++;
    *host = t;
    return 0;
}

/* The host waits for the copies of one direction started so far. */
static int settle_copies(zoffload *o, int up, int *pending) {
    if (!*pending) return 0;
    *pending = 0;
    return o->copier.mark(o->copier.ud, up, 0) || o->copier.wait(o->copier.ud, up, 0) ? -1 : 0;
}

int ds_zero_offload_settle(ds_zero *z) { return z->offload ? settle_copies(z->offload, 0, &z->offload->fetching) : 0; }

/* ---------------------------------------------------------------- stage 3's shards ahead */

bool ds_zero_offload_joins(const ds_zero *z) { return z->offload && z->offload->copier.join; }

/* After the compute stream's work so far: send may be memory it still reads. */
int ds_zero_offload_load(ds_zero *z, ds_tensor *send, int n, const int *list) {
    zoffload *o = z->offload;
    if (o->copier.start(o->copier.ud)) return -1;
    char *dst = ds_tensor_data_w(send, "stage 3 gather");
    size_t es = ds_dtype_size(z->dtype);
    for (int k = 0; k < n; k++) {
        zparam *q = &z->p[list[k]];
        if (o->copier.copy(o->copier.ud, 1, dst, ds_tensor_data(q->own), (size_t)q->shard * es)) return -1;
        dst += (size_t)q->shard * es;
        o->loading++;
        o->shards++;
    }
    return 0;
}

int ds_zero_offload_join(ds_zero *z) {
    zoffload *o = z->offload;
    return o->copier.join(o->copier.ud, 1);
}

int ds_zero_offload_settle_up(ds_zero *z) { return z->offload ? settle_copies(z->offload, 1, &z->offload->loading) : 0; }

/* ---------------------------------------------------------------- the step */

/* Masters on the host, an optimizer that steps in pieces and writes the
 * 16-bit copy in its pass, and with nothing partitioned each group's
 * parameters back to back. */
bool ds_zero_offload_takes(const ds_zero *z) {
    if (!z->offload || !z->optim || !ds_zero_fused_step(z) || z->c.master_device.type != DS_DEV_CPU) return false;
    if (z->dtype != DS_F32 && z->dtype != DS_BF16 && z->dtype != DS_F16) return false;
    bool whole = z->parts == 1 && z->c.stage != 3;
    for (int g = 0; g < z->n_groups && whole; g++)
        if (!z->flat_params || !z->flat_params[g]) return false;
    return true;
}

typedef struct {
    ds_zero *z;
    int g;
    const ds_optim_hparams *h;
    double f;
} zpiece;

static int step_piece(void *ud, int64_t lo, int64_t n) {
    zpiece *s = ud;
    ds_tensor *shadow = s->z->offload->shadow[s->g];
    ds_tensor *piece = shadow ? ds_zero_elements(shadow, lo, n) : NULL;
    int rc = shadow && !piece ? -1 : ds_optim_step_piece(s->z->optim, s->g, s->h, lo, n, s->f, piece);
    ds_tensor_release(piece);
    if (rc == 0) s->z->offload->chunks++;
    return rc;
}

/* Group g's 16-bit parameters on the host, made at its first step. */
static ds_tensor *shadow_of(ds_zero *z, int g) {
    ds_tensor **s = &z->offload->shadow[g];
    if (*s || z->dtype == DS_F32) return *s;
    int64_t n = z->group_len[g] > 0 ? z->group_len[g] : 1;
    *s = ds_tensor_new_staging(1, &n, z->dtype, ds_zero_param_device(z));
    if (*s) ds_tensor_set_category(*s, DS_MEM_PARAM);
    return *s;
}

static int step_group(ds_zero *z, int g, const ds_optim_hparams *h, double f, ds_tensor *dst) {
    zoffload *o = z->offload;
    if (z->dtype != DS_F32 && !shadow_of(z, g)) return -1;
    if (ds_optim_begin_pieces(z->optim, g, h)) return -1;
    ds_tensor *src = o->shadow[g] ? o->shadow[g] : z->masters[g];
    zpiece s = { z, g, h, f };
    ds_offload_plan p = { .n = z->group_len[g], .chunk = o->chunk, .param_src = ds_tensor_data(src),
                          .param_dst = ds_tensor_data_w(dst, "offload step"), .param_size = ds_dtype_size(z->dtype),
                          .step = step_piece, .ud = &s };
    if (ds_offload_run(&o->copier, &p)) return -1;
    ds_optim_end_pieces(z->optim, g, h);
    return 0;
}

int ds_zero_offload_step(ds_zero *z, const ds_optim_hparams *h, double f, ds_tensor *const *dst) {
    for (int g = 0; g < z->n_groups; g++)
        if (step_group(z, g, &h[g], f, dst ? dst[g] : z->flat_params[g])) return -1;
    return 0;
}

void ds_zero_offload_free(ds_zero *z) {
    zoffload *o = z->offload;
    if (!o) return;
    for (int g = 0; o->shadow && g < z->n_groups; g++) ds_tensor_release(o->shadow[g]);
    free(o->shadow);
    release_copier(o);
    free(o);
    z->offload = NULL;
}
