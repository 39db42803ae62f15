/* safetensors files, the format Hugging Face's `safetensors` and PyTorch
 * read: an 8-byte little-endian header length N, N bytes of JSON
 *   {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]},
 *    ..., "__metadata__": {"<key>": "<string>", ...}}
 * (padded with spaces so the data starts 8-byte aligned), then the tensors'
 * bytes back to back, little-endian, offsets counted from the data's start.
 *
 * Saving writes a temporary file, fsyncs it and renames it into place, so
 * the final name only ever holds a complete file, and hashes the bytes as
 * they go out (SHA-256 of the file; CRC-32 of each tensor when asked, to
 * tell which tensor of a damaged file changed). Opening
 * checks the whole header against the file's size before any read, so a
 * truncated or corrupt file is an error naming the file and the tensor. */
#ifndef DS_SAFETENSORS_H
#define DS_SAFETENSORS_H

#include "ds_sha256.h"
#include "ds_tensor.h"

typedef struct {
    int64_t bytes;                  /* the whole file's */
    char sha256[DS_SHA256_HEX];     /* the whole file's */
} ds_safetensors_saved;

/* Writes n tensors (any dtype dslua has, on any device; views are fine)
 * under unique names to path. meta: n_meta key/value strings for
 * __metadata__. tensor_crc32: NULL, or room for the CRC-32 (zlib's) of
 * each tensor's bytes. kill_after >= 0 is a test hook: the process kills itself
 * (SIGKILL) once that many bytes of tensor data are written, leaving the
 * temporary file behind as a crash would. The directory's fsync, which
 * makes the rename durable, is the caller's (one for many files). */
int ds_safetensors_save(const char *path, int n, const char *const *names, ds_tensor *const *tensors, int n_meta,
                        const char *const *meta_keys, const char *const *meta_values,
                        uint32_t *tensor_crc32, int64_t kill_after, ds_safetensors_saved *out);

typedef struct ds_safetensors_file ds_safetensors_file;

typedef struct {
    const char *name;
    ds_dtype dtype;
    int ndim;
    int64_t shape[DS_MAX_DIMS];
    int64_t numel;
    int64_t begin, end;             /* bytes, from the start of the data */
} ds_safetensors_entry;

/* Opens and checks path: NULL with an error naming the file (and the
 * tensor) when it is not a complete safetensors file. */
ds_safetensors_file *ds_safetensors_open(const char *path);
void ds_safetensors_close(ds_safetensors_file *f);
const char *ds_safetensors_path(const ds_safetensors_file *f);
int ds_safetensors_count(const ds_safetensors_file *f);
const ds_safetensors_entry *ds_safetensors_entry_at(const ds_safetensors_file *f, int i);
/* The entry's index, -1 when the file has none of that name. */
int ds_safetensors_find(const ds_safetensors_file *f, const char *name);
int ds_safetensors_n_metadata(const ds_safetensors_file *f);
void ds_safetensors_metadata_at(const ds_safetensors_file *f, int i, const char **key, const char **value);
/* Elements [lo, lo + n) of entry i as a new 1-D CPU tensor of its dtype. */
ds_tensor *ds_safetensors_read(ds_safetensors_file *f, int i, int64_t lo, int64_t n);
/* Elements [lo, lo + n) of entry i into contiguous dst from its element
 * at: read straight into its memory when it is a CPU tensor of the
 * file's dtype, else converted (dtype, device) on the way. */
int ds_safetensors_read_into(ds_safetensors_file *f, int i, int64_t lo, int64_t n, ds_tensor *dst, int64_t at);
/* CRC-32 of entry i's bytes as they are in the file. */
int ds_safetensors_entry_crc32(ds_safetensors_file *f, int i, uint32_t *crc);

#endif
