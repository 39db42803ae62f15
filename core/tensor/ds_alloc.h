/* Allocators and the byte accounting behind memory reports.
 *
 * Every byte of tensor storage goes through a ds_allocator (one per device)
 * and is counted under a category, so `memory_report` can say how much is
 * parameters, gradients, fp32 master weights (mixed precision, ZeRO),
 * optimizer state or activations, now and at peak. */
#ifndef DS_ALLOC_H
#define DS_ALLOC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    DS_MEM_PARAM, DS_MEM_GRAD, DS_MEM_MASTER, DS_MEM_OPTIM, DS_MEM_ACT, DS_MEM_OTHER,
    DS_MEM_NCATEGORIES
} ds_mem_category;

typedef struct ds_allocator {
    const char *name;
    void *(*alloc)(struct ds_allocator *self, size_t nbytes);
    void (*free)(struct ds_allocator *self, void *ptr, size_t nbytes);
    bool on_device;        /* an accelerator's memory, counted apart too */
} ds_allocator;

typedef struct {
    int64_t current[DS_MEM_NCATEGORIES];
    int64_t peak[DS_MEM_NCATEGORIES];
    int64_t total_current, total_peak;
    int64_t cached;        /* freed CPU blocks kept for reuse, not in the counts above */
} ds_mem_stats;

extern ds_allocator ds_cpu_allocator;   /* 64-byte aligned, for SIMD rows */

/* Allocates through `a` and counts the bytes. On failure it calls the
 * out-of-memory handler (the binding frees garbage there) and tries once
 * more before failing with DS_ERR_NOMEM. */
void *ds_mem_alloc(ds_allocator *a, size_t nbytes, ds_mem_category cat);
void ds_mem_free(ds_allocator *a, void *ptr, size_t nbytes, ds_mem_category cat);
/* Moves counted bytes from one category to another (a tensor becoming a
 * parameter, say). */
void ds_mem_recategorize(size_t nbytes, ds_mem_category from, ds_mem_category to);

void ds_mem_get_stats(ds_mem_stats *out);
/* Returns the cached free CPU blocks to the system (an allocation that
 * fails does this before it gives up). */
void ds_mem_empty_cache(void);
void ds_mem_reset_peak(void);
int64_t ds_mem_live_bytes(void);
int64_t ds_mem_device_live_bytes(void);   /* the part of it on accelerators */
const char *ds_mem_category_name(ds_mem_category c);
int ds_mem_category_parse(const char *name);   /* -1 if unknown */

typedef void (*ds_oom_handler)(void *ud);
void ds_mem_set_oom_handler(ds_oom_handler fn, void *ud);

#endif
