/* A refcounted block of device memory, counted under one memory category. */
#ifndef DS_STORAGE_H
#define DS_STORAGE_H

#include "ds_device.h"

typedef struct ds_storage {
    _Atomic int refcount;
    void *data;
    size_t nbytes;
    ds_device device;
    ds_mem_category category;
    ds_allocator *allocator;        /* what frees data */
} ds_storage;

ds_storage *ds_storage_new(size_t nbytes, ds_device dev, ds_mem_category cat);
/* CPU bytes that `dev` uploads from fastest: its backend's page-locked
 * host memory, or plain CPU memory where there is none (the CPU itself). */
ds_storage *ds_storage_new_staging(size_t nbytes, ds_device dev, ds_mem_category cat);
/* No bytes at all: what a released parameter points at (ds_tensor_release_data). */
ds_storage *ds_storage_new_empty(ds_device dev, ds_mem_category cat);
void ds_storage_retain(ds_storage *s);
void ds_storage_release(ds_storage *s);
void ds_storage_set_category(ds_storage *s, ds_mem_category cat);

#endif
