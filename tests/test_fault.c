/* The records of checks a device answers in its own time (ds_fault.h),
 * driven on the CPU: the test writes each record as a GPU's check kernel
 * would, later, and the settle that a read back or the step engine's
 * agreement makes reports the first check opened that hit, naming its op
 * and value, once. */
#include "ds_fault.h"
#include "ds_error.h"

#include <stdio.h>
#include <string.h>

#include "check.h"

static const ds_device gpu = { DS_DEV_CUDA, 0 };

static void describe(char *buf, size_t n, const void *ctx, ds_index_hit hit) {
    snprintf(buf, n, "%s: value %lld at position %lld", (const char *)ctx, (long long)hit.value,
             (long long)hit.pos);
}

static ds_index_hit *open_check(ds_device dev, const char *op) {
    return ds_fault_open(dev, describe, op, strlen(op) + 1);
}

static void check_error(int rc, const char *want, const char *what) {
    check(rc == -1, "%s: settle returned %d, expected -1", what, rc);
    if (rc == -1) check(strcmp(ds_error_message(), want) == 0, "%s: got '%s', want '%s'", what, ds_error_message(), want);
}

/* The first check opened that hit is the error; those after it, hit or
 * not, close with it (they may stem from it); a record its kernel has not
 * written stays open for the next settle. */
static void test_first_hit_reported_once(void) {
    ds_index_hit *emb = open_check(gpu, "embedding"), *ce = open_check(gpu, "cross_entropy");
    ds_index_hit *late = open_check(gpu, "gather");
    check(emb && ce && late, "open: %s", ds_error_message());
    if (!emb || !ce || !late) return;
    check(ds_fault_settle(gpu) == 0, "nothing written yet: no error");
    *emb = (ds_index_hit){ -1, 0 };
    *ce = (ds_index_hit){ 17, 50300 };
    check_error(ds_fault_settle(gpu), "cross_entropy: value 50300 at position 17 (checked on cuda:0, reported at the first "
                    "synchronisation after)", "cross_entropy");
    check(ds_fault_settle(gpu) == 0, "the gather check, still unwritten, is not reported");
    *late = (ds_index_hit){ 3, -1 };
    check_error(ds_fault_settle(gpu), "gather: value -1 at position 3 (checked on cuda:0, reported at the first "
                                      "synchronisation after)", "gather");
    check(ds_fault_settle(gpu) == 0, "reported once");
}

static void test_later_hits_close_with_first(void) {
    ds_index_hit *a = open_check(gpu, "embedding"), *b = open_check(gpu, "cross_entropy");
    if (!a || !b) {
        check(0, "open: %s", ds_error_message());
        return;
    }
    *b = (ds_index_hit){ 2, 9 };
    *a = (ds_index_hit){ 1, 8 };
    check_error(ds_fault_settle(gpu), "embedding: value 8 at position 1 (checked on cuda:0, reported at the first "
                                      "synchronisation after)", "the first opened");
    check(ds_fault_settle(gpu) == 0, "the later hit closed with the first");
}

/* 64 records without a synchronisation: the 65th makes room by settling
 * (here no device to wait for), and fails when every record still waits. */
static void test_full_pool(void) {
    ds_index_hit *open[64];
    for (int i = 0; i < 64; i++) open[i] = open_check(gpu, "index_select");
    check(open[63] != NULL, "64 records open");
    check(open_check(gpu, "index_select") == NULL, "a 65th with every record waiting is refused");
    check(strstr(ds_error_message(), "every record of 64 is still waiting") != NULL, "why: %s", ds_error_message());
    for (int i = 0; i < 64; i++) *open[i] = (ds_index_hit){ -1, 0 };
    ds_index_hit *next = open_check(gpu, "index_select");
    check(next != NULL, "room once the checks have run: %s", ds_error_message());
    if (next) *next = (ds_index_hit){ -1, 0 };
    open[0] = open_check(gpu, "index_select");
    for (int i = 1; i < 64; i++) open[i] = open_check(gpu, "index_select");
    *open[5] = (ds_index_hit){ 0, 77 };
    for (int i = 0; i < 64; i++)
        if (i != 5) *open[i] = (ds_index_hit){ -1, 0 };
    check(open_check(gpu, "index_select") == NULL, "making room reports a hit");
    check(strstr(ds_error_message(), "index_select: value 77 at position 0") != NULL, "%s", ds_error_message());
    check(ds_fault_settle(gpu) == 0, "and closes every record");
}

/* The CPU's check closes its own record: the op's own error, no suffix. */
static void test_cpu_closes_at_once(void) {
    ds_index_hit *h = open_check(DS_CPU_DEVICE, "embedding");
    if (!h) {
        check(0, "open: %s", ds_error_message());
        return;
    }
    *h = (ds_index_hit){ 4, 50257 };
    check_error(ds_fault_close(DS_CPU_DEVICE, h), "embedding: value 50257 at position 4", "cpu");
    check(ds_fault_settle(DS_CPU_DEVICE) == 0, "closed");
}

int main(void) {
    test_first_hit_reported_once();
    test_later_hits_close_with_first();
    test_full_pool();
    test_cpu_closes_at_once();
    return check_summary("test_fault");
}
