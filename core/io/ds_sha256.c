#include "ds_sha256.h"
#include "ds_error.h"
#include "ds_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <openssl/evp.h>

struct ds_sha256 { EVP_MD_CTX *ctx; };

ds_sha256 *ds_sha256_new(void) {
    ds_sha256 *h = malloc(sizeof *h);
    if (!h) return ds_fail(DS_ERR_NOMEM, "sha256: out of memory");
    if (!(h->ctx = EVP_MD_CTX_new()) || EVP_DigestInit_ex(h->ctx, EVP_sha256(), NULL) != 1) {
        ds_sha256_free(h);
        return ds_fail(DS_ERR_STATE, "sha256: OpenSSL could not start a digest");
    }
    return h;
}

int ds_sha256_update(ds_sha256 *h, const void *data, size_t n) {
    if (n && EVP_DigestUpdate(h->ctx, data, n) != 1)
        return ds_fail(DS_ERR_STATE, "sha256: OpenSSL digest update failed"), -1;
    return 0;
}

int ds_sha256_final(ds_sha256 *h, char *hex) {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    int ok = EVP_DigestFinal_ex(h->ctx, md, &len) == 1 && len == 32;
    ds_sha256_free(h);
    if (!ok) return ds_fail(DS_ERR_STATE, "sha256: OpenSSL digest final failed"), -1;
    for (unsigned i = 0; i < len; i++) snprintf(hex + 2 * i, 3, "%02x", md[i]);
    return 0;
}

void ds_sha256_free(ds_sha256 *h) {
    if (!h) return;
    EVP_MD_CTX_free(h->ctx);
    free(h);
}

int ds_sha256_bytes(const void *data, size_t n, char *hex) {
    ds_sha256 *h = ds_sha256_new();
    if (!h) return -1;
    if (ds_sha256_update(h, data, n)) {
        ds_sha256_free(h);
        return -1;
    }
    return ds_sha256_final(h, hex);
}

int ds_sha256_file(const char *path, char *hex) {
    int fd = ds_file_open(path, DS_FILE_READ, INT64_MAX);
    if (fd < 0) return -1;
    enum { CHUNK = 1 << 22 };
    unsigned char *buf = malloc(CHUNK);
    ds_sha256 *h = buf ? ds_sha256_new() : NULL;
    int rc = h ? 0 : -1;
    if (!buf) ds_fail(DS_ERR_NOMEM, "sha256: out of memory reading '%s'", path);
    while (rc == 0) {
        ssize_t got = read(fd, buf, CHUNK);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) rc = -1, ds_fail(DS_ERR_IO, "cannot read '%s': %s", path, strerror(errno));
        if (got <= 0) break;
        rc = ds_sha256_update(h, buf, (size_t)got);
    }
    close(fd);
    free(buf);
    if (rc) {
        ds_sha256_free(h);
        return -1;
    }
    return ds_sha256_final(h, hex);
}
