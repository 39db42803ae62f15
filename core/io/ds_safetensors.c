#define _GNU_SOURCE          /* sync_file_range */
#include "ds_safetensors.h"
#include "ds_error.h"
#include "ds_file.h"
#include "ds_ops.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

/* A header larger than this is not one a writer made: refuse it before
 * allocating. */
#define MAX_HEADER ((int64_t)100 << 20)
#define CHUNK ((size_t)8 << 20)

static const char *const st_names[DS_NDTYPES] = {
    [DS_F32] = "F32", [DS_F64] = "F64", [DS_BF16] = "BF16", [DS_F16] = "F16",
    [DS_I32] = "I32", [DS_I64] = "I64", [DS_U8] = "U8", [DS_BOOL] = "BOOL",
};

static int st_dtype(const char *s) {
    for (int i = 0; i < DS_NDTYPES; i++)
        if (st_names[i] && strcmp(s, st_names[i]) == 0) return i;
    return -1;
}

/* ---------------------------------------------------------------- saving */

/* The header: each tensor's entry in order, then __metadata__, padded
 * with spaces to a multiple of 8. NULL with the error set. */
static char *make_header(int n, const char *const *names, ds_tensor *const *tensors, int n_meta,
                         const char *const *keys, const char *const *values, int64_t *len) {
    cJSON *root = cJSON_CreateObject();
    int64_t at = 0;
    for (int i = 0; root && i < n; i++) {
        const ds_tensor *t = tensors[i];
        int64_t bytes = ds_tensor_numel(t) * (int64_t)ds_dtype_size(t->dtype);
        cJSON *e = cJSON_CreateObject(), *shape = cJSON_CreateArray(), *off = cJSON_CreateArray();
        bool ok = e && shape && off && cJSON_AddStringToObject(e, "dtype", st_names[t->dtype]);
        for (int d = 0; ok && d < t->ndim; d++) ok = cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)t->shape[d]));
        ok = ok && cJSON_AddItemToArray(off, cJSON_CreateNumber((double)at)) &&
             cJSON_AddItemToArray(off, cJSON_CreateNumber((double)(at + bytes)));
        if (ok) {
            cJSON_AddItemToObject(e, "shape", shape);
            cJSON_AddItemToObject(e, "data_offsets", off);
            cJSON_AddItemToObject(root, names[i], e);
        } else {
            cJSON_Delete(e);
            cJSON_Delete(shape);
            cJSON_Delete(off);
            cJSON_Delete(root);
            root = NULL;
        }
        at += bytes;
    }
    if (root && n_meta > 0) {
        cJSON *meta = cJSON_AddObjectToObject(root, "__metadata__");
        for (int i = 0; meta && i < n_meta; i++)
            if (!cJSON_AddStringToObject(meta, keys[i], values[i])) meta = NULL;
        if (!meta) {
            cJSON_Delete(root);
            root = NULL;
        }
    }
    char *text = root ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!text) return ds_fail(DS_ERR_NOMEM, "safetensors: out of memory building the header");
    size_t tl = strlen(text);
    size_t padded = (tl + 7) / 8 * 8;
    char *out = malloc(padded);
    if (!out) {
        cJSON_free(text);
        return ds_fail(DS_ERR_NOMEM, "safetensors: out of memory building the header");
    }
    memcpy(out, text, tl);
    memset(out + tl, ' ', padded - tl);
    cJSON_free(text);
    *len = (int64_t)padded;
    return out;
}

/* The bytes a save hashes: the 8-byte length and the header, then each
 * tensor's host bytes, the same memory the writer writes from. */
typedef struct {
    const void *head[2];
    size_t head_len[2];
    int n;
    ds_tensor **hosts;
    ds_sha256 *file_hash;
    uint32_t *crc;              /* NULL, or one per tensor */
    int rc;
} hash_job;

static size_t host_bytes(const ds_tensor *t) { return (size_t)ds_tensor_numel(t) * ds_dtype_size(t->dtype); }

/* Hashes a save's bytes in file order: on its own thread, so the hashing
 * runs while the writer writes (both read the host bytes, neither
 * changes them), and a save takes about as long as its write. */
static void *hash_all(void *arg) {
    hash_job *j = arg;
    for (int k = 0; k < 2 && j->rc == 0; k++) j->rc = ds_sha256_update(j->file_hash, j->head[k], j->head_len[k]);
    for (int i = 0; i < j->n && j->rc == 0; i++) {
        const char *p = ds_tensor_data(j->hosts[i]);
        size_t bytes = host_bytes(j->hosts[i]);
        uLong crc = crc32(0L, Z_NULL, 0);
        for (size_t done = 0; done < bytes && j->rc == 0; done += CHUNK) {
            size_t step = bytes - done < CHUNK ? bytes - done : CHUNK;
            j->rc = ds_sha256_update(j->file_hash, p + done, step);
            if (j->crc) crc = crc32(crc, (const Bytef *)p + done, (uInt)step);
        }
        if (j->crc) j->crc[i] = (uint32_t)crc;
    }
    return NULL;
}

typedef struct {
    int fd;
    const char *path;
    int64_t written, data_written, kill_after;
} writer;

/* Writes n bytes. Each piece's writeback starts at once
 * (sync_file_range), so the disk works while the next pieces are written
 * and the final fsync has little left to wait for. */
static int put(writer *w, const char *p, size_t n) {
    for (size_t left = n; left > 0;) {
        ssize_t got = write(w->fd, p, left);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return ds_fail(DS_ERR_IO, "cannot write '%s': %s", w->path, strerror(errno)), -1;
        p += got;
        left -= (size_t)got;
    }
    sync_file_range(w->fd, w->written, (off_t)n, SYNC_FILE_RANGE_WRITE);     /* a hint: errors show at fsync */
    w->written += (int64_t)n;
    return 0;
}

/* Tensor bytes in pieces; the kill hook fires at exactly kill_after
 * data bytes. */
static int put_data(writer *w, const char *p, size_t n) {
    for (size_t done = 0; done < n;) {
        size_t step = n - done < CHUNK ? n - done : CHUNK;
        if (w->kill_after >= 0) {
            if (w->data_written >= w->kill_after) raise(SIGKILL);
            if ((int64_t)step > w->kill_after - w->data_written) step = (size_t)(w->kill_after - w->data_written);
        }
        if (put(w, p + done, step)) return -1;
        done += step;
        w->data_written += (int64_t)step;
    }
    if (w->kill_after >= 0 && w->data_written >= w->kill_after) raise(SIGKILL);
    return 0;
}

/* t's bytes in host memory, contiguous: t itself, or a copy of another
 * device's tensor or of a strided view. */
static ds_tensor *host_copy(const char *path, const char *name, ds_tensor *t) {
    ds_tensor *host = t;
    ds_tensor_retain(host);
    if (!ds_device_equal(ds_tensor_device(t), DS_CPU_DEVICE)) {
        ds_tensor *c = ds_to_device(host, DS_CPU_DEVICE);
        ds_tensor_release(host);
        host = c;
    }
    if (host && !ds_tensor_is_contiguous(host)) {
        ds_tensor *c = ds_contiguous(host);
        ds_tensor_release(host);
        host = c;
    }
    if (!host) return ds_fail(DS_ERR_STATE, "safetensors: '%s': tensor '%s': %s", path, name, ds_error_message());
    return host;
}

/* Writes the file under tmp: the bytes by this thread, their hashes by
 * another meanwhile. */
static int write_file(const char *tmp, hash_job *job, int64_t kill_after, ds_safetensors_saved *out) {
    writer w = { ds_file_open(tmp, DS_FILE_WRITE, 0), tmp, 0, 0, kill_after };
    if (w.fd < 0) return -1;
    pthread_t th;
    bool threaded = pthread_create(&th, NULL, hash_all, job) == 0;
    if (!threaded) hash_all(job);
    int rc = 0;
    for (int k = 0; k < 2 && rc == 0; k++) rc = put(&w, job->head[k], job->head_len[k]);
    for (int i = 0; i < job->n && rc == 0; i++) rc = put_data(&w, ds_tensor_data(job->hosts[i]), host_bytes(job->hosts[i]));
    if (threaded) pthread_join(th, NULL);
    if (rc == 0 && job->rc) rc = -1, ds_fail(DS_ERR_STATE, "safetensors: '%s': OpenSSL's SHA-256 failed", tmp);
    if (rc == 0 && fsync(w.fd) != 0) rc = -1, ds_fail(DS_ERR_IO, "cannot fsync '%s': %s", tmp, strerror(errno));
    if (close(w.fd) != 0 && rc == 0) rc = -1, ds_fail(DS_ERR_IO, "cannot close '%s': %s", tmp, strerror(errno));
    out->bytes = w.written;
    return rc;
}

int ds_safetensors_save(const char *path, int n, const char *const *names, ds_tensor *const *tensors, int n_meta,
                        const char *const *meta_keys, const char *const *meta_values,
                        uint32_t *tensor_crc32, int64_t kill_after, ds_safetensors_saved *out) {
    for (int i = 0; i < n; i++) {
        if (ds_tensor_is_released(tensors[i]))
            return ds_fail(DS_ERR_ARG, "safetensors: '%s': tensor '%s' is released (a partitioned parameter)", path,
                           names[i]), -1;
        if (strcmp(names[i], "__metadata__") == 0)
            return ds_fail(DS_ERR_ARG, "safetensors: '%s': '__metadata__' cannot name a tensor", path), -1;
    }
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp)
        return ds_fail(DS_ERR_ARG, "safetensors: path too long: '%s'", path), -1;
    int64_t hlen = 0;
    char *header = make_header(n, names, tensors, n_meta, meta_keys, meta_values, &hlen);
    ds_tensor **hosts = calloc((size_t)n + 1, sizeof *hosts);
    int rc = header && hosts ? 0 : -1;
    if (header && !hosts) ds_fail(DS_ERR_NOMEM, "safetensors: out of memory saving '%s'", path);
    for (int i = 0; i < n && rc == 0; i++)
        if (!(hosts[i] = host_copy(path, names[i], tensors[i]))) rc = -1;
    unsigned char len8[8];
    for (int b = 0; b < 8; b++) len8[b] = (unsigned char)((uint64_t)hlen >> (8 * b));
    hash_job job = { { len8, header }, { 8, (size_t)hlen }, n, hosts, NULL, tensor_crc32, 0 };
    if (rc == 0 && !(job.file_hash = ds_sha256_new())) rc = -1;
    if (rc == 0) rc = write_file(tmp, &job, kill_after, out);
    if (rc == 0) {
        rc = ds_sha256_final(job.file_hash, out->sha256);
        job.file_hash = NULL;
    }
    ds_sha256_free(job.file_hash);
    for (int i = 0; hosts && i < n; i++) ds_tensor_release(hosts[i]);
    free(hosts);
    free(header);
    if (rc == 0 && rename(tmp, path) != 0)
        rc = -1, ds_fail(DS_ERR_IO, "cannot rename '%s' to '%s': %s", tmp, path, strerror(errno));
    if (rc) unlink(tmp);
    return rc;
}

/* ---------------------------------------------------------------- reading */

struct ds_safetensors_file {
    int fd;
    char *path;
    cJSON *root;                    /* names point into it */
    int64_t data_start, data_size;
    int n, n_meta;
    ds_safetensors_entry *e;
    const ds_safetensors_entry **by_name;     /* e sorted by name, for find */
    const char **meta_keys, **meta_values;
};

const char *ds_safetensors_path(const ds_safetensors_file *f) { return f->path; }
int ds_safetensors_count(const ds_safetensors_file *f) { return f->n; }
const ds_safetensors_entry *ds_safetensors_entry_at(const ds_safetensors_file *f, int i) { return &f->e[i]; }
int ds_safetensors_n_metadata(const ds_safetensors_file *f) { return f->n_meta; }

void ds_safetensors_metadata_at(const ds_safetensors_file *f, int i, const char **key, const char **value) {
    *key = f->meta_keys[i];
    *value = f->meta_values[i];
}

static int by_name(const void *a, const void *b) {
    return strcmp((*(const ds_safetensors_entry *const *)a)->name, (*(const ds_safetensors_entry *const *)b)->name);
}

static int by_offset(const void *a, const void *b) {
    const ds_safetensors_entry *x = *(const ds_safetensors_entry *const *)a, *y = *(const ds_safetensors_entry *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return (x->end > y->end) - (x->end < y->end);
}

/* A binary search of the sorted index: a file of many tensors read one
 * by one stays n log n. */
int ds_safetensors_find(const ds_safetensors_file *f, const char *name) {
    ds_safetensors_entry key = { .name = name };
    const ds_safetensors_entry *k = &key, **hit = bsearch(&k, f->by_name, (size_t)f->n, sizeof *f->by_name, by_name);
    return hit ? (int)(*hit - f->e) : -1;
}

void ds_safetensors_close(ds_safetensors_file *f) {
    if (!f) return;
    if (f->fd >= 0) close(f->fd);
    cJSON_Delete(f->root);
    free(f->e);
    free(f->by_name);
    free(f->meta_keys);
    free(f->meta_values);
    free(f->path);
    free(f);
}

/* n bytes at offset, all of them (a short read is a truncated file). */
static int read_at(ds_safetensors_file *f, void *buf, size_t n, int64_t offset, const char *what) {
    char *p = buf;
    while (n > 0) {
        ssize_t got = pread(f->fd, p, n, (off_t)offset);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return ds_fail(DS_ERR_IO, "cannot read '%s' (%s): %s", f->path, what, strerror(errno)), -1;
        if (got == 0)
            return ds_fail(DS_ERR_IO, "'%s' ends early while reading %s: the file is truncated", f->path, what), -1;
        p += got;
        n -= (size_t)got;
        offset += got;
    }
    return 0;
}

/* A tensor's name as a message quotes it: at most SHOWN bytes of it, so a
 * hostile header's name of megabytes does not become the message. */
#define SHOWN 100
typedef struct { char s[SHOWN + 4]; } shown_name;

static const char *shown(const char *name, shown_name *buf) {
    if (strlen(name) <= SHOWN) return name;
    snprintf(buf->s, sizeof buf->s, "%.*s...", SHOWN, name);
    return buf->s;
}

static bool whole(double v) { return v >= 0 && v <= 0x1p53 && v == (double)(int64_t)v; }

/* One tensor entry of the header, checked against the data's size. */
static int parse_entry(ds_safetensors_file *f, const cJSON *item, ds_safetensors_entry *e) {
    shown_name buf;
    const char *name = shown(item->string, &buf);
    e->name = item->string;
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(item, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(item, "shape");
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
    if (!cJSON_IsObject(item) || !cJSON_IsString(dt) || !cJSON_IsArray(shape) || !cJSON_IsArray(off) ||
        cJSON_GetArraySize(off) != 2)
        return ds_fail(DS_ERR_IO, "'%s': tensor '%s': the header entry needs dtype, shape and data_offsets [begin, "
                       "end]: the file is corrupt", f->path, name), -1;
    int dtype = st_dtype(dt->valuestring);
    if (dtype < 0)
        return ds_fail(DS_ERR_IO, "'%s': tensor '%s': dtype '%.32s' is not one dslua reads (F32 F64 BF16 F16 I32 I64 "
                       "U8 BOOL)", f->path, name, dt->valuestring), -1;
    e->dtype = (ds_dtype)dtype;
    e->ndim = cJSON_GetArraySize(shape);
    if (e->ndim > DS_MAX_DIMS)
        return ds_fail(DS_ERR_IO, "'%s': tensor '%s' has %d dims, dslua's tensors at most %d", f->path, name, e->ndim,
                       DS_MAX_DIMS), -1;
    e->numel = 1;
    int d = 0;
    for (const cJSON *s = shape->child; s; s = s->next, d++) {
        if (!cJSON_IsNumber(s) || !whole(s->valuedouble))
            return ds_fail(DS_ERR_IO, "'%s': tensor '%s': shape entry %d is not a non-negative integer: the file is "
                           "corrupt", f->path, name, d + 1), -1;
        e->shape[d] = (int64_t)s->valuedouble;
        if (__builtin_mul_overflow(e->numel, e->shape[d], &e->numel))
            return ds_fail(DS_ERR_IO, "'%s': tensor '%s': its shape has more than 2^63 elements: the file is corrupt",
                           f->path, name), -1;
    }
    const cJSON *b = cJSON_GetArrayItem(off, 0), *en = cJSON_GetArrayItem(off, 1);
    if (!cJSON_IsNumber(b) || !cJSON_IsNumber(en) || !whole(b->valuedouble) || !whole(en->valuedouble) ||
        en->valuedouble < b->valuedouble)
        return ds_fail(DS_ERR_IO, "'%s': tensor '%s': data_offsets are not [begin, end] with 0 <= begin <= end: the "
                       "file is corrupt", f->path, name), -1;
    e->begin = (int64_t)b->valuedouble;
    e->end = (int64_t)en->valuedouble;
    int64_t need;
    if (__builtin_mul_overflow(e->numel, (int64_t)ds_dtype_size(e->dtype), &need))
        return ds_fail(DS_ERR_IO, "'%s': tensor '%s': its dtype and shape need more than 2^63 bytes: the file is "
                       "corrupt", f->path, name), -1;
    if (e->end - e->begin != need)
        return ds_fail(DS_ERR_IO, "'%s': tensor '%s': data_offsets [%lld, %lld] hold %lld bytes, its dtype and shape "
                       "need %lld: the file is corrupt", f->path, name, (long long)e->begin, (long long)e->end,
                       (long long)(e->end - e->begin), (long long)need), -1;
    if (e->end > f->data_size)
        return ds_fail(DS_ERR_IO, "'%s': tensor '%s': its bytes [%lld, %lld) run past the end of the data (%lld "
                       "bytes): the file is truncated", f->path, name, (long long)e->begin, (long long)e->end,
                       (long long)f->data_size), -1;
    return 0;
}

/* Sorts the entries by name, for find, and by offset: two tensors of one
 * name, or two whose bytes overlap, make one of them read the other's
 * weights, so either is a corrupt file. */
static int index_entries(ds_safetensors_file *f) {
    const ds_safetensors_entry **at = malloc(((size_t)f->n + 1) * sizeof *at);
    f->by_name = malloc(((size_t)f->n + 1) * sizeof *f->by_name);
    int rc = at && f->by_name ? 0 : -1;
    if (rc) ds_fail(DS_ERR_NOMEM, "'%s': out of memory for the header", f->path);
    for (int i = 0; rc == 0 && i < f->n; i++) at[i] = f->by_name[i] = &f->e[i];
    if (rc == 0) {
        qsort(f->by_name, (size_t)f->n, sizeof *f->by_name, by_name);
        qsort(at, (size_t)f->n, sizeof *at, by_offset);
    }
    shown_name a, b;
    for (int i = 1; rc == 0 && i < f->n; i++)
        if (strcmp(f->by_name[i - 1]->name, f->by_name[i]->name) == 0)
            rc = -1, ds_fail(DS_ERR_IO, "'%s': tensor '%s' is in the header twice: the file is corrupt", f->path,
                             shown(f->by_name[i]->name, &a));
    const ds_safetensors_entry *last = NULL;   /* the non-empty range that ends furthest */
    for (int i = 0; rc == 0 && i < f->n; i++) {
        const ds_safetensors_entry *e = at[i];
        if (e->begin == e->end) continue;
        if (last && e->begin < last->end)
            rc = -1, ds_fail(DS_ERR_IO, "'%s': tensors '%s' [%lld, %lld) and '%s' [%lld, %lld) share bytes: the file "
                             "is corrupt", f->path, shown(last->name, &a), (long long)last->begin, (long long)last->end,
                             shown(e->name, &b), (long long)e->begin, (long long)e->end);
        if (!last || e->end > last->end) last = e;
    }
    free(at);
    return rc;
}

static int parse_header(ds_safetensors_file *f, const char *text, int64_t len) {
    f->root = cJSON_ParseWithLength(text, (size_t)len);
    if (!cJSON_IsObject(f->root))
        return ds_fail(DS_ERR_IO, "'%s': the header is not a JSON object: not a safetensors file, or corrupt",
                       f->path), -1;
    int count = cJSON_GetArraySize(f->root);
    f->e = calloc((size_t)count + 1, sizeof *f->e);
    if (!f->e) return ds_fail(DS_ERR_NOMEM, "'%s': out of memory for the header", f->path), -1;
    for (const cJSON *item = f->root->child; item; item = item->next) {
        if (strcmp(item->string, "__metadata__") != 0) {
            if (parse_entry(f, item, &f->e[f->n])) return -1;
            f->n++;
            continue;
        }
        if (!cJSON_IsObject(item))
            return ds_fail(DS_ERR_IO, "'%s': __metadata__ is not an object of strings", f->path), -1;
        if (f->meta_keys)
            return ds_fail(DS_ERR_IO, "'%s': __metadata__ is in the header twice: the file is corrupt", f->path), -1;
        int m = cJSON_GetArraySize(item);
        f->meta_keys = calloc((size_t)m + 1, sizeof *f->meta_keys);
        f->meta_values = calloc((size_t)m + 1, sizeof *f->meta_values);
        if (!f->meta_keys || !f->meta_values) return ds_fail(DS_ERR_NOMEM, "'%s': out of memory", f->path), -1;
        for (const cJSON *kv = item->child; kv; kv = kv->next) {
            if (!cJSON_IsString(kv))
                return ds_fail(DS_ERR_IO, "'%s': __metadata__ entry '%s' is not a string", f->path, kv->string), -1;
            f->meta_keys[f->n_meta] = kv->string;
            f->meta_values[f->n_meta++] = kv->valuestring;
        }
    }
    return index_entries(f);
}

ds_safetensors_file *ds_safetensors_open(const char *path) {
    ds_safetensors_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        return ds_fail(DS_ERR_NOMEM, "safetensors: out of memory opening '%s'", path);
    }
    struct stat st;
    char *text = NULL;
    int rc = 0;
    if ((f->fd = ds_file_open(path, DS_FILE_READ, INT64_MAX)) < 0) rc = -1;
    else if (fstat(f->fd, &st) != 0) rc = -1, ds_fail(DS_ERR_IO, "cannot stat '%s': %s", path, strerror(errno));
    unsigned char len8[8];
    int64_t size = rc == 0 ? (int64_t)st.st_size : 0, hlen = 0;
    uint64_t ulen = 0;                              /* any 8 bytes, so unsigned until checked */
    if (rc == 0 && size < 8)
        rc = -1, ds_fail(DS_ERR_IO, "'%s' is %lld bytes, too short for a safetensors header: the file is truncated",
                         path, (long long)size);
    if (rc == 0) rc = read_at(f, len8, 8, 0, "the header length");
    for (int b = 7; rc == 0 && b >= 0; b--) ulen = (ulen << 8) | len8[b];
    if (rc == 0 && (ulen < 2 || ulen > (uint64_t)MAX_HEADER))
        rc = -1, ds_fail(DS_ERR_IO, "'%s': a header length of %llu bytes: not a safetensors file, or corrupt", path,
                         (unsigned long long)ulen);
    if (rc == 0) hlen = (int64_t)ulen;
    if (rc == 0 && 8 + hlen > size)
        rc = -1, ds_fail(DS_ERR_IO, "'%s': the %lld-byte header runs past the end of the file (%lld bytes): the file "
                         "is truncated", path, (long long)hlen, (long long)size);
    if (rc == 0 && !(text = malloc((size_t)hlen)))
        rc = -1, ds_fail(DS_ERR_NOMEM, "'%s': out of memory for the header", path);
    if (rc == 0) rc = read_at(f, text, (size_t)hlen, 8, "the header");
    if (rc == 0) {
        f->data_start = 8 + hlen;
        f->data_size = size - f->data_start;
        rc = parse_header(f, text, hlen);
    }
    free(text);
    if (rc) {
        ds_safetensors_close(f);
        return NULL;
    }
    return f;
}

/* Is [lo, lo + n) outside e's elements? Set the error if so (no sum
 * that could overflow). */
static bool outside(const ds_safetensors_file *f, const ds_safetensors_entry *e, int64_t lo, int64_t n) {
    if (lo >= 0 && n >= 0 && lo <= e->numel && n <= e->numel - lo) return false;
    ds_fail(DS_ERR_ARG, "'%s': tensor '%s': %lld elements from element %lld are outside its %lld", f->path, e->name,
            (long long)n, (long long)lo, (long long)e->numel);
    return true;
}

ds_tensor *ds_safetensors_read(ds_safetensors_file *f, int i, int64_t lo, int64_t n) {
    const ds_safetensors_entry *e = &f->e[i];
    if (outside(f, e, lo, n)) return NULL;
    ds_tensor *t = ds_tensor_new(1, &n, e->dtype, DS_CPU_DEVICE);
    if (!t) return NULL;
    int64_t size = (int64_t)ds_dtype_size(e->dtype);
    char what[PATH_MAX];
    snprintf(what, sizeof what, "tensor '%s'", e->name);
    if (n > 0 && read_at(f, ds_tensor_data(t), (size_t)(n * size), f->data_start + e->begin + lo * size, what)) {
        ds_tensor_release(t);
        return NULL;
    }
    return t;
}

int ds_safetensors_read_into(ds_safetensors_file *f, int i, int64_t lo, int64_t n, ds_tensor *dst, int64_t at) {
    const ds_safetensors_entry *e = &f->e[i];
    if (!ds_tensor_is_contiguous(dst) || at < 0 || n < 0 || at > ds_tensor_numel(dst) - n)
        return ds_fail(DS_ERR_ARG, "'%s': tensor '%s': %lld elements do not fit at %lld of a tensor of %lld", f->path,
                       e->name, (long long)n, (long long)at, (long long)ds_tensor_numel(dst)), -1;
    if (outside(f, e, lo, n)) return -1;
    if (n == 0) return 0;
    int64_t size = (int64_t)ds_dtype_size(e->dtype);
    if (dst->dtype == e->dtype && ds_device_equal(ds_tensor_device(dst), DS_CPU_DEVICE)) {
        char what[PATH_MAX];
        snprintf(what, sizeof what, "tensor '%s'", e->name);
        return read_at(f, (char *)ds_tensor_data_w(dst, "a safetensors read") + at * size, (size_t)(n * size), f->data_start + e->begin + lo * size,
                       what);
    }
    /* another dtype or device: through a host tensor of the file's dtype */
    ds_tensor *tmp = ds_safetensors_read(f, i, lo, n);
    int64_t one = 1;
    ds_tensor *view = tmp ? ds_tensor_view_of(dst, 1, &n, &one, dst->offset + at) : NULL;
    int rc = view ? ds_copy_(view, tmp) : -1;
    ds_tensor_release(view);
    ds_tensor_release(tmp);
    return rc;
}

int ds_safetensors_entry_crc32(ds_safetensors_file *f, int i, uint32_t *crc) {
    const ds_safetensors_entry *e = &f->e[i];
    char *buf = malloc(CHUNK);
    if (!buf) return ds_fail(DS_ERR_NOMEM, "'%s': out of memory checking tensor '%s'", f->path, e->name), -1;
    char what[PATH_MAX];
    snprintf(what, sizeof what, "tensor '%s'", e->name);
    uLong c = crc32(0L, Z_NULL, 0);
    int rc = 0;
    for (int64_t at = e->begin; rc == 0 && at < e->end; at += (int64_t)CHUNK) {
        size_t n = e->end - at < (int64_t)CHUNK ? (size_t)(e->end - at) : CHUNK;
        rc = read_at(f, buf, n, f->data_start + at, what);
        if (rc == 0) c = crc32(c, (const Bytef *)buf, (uInt)n);
    }
    free(buf);
    *crc = (uint32_t)c;
    return rc;
}
