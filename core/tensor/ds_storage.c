#include "ds_storage.h"
#include "ds_error.h"

#include <stdatomic.h>
#include <stdlib.h>

static _Atomic uint64_t storages_made;

static void init_header(ds_storage *s, size_t nbytes, ds_device dev, ds_mem_category cat, ds_allocator *a) {
    atomic_init(&s->refcount, 1);
    s->nbytes = nbytes;
    s->device = dev;
    s->category = cat;
    s->allocator = a;
    s->id = atomic_fetch_add(&storages_made, 1) + 1;
    atomic_init(&s->version, 0);
    atomic_init(&s->modified_by, NULL);
    atomic_init(&s->pins, 0);
    atomic_init(&s->pinned_by, NULL);
}

static const ds_backend *backend_of(ds_device dev) {
    char name[16];
    ds_device_name(dev, name, sizeof name);
    return ds_device_check(name, dev) ? NULL : ds_backend_get(dev);
}

static ds_storage *storage_alloc(size_t nbytes, ds_device dev, ds_mem_category cat, ds_allocator *a) {
    ds_storage *s = malloc(sizeof *s);
    if (!s) return ds_fail(DS_ERR_NOMEM, "out of memory for a storage header");
    s->data = ds_mem_alloc(a, nbytes, cat);
    if (!s->data) { free(s); return NULL; }
    init_header(s, nbytes, dev, cat, a);
    return s;
}

ds_storage *ds_storage_new(size_t nbytes, ds_device dev, ds_mem_category cat) {
    const ds_backend *b = backend_of(dev);
    return b ? storage_alloc(nbytes, dev, cat, b->allocator) : NULL;
}

ds_storage *ds_storage_new_staging(size_t nbytes, ds_device dev, ds_mem_category cat) {
    const ds_backend *b = backend_of(dev);     /* makes dev current: its host memory is for it */
    if (!b) return NULL;
    return storage_alloc(nbytes, DS_CPU_DEVICE, cat, b->host_allocator ? b->host_allocator : &ds_cpu_allocator);
}

ds_storage *ds_storage_new_empty(ds_device dev, ds_mem_category cat) {
    ds_storage *s = malloc(sizeof *s);
    if (!s) return ds_fail(DS_ERR_NOMEM, "out of memory for a storage header");
    s->data = NULL;
    init_header(s, 0, dev, cat, NULL);
    return s;
}

void ds_storage_retain(ds_storage *s) { atomic_fetch_add(&s->refcount, 1); }

void ds_storage_release(ds_storage *s) {
    if (!s || atomic_fetch_sub(&s->refcount, 1) != 1) return;
    if (s->data) ds_mem_free(s->allocator, s->data, s->nbytes, s->category);
    free(s);
}

void ds_storage_set_category(ds_storage *s, ds_mem_category cat) {
    ds_mem_recategorize(s->nbytes, s->category, cat);
    s->category = cat;
}

void ds_storage_bump_version(ds_storage *s, const char *op) {
    atomic_store_explicit(&s->modified_by, op, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->version, 1, memory_order_relaxed);
}

void ds_storage_pin(ds_storage *s, const char *who) {
    atomic_store_explicit(&s->pinned_by, who, memory_order_relaxed);
    atomic_fetch_add(&s->pins, 1);
}

void ds_storage_unpin(ds_storage *s) { atomic_fetch_sub(&s->pins, 1); }
