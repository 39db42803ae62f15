#include "ds_data.h"
#include "ds_error.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#define CIFAR_PIXELS 3072
#define CIFAR_RECORD (1 + CIFAR_PIXELS)

static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static int32_t le32(const unsigned char *p) {
    return (int32_t)((uint32_t)p[3] << 24 | (uint32_t)p[2] << 16 | (uint32_t)p[1] << 8 | p[0]);
}

/* gzread's failure as a message: the system's for I/O errors, zlib's for
 * a corrupt stream. */
static void *gz_failure(gzFile f, const char *path, unsigned char *buf) {
    int code;
    const char *msg = gzerror(f, &code);
    if (code == Z_ERRNO) ds_fail(DS_ERR_IO, "%s: read error (%s)", path, strerror(errno));
    else ds_fail(DS_ERR_IO, "%s: bad gzip stream (zlib: %s)", path, msg);
    gzclose(f);
    free(buf);
    return NULL;
}

/* path opened for reading if it is a regular file: a FIFO would block the
 * open (hence O_NONBLOCK until checked), a device would never end. -1 with
 * the error. */
static int open_regular(const char *path, struct stat *st) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return ds_fail(DS_ERR_IO, "%s: cannot open (%s)", path, strerror(errno)), -1;
    if (fstat(fd, st) != 0) {
        ds_fail(DS_ERR_IO, "%s: cannot stat (%s)", path, strerror(errno));
        close(fd);
        return -1;
    }
    if (!S_ISREG(st->st_mode)) {
        const char *what = S_ISDIR(st->st_mode) ? "a directory" : S_ISFIFO(st->st_mode) ? "a FIFO"
                         : S_ISCHR(st->st_mode) || S_ISBLK(st->st_mode) ? "a device"
                         : S_ISSOCK(st->st_mode) ? "a socket" : "not a regular file";
        close(fd);
        return ds_fail(DS_ERR_IO, "%s: is %s, expected a regular file", path, what), -1;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return fd;
}

/* The most bytes a file of `size` bytes can give: itself when plain; for
 * gzip the size its trailer declares (ISIZE, the length modulo 2^32),
 * taken past 2^32 only as far as DEFLATE's ratio (1032:1) allows. A gzip
 * bomb stops there instead of filling memory. */
static size_t most_bytes(int fd, size_t size) {
    unsigned char head[2] = { 0 }, tail[4];
    if (!(size >= 18 && pread(fd, head, 2, 0) == 2 && head[0] == 0x1f && head[1] == 0x8b)) return size;
    if (pread(fd, tail, 4, (off_t)(size - 4)) != 4) return 0;
    uint64_t isize = (uint64_t)tail[0] | (uint64_t)tail[1] << 8 | (uint64_t)tail[2] << 16 | (uint64_t)tail[3] << 24;
    uint64_t ceiling = (uint64_t)size * 1032 + 64;
    while (isize + (1ull << 32) <= ceiling) isize += 1ull << 32;
    return isize > SIZE_MAX ? SIZE_MAX : (size_t)isize;
}

/* A buffer that grows as bytes arrive: a bound (a declared size) is never
 * allocated before the stream has delivered that much. */
typedef struct {
    unsigned char *buf;
    size_t len, cap;
} growbuf;

/* Reads on until b->len is want or the stream ends: 0, -1 from gzread,
 * -2 out of memory. */
static int read_upto(gzFile f, growbuf *b, size_t want) {
    while (b->len < want) {
        if (b->len == b->cap) {
            size_t cap = b->cap < (1u << 16) ? (1u << 16) : b->cap > SIZE_MAX / 2 ? SIZE_MAX : b->cap * 2;
            if (cap > want) cap = want;
            unsigned char *grown = realloc(b->buf, cap + 1);
            if (!grown) return -2;
            b->buf = grown;
            b->cap = cap;
        }
        size_t left = b->cap - b->len;
        int got = gzread(f, b->buf + b->len, (unsigned)(left < (1u << 30) ? left : (1u << 30)));
        if (got < 0) return -1;
        if (got == 0) return 0;
        b->len += (size_t)got;
    }
    return 0;
}

/* Reads path (gzip or plain), never more than most_bytes allows: with
 * body, its first `head` bytes and then as many as body(those bytes) says
 * follow (no byte past them); without, to the end. *n the bytes read.
 * malloc'd, or NULL with the error. */
typedef size_t (*body_fn)(const unsigned char *head, size_t n);

static unsigned char *read_file(const char *path, size_t head, body_fn body, size_t *n) {
    struct stat st;
    int fd = open_regular(path, &st);
    if (fd < 0) return NULL;
    size_t most = most_bytes(fd, (size_t)st.st_size);
    gzFile f = gzdopen(fd, "rb");
    if (!f) {
        close(fd);
        return ds_fail(DS_ERR_NOMEM, "%s: out of memory opening it", path);
    }
    gzbuffer(f, 1 << 17);
    growbuf b = { NULL, 0, 0 };
    int rc = read_upto(f, &b, body && head < most ? head : most);
    if (rc == 0 && body && b.len == head) {
        /* more than the file can hold is a truncated file: the caller says so */
        size_t more = body(b.buf, b.len);
        rc = read_upto(f, &b, b.len + (more < most - b.len ? more : most - b.len));
    } else if (rc == 0 && !body && b.len == most) {
        /* one byte past the bound tells a stream that goes on */
        rc = read_upto(f, &b, most + 1);
        if (rc == 0 && b.len > most) {
            ds_fail(DS_ERR_IO, "%s: decompresses past the %zu bytes its gzip trailer declares", path, most);
            rc = -3;
        }
    }
    if (rc == -1) return gz_failure(f, path, b.buf);
    if (rc == -2) ds_fail(DS_ERR_NOMEM, "%s: out of memory reading past %zu bytes", path, b.len);
    int code;
    gzerror(f, &code);
    gzclose(f);
    if (rc == 0 && code == Z_BUF_ERROR) {   /* the stream stopped before its end marker */
        ds_fail(DS_ERR_IO, "%s: truncated gzip stream (unexpected end of file after %zu bytes)", path, b.len);
        rc = -3;
    } else if (rc == 0 && code != Z_OK) {
        ds_fail(DS_ERR_IO, "%s: bad gzip stream (zlib error %d)", path, code);
        rc = -3;
    }
    if (rc == 0 && !b.buf && !(b.buf = malloc(1))) {     /* an empty file: still a buffer to free */
        ds_fail(DS_ERR_NOMEM, "%s: out of memory", path);
        rc = -2;
    }
    if (rc) {
        free(b.buf);
        return NULL;
    }
    *n = b.len;
    return b.buf;
}

unsigned char *ds_data_read_all(const char *path, size_t *n) { return read_file(path, 0, NULL, n); }

/* The data bytes an IDX header declares (items times the item's dims); 0
 * when it is not an unsigned-byte IDX header, which the reader reports. */
static size_t idx_body(const unsigned char *h, size_t n) {
    if (n < 8 || (be32(h) & ~0xffu) != 0x800u || 4 + 4 * (size_t)(be32(h) & 0xff) != n) return 0;
    size_t bytes = 1;
    for (size_t d = 4; d < n; d += 4)
        if (__builtin_mul_overflow(bytes, (size_t)be32(h + d), &bytes)) return SIZE_MAX;
    return bytes;
}

static const char *idx_kind(int ndim) {
    return ndim == 3 ? "IDX images" : ndim == 1 ? "IDX labels" : "IDX unsigned bytes";
}

/* The IDX header at b (n bytes read) checked: 0, or -1 with the error. */
static int idx_check(const char *path, int ndim, const unsigned char *b, size_t n) {
    uint32_t expect = 0x800u | (uint32_t)ndim;
    size_t header = 4 + 4 * (size_t)ndim;
    if (n < 4)
        return ds_fail(DS_ERR_IO, "%s: %zu bytes, too short for an IDX magic number (%s)", path, n, idx_kind(ndim)), -1;
    if (be32(b) != expect)
        return ds_fail(DS_ERR_IO, "%s: magic 0x%08x, expected 0x%08x (%s)", path, be32(b), expect, idx_kind(ndim)), -1;
    if (n < header)
        return ds_fail(DS_ERR_IO, "%s: truncated: %zu bytes, the %s header needs %zu", path, n, idx_kind(ndim),
                       header), -1;
    return 0;
}

static size_t no_body(const unsigned char *h, size_t n) { (void)h, (void)n; return 0; }

int ds_data_idx_items(const char *path, int ndim, int64_t *items) {
    if (ndim < 1 || ndim > DS_MAX_DIMS)
        return ds_fail(DS_ERR_ARG, "%s: IDX files with %d dims are not supported", path, ndim), -1;
    size_t n;
    unsigned char *b = read_file(path, 4 + 4 * (size_t)ndim, no_body, &n);
    if (!b) return -1;
    int rc = idx_check(path, ndim, b, n);
    if (rc == 0) *items = be32(b + 4);
    free(b);
    return rc;
}

ds_tensor *ds_data_read_idx(const char *path, int ndim, int64_t first, int64_t count, int64_t *total) {
    if (ndim < 1 || ndim > DS_MAX_DIMS)
        return ds_fail(DS_ERR_ARG, "%s: IDX files with %d dims are not supported", path, ndim);
    size_t n, header = 4 + 4 * (size_t)ndim;
    unsigned char *b = read_file(path, header, idx_body, &n);
    if (!b) return NULL;
    ds_tensor *t = NULL;
    if (idx_check(path, ndim, b, n)) goto done;
    int64_t shape[DS_MAX_DIMS], items = be32(b + 4), item_bytes = 1, need;
    bool huge = false;
    for (int d = 1; d < ndim; d++) {
        shape[d] = be32(b + 4 + 4 * d);
        huge |= __builtin_mul_overflow(item_bytes, shape[d], &item_bytes);
    }
    huge |= __builtin_mul_overflow(items, item_bytes, &need);
    if (huge || (uint64_t)need > n - header) {
        ds_fail(DS_ERR_IO, "%s: truncated: %zu bytes of data, expected %lld items of %lld bytes", path,
                n - header, (long long)items, (long long)item_bytes);
        goto done;
    }
    if (count < 0) count = items - first;
    if (first < 0 || count < 0 || first > items || count > items - first) {
        ds_fail(DS_ERR_ARG, "%s: items %lld to %lld requested (counting from 1), the file has %lld", path,
                (long long)first + 1, (long long)(first + count), (long long)items);
        goto done;
    }
    if (total) *total = items;
    shape[0] = count;
    t = ds_tensor_new(ndim, shape, DS_U8, DS_CPU_DEVICE);
    if (t) memcpy(ds_tensor_data(t), b + header + first * item_bytes, (size_t)(count * item_bytes));
done:
    free(b);
    return t;
}

int ds_data_read_cifar10(int nfiles, const char *const *paths, ds_tensor **x, ds_tensor **y) {
    *x = *y = NULL;
    if (nfiles < 1) { ds_fail(DS_ERR_ARG, "cifar10: no files given"); return -1; }
    unsigned char **bufs = calloc((size_t)nfiles, sizeof *bufs);
    size_t *sizes = calloc((size_t)nfiles, sizeof *sizes);
    int rc = -1;
    int64_t total = 0;
    if (!bufs || !sizes) { ds_fail(DS_ERR_NOMEM, "cifar10: out of memory"); goto done; }
    for (int k = 0; k < nfiles; k++) {
        bufs[k] = ds_data_read_all(paths[k], &sizes[k]);
        if (!bufs[k]) goto done;
        if (sizes[k] == 0 || sizes[k] % CIFAR_RECORD) {
            ds_fail(DS_ERR_IO, "%s: %zu bytes, expected a whole number of %d-byte records (label + 3x32x32 pixels)%s",
                    paths[k], sizes[k], CIFAR_RECORD, sizes[k] > CIFAR_RECORD ? ": truncated?" : "");
            goto done;
        }
        for (size_t r = 0; r < sizes[k] / CIFAR_RECORD; r++) {
            unsigned label = bufs[k][r * CIFAR_RECORD];
            if (label > 9) {
                ds_fail(DS_ERR_IO, "%s: record %zu has label %u, expected 0-9 (CIFAR-10 binary batch)", paths[k],
                        r + 1, label);
                goto done;
            }
        }
        total += (int64_t)(sizes[k] / CIFAR_RECORD);
    }
    *x = ds_tensor_new(4, (int64_t[]){ total, 3, 32, 32 }, DS_U8, DS_CPU_DEVICE);
    *y = *x ? ds_tensor_new(1, &total, DS_I64, DS_CPU_DEVICE) : NULL;
    if (!*y) goto done;
    unsigned char *px = ds_tensor_data(*x);
    int64_t *lab = ds_tensor_data(*y), i = 0;
    for (int k = 0; k < nfiles; k++)
        for (size_t r = 0; r < sizes[k] / CIFAR_RECORD; r++, i++) {
            lab[i] = bufs[k][r * CIFAR_RECORD];
            memcpy(px + i * CIFAR_PIXELS, bufs[k] + r * CIFAR_RECORD + 1, CIFAR_PIXELS);
        }
    rc = 0;
done:
    if (rc) {
        ds_tensor_release(*x);
        ds_tensor_release(*y);
        *x = *y = NULL;
    }
    for (int k = 0; bufs && k < nfiles; k++) free(bufs[k]);
    free(bufs);
    free(sizes);
    return rc;
}

/* s's bytes as the i64 token ids id[] gives them. */
static ds_tensor *ids_of(const unsigned char *s, size_t n, const int16_t *id) {
    int64_t len = (int64_t)n;
    ds_tensor *t = ds_tensor_new(1, &len, DS_I64, DS_CPU_DEVICE);
    if (!t) return NULL;
    int64_t *out = ds_tensor_data(t);
    for (size_t i = 0; i < n; i++) out[i] = id[s[i]];
    return t;
}

ds_tensor *ds_data_char_tokens(const unsigned char *s, size_t n, unsigned char vocab[256], int *nvocab) {
    int16_t id[256];
    bool seen[256] = { false };
    for (size_t i = 0; i < n; i++) seen[s[i]] = true;
    int v = 0;
    for (int c = 0; c < 256; c++) {
        id[c] = seen[c] ? (int16_t)v : -1;
        if (seen[c]) vocab[v++] = (unsigned char)c;
    }
    *nvocab = v;
    return ids_of(s, n, id);
}

ds_tensor *ds_data_encode(const unsigned char *s, size_t n, const unsigned char *vocab, int nvocab) {
    int16_t id[256];
    memset(id, -1, sizeof id);
    for (int k = 0; k < nvocab; k++) id[vocab[k]] = (int16_t)k;
    for (size_t i = 0; i < n; i++)
        if (id[s[i]] < 0)
            return ds_fail(DS_ERR_ARG, "encode: byte 0x%02x ('%c') at position %zu is not in the vocabulary of %d",
                           s[i], s[i] >= 32 && s[i] < 127 ? s[i] : '?', i + 1, nvocab);
    return ids_of(s, n, id);
}

int ds_data_decode(const ds_tensor *ids, const unsigned char *vocab, int nvocab, unsigned char *out) {
    if (ds_dtype_is_float(ids->dtype) || ids->dtype == DS_BOOL) {
        ds_fail(DS_ERR_ARG, "decode: token ids must be integers, got %s", ds_dtype_name(ids->dtype));
        return -1;
    }
    if (ds_tensor_device(ids).type != DS_DEV_CPU) {
        ds_fail(DS_ERR_ARG, "decode: token ids must be on the CPU");
        return -1;
    }
    int64_t n = ds_tensor_numel(ids);
    for (int64_t i = 0; i < n; i++) {
        double v = ds_tensor_get(ids, i);
        if (!(v >= 0 && v < nvocab)) {
            ds_fail(DS_ERR_ARG, "decode: token %.0f at position %lld is outside the vocabulary [0, %d)", v,
                    (long long)i + 1, nvocab);
            return -1;
        }
        out[i] = vocab[(int)v];
    }
    return 0;
}

/* The token count of a shard of n bytes whose header (or first two bytes,
 * when n is shorter) is h; -1 with the error naming path. */
static int64_t shard_count(const char *path, const unsigned char *h, size_t n) {
    const size_t header = DS_SHARD_HEADER_INTS * 4;
    if (n >= 2 && h[0] == 0x1f && h[1] == 0x8b)
        return ds_fail(DS_ERR_IO, "%s: gzip-compressed; token shards are memory-mapped, decompress it first", path), -1;
    if (n < header)
        return ds_fail(DS_ERR_IO, "%s: truncated: %zu bytes, the token shard header needs %zu", path, n, header), -1;
    int32_t magic = le32(h), version = le32(h + 4), count = le32(h + 8);
    if (magic != DS_SHARD_MAGIC)
        return ds_fail(DS_ERR_IO, "%s: magic %d, expected %d (llm.c token shard)", path, magic, DS_SHARD_MAGIC), -1;
    if (version != DS_SHARD_VERSION)
        return ds_fail(DS_ERR_IO, "%s: version %d, expected %d (llm.c token shard of uint16 tokens)", path, version,
                       DS_SHARD_VERSION), -1;
    if (count < 0 || n - header < (size_t)count * 2)
        return ds_fail(DS_ERR_IO, "%s: truncated: %zu bytes of tokens, the header says %d tokens (%lld bytes)", path,
                       n - header, count, (long long)count * 2), -1;
    return count;
}

/* The shard at path mapped read-only, its header and size checked once. */
static int shard_open(const char *path, ds_shard *s) {
    struct stat st;
    int fd = open_regular(path, &st);
    if (fd < 0) return -1;
    unsigned char h[DS_SHARD_HEADER_INTS * 4] = { 0 };
    size_t n = (size_t)st.st_size;
    ssize_t got = pread(fd, h, n < sizeof h ? n : sizeof h, 0);
    int64_t count = got < 0 ? -1 : shard_count(path, h, (size_t)got < sizeof h ? (size_t)got : n);
    if (got < 0) ds_fail(DS_ERR_IO, "%s: cannot read (%s)", path, strerror(errno));
    if (count >= 0) {
        s->map_len = sizeof h + (size_t)count * 2;
        s->map = mmap(NULL, s->map_len, PROT_READ, MAP_SHARED, fd, 0);
        if (s->map == MAP_FAILED) {
            s->map = NULL;
            ds_fail(DS_ERR_IO, "%s: cannot map (%s)", path, strerror(errno));
        }
    }
    close(fd);
    if (!s->map) return -1;
    s->tokens = (const unsigned char *)s->map + sizeof h;
    s->ntok = count;
    return 0;
}

/* Bytes of a shard read before they are dropped from this process: the
 * vocabulary check streams through the file without keeping it resident. */
#define SHARD_SCAN_BYTES ((size_t)16 << 20)

/* Every token below vocab, read once, a piece at a time. */
static int shard_check_vocab(const char *path, ds_shard *s, int64_t vocab) {
    const size_t header = DS_SHARD_HEADER_INTS * 4;
    int64_t i = 0;
    for (size_t at = 0; at < s->map_len; at += SHARD_SCAN_BYTES) {
        size_t end = at + SHARD_SCAN_BYTES < s->map_len ? at + SHARD_SCAN_BYTES : s->map_len;
        for (; i < s->ntok && header + 2 * (size_t)i < end; i++) {
            int64_t t = ds_shard_token(s, i);
            if (t >= vocab) {
                ds_fail(DS_ERR_IO, "%s: token %lld at position %lld (byte offset %lld) is outside the vocabulary "
                        "[0, %lld)", path, (long long)t, (long long)i + 1, (long long)(header + 2 * (size_t)i),
                        (long long)vocab);
                return -1;
            }
        }
        madvise((char *)s->map + at, end - at, MADV_DONTNEED);
    }
    return 0;
}

int ds_shard_map(const char *path, int64_t vocab, ds_shard *s) {
    memset(s, 0, sizeof *s);
    if (shard_open(path, s)) return -1;
    if (vocab > 0 && shard_check_vocab(path, s, vocab)) {
        ds_shard_unmap(s);
        return -1;
    }
    return 0;
}

/* A fault on a mapped file maps the cached pages around it too: 64 KB
 * (Linux's fault_around_bytes), or the whole large folio the page cache
 * holds the page in, up to a PMD (2 MB on x86-64) aligned. A window drops
 * its 2 MB-aligned span: dropping 64 KB left the rest of each folio
 * mapped, and a shuffled epoch grew resident memory towards the corpus. */
#define SHARD_FAULT_AROUND ((uintptr_t)2 << 20)

void ds_shard_drop(const ds_shard *s, int64_t at, int64_t n) {
    uintptr_t lo = (uintptr_t)(s->tokens + 2 * at) & ~(SHARD_FAULT_AROUND - 1);
    uintptr_t hi = ((uintptr_t)(s->tokens + 2 * (at + n)) + SHARD_FAULT_AROUND - 1) & ~(SHARD_FAULT_AROUND - 1);
    uintptr_t first = (uintptr_t)s->map, last = first + s->map_len;
    if (lo < first) lo = first;
    if (hi > last) hi = last;
    madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

void ds_shard_unmap(ds_shard *s) {
    if (s->map) munmap(s->map, s->map_len);
    memset(s, 0, sizeof *s);
}
