#include "ds_hash.h"
#include "ds_error.h"

#include <openssl/err.h>
#include <openssl/evp.h>

/* OpenSSL's own reason for the last failure, for the error message. */
static const char *openssl_reason(void) {
    unsigned long e = ERR_get_error();
    const char *r = e ? ERR_reason_error_string(e) : NULL;
    return r ? r : "unknown OpenSSL error";
}

int ds_hash_sha256_hex(const void *data, size_t n, char hex[DS_HASH_SHA256_HEX]) {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    /* one-shot: EVP_Digest makes and frees its own context */
    if (!EVP_Digest(data, n, md, &len, EVP_sha256(), NULL)) {
        ds_fail(DS_ERR_STATE, "sha256: %s", openssl_reason());
        return -1;
    }
    static const char digits[] = "0123456789abcdef";
    for (unsigned int i = 0; i < len; i++) {
        hex[2 * i] = digits[md[i] >> 4];
        hex[2 * i + 1] = digits[md[i] & 15];
    }
    hex[2 * len] = '\0';
    return 0;
}
