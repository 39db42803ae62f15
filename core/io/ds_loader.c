#include "ds_loader.h"
#include "ds_data.h"
#include "ds_error.h"
#include "ds_op_shape.h"
#include "ds_order.h"
#include "ds_upload.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { DS_DATASET_ROWS, DS_DATASET_WINDOWS } dataset_kind;

struct ds_dataset {
    _Atomic int refcount;
    dataset_kind kind;
    int64_t len;
    int nfields;
    char names[DS_DATASET_MAX_FIELDS][DS_DATASET_NAME_MAX];
    ds_tensor *fields[DS_DATASET_MAX_FIELDS];   /* rows: contiguous, leading dim len */
    /* windows, over tokens or over mapped shards (one a segment) */
    ds_tensor *tokens;
    ds_shard *shards;
    int64_t block, stride;
    int nseg;
    int64_t *seg_start;     /* first token of each segment */
    int64_t *seg_first;     /* first sample of each segment; [nseg] = len */
};

static ds_dataset *dataset_alloc(dataset_kind kind) {
    ds_dataset *d = calloc(1, sizeof *d);
    if (!d) return ds_fail(DS_ERR_NOMEM, "dataset: out of memory");
    atomic_init(&d->refcount, 1);
    d->kind = kind;
    return d;
}

ds_dataset *ds_dataset_rows(int nfields, const char *const *names, ds_tensor *const *fields) {
    if (nfields < 1 || nfields > DS_DATASET_MAX_FIELDS)
        return ds_fail(DS_ERR_ARG, "dataset: %d fields, expected 1 to %d", nfields, DS_DATASET_MAX_FIELDS);
    char s[96];
    for (int k = 0; k < nfields; k++) {
        const ds_tensor *t = fields[k];
        if (strlen(names[k]) >= DS_DATASET_NAME_MAX)
            return ds_fail(DS_ERR_ARG, "dataset: field name '%s' is longer than %d bytes", names[k],
                           DS_DATASET_NAME_MAX - 1);
        if (ds_tensor_device(t).type != DS_DEV_CPU)
            return ds_fail(DS_ERR_ARG, "dataset: field '%s' must be on the CPU", names[k]);
        if (t->ndim < 1)
            return ds_fail(DS_ERR_ARG, "dataset: field '%s' is a scalar, expected a leading sample dim", names[k]);
        if (t->shape[0] != fields[0]->shape[0])
            return ds_fail(DS_ERR_ARG, "dataset: field '%s' has shape %s, expected %lld samples like '%s'", names[k],
                           ds_shape_str(t, s, sizeof s), (long long)fields[0]->shape[0], names[0]);
    }
    ds_dataset *d = dataset_alloc(DS_DATASET_ROWS);
    if (!d) return NULL;
    d->len = fields[0]->shape[0];
    for (int k = 0; k < nfields; k++) {
        snprintf(d->names[k], DS_DATASET_NAME_MAX, "%s", names[k]);
        ds_tensor *t = fields[k];
        if (ds_tensor_is_contiguous(t)) {
            ds_tensor_retain(t);
        } else {            /* a private copy: gathers then copy whole rows */
            t = ds_tensor_new(t->ndim, t->shape, t->dtype, DS_CPU_DEVICE);
            if (t && ds_copy_(t, fields[k])) { ds_tensor_release(t); t = NULL; }
        }
        if (!t) { ds_dataset_release(d); return NULL; }
        ds_storage_pin(t->storage, "a dataset (its loader threads read it)");
        d->fields[k] = t;
        d->nfields = k + 1;
    }
    return d;
}

/* The segments' first tokens and samples, the windows' shape: 0 or -1. */
static int windows_index(ds_dataset *d, int nseg, const int64_t *seg_len, int64_t block, int64_t stride) {
    d->seg_start = malloc(sizeof *d->seg_start * (size_t)nseg);
    d->seg_first = malloc(sizeof *d->seg_first * (size_t)(nseg + 1));
    if (!d->seg_start || !d->seg_first) return ds_fail(DS_ERR_NOMEM, "dataset: out of memory"), -1;
    int64_t at = 0, first = 0;
    for (int k = 0; k < nseg; k++) {
        d->seg_start[k] = at;
        d->seg_first[k] = first;
        if (seg_len[k] >= block + 1) first += (seg_len[k] - block - 1) / stride + 1;
        at += seg_len[k];
    }
    d->seg_first[nseg] = first;
    d->nseg = nseg;
    d->len = first;
    d->block = block;
    d->stride = stride;
    d->nfields = 2;
    strcpy(d->names[0], "x");
    strcpy(d->names[1], "y");
    return 0;
}

static int check_window(int64_t block, int64_t stride) {
    if (block >= 1 && stride >= 1) return 0;
    return ds_fail(DS_ERR_ARG, "dataset: block_size %lld and stride %lld must be at least 1", (long long)block,
                   (long long)stride), -1;
}

ds_dataset *ds_dataset_windows(ds_tensor *tokens, int nseg, const int64_t *seg_len, int64_t block, int64_t stride) {
    char s[96];
    if (ds_tensor_device(tokens).type != DS_DEV_CPU || tokens->ndim != 1 || !ds_tensor_is_contiguous(tokens) ||
        !(tokens->dtype == DS_U8 || tokens->dtype == DS_I32 || tokens->dtype == DS_I64))
        return ds_fail(DS_ERR_ARG, "dataset: tokens must be a contiguous 1-D CPU tensor of u8, i32 or i64, got %s %s",
                       ds_dtype_name(tokens->dtype), ds_shape_str(tokens, s, sizeof s));
    if (check_window(block, stride)) return NULL;
    int64_t sum = 0, longest = 0;
    for (int k = 0; k < nseg; k++) {
        sum += seg_len[k];
        if (seg_len[k] > longest) longest = seg_len[k];
    }
    if (nseg < 1 || sum != tokens->shape[0])
        return ds_fail(DS_ERR_ARG, "dataset: %d segments of %lld tokens in all, the tokens hold %lld", nseg,
                       (long long)sum, (long long)tokens->shape[0]);
    if (longest < block + 1)
        return ds_fail(DS_ERR_ARG, "dataset: block_size %lld needs %lld tokens (inputs and next-token targets), "
                       "the longest sequence has %lld", (long long)block, (long long)block + 1, (long long)longest);
    ds_dataset *d = dataset_alloc(DS_DATASET_WINDOWS);
    if (!d) return NULL;
    if (windows_index(d, nseg, seg_len, block, stride)) {
        ds_dataset_release(d);
        return NULL;
    }
    ds_tensor_retain(tokens);
    ds_storage_pin(tokens->storage, "a dataset (its loader threads read it)");
    d->tokens = tokens;
    return d;
}

/* Maps the shards and checks each holds a window; their lengths to len. */
static int map_shards(ds_dataset *d, int nfiles, const char *const *paths, int64_t block, int64_t vocab,
                      int64_t *len) {
    d->shards = calloc((size_t)nfiles, sizeof *d->shards);
    if (!d->shards) return ds_fail(DS_ERR_NOMEM, "dataset: out of memory"), -1;
    d->nseg = nfiles;
    for (int k = 0; k < nfiles; k++) {
        if (ds_shard_map(paths[k], vocab, &d->shards[k])) return -1;
        len[k] = d->shards[k].ntok;
        if (len[k] < block + 1)
            return ds_fail(DS_ERR_ARG, "%s: %lld token%s, a window of block_size %lld needs %lld", paths[k],
                           (long long)len[k], len[k] == 1 ? "" : "s", (long long)block, (long long)block + 1), -1;
    }
    return 0;
}

ds_dataset *ds_dataset_shards(int nfiles, const char *const *paths, int64_t block, int64_t stride, int64_t vocab,
                              int64_t *len) {
    if (nfiles < 1) return ds_fail(DS_ERR_ARG, "shards: no files given");
    if (check_window(block, stride)) return NULL;
    ds_dataset *d = dataset_alloc(DS_DATASET_WINDOWS);
    if (!d) return NULL;
    if (map_shards(d, nfiles, paths, block, vocab, len) || windows_index(d, nfiles, len, block, stride)) {
        ds_dataset_release(d);
        return NULL;
    }
    return d;
}

void ds_dataset_retain(ds_dataset *d) { atomic_fetch_add(&d->refcount, 1); }

void ds_dataset_release(ds_dataset *d) {
    if (!d || atomic_fetch_sub(&d->refcount, 1) != 1) return;
    for (int k = 0; k < d->nfields && d->kind == DS_DATASET_ROWS; k++) {
        ds_storage_unpin(d->fields[k]->storage);
        ds_tensor_release(d->fields[k]);
    }
    if (d->tokens) ds_storage_unpin(d->tokens->storage);
    ds_tensor_release(d->tokens);
    for (int k = 0; d->shards && k < d->nseg; k++) ds_shard_unmap(&d->shards[k]);
    free(d->shards);
    free(d->seg_start);
    free(d->seg_first);
    free(d);
}

int64_t ds_dataset_len(const ds_dataset *d) { return d->len; }
int ds_dataset_nfields(const ds_dataset *d) { return d->nfields; }
const char *ds_dataset_field_name(const ds_dataset *d, int k) { return d->names[k]; }

int ds_dataset_check_indices(const ds_dataset *d, const int64_t *idx, int64_t n) {
    for (int64_t b = 0; b < n; b++)
        if (idx[b] < 0 || idx[b] >= d->len) {
            ds_fail(DS_ERR_ARG, "dataset: sample index %lld (0-based) out of range for %lld samples",
                    (long long)idx[b], (long long)d->len);
            return -1;
        }
    return 0;
}

static int gather_rows(const ds_dataset *d, const int64_t *idx, int64_t n, ds_device dev, ds_tensor **out) {
    for (int k = 0; k < d->nfields; k++) {
        const ds_tensor *f = d->fields[k];
        int64_t shape[DS_MAX_DIMS];
        memcpy(shape, f->shape, sizeof shape);
        shape[0] = n;
        out[k] = ds_tensor_new_staging(f->ndim, shape, f->dtype, dev);
        if (!out[k]) return -1;
        size_t row = (size_t)(f->shape[0] ? ds_tensor_numel(f) / f->shape[0] : 0) * ds_dtype_size(f->dtype);
        const char *src = ds_tensor_data(f);
        char *dst = ds_tensor_data(out[k]);
        for (int64_t b = 0; b < n; b++) memcpy(dst + (size_t)b * row, src + (size_t)idx[b] * row, row);
    }
    return 0;
}

static void copy_tokens(int64_t *dst, const ds_tensor *tokens, int64_t at, int64_t n) {
    const void *src = ds_tensor_data(tokens);
    switch (tokens->dtype) {
    case DS_U8:
        for (int64_t t = 0; t < n; t++) dst[t] = ((const uint8_t *)src)[at + t];
        break;
    case DS_I32:
        for (int64_t t = 0; t < n; t++) dst[t] = ((const int32_t *)src)[at + t];
        break;
    default:
        memcpy(dst, (const int64_t *)src + at, sizeof *dst * (size_t)n);
    }
}

static void copy_shard(int64_t *dst, const ds_shard *s, int64_t at, int64_t n) {
    for (int64_t t = 0; t < n; t++) dst[t] = ds_shard_token(s, at + t);
}

static int gather_windows(const ds_dataset *d, const int64_t *idx, int64_t n, ds_device dev, ds_tensor **out) {
    int64_t shape[2] = { n, d->block };
    out[0] = ds_tensor_new_staging(2, shape, DS_I64, dev);
    out[1] = out[0] ? ds_tensor_new_staging(2, shape, DS_I64, dev) : NULL;
    if (!out[1]) return -1;
    int64_t *x = ds_tensor_data(out[0]), *y = ds_tensor_data(out[1]);
    for (int64_t b = 0; b < n; b++) {
        int lo = 0, hi = d->nseg - 1;       /* the last segment starting at or before the sample */
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (d->seg_first[mid] <= idx[b]) lo = mid;
            else hi = mid - 1;
        }
        int64_t p = (idx[b] - d->seg_first[lo]) * d->stride;
        if (d->shards) {
            copy_shard(x + b * d->block, &d->shards[lo], p, d->block);
            copy_shard(y + b * d->block, &d->shards[lo], p + 1, d->block);
            ds_shard_drop(&d->shards[lo], p, d->block + 1);
        } else {
            copy_tokens(x + b * d->block, d->tokens, d->seg_start[lo] + p, d->block);
            copy_tokens(y + b * d->block, d->tokens, d->seg_start[lo] + p + 1, d->block);
        }
    }
    return 0;
}

int ds_dataset_gather(const ds_dataset *d, const int64_t *idx, int64_t n, ds_device dev, ds_tensor **out) {
    for (int k = 0; k < d->nfields; k++) out[k] = NULL;
    if (n < 0) { ds_fail(DS_ERR_ARG, "dataset: negative batch size %lld", (long long)n); return -1; }
    if (ds_dataset_check_indices(d, idx, n)) return -1;
    int rc = d->kind == DS_DATASET_ROWS ? gather_rows(d, idx, n, dev, out) : gather_windows(d, idx, n, dev, out);
    if (rc)
        for (int k = 0; k < d->nfields; k++) {
            ds_tensor_release(out[k]);
            out[k] = NULL;
        }
    return rc;
}

ds_tensor *ds_dataset_permutation(int64_t n, uint64_t seed) {
    ds_tensor *t = ds_tensor_new(1, &n, DS_I64, DS_CPU_DEVICE);
    if (!t) return NULL;
    int64_t *p = ds_tensor_data(t);
    ds_shuffle s;
    ds_shuffle_init(&s, n, seed);
    for (int64_t i = 0; i < n; i++) p[i] = ds_shuffle_at(&s, i);
    return t;
}

/* ---- prefetch threads ---- */

typedef enum { SLOT_FREE, SLOT_QUEUED, SLOT_BUSY, SLOT_READY, SLOT_FAILED } slot_state;

typedef struct {
    slot_state state;
    int64_t *idx, n, cap;
    ds_tensor *out[DS_DATASET_MAX_FIELDS];
    char err[1024];
} slot;

/* Batches carry sequence numbers: head (next to take) <= next_job (next to
 * gather) <= tail (next to submit), and tail - head <= depth. The slot of
 * batch s is slots[s % depth]. On a device, `ahead` is the batch taken
 * from the ring and on its way up (or, when ahead_failed, ahead_err says
 * why it is not), which the next ds_loader_next hands out; the caller's
 * thread alone touches them. */
struct ds_loader {
    ds_dataset *d;
    int nworkers, nthreads, depth;
    ds_device dev;
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    slot *slots;
    int64_t head, next_job, tail;
    bool stop;
    ds_upload *ahead;
    bool ahead_failed;
    char ahead_err[1024];
};

static void gather_slot(ds_loader *l, slot *s) {
    if (ds_dataset_gather(l->d, s->idx, s->n, l->dev, s->out))
        snprintf(s->err, sizeof s->err, "%s", ds_error_message());
}

static void *worker(void *arg) {
    ds_loader *l = arg;
    pthread_mutex_lock(&l->mu);
    for (;;) {
        while (!l->stop && l->next_job == l->tail) pthread_cond_wait(&l->work, &l->mu);
        if (l->stop) break;
        slot *s = &l->slots[l->next_job++ % l->depth];
        s->state = SLOT_BUSY;
        pthread_mutex_unlock(&l->mu);
        gather_slot(l, s);          /* the slot is this thread's until marked done */
        pthread_mutex_lock(&l->mu);
        s->state = s->out[0] ? SLOT_READY : SLOT_FAILED;
        pthread_cond_broadcast(&l->done);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

ds_loader *ds_loader_new(ds_dataset *d, int num_workers, int depth, ds_device dev) {
    if (num_workers < 0 || num_workers > 256)
        return ds_fail(DS_ERR_ARG, "loader: num_workers %d, expected 0 to 256", num_workers);
    if (depth < 1 || depth > 4096) return ds_fail(DS_ERR_ARG, "loader: depth %d, expected 1 to 4096", depth);
    if (ds_device_check("loader", dev)) return NULL;
    ds_loader *l = calloc(1, sizeof *l);
    slot *slots = calloc((size_t)depth, sizeof *slots);
    pthread_t *threads = calloc((size_t)(num_workers ? num_workers : 1), sizeof *threads);
    if (!l || !slots || !threads) {
        free(l);
        free(slots);
        free(threads);
        return ds_fail(DS_ERR_NOMEM, "loader: out of memory");
    }
    ds_dataset_retain(d);
    l->d = d;
    l->nworkers = num_workers;
    l->depth = depth;
    l->dev = dev;
    l->slots = slots;
    l->threads = threads;
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->work, NULL);
    pthread_cond_init(&l->done, NULL);
    for (; l->nthreads < num_workers; l->nthreads++) {
        int rc = pthread_create(&l->threads[l->nthreads], NULL, worker, l);
        if (rc) {
            ds_loader_free(l);
            return ds_fail(DS_ERR_STATE, "loader: cannot start worker thread %d of %d (%s)", l->nthreads + 1,
                           num_workers, strerror(rc));
        }
    }
    return l;
}

int ds_loader_submit(ds_loader *l, const int64_t *idx, int64_t n) {
    if (n < 1) { ds_fail(DS_ERR_ARG, "loader: a batch needs at least one sample, got %lld", (long long)n); return -1; }
    if (ds_dataset_check_indices(l->d, idx, n)) return -1;
    pthread_mutex_lock(&l->mu);
    int rc = -1;
    slot *s = &l->slots[l->tail % l->depth];
    int64_t *grown = NULL;
    if (l->tail - l->head == l->depth) {
        ds_fail(DS_ERR_STATE, "loader: %d batches already queued; take one first", l->depth);
    } else if (s->cap < n && !(grown = realloc(s->idx, sizeof *s->idx * (size_t)n))) {
        ds_fail(DS_ERR_NOMEM, "loader: out of memory for %lld indices", (long long)n);
    } else {
        if (grown) {
            s->idx = grown;
            s->cap = n;
        }
        memcpy(s->idx, idx, sizeof *idx * (size_t)n);
        s->n = n;
        s->state = SLOT_QUEUED;
        l->tail++;
        pthread_cond_signal(&l->work);
        rc = 0;
    }
    pthread_mutex_unlock(&l->mu);
    return rc;
}

int ds_loader_queued(ds_loader *l) {
    pthread_mutex_lock(&l->mu);
    int n = (int)(l->tail - l->head);
    pthread_mutex_unlock(&l->mu);
    return n;
}

int ds_loader_depth(const ds_loader *l) { return l->depth; }

/* The oldest submitted batch as gathered (CPU tensors). */
static int take_gathered(ds_loader *l, ds_tensor **out) {
    pthread_mutex_lock(&l->mu);
    if (l->head == l->tail) {
        pthread_mutex_unlock(&l->mu);
        ds_fail(DS_ERR_STATE, "loader: no batch was submitted");
        return -1;
    }
    slot *s = &l->slots[l->head % l->depth];
    if (l->nworkers == 0) {         /* no threads: gather here */
        l->next_job++;
        s->state = SLOT_BUSY;
        pthread_mutex_unlock(&l->mu);
        gather_slot(l, s);
        pthread_mutex_lock(&l->mu);
        s->state = s->out[0] ? SLOT_READY : SLOT_FAILED;
    }
    while (s->state == SLOT_QUEUED || s->state == SLOT_BUSY) pthread_cond_wait(&l->done, &l->mu);
    l->head++;
    int rc = 0;
    if (s->state == SLOT_FAILED) {
        ds_fail(DS_ERR_STATE, "%s", s->err);
        rc = -1;
    }
    for (int k = 0; k < l->d->nfields; k++) {
        out[k] = s->out[k];
        s->out[k] = NULL;
    }
    s->state = SLOT_FREE;
    pthread_mutex_unlock(&l->mu);
    return rc;
}

/* Takes the oldest submitted batch from the ring and starts its upload. */
static void send_ahead(ds_loader *l) {
    ds_tensor *host[DS_DATASET_MAX_FIELDS];
    int rc = take_gathered(l, host);
    if (rc == 0) {
        l->ahead = ds_upload_start(host, l->d->nfields, l->dev);
        rc = l->ahead ? 0 : -1;
    }
    if (rc) {
        l->ahead_failed = true;
        snprintf(l->ahead_err, sizeof l->ahead_err, "%s", ds_error_message());
    }
    for (int k = 0; k < l->d->nfields; k++) ds_tensor_release(host[k]);
}

int ds_loader_next(ds_loader *l, ds_tensor **out) {
    if (l->dev.type == DS_DEV_CPU) return take_gathered(l, out);
    for (int k = 0; k < l->d->nfields; k++) out[k] = NULL;
    if (!l->ahead && !l->ahead_failed) {       /* nothing sent ahead: the first batch, or after a drain */
        if (ds_loader_queued(l) == 0) return take_gathered(l, out);     /* says none is queued */
        send_ahead(l);
    }
    int rc = 0;
    if (l->ahead_failed) {
        ds_fail(DS_ERR_STATE, "%s", l->ahead_err);
        l->ahead_failed = false;
        rc = -1;
    } else {
        rc = ds_upload_take(l->ahead, out);
        l->ahead = NULL;
    }
    if (ds_loader_queued(l) > 0) {
        /* batch k+1 starts up now, while the device computes step k; its
         * error waits for its own take, after this batch's success */
        char err[1024];
        if (rc) snprintf(err, sizeof err, "%s", ds_error_message());
        send_ahead(l);
        if (rc) ds_fail(DS_ERR_STATE, "%s", err);
    }
    return rc;
}

void ds_loader_drain(ds_loader *l) {
    ds_upload_free(l->ahead);
    l->ahead = NULL;
    l->ahead_failed = false;
    pthread_mutex_lock(&l->mu);
    l->tail = l->next_job;          /* batches no worker has started are dropped now */
    for (int64_t b = l->head; b < l->tail; b++) {
        slot *s = &l->slots[b % l->depth];
        while (s->state == SLOT_BUSY) pthread_cond_wait(&l->done, &l->mu);
    }
    for (int k = 0; k < l->depth; k++) {
        slot *s = &l->slots[k];
        for (int f = 0; f < l->d->nfields; f++) {
            ds_tensor_release(s->out[f]);
            s->out[f] = NULL;
        }
        s->state = SLOT_FREE;
    }
    l->head = l->tail;
    pthread_mutex_unlock(&l->mu);
}

void ds_loader_free(ds_loader *l) {
    if (!l) return;
    ds_loader_drain(l);
    pthread_mutex_lock(&l->mu);
    l->stop = true;
    pthread_cond_broadcast(&l->work);
    pthread_mutex_unlock(&l->mu);
    for (int k = 0; k < l->nthreads; k++) pthread_join(l->threads[k], NULL);
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->work);
    pthread_cond_destroy(&l->done);
    for (int k = 0; k < l->depth; k++) free(l->slots[k].idx);
    free(l->slots);
    free(l->threads);
    ds_dataset_release(l->d);
    free(l);
}
