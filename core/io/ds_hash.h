/* SHA-256 over OpenSSL's EVP interface: the hash that names a version of a
 * reloaded file (rank 0 sends it with the bytes, every rank checks it). */
#ifndef DS_HASH_H
#define DS_HASH_H

#include <stddef.h>

#define DS_HASH_SHA256_HEX 65      /* 64 hex digits and the terminator */

/* Writes the SHA-256 of data[0..n) as lowercase hex into hex. 0, or -1
 * with the error set. */
int ds_hash_sha256_hex(const void *data, size_t n, char hex[DS_HASH_SHA256_HEX]);

#endif
