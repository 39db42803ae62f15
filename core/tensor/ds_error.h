/* Errors: a failing core function returns NULL or -1 and leaves a message
 * here, per thread. The binding layer turns it into a Lua error. */
#ifndef DS_ERROR_H
#define DS_ERROR_H

typedef enum { DS_OK = 0, DS_ERR_ARG, DS_ERR_NOMEM, DS_ERR_IO, DS_ERR_STATE } ds_errcode;

#if defined(__GNUC__)
#define DS_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define DS_PRINTF(a, b)
#endif

/* Sets the message (printf-style) and returns NULL so callers can write
 * `return ds_fail(DS_ERR_ARG, "...")`. */
void *ds_fail(ds_errcode code, const char *fmt, ...) DS_PRINTF(2, 3);
const char *ds_error_message(void);
ds_errcode ds_error_code(void);
void ds_error_clear(void);

#endif
