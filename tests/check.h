/* The C tests' one assertion: count every check, report each failure with
 * its message, and let main print the summary and set the exit status. */
#ifndef TESTS_CHECK_H
#define TESTS_CHECK_H

#include <stdarg.h>
#include <stdio.h>

static int checks, failures;

static void check(int ok, const char *fmt, ...) {
    checks++;
    if (ok) return;
    failures++;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAIL: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

/* Prints "<name>: N checks, N failed" and returns the exit status. */
static int check_summary(const char *name) {
    printf("%s: %d checks, %d failed\n", name, checks, failures);
    return failures != 0;
}

#endif
