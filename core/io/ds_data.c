#include "ds_data.h"
#include "ds_error.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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

unsigned char *ds_data_read_all(const char *path, size_t *n) {
    struct stat st;
    if (stat(path, &st) != 0) return ds_fail(DS_ERR_IO, "%s: cannot open (%s)", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) return ds_fail(DS_ERR_IO, "%s: is a directory, expected a file", path);
    gzFile f = gzopen(path, "rb");
    if (!f) return ds_fail(DS_ERR_IO, "%s: cannot open (%s)", path, errno ? strerror(errno) : "out of memory");
    gzbuffer(f, 1 << 17);
    /* plain files come back at their size; gzip ones usually grow a few times */
    size_t cap = (size_t)st.st_size + 1, len = 0;
    unsigned char *buf = malloc(cap);
    if (!buf) { gzclose(f); return ds_fail(DS_ERR_NOMEM, "%s: out of memory for %zu bytes", path, cap); }
    for (;;) {
        if (len == cap) {
            unsigned char *grown = cap > SIZE_MAX / 2 ? NULL : realloc(buf, cap * 2);
            if (!grown) {
                gzclose(f);
                free(buf);
                return ds_fail(DS_ERR_NOMEM, "%s: out of memory reading past %zu bytes", path, len);
            }
            buf = grown;
            cap *= 2;
        }
        size_t want = cap - len < (1u << 30) ? cap - len : (1u << 30);
        int got = gzread(f, buf + len, (unsigned)want);
        if (got < 0) return gz_failure(f, path, buf);
        if (got == 0) break;
        len += (size_t)got;
    }
    int code;
    gzerror(f, &code);
    gzclose(f);
    if (code == Z_BUF_ERROR) {   /* the stream stopped before its end marker */
        free(buf);
        return ds_fail(DS_ERR_IO, "%s: truncated gzip stream (unexpected end of file after %zu bytes)", path, len);
    }
    if (code != Z_OK) {
        free(buf);
        return ds_fail(DS_ERR_IO, "%s: bad gzip stream (zlib error %d)", path, code);
    }
    *n = len;
    return buf;
}

ds_tensor *ds_data_read_idx(const char *path, int ndim, int64_t first, int64_t count, int64_t *total) {
    if (ndim < 1 || ndim > DS_MAX_DIMS)
        return ds_fail(DS_ERR_ARG, "%s: IDX files with %d dims are not supported", path, ndim);
    size_t n;
    unsigned char *b = ds_data_read_all(path, &n);
    if (!b) return NULL;
    const char *kind = ndim == 3 ? "IDX images" : ndim == 1 ? "IDX labels" : "IDX unsigned bytes";
    uint32_t expect = 0x800u | (uint32_t)ndim;
    size_t header = 4 + 4 * (size_t)ndim;
    ds_tensor *t = NULL;
    if (n < 4) {
        ds_fail(DS_ERR_IO, "%s: %zu bytes, too short for an IDX magic number (%s)", path, n, kind);
        goto done;
    }
    if (be32(b) != expect) {
        ds_fail(DS_ERR_IO, "%s: magic 0x%08x, expected 0x%08x (%s)", path, be32(b), expect, kind);
        goto done;
    }
    if (n < header) {
        ds_fail(DS_ERR_IO, "%s: truncated: %zu bytes, the %s header needs %zu", path, n, kind, header);
        goto done;
    }
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
    int64_t len = (int64_t)n;
    ds_tensor *t = ds_tensor_new(1, &len, DS_I64, DS_CPU_DEVICE);
    if (!t) return NULL;
    int64_t *out = ds_tensor_data(t);
    for (size_t i = 0; i < n; i++) out[i] = id[s[i]];
    return t;
}

ds_tensor *ds_data_encode(const unsigned char *s, size_t n, const unsigned char *vocab, int nvocab) {
    int16_t id[256];
    memset(id, -1, sizeof id);
    for (int k = 0; k < nvocab; k++) id[vocab[k]] = (int16_t)k;
    for (size_t i = 0; i < n; i++)
        if (id[s[i]] < 0)
            return ds_fail(DS_ERR_ARG, "encode: byte 0x%02x ('%c') at position %zu is not in the vocabulary of %d",
                           s[i], s[i] >= 32 && s[i] < 127 ? s[i] : '?', i + 1, nvocab);
    int64_t len = (int64_t)n;
    ds_tensor *t = ds_tensor_new(1, &len, DS_I64, DS_CPU_DEVICE);
    if (!t) return NULL;
    int64_t *out = ds_tensor_data(t);
    for (size_t i = 0; i < n; i++) out[i] = id[s[i]];
    return t;
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

/* One shard's tokens, validated, as the malloc'd file (tokens at byte 1024). */
static unsigned char *read_shard(const char *path, int64_t *ntok) {
    size_t n;
    unsigned char *b = ds_data_read_all(path, &n);
    if (!b) return NULL;
    const size_t header = DS_SHARD_HEADER_INTS * 4;
    if (n < header) {
        free(b);
        return ds_fail(DS_ERR_IO, "%s: truncated: %zu bytes, the token shard header needs %zu", path, n, header);
    }
    int32_t magic = le32(b), version = le32(b + 4), count = le32(b + 8);
    if (magic != DS_SHARD_MAGIC) {
        free(b);
        return ds_fail(DS_ERR_IO, "%s: magic %d, expected %d (llm.c token shard)", path, magic, DS_SHARD_MAGIC);
    }
    if (version != DS_SHARD_VERSION) {
        free(b);
        return ds_fail(DS_ERR_IO, "%s: version %d, expected %d (llm.c token shard of uint16 tokens)", path, version,
                       DS_SHARD_VERSION);
    }
    if (count < 0 || n - header < (size_t)count * 2) {
        free(b);
        return ds_fail(DS_ERR_IO, "%s: truncated: %zu bytes of tokens, the header says %d tokens (%lld bytes)", path,
                       n - header, count, (long long)count * 2);
    }
    *ntok = count;
    return b;
}

ds_tensor *ds_data_read_shards(int nfiles, const char *const *paths, int64_t *lengths) {
    if (nfiles < 1) return ds_fail(DS_ERR_ARG, "shards: no files given");
    unsigned char **bufs = calloc((size_t)nfiles, sizeof *bufs);
    if (!bufs) return ds_fail(DS_ERR_NOMEM, "shards: out of memory");
    ds_tensor *t = NULL;
    int64_t total = 0;
    for (int k = 0; k < nfiles; k++) {
        bufs[k] = read_shard(paths[k], &lengths[k]);
        if (!bufs[k]) goto done;
        total += lengths[k];
    }
    t = ds_tensor_new(1, &total, DS_I32, DS_CPU_DEVICE);
    if (!t) goto done;
    int32_t *out = ds_tensor_data(t);
    for (int k = 0; k < nfiles; k++) {
        const unsigned char *p = bufs[k] + DS_SHARD_HEADER_INTS * 4;
        for (int64_t i = 0; i < lengths[k]; i++) *out++ = (int32_t)(p[2 * i] | p[2 * i + 1] << 8);
    }
done:
    for (int k = 0; k < nfiles; k++) free(bufs[k]);
    free(bufs);
    return t;
}
