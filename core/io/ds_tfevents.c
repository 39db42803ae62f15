/* TensorBoard event files by hand (see ds_tfevents.h). The protobuf wire
 * format needs only varints, fixed 32/64-bit fields and length-delimited
 * fields; the few Event fields TensorBoard's scalar reader uses are written
 * with their field numbers from tensorflow/core/util/event.proto and
 * summary.proto. */
#define _GNU_SOURCE
#include "ds_tfevents.h"
#include "ds_error.h"
#include "ds_file.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct ds_tfevents {
    FILE *f;
    char *path;
};

static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;   /* reflected Castagnoli */
        crc_table[i] = c;
    }
}

uint32_t ds_tfevents_crc32c(const void *data, size_t n) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, crc_init);
    const unsigned char *p = data;
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* TFRecord masks its CRCs so a CRC of data holding CRCs stays strong. */
static uint32_t masked_crc(const void *data, size_t n) {
    uint32_t c = ds_tfevents_crc32c(data, n);
    return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

static void put_le(unsigned char *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_le(const unsigned char *p, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* ---------------------------------------------------------------- writing */

/* A message being built; sizes here are small (a tag and a few numbers). */
typedef struct {
    unsigned char *p;
    size_t n, cap;
} buf;

static int grow(buf *b, size_t more) {
    if (b->n + more <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->n + more) cap *= 2;
    unsigned char *p = realloc(b->p, cap);
    if (!p) { ds_fail(DS_ERR_NOMEM, "tfevents: out of memory"); return -1; }
    b->p = p;
    b->cap = cap;
    return 0;
}

static int put_varint(buf *b, uint64_t v) {
    if (grow(b, 10)) return -1;
    do {
        unsigned char byte = v & 0x7F;
        v >>= 7;
        b->p[b->n++] = byte | (v ? 0x80 : 0);
    } while (v);
    return 0;
}

static int put_bytes(buf *b, const void *p, size_t n) {
    if (grow(b, n)) return -1;
    memcpy(b->p + b->n, p, n);
    b->n += n;
    return 0;
}

/* key = field number << 3 | wire type (0 varint, 1 fixed64, 2 length, 5 fixed32) */
static int put_len_field(buf *b, int field, const void *p, size_t n) {
    if (put_varint(b, (uint64_t)field << 3 | 2) || put_varint(b, n)) return -1;
    return put_bytes(b, p, n);
}

static int put_fixed(buf *b, int field, int wire, uint64_t v, int bytes) {
    if (put_varint(b, (uint64_t)field << 3 | wire) || grow(b, (size_t)bytes)) return -1;
    put_le(b->p + b->n, v, bytes);
    b->n += (size_t)bytes;
    return 0;
}

/* Event head: wall_time = 1 (double), step = 2 (int64). */
static int put_event_head(buf *b, double wall_time, int64_t step) {
    uint64_t bits;
    memcpy(&bits, &wall_time, 8);
    if (put_fixed(b, 1, 1, bits, 8)) return -1;
    return step ? put_varint(b, 2 << 3) || put_varint(b, (uint64_t)step) : 0;
}

static int write_record(ds_tfevents *w, const buf *b) {
    unsigned char head[12], tail[4];
    put_le(head, b->n, 8);
    put_le(head + 8, masked_crc(head, 8), 4);
    put_le(tail, masked_crc(b->p, b->n), 4);
    if (fwrite(head, 1, 12, w->f) != 12 || fwrite(b->p, 1, b->n, w->f) != b->n || fwrite(tail, 1, 4, w->f) != 4) {
        ds_fail(DS_ERR_IO, "tfevents: cannot write %s: %s", w->path, strerror(errno));
        return -1;
    }
    return 0;
}

const char *ds_tfevents_path(const ds_tfevents *w) { return w->path; }

ds_tfevents *ds_tfevents_open(const char *dir) {
    static int serial;        /* files opened by this process in the same second stay apart */
    char host[256];
    if (gethostname(host, sizeof host)) strcpy(host, "localhost");
    host[sizeof host - 1] = '\0';
    ds_tfevents *w = calloc(1, sizeof *w);
    if (!w) return ds_fail(DS_ERR_NOMEM, "tfevents: out of memory");
    if (asprintf(&w->path, "%s/events.out.tfevents.%010ld.%s.%d.%d", dir, (long)time(NULL), host, (int)getpid(),
                 serial++) < 0) {
        free(w);
        return ds_fail(DS_ERR_NOMEM, "tfevents: out of memory");
    }
    int fd = ds_file_open(w->path, DS_FILE_WRITE, 0);
    w->f = fd < 0 ? NULL : fdopen(fd, "wb");
    if (!w->f) {
        if (fd >= 0) ds_fail(DS_ERR_IO, "tfevents: cannot create %s: %s", w->path, strerror(errno)), close(fd);
        free(w->path);
        free(w);
        return NULL;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    buf b = {0};
    static const char version[] = "brain.Event:2";
    int rc = put_event_head(&b, (double)ts.tv_sec + ts.tv_nsec * 1e-9, 0);
    if (!rc) rc = put_len_field(&b, 3, version, sizeof version - 1);    /* file_version = 3 */
    if (!rc) rc = write_record(w, &b);
    if (!rc) rc = ds_tfevents_flush(w);
    free(b.p);
    if (rc) {
        fclose(w->f);
        free(w->path);
        free(w);
        return NULL;
    }
    return w;
}

int ds_tfevents_scalar(ds_tfevents *w, const char *tag, float value, int64_t step, double wall_time) {
    buf val = {0}, sum = {0}, ev = {0};
    uint32_t bits;
    memcpy(&bits, &value, 4);
    /* Summary.Value: tag = 1, simple_value = 2 (float); Summary: value = 1; Event: summary = 5 */
    int rc = put_len_field(&val, 1, tag, strlen(tag));
    if (!rc) rc = put_fixed(&val, 2, 5, bits, 4);
    if (!rc) rc = put_len_field(&sum, 1, val.p, val.n);
    if (!rc) rc = put_event_head(&ev, wall_time, step);
    if (!rc) rc = put_len_field(&ev, 5, sum.p, sum.n);
    if (!rc) rc = write_record(w, &ev);
    free(val.p);
    free(sum.p);
    free(ev.p);
    return rc;
}

int ds_tfevents_flush(ds_tfevents *w) {
    if (fflush(w->f)) {
        ds_fail(DS_ERR_IO, "tfevents: cannot write %s: %s", w->path, strerror(errno));
        return -1;
    }
    return 0;
}

int ds_tfevents_close(ds_tfevents *w) {
    if (!w) return 0;
    int rc = 0;
    if (fclose(w->f)) {
        ds_fail(DS_ERR_IO, "tfevents: cannot write %s: %s", w->path, strerror(errno));
        rc = -1;
    }
    free(w->path);
    free(w);
    return rc;
}

/* ---------------------------------------------------------------- reading */

typedef struct {
    const unsigned char *p, *end;
} cursor;

static bool get_varint(cursor *c, uint64_t *v) {
    *v = 0;
    for (int shift = 0; shift < 64 && c->p < c->end; shift += 7) {
        unsigned char byte = *c->p++;
        *v |= (uint64_t)(byte & 0x7F) << shift;
        if (!(byte & 0x80)) return true;
    }
    return false;
}

/* The next field: its number, wire type, and its value (an integer for
 * varint and fixed fields, a sub-cursor for length-delimited ones). */
static bool get_field(cursor *c, int *field, int *wire, uint64_t *v, cursor *sub) {
    uint64_t key;
    if (!get_varint(c, &key)) return false;
    *field = (int)(key >> 3);
    *wire = (int)(key & 7);
    switch (*wire) {
    case 0: return get_varint(c, v);
    case 1:
    case 5: {
        int bytes = *wire == 1 ? 8 : 4;
        if (c->end - c->p < bytes) return false;
        *v = get_le(c->p, bytes);
        c->p += bytes;
        return true;
    }
    case 2:
        if (!get_varint(c, v) || (uint64_t)(c->end - c->p) < *v) return false;
        sub->p = c->p;
        sub->end = c->p + *v;
        c->p += *v;
        return true;
    default: return false;
    }
}

static char *dup_span(cursor s) {
    size_t n = (size_t)(s.end - s.p);
    char *out = malloc(n + 1);
    if (out) {
        memcpy(out, s.p, n);
        out[n] = '\0';
    }
    return out;
}

typedef struct {
    const char *path;
    long offset;
    ds_tfevents_fn fn;
    void *ctx;
} reader;

static int bad_record(const reader *r, const char *what) {
    ds_fail(DS_ERR_IO, "tfevents: %s: record at byte %ld: %s", r->path, r->offset, what);
    return -1;
}

/* Summary.Value: one event per simple_value */
static int read_value(const reader *r, ds_tfevent *e, cursor c) {
    cursor tag = {0}, sub;
    bool has_value = false;
    int field, wire;
    uint64_t v;
    while (c.p < c.end) {
        if (!get_field(&c, &field, &wire, &v, &sub)) return bad_record(r, "a malformed Summary.Value");
        if (field == 1 && wire == 2) tag = sub;
        if (field == 2 && wire == 5) {
            uint32_t bits = (uint32_t)v;
            memcpy(&e->value, &bits, 4);
            has_value = true;
        }
    }
    if (!has_value) return 0;      /* images, histograms, tensors: not scalars */
    char *t = dup_span(tag);
    if (!t) { ds_fail(DS_ERR_NOMEM, "tfevents: out of memory"); return -1; }
    e->tag = t;
    int rc = r->fn(e, r->ctx);
    free(t);
    e->tag = NULL;
    return rc;
}

static int read_event(const reader *r, cursor c) {
    ds_tfevent e = {0};
    cursor summary = {0}, version = {0}, sub;
    bool has_summary = false, has_version = false;
    int field, wire;
    uint64_t v;
    while (c.p < c.end) {
        if (!get_field(&c, &field, &wire, &v, &sub)) return bad_record(r, "a malformed Event");
        if (field == 1 && wire == 1) memcpy(&e.wall_time, &v, 8);
        else if (field == 2 && wire == 0) e.step = (int64_t)v;
        else if (field == 3 && wire == 2) { version = sub; has_version = true; }
        else if (field == 5 && wire == 2) { summary = sub; has_summary = true; }
    }
    if (has_version) {
        char *s = dup_span(version);
        if (!s) { ds_fail(DS_ERR_NOMEM, "tfevents: out of memory"); return -1; }
        e.file_version = s;
        int rc = r->fn(&e, r->ctx);
        free(s);
        return rc;
    }
    while (has_summary && summary.p < summary.end) {
        if (!get_field(&summary, &field, &wire, &v, &sub)) return bad_record(r, "a malformed Summary");
        if (field == 1 && wire == 2) {
            int rc = read_value(r, &e, sub);
            if (rc) return rc;
        }
    }
    return 0;
}

int ds_tfevents_read(const char *path, ds_tfevents_fn fn, void *ctx, long *torn_at) {
    int fd = ds_file_open(path, DS_FILE_READ, INT64_MAX);
    FILE *f = fd < 0 ? NULL : fdopen(fd, "rb");
    if (!f) {
        if (fd >= 0) ds_fail(DS_ERR_IO, "tfevents: cannot open %s: %s", path, strerror(errno)), close(fd);
        return -1;
    }
    reader r = {path, 0, fn, ctx};
    unsigned char head[12], tail[4], *data = NULL;
    int rc = 0;
    *torn_at = -1;
    struct stat st;
    long size = fstat(fileno(f), &st) == 0 ? (long)st.st_size : LONG_MAX;
    for (;;) {
        size_t got = fread(head, 1, 12, f);
        if (got == 0) break;
        if (got != 12) { *torn_at = r.offset; break; }
        if (get_le(head + 8, 4) != masked_crc(head, 8)) { rc = bad_record(&r, "length CRC mismatch"); break; }
        uint64_t n = get_le(head, 8);
        if (n > (1u << 30)) { rc = bad_record(&r, "implausible length"); break; }
        /* the file ends inside the record: a writer stopped mid-write (known
         * from the size before a buffer of n bytes is taken) */
        if ((long)n + 16 > size - r.offset) { *torn_at = r.offset; break; }
        unsigned char *p = realloc(data, n ? n : 1);
        if (!p) { rc = -1; ds_fail(DS_ERR_NOMEM, "tfevents: out of memory"); break; }
        data = p;
        if (fread(data, 1, n, f) != n || fread(tail, 1, 4, f) != 4) { *torn_at = r.offset; break; }
        if (get_le(tail, 4) != masked_crc(data, n)) { rc = bad_record(&r, "data CRC mismatch"); break; }
        rc = read_event(&r, (cursor){data, data + n});
        if (rc) break;
        r.offset += 16 + (long)n;
    }
    if (!rc && ferror(f)) rc = bad_record(&r, strerror(errno));
    free(data);
    fclose(f);
    return rc;
}
