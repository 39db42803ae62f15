#include "ds_alloc.h"
#include "ds_error.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static _Atomic int64_t cur[DS_MEM_NCATEGORIES], peak[DS_MEM_NCATEGORIES];
static _Atomic int64_t total_cur, total_peak;
static ds_oom_handler oom_fn;
static void *oom_ud;

static const char *const category_names[DS_MEM_NCATEGORIES] = {
    "parameters", "gradients", "master_weights", "optimizer_state", "activations", "other"
};

/* ---- the CPU block cache ----
 * Large blocks come from mmap, so every fresh one costs a page fault and
 * a zeroed page per 4 KiB, and every free an munmap: in a training step
 * that re-allocates the same activation and gradient sizes each time, that
 * was a fifth of the step. Freed blocks of CACHE_MIN bytes or more are kept
 * by size (most recent first) and handed out again on an exact match;
 * the oldest go back to the system once the cache would pass its bound
 * (DSLUA_ALLOC_CACHE_MB, default min(2 GiB, RAM / 8); 0 turns it off). */
#define CACHE_MIN ((size_t)256 << 10)
#define CACHE_SLOTS 512

static struct { void *ptr; size_t nbytes; } cache[CACHE_SLOTS];
static int cache_n;
static size_t cache_bytes, cache_cap = (size_t)-1;    /* -1: not read yet */
static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t cache_limit(void) {    /* caller holds the lock */
    if (cache_cap != (size_t)-1) return cache_cap;
    const char *v = getenv("DSLUA_ALLOC_CACHE_MB");
    if (v && *v) {
        long long mb = atoll(v);
        cache_cap = mb > 0 ? (size_t)mb << 20 : 0;
    } else {
        long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        size_t ram8 = pages > 0 && page > 0 ? (size_t)pages * (size_t)page / 8 : 0;
        cache_cap = ram8 < ((size_t)2 << 30) ? ram8 : (size_t)2 << 30;
    }
    return cache_cap;
}

static void cache_drop(int i) {    /* caller holds the lock */
    cache_bytes -= cache[i].nbytes;
    memmove(&cache[i], &cache[i + 1], sizeof cache[0] * (size_t)(cache_n - i - 1));
    cache_n--;
}

static void *cache_take(size_t rounded) {
    void *p = NULL;
    pthread_mutex_lock(&cache_lock);
    for (int i = cache_n - 1; i >= 0; i--)
        if (cache[i].nbytes == rounded) { p = cache[i].ptr; cache_drop(i); break; }
    pthread_mutex_unlock(&cache_lock);
    return p;
}

/* Keeps the block, or returns false when it does not fit the bound. */
static bool cache_put(void *ptr, size_t rounded) {
    void *evicted[CACHE_SLOTS];
    int ne = 0;
    pthread_mutex_lock(&cache_lock);
    if (rounded > cache_limit()) {
        pthread_mutex_unlock(&cache_lock);
        return false;
    }
    while (cache_n > 0 && (cache_n == CACHE_SLOTS || cache_bytes + rounded > cache_cap)) {
        evicted[ne++] = cache[0].ptr;
        cache_drop(0);
    }
    cache[cache_n].ptr = ptr;
    cache[cache_n].nbytes = rounded;
    cache_n++;
    cache_bytes += rounded;
    pthread_mutex_unlock(&cache_lock);
    for (int i = 0; i < ne; i++) free(evicted[i]);
    return true;
}

void ds_mem_empty_cache(void) {
    pthread_mutex_lock(&cache_lock);
    while (cache_n > 0) {
        free(cache[cache_n - 1].ptr);
        cache_drop(cache_n - 1);
    }
    pthread_mutex_unlock(&cache_lock);
}

static size_t round64(size_t nbytes) { return nbytes ? (nbytes + 63) & ~(size_t)63 : 64; }

static void *cpu_alloc(ds_allocator *self, size_t nbytes) {
    (void)self;
    void *p = NULL;
    if (nbytes > SIZE_MAX - 63) return NULL;     /* rounding up would wrap to 0 */
    size_t rounded = round64(nbytes);
    if (rounded >= CACHE_MIN && (p = cache_take(rounded))) return p;
    if (posix_memalign(&p, 64, rounded) != 0) return NULL;
    return p;
}

static void cpu_free(ds_allocator *self, void *ptr, size_t nbytes) {
    (void)self;
    size_t rounded = round64(nbytes);
    if (rounded >= CACHE_MIN && cache_put(ptr, rounded)) return;
    free(ptr);
}

ds_allocator ds_cpu_allocator = { "cpu", cpu_alloc, cpu_free, false };

static void raise_peak(_Atomic int64_t *pk, int64_t v) {
    int64_t old = atomic_load(pk);
    while (v > old && !atomic_compare_exchange_weak(pk, &old, v)) {}
}

/* Bytes on an accelerator: their garbage costs device memory, not cache
 * misses and page faults, so the binding may let more of it wait. */
static _Atomic int64_t device_cur;

static void count(ds_mem_category cat, int64_t delta) {
    int64_t c = atomic_fetch_add(&cur[cat], delta) + delta;
    int64_t t = atomic_fetch_add(&total_cur, delta) + delta;
    if (delta > 0) { raise_peak(&peak[cat], c); raise_peak(&total_peak, t); }
}

void *ds_mem_alloc(ds_allocator *a, size_t nbytes, ds_mem_category cat) {
    void *p = a->alloc(a, nbytes);
    if (!p) {
        ds_mem_empty_cache();
        p = a->alloc(a, nbytes);
    }
    if (!p && oom_fn) {
        oom_fn(oom_ud);
        ds_mem_empty_cache();      /* what the collection freed went to the cache */
        p = a->alloc(a, nbytes);
    }
    if (!p) return ds_fail(DS_ERR_NOMEM, "out of memory: %zu bytes on %s", nbytes, a->name);
    count(cat, (int64_t)nbytes);
    if (a->on_device) atomic_fetch_add(&device_cur, (int64_t)nbytes);
    return p;
}

void ds_mem_free(ds_allocator *a, void *ptr, size_t nbytes, ds_mem_category cat) {
    if (!ptr) return;
    a->free(a, ptr, nbytes);
    count(cat, -(int64_t)nbytes);
    if (a->on_device) atomic_fetch_sub(&device_cur, (int64_t)nbytes);
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
    pthread_mutex_lock(&cache_lock);
    out->cached = (int64_t)cache_bytes;
    pthread_mutex_unlock(&cache_lock);
}

void ds_mem_reset_peak(void) {
    for (int i = 0; i < DS_MEM_NCATEGORIES; i++) atomic_store(&peak[i], atomic_load(&cur[i]));
    atomic_store(&total_peak, atomic_load(&total_cur));
}

int64_t ds_mem_live_bytes(void) { return atomic_load(&total_cur); }

int64_t ds_mem_device_live_bytes(void) { return atomic_load(&device_cur); }

const char *ds_mem_category_name(ds_mem_category c) { return category_names[c]; }

int ds_mem_category_parse(const char *name) {
    for (int i = 0; i < DS_MEM_NCATEGORIES; i++)
        if (strcmp(name, category_names[i]) == 0) return i;
    return -1;
}

void ds_mem_set_oom_handler(ds_oom_handler fn, void *ud) { oom_fn = fn; oom_ud = ud; }
