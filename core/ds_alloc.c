#include "ds_alloc.h"
#include "ds_error.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static _Atomic int64_t cur[DS_MEM_NCATEGORIES], peak[DS_MEM_NCATEGORIES];
static _Atomic int64_t total_cur, total_peak;
static ds_oom_handler oom_fn;
static void *oom_ud;

static const char *const category_names[DS_MEM_NCATEGORIES] = {
    "parameters", "gradients", "optimizer_state", "activations", "other"
};

static void *cpu_alloc(ds_allocator *self, size_t nbytes) {
    (void)self;
    void *p = NULL;
    if (nbytes > SIZE_MAX - 63) return NULL;     /* rounding up would wrap to 0 */
    size_t rounded = (nbytes + 63) & ~(size_t)63;
    if (posix_memalign(&p, 64, rounded ? rounded : 64) != 0) return NULL;
    return p;
}

static void cpu_free(ds_allocator *self, void *ptr, size_t nbytes) {
    (void)self; (void)nbytes;
    free(ptr);
}

ds_allocator ds_cpu_allocator = { "cpu", cpu_alloc, cpu_free };

static void raise_peak(_Atomic int64_t *pk, int64_t v) {
    int64_t old = atomic_load(pk);
    while (v > old && !atomic_compare_exchange_weak(pk, &old, v)) {}
}

static void count(ds_mem_category cat, int64_t delta) {
    int64_t c = atomic_fetch_add(&cur[cat], delta) + delta;
    int64_t t = atomic_fetch_add(&total_cur, delta) + delta;
    if (delta > 0) { raise_peak(&peak[cat], c); raise_peak(&total_peak, t); }
}

void *ds_mem_alloc(ds_allocator *a, size_t nbytes, ds_mem_category cat) {
    void *p = a->alloc(a, nbytes);
    if (!p && oom_fn) {
        oom_fn(oom_ud);
        p = a->alloc(a, nbytes);
    }
    if (!p) return ds_fail(DS_ERR_NOMEM, "out of memory: %zu bytes on %s", nbytes, a->name);
    count(cat, (int64_t)nbytes);
    return p;
}

void ds_mem_free(ds_allocator *a, void *ptr, size_t nbytes, ds_mem_category cat) {
    if (!ptr) return;
    a->free(a, ptr, nbytes);
    count(cat, -(int64_t)nbytes);
}

void ds_mem_recategorize(size_t nbytes, ds_mem_category from, ds_mem_category to) {
    if (from == to) return;
    count(from, -(int64_t)nbytes);
    count(to, (int64_t)nbytes);
}

void ds_mem_get_stats(ds_mem_stats *out) {
    for (int i = 0; i < DS_MEM_NCATEGORIES; i++) {
        out->current[i] = atomic_load(&cur[i]);
        out->peak[i] = atomic_load(&peak[i]);
    }
    out->total_current = atomic_load(&total_cur);
    out->total_peak = atomic_load(&total_peak);
}

void ds_mem_reset_peak(void) {
    for (int i = 0; i < DS_MEM_NCATEGORIES; i++) atomic_store(&peak[i], atomic_load(&cur[i]));
    atomic_store(&total_peak, atomic_load(&total_cur));
}

int64_t ds_mem_live_bytes(void) { return atomic_load(&total_cur); }

const char *ds_mem_category_name(ds_mem_category c) { return category_names[c]; }

int ds_mem_category_parse(const char *name) {
    for (int i = 0; i < DS_MEM_NCATEGORIES; i++)
        if (strcmp(name, category_names[i]) == 0) return i;
    return -1;
}

void ds_mem_set_oom_handler(ds_oom_handler fn, void *ud) { oom_fn = fn; oom_ud = ud; }
