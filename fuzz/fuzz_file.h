/* The fuzz input as a file on disk, for readers that take a path: one
 * file in a private temporary folder, rewritten for each input and
 * removed at exit. */
#ifndef FUZZ_FILE_H
#define FUZZ_FILE_H

#include <stddef.h>
#include <stdint.h>

/* The file's path once it holds data; NULL when it cannot be written. */
const char *fuzz_file_put(const uint8_t *data, size_t size);

#endif
