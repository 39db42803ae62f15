/* ZeRO-Offload's step from a GPU: the pipeline of chunks (ds_offload_run)
 * and the step engine's use of it. The masters and their gradients move
 * into page-locked host memory when the optimizer is attached; a step
 * runs the optimizer over each group a chunk at a time, the 16-bit
 * parameters (or f32 ones) written in its pass into page-locked memory
 * and sent up on the copy stream while the next chunk steps. */
#include "ds_zero_offload.h"
#include "ds_zero_impl.h"
#include "ds_cuda.h"
#include "ds_error.h"

#include <stdlib.h>

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

/* ---------------------------------------------------------------- the step engine's */

struct zoffload {
    ds_offload_copier copier;
    ds_cuda_copier *cuda;           /* behind copier on a GPU */
    int64_t chunk;
    ds_tensor **shadow;             /* per group: 16-bit parameters, page-locked; NULL for f32 models */
};

static int cuda_start(void *ud) { return ds_cuda_copier_start(ud); }
static int cuda_copy(void *ud, int up, void *dst, const void *src, size_t nb) {
    return ds_cuda_copier_copy(ud, up, dst, src, nb);
}
static int cuda_mark(void *ud, int up, int slot) { return ds_cuda_copier_mark(ud, up, slot); }
static int cuda_wait(void *ud, int up, int slot) { return ds_cuda_copier_wait(ud, up, slot); }

/* Whether the masters live on the host for parameters on a GPU. */
static bool from_gpu(const ds_zero *z) {
    return z->c.masters && z->n > 0 && z->c.master_device.type == DS_DEV_CPU &&
           ds_zero_param_device(z).type == DS_DEV_CUDA;
}

int ds_zero_offload_use(ds_zero *z, const ds_offload_copier *c, int64_t chunk) {
    if (chunk < 1) return ds_fail(DS_ERR_ARG, "step engine: offload chunk of %lld elements", (long long)chunk), -1;
    zoffload *o = z->offload;
    if (!o && !(o = z->offload = calloc(1, sizeof *o))) return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    if (!o->shadow && !(o->shadow = calloc((size_t)z->n_groups + 1, sizeof *o->shadow)))
        return ds_fail(DS_ERR_NOMEM, "step engine: out of memory"), -1;
    o->copier = *c;
    o->chunk = chunk;
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
    /* a device without asynchronous copies (a test's stand-in) steps the plain way */
    const ds_backend *b = ds_backend_get(ds_zero_param_device(z));
    if (!b || !b->upload) return 0;
    ds_cuda_copier *cuda = ds_cuda_copier_new(ds_zero_param_device(z).index);
    ds_offload_copier c = { cuda_start, cuda_copy, cuda_mark, cuda_wait, cuda };
    if (!cuda || ds_zero_offload_use(z, &c, OFFLOAD_CHUNK)) {
        ds_cuda_copier_free(cuda);
        return -1;
    }
    z->offload->cuda = cuda;
    return 0;
}

/* Whether this step can take the pipeline: masters whole on the host
 * beside each group's parameters back to back, an optimizer that steps in
 * pieces and writes the 16-bit copy in its pass. */
static bool fits(const ds_zero *z) {
    if (!z->offload || !z->optim || !ds_zero_fused_step(z) || z->parts != 1 || z->c.stage == 3 || !z->flat_params ||
        z->c.master_device.type != DS_DEV_CPU)
        return false;
    if (z->dtype != DS_F32 && z->dtype != DS_BF16 && z->dtype != DS_F16) return false;
    for (int g = 0; g < z->n_groups; g++)
        if (!z->flat_params[g]) return false;
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
    return rc;
}

/* Group g's 16-bit parameters on the host, made at its first step. */
static ds_tensor *shadow_of(ds_zero *z, int g) {
    ds_tensor **s = &z->offload->shadow[g];
    if (*s || z->dtype == DS_F32) return *s;
    *s = ds_tensor_new_staging(1, &z->group_len[g], z->dtype, ds_tensor_device(z->flat_params[g]));
    if (*s) ds_tensor_set_category(*s, DS_MEM_PARAM);
    return *s;
}

static int step_group(ds_zero *z, int g, const ds_optim_hparams *h, double f) {
    zoffload *o = z->offload;
    if (z->dtype != DS_F32 && !shadow_of(z, g)) return -1;
    if (ds_optim_begin_pieces(z->optim, g, h)) return -1;
    ds_tensor *src = o->shadow[g] ? o->shadow[g] : z->masters[g];
    zpiece s = { z, g, h, f };
    ds_offload_plan p = { .n = z->group_len[g], .chunk = o->chunk, .param_src = ds_tensor_data(src),
                          .param_dst = ds_tensor_data_w(z->flat_params[g], "offload step"), .param_size = ds_dtype_size(z->dtype),
                          .step = step_piece, .ud = &s };
    if (ds_offload_run(&o->copier, &p)) return -1;
    ds_optim_end_pieces(z->optim, g, h);
    return 0;
}

int ds_zero_offload_step(ds_zero *z, const ds_optim_hparams *h, double f) {
    if (!fits(z)) return 1;
    for (int g = 0; g < z->n_groups; g++)
        if (step_group(z, g, &h[g], f)) return -1;
    return 0;
}

void ds_zero_offload_free(ds_zero *z) {
    zoffload *o = z->offload;
    if (!o) return;
    for (int g = 0; o->shadow && g < z->n_groups; g++) ds_tensor_release(o->shadow[g]);
    free(o->shadow);
    ds_cuda_copier_free(o->cuda);
    free(o);
    z->offload = NULL;
}
