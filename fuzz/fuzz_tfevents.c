/* libFuzzer target: the TensorBoard event reader (core/io/ds_tfevents.c)
 * on any bytes: TFRecord framing, CRCs, Event and Summary protobufs. It
 * may refuse the file or stop at a torn last record; it must never crash,
 * leak or read out of bounds, and a torn record lies inside the file. */
#include "ds_tfevents.h"
#include "fuzz_file.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* touches every byte the reader hands out */
static int visit(const ds_tfevent *e, void *ctx) {
    size_t *n = ctx;
    *n += e->tag ? strlen(e->tag) : strlen(e->file_version);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_file_put(data, size);
    size_t n = 0;
    long torn = -1;
    if (path && ds_tfevents_read(path, visit, &n, &torn) == 0 && (torn < -1 || torn >= (long)size)) {
        fprintf(stderr, "fuzz_tfevents: a torn record at byte %ld of a %zu-byte file\n", torn, size);
        abort();
    }
    return 0;
}
