#include "ds_storage.h"
#include "ds_error.h"

#include <stdatomic.h>
#include <stdlib.h>

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
    atomic_init(&s->refcount, 1);
    s->nbytes = nbytes;
    s->device = dev;
    s->category = cat;
    s->allocator = a;
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
    atomic_init(&s->refcount, 1);
    s->data = NULL;
    s->nbytes = 0;
    s->device = dev;
    s->category = cat;
    s->allocator = NULL;
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
