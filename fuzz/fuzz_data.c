/* libFuzzer target: the dataset readers (core/io/ds_data.c) on any bytes,
 * gzip or plain. The first byte picks the reader (IDX of 1, 2 or 3 dims,
 * an llm.c token shard, a CIFAR-10 batch, text); the rest is the file,
 * handed over as a memfd so nothing touches the disk. A reader may refuse
 * the file; it must never crash, leak or read out of bounds. */
#define _GNU_SOURCE
#include "ds_data.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int fd = memfd_create("dslua-fuzz", MFD_CLOEXEC);
    if (fd < 0) return 0;
    if (write(fd, data + 1, size - 1) != (ssize_t)(size - 1)) {
        close(fd);
        return 0;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    const char *paths[] = { path };
    ds_tensor *x = NULL, *y = NULL;
    int64_t n = 0;
    switch (data[0] % 6) {
    case 0: case 1: case 2:
        x = ds_data_read_idx(path, data[0] % 6 + 1, 0, -1, &n);
        break;
    case 3: {
        ds_shard s;
        if (ds_shard_map(path, 65536, &s) == 0) ds_shard_unmap(&s);
        break;
    }
    case 4:
        ds_data_read_cifar10(1, paths, &x, &y);
        break;
    default: {
        size_t len;
        unsigned char *text = ds_data_read_all(path, &len), vocab[256];
        int nvocab;
        if (text) x = ds_data_char_tokens(text, len, vocab, &nvocab);
        free(text);
    }
    }
    ds_tensor_release(x);
    ds_tensor_release(y);
    close(fd);
    return 0;
}
