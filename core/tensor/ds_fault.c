/* Faults a device finds in its own time: a pool of records per device,
 * their hits in memory the device writes into (page-locked for a GPU). */
#include "ds_fault.h"
#include "ds_error.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { FAULT_SLOTS = 64, FAULT_DEVICES = 64 };

/* A hit's pos until its check writes it: -1 (none) or a position then. */
#define FAULT_PENDING (-2)

typedef struct {
    ds_fault_describe describe;    /* NULL: the slot is free */
    uint64_t seq;                  /* the order opened */
    unsigned char ctx[DS_FAULT_CTX_MAX];
} fault_note;

typedef struct {
    ds_index_hit *hits;            /* FAULT_SLOTS, where the checks write */
    fault_note notes[FAULT_SLOTS];
} fault_pool;

static struct {
    pthread_mutex_t lock;
    uint64_t seq;
    fault_pool *pools[DS_NDEVICE_TYPES][FAULT_DEVICES];
} F = { PTHREAD_MUTEX_INITIALIZER, 0, { { NULL } } };

/* dev's pool, made on first use; NULL with the error set. */
static fault_pool *pool_of(ds_device dev) {
    if (dev.index < 0 || dev.index >= FAULT_DEVICES)
        return ds_fail(DS_ERR_ARG, "device index %d out of range for checks", dev.index);
    fault_pool **slot = &F.pools[dev.type][dev.index];
    if (*slot) return *slot;
    const ds_backend *b = ds_backend_get(dev);
    ds_allocator *host = b ? b->host_allocator : NULL;
    fault_pool *p = calloc(1, sizeof *p);
    size_t nb = FAULT_SLOTS * sizeof *p->hits;
    if (p) p->hits = host ? host->alloc(host, nb) : malloc(nb);
    if (!p || !p->hits) {
        free(p);
        return ds_fail(DS_ERR_NOMEM, "out of memory for the records of index checks");
    }
    return *slot = p;
}

static int free_slot(const fault_pool *p) {
    for (int i = 0; i < FAULT_SLOTS; i++)
        if (!p->notes[i].describe) return i;
    return -1;
}

/* Slot i's hit (a copy taken once) as the error, its slot closed. */
static int report(fault_pool *p, int i, ds_index_hit hit, ds_device dev) {
    char msg[512];
    p->notes[i].describe(msg, sizeof msg, p->notes[i].ctx, hit);
    p->notes[i].describe = NULL;
    if (dev.type == DS_DEV_CPU) return ds_fail(DS_ERR_ARG, "%s", msg), -1;
    char name[16];
    ds_device_name(dev, name, sizeof name);
    return ds_fail(DS_ERR_ARG, "%s (checked on %s, reported at the first synchronisation after)", msg, name), -1;
}

/* settle with F.lock held; each hit read once, since a copy may still
 * land on one that was pending */
static int settle_locked(fault_pool *p, ds_device dev) {
    ds_index_hit seen[FAULT_SLOTS];
    int first = -1;
    for (int i = 0; i < FAULT_SLOTS; i++) {
        fault_note *n = &p->notes[i];
        seen[i] = p->hits[i];
        if (!n->describe || seen[i].pos == FAULT_PENDING) continue;
        if (seen[i].pos >= 0 && (first < 0 || n->seq < p->notes[first].seq)) first = i;
    }
    /* the others that hit came after the first and may stem from it: one error */
    for (int i = 0; i < FAULT_SLOTS; i++)
        if (i != first && p->notes[i].describe && seen[i].pos != FAULT_PENDING) p->notes[i].describe = NULL;
    return first < 0 ? 0 : report(p, first, seen[first], dev);
}

ds_index_hit *ds_fault_open(ds_device dev, ds_fault_describe describe, const void *ctx, size_t ctx_size) {
    if (ctx_size > DS_FAULT_CTX_MAX) return ds_fail(DS_ERR_ARG, "check context of %zu bytes too large", ctx_size);
    pthread_mutex_lock(&F.lock);
    fault_pool *p = pool_of(dev);
    int i = p ? free_slot(p) : -1;
    if (p && i < 0) {
        /* every slot waits on the device: let it catch up, then reuse them */
        const ds_backend *b = ds_backend_get(dev);
        if (b && b->synchronize && b->synchronize(dev.index)) {
            ds_fail(DS_ERR_STATE, "index check: %s", ds_kernel_error());
            p = NULL;
        }
        if (p && settle_locked(p, dev)) p = NULL;
        if (p && (i = free_slot(p)) < 0) {
            ds_fail(DS_ERR_STATE, "index check: every record of %d is still waiting for its check", FAULT_SLOTS);
            p = NULL;
        }
    }
    ds_index_hit *hit = NULL;
    if (p && i >= 0) {
        p->notes[i].describe = describe;
        p->notes[i].seq = F.seq++;
        memcpy(p->notes[i].ctx, ctx, ctx_size);
        hit = &p->hits[i];
        *hit = (ds_index_hit){ FAULT_PENDING, 0 };
    }
    pthread_mutex_unlock(&F.lock);
    return hit;
}

int ds_fault_settle(ds_device dev) {
    if (dev.index < 0 || dev.index >= FAULT_DEVICES) return 0;
    pthread_mutex_lock(&F.lock);
    fault_pool *p = F.pools[dev.type][dev.index];
    int rc = p ? settle_locked(p, dev) : 0;
    pthread_mutex_unlock(&F.lock);
    return rc;
}

int ds_fault_close(ds_device dev, ds_index_hit *hit) {
    pthread_mutex_lock(&F.lock);
    fault_pool *p = F.pools[dev.type][dev.index];
    int i = (int)(hit - p->hits), rc = 0;
    ds_index_hit seen = *hit;
    if (seen.pos >= 0) rc = report(p, i, seen, dev);
    else p->notes[i].describe = NULL;
    pthread_mutex_unlock(&F.lock);
    return rc;
}
