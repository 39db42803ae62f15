#include "ds_kernels.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char kernel_err[512];

int ds_kernel_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(kernel_err, sizeof kernel_err, fmt, ap);
    va_end(ap);
    return -1;
}

const char *ds_kernel_error(void) { return kernel_err; }
