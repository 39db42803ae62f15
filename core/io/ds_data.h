/* Dataset readers: MNIST IDX, CIFAR-10 binary batches, character-level
 * text, each read whole into tensors, and llm.c token shards, mapped.
 *
 * Files may be gzip-compressed or plain (zlib reads both). Errors name the
 * file and what was expected against what was found. Every function
 * returning ds_tensor* returns a new reference or NULL with the error set. */
#ifndef DS_DATA_H
#define DS_DATA_H

#include "ds_tensor.h"

#include <stddef.h>

/* llm.c token shards: a header of 256 int32 (magic, version, token count)
 * then the tokens as uint16. */
#define DS_SHARD_MAGIC 20240520
#define DS_SHARD_VERSION 1
#define DS_SHARD_HEADER_INTS 256

/* The whole file, decompressed when it is gzip, in malloc'd memory the
 * caller frees. */
unsigned char *ds_data_read_all(const char *path, size_t *n);

/* Items [first, first + count) (0-based; count < 0: to the end) of an
 * unsigned-byte IDX file of ndim dims, as a u8 tensor [count, dims...].
 * *total (when given) receives the file's item count. */
ds_tensor *ds_data_read_idx(const char *path, int ndim, int64_t first, int64_t count, int64_t *total);
/* The item count an IDX file's header declares, its data unread (to
 * compare two files' counts before reading either): 0 or -1. */
int ds_data_idx_items(const char *path, int ndim, int64_t *items);

/* CIFAR-10 binary batches (records of one label byte and 3x32x32 pixel
 * bytes), concatenated: *x u8 [N,3,32,32], *y i64 [N]. 0 or -1. */
int ds_data_read_cifar10(int nfiles, const char *const *paths, ds_tensor **x, ds_tensor **y);

/* Character-level tokens of n bytes: the vocabulary is the sorted
 * distinct bytes (written to vocab, their count to *nvocab), a token is a
 * byte's place in it. Returns i64 [n]. */
ds_tensor *ds_data_char_tokens(const unsigned char *s, size_t n, unsigned char vocab[256], int *nvocab);
/* s in the vocabulary's tokens, i64 [n]; a byte outside it is an error. */
ds_tensor *ds_data_encode(const unsigned char *s, size_t n, const unsigned char *vocab, int nvocab);
/* The bytes of integer tokens ids (any shape, row-major) into out, which
 * holds numel(ids) bytes; an id outside the vocabulary is an error. */
int ds_data_decode(const ds_tensor *ids, const unsigned char *vocab, int nvocab, unsigned char *out);

/* A token shard mapped read-only: its tokens stay in the page cache and
 * are read where a window needs them, so a corpus of any size costs this
 * process no anonymous memory. */
typedef struct {
    void *map;
    size_t map_len;
    const unsigned char *tokens;    /* ntok little-endian uint16 */
    int64_t ntok;
} ds_shard;

/* Maps path, checking its header and size; vocab > 0 also checks every
 * token is below it (one read of the shard). 0, or -1 naming the file. */
int ds_shard_map(const char *path, int64_t vocab, ds_shard *s);
/* Drops the pages holding tokens [at, at + n) from this process once read
 * (the page cache keeps them), so its resident size does not grow with
 * the windows an epoch has read. */
void ds_shard_drop(const ds_shard *s, int64_t at, int64_t n);
/* Unmaps s (a zeroed s too). */
void ds_shard_unmap(ds_shard *s);
static inline int64_t ds_shard_token(const ds_shard *s, int64_t i) {
    return s->tokens[2 * i] | s->tokens[2 * i + 1] << 8;
}

#endif
