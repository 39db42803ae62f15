/* A refcounted block of device memory, counted under one memory category. */
#ifndef DS_STORAGE_H
#define DS_STORAGE_H

#include "ds_device.h"

#include <stdint.h>

/* version counts the in-place writes into the bytes (PyTorch's version
 * counter, shared by every view): autograd compares it with the one a
 * saved tensor had. id tells storages apart without address reuse. */
typedef struct ds_storage {
    _Atomic int refcount;
    void *data;
    size_t nbytes;
    ds_device device;
    ds_mem_category category;
    ds_allocator *allocator;        /* what frees data */
    uint64_t id;
    _Atomic uint64_t version;
    _Atomic(const char *) modified_by;  /* the last in-place op, for errors */
    _Atomic int pins;                   /* users reading or writing the bytes outside any tensor op */
    _Atomic(const char *) pinned_by;    /* the latest of them, for errors */
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
/* An in-place write by op into s's bytes. */
void ds_storage_bump_version(ds_storage *s, const char *op);
/* Marks the bytes in use by who (a dataset, a transfer in flight) until
 * the matching unpin: a tensor on s cannot then swap s out (release_data,
 * set_data, reseat), which would free the bytes under their user. */
void ds_storage_pin(ds_storage *s, const char *who);
void ds_storage_unpin(ds_storage *s);

#endif
