#include "fuzz_file.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static char dir[] = "/tmp/dslua-fuzz-XXXXXX";
static char path[64];

static void remove_file(void) {
    unlink(path);
    rmdir(dir);
}

const char *fuzz_file_put(const uint8_t *data, size_t size) {
    if (!path[0]) {
        if (!mkdtemp(dir)) return NULL;
        snprintf(path, sizeof path, "%s/input", dir);
        atexit(remove_file);
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return NULL;
    ssize_t got = size ? write(fd, data, size) : 0;
    close(fd);
    return got == (ssize_t)size ? path : NULL;
}
