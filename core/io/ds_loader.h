/* Batches from in-memory datasets, gathered on the calling thread or by
 * prefetch threads.
 *
 * A ds_dataset is a batch gatherer over tensors already in memory or
 * mapped files: rows of a few named tensors (MNIST, CIFAR, tensors in
 * memory), or windows over a token sequence (text, token shards). A ds_loader runs num_workers
 * pthreads (no Lua in them) that gather the batches whose sample indices the
 * main thread hands over ahead of time; a bounded ring holds the batches in
 * flight, and they come back in the order they were submitted, so workers
 * change timing, never content. A worker's error reaches the main thread
 * when it takes that batch.
 *
 * A loader for a device other than the CPU hands out batches on that
 * device without stalling the step: its batches are gathered into the
 * device's staging memory (page-locked on a GPU), and taking batch k
 * starts the upload of batch k+1 (ds_upload.h), which then runs while the
 * device computes step k. */
#ifndef DS_LOADER_H
#define DS_LOADER_H

#include "ds_tensor.h"

#define DS_DATASET_MAX_FIELDS 8
#define DS_DATASET_NAME_MAX 32

typedef struct ds_dataset ds_dataset;
typedef struct ds_loader ds_loader;

/* Sample i is row i of each field; the fields are CPU tensors with the same
 * leading size (copied if not contiguous). Retains them. */
ds_dataset *ds_dataset_rows(int nfields, const char *const *names, ds_tensor *const *fields);
/* Windows over tokens (a 1-D CPU tensor of u8, i32 or i64) cut into nseg
 * segments of seg_len tokens (shards; windows never cross them). Sample i
 * is x = tokens[p, p+block), y = tokens[p+1, p+block+1] as i64, where
 * windows start every `stride` tokens of a segment. Fields "x" and "y". */
ds_dataset *ds_dataset_windows(ds_tensor *tokens, int nseg, const int64_t *seg_len, int64_t block, int64_t stride);
/* The same windows over llm.c token shards (ds_data.h), one segment each,
 * memory-mapped: a batch reads its windows' tokens from the page cache, so
 * the corpus costs no anonymous memory whatever its size. Every shard must
 * hold a window; vocab > 0 checks every token is below it. len[k]
 * receives shard k's token count. */
ds_dataset *ds_dataset_shards(int nfiles, const char *const *paths, int64_t block, int64_t stride, int64_t vocab,
                              int64_t *len);
void ds_dataset_retain(ds_dataset *d);
void ds_dataset_release(ds_dataset *d);

int64_t ds_dataset_len(const ds_dataset *d);
int ds_dataset_nfields(const ds_dataset *d);
const char *ds_dataset_field_name(const ds_dataset *d, int k);
/* 0, or -1 naming the first index outside [0, len). */
int ds_dataset_check_indices(const ds_dataset *d, const int64_t *idx, int64_t n);
/* Samples idx[0..n) (0-based) into new CPU tensors out[0..nfields) with a
 * leading dim n, in the staging memory of dev (ds_tensor_new_staging; plain
 * memory for the CPU). Safe to call from several threads at once. 0 or -1. */
int ds_dataset_gather(const ds_dataset *d, const int64_t *idx, int64_t n, ds_device dev, ds_tensor **out);
/* A permutation of [0, n) as i64, a pure function of (n, seed): element i is
 * ds_shuffle_at(n, seed)'s image of i, the order a shuffled loader reads lazily. */
ds_tensor *ds_dataset_permutation(int64_t n, uint64_t seed);

/* num_workers threads (0: batches are gathered by ds_loader_next on the
 * caller's thread), room for `depth` batches in flight, batches on dev.
 * Retains d. */
ds_loader *ds_loader_new(ds_dataset *d, int num_workers, int depth, ds_device dev);
/* Queues a batch of n sample indices (copied). -1 when the ring is full or
 * an index is out of range. */
int ds_loader_submit(ds_loader *l, const int64_t *idx, int64_t n);
/* Batches submitted and not yet taken (the one on its way to the device
 * not counted); the ring's size. */
int ds_loader_queued(ds_loader *l);
int ds_loader_depth(const ds_loader *l);
/* The oldest submitted batch, waiting for it: new references in
 * out[0..nfields), on the loader's device. On a device, the next submitted
 * batch starts its upload. -1 with the worker's (or the upload's) error
 * for that batch, or when none is queued. */
int ds_loader_next(ds_loader *l, ds_tensor **out);
/* Drops every batch submitted and not taken (an epoch left early), the
 * one on its way to the device too. */
void ds_loader_drain(ds_loader *l);
/* Drains, stops and joins the threads, frees everything. NULL is fine. */
void ds_loader_free(ds_loader *l);

#endif
