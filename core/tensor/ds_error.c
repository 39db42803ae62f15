#include "ds_error.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char err_msg[1024];
static _Thread_local ds_errcode err_code;

void *ds_fail(ds_errcode code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err_msg, sizeof err_msg, fmt, ap);
    va_end(ap);
    err_code = code;
    return NULL;
}

const char *ds_error_message(void) { return err_code ? err_msg : "no error"; }
ds_errcode ds_error_code(void) { return err_code; }
void ds_error_clear(void) { err_code = DS_OK; err_msg[0] = 0; }
