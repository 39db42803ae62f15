/* SHA-256 (OpenSSL's EVP) of bytes, streams and files: what checkpoint
 * manifests record so a load can tell a file is the one that was saved. */
#ifndef DS_SHA256_H
#define DS_SHA256_H

#include <stddef.h>

#define DS_SHA256_HEX 65        /* 64 hex digits and the terminating NUL */

typedef struct ds_sha256 ds_sha256;

/* A running hash; NULL with the error set. */
ds_sha256 *ds_sha256_new(void);
int ds_sha256_update(ds_sha256 *h, const void *data, size_t n);
/* The digest as lowercase hex into hex[DS_SHA256_HEX]; frees h. */
int ds_sha256_final(ds_sha256 *h, char *hex);
/* Frees h without a digest (after an error). */
void ds_sha256_free(ds_sha256 *h);

int ds_sha256_bytes(const void *data, size_t n, char *hex);
/* The file's whole content; errors name the path. */
int ds_sha256_file(const char *path, char *hex);

#endif
