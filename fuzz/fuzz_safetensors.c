/* libFuzzer target: the safetensors reader (core/io/ds_safetensors.c) on
 * any bytes. A file it opens must hold what its header promises: every
 * tensor found by its own name, read whole and hashed within the file.
 * It may refuse the file; it must never crash, leak, overflow or read
 * out of bounds. */
#include "ds_error.h"
#include "ds_safetensors.h"
#include "fuzz_file.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_file(ds_safetensors_file *f) {
    for (int i = 0; i < ds_safetensors_count(f); i++) {
        const ds_safetensors_entry *e = ds_safetensors_entry_at(f, i);
        if (ds_safetensors_find(f, e->name) != i) {
            fprintf(stderr, "fuzz_safetensors: tensor '%s' is not found at its own index %d\n", e->name, i);
            abort();
        }
        ds_tensor *t = ds_safetensors_read(f, i, 0, e->numel);
        uint32_t crc;
        if (!t || ds_safetensors_entry_crc32(f, i, &crc)) {
            fprintf(stderr, "fuzz_safetensors: tensor '%s' of an opened file does not read: %s\n", e->name,
                    ds_error_message());
            abort();
        }
        ds_tensor_release(t);
    }
    for (int i = 0; i < ds_safetensors_n_metadata(f); i++) {
        const char *k, *v;
        ds_safetensors_metadata_at(f, i, &k, &v);
        if (!k || !v) abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_file_put(data, size);
    ds_safetensors_file *f = path ? ds_safetensors_open(path) : NULL;
    if (f) check_file(f);
    ds_safetensors_close(f);
    return 0;
}
