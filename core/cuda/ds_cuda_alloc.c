/* The caching device allocator. cudaMalloc and cudaFree synchronise the
 * device and cost microseconds to milliseconds, and a training step frees
 * and re-allocates the same sizes every time, so freed blocks are kept:
 * sizes are rounded to classes (four per power of two, under 25% waste),
 * and a freed block waits in the list of its device, stream and class for
 * the next request of that class. A block is only handed out again for
 * work queued later on the stream it was allocated on, which runs after
 * everything the freed tensor was used for. When cudaMalloc fails the
 * device's cache goes back to the driver and the call is tried once more.
 * ds_mem_alloc counts tensor bytes by category on top, as for the CPU. */
#include "ds_cuda_impl.h"
#include "ds_error.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct block {
    void *ptr;
    size_t size;                 /* the class size */
    int device;
    cudaStream_t stream;
    struct block *next;          /* in a free list */
} block;

#define NCLASSES 256             /* 4 per power of two up to 2^64 */

static struct {
    pthread_mutex_t lock;
    block *free_list[DS_CUDA_MAX_DEVICES][NCLASSES];
    block **live;                /* open addressing by ptr, linear probing */
    size_t live_cap, live_n;
    ds_cuda_mem_info info[DS_CUDA_MAX_DEVICES];
} A = { .lock = PTHREAD_MUTEX_INITIALIZER };

/* The class of n bytes: its index and its size. 512 bytes at least; above,
 * 2^k < n <= 2^(k+1) rounds up to a multiple of 2^(k-2). */
static int size_class(size_t n, size_t *size) {
    if (n <= 512) { *size = 512; return 0; }
    int k = 63 - __builtin_clzll((unsigned long long)(n - 1));
    size_t step = (size_t)1 << (k - 2);
    size_t m = (n - ((size_t)1 << k) + step - 1) / step;      /* 1..4 */
    *size = ((size_t)1 << k) + m * step;
    return (k - 9) * 4 + (int)m;
}

static size_t slot_of(void *p, size_t cap) {
    uintptr_t h = (uintptr_t)p >> 9;
    h *= (uintptr_t)0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 17) & (cap - 1);
}

static int live_put(block *b) {          /* caller holds the lock */
    if ((A.live_n + 1) * 2 > A.live_cap) {
        size_t cap = A.live_cap ? A.live_cap * 2 : 1024;
        block **t = calloc(cap, sizeof *t);
        if (!t) return -1;
        for (size_t i = 0; i < A.live_cap; i++) {
            if (!A.live[i]) continue;
            size_t s = slot_of(A.live[i]->ptr, cap);
            while (t[s]) s = (s + 1) & (cap - 1);
            t[s] = A.live[i];
        }
        free(A.live);
        A.live = t;
        A.live_cap = cap;
    }
    size_t s = slot_of(b->ptr, A.live_cap);
    while (A.live[s]) s = (s + 1) & (A.live_cap - 1);
    A.live[s] = b;
    A.live_n++;
    return 0;
}

/* Removes and returns ptr's block (backward-shift deletion keeps every
 * probe sequence unbroken), or NULL when ptr is not live. */
static block *live_take(void *ptr) {     /* caller holds the lock */
    if (!A.live_cap) return NULL;
    size_t mask = A.live_cap - 1, s = slot_of(ptr, A.live_cap);
    while (A.live[s] && A.live[s]->ptr != ptr) s = (s + 1) & mask;
    block *b = A.live[s];
    if (!b) return NULL;
    A.live[s] = NULL;
    A.live_n--;
    for (size_t j = (s + 1) & mask; A.live[j]; j = (j + 1) & mask) {
        size_t home = slot_of(A.live[j]->ptr, A.live_cap);
        /* move j back into the hole when its home is not in (s, j] */
        if ((j > s && (home <= s || home > j)) || (j < s && home <= s && home > j)) {
            A.live[s] = A.live[j];
            A.live[j] = NULL;
            s = j;
        }
    }
    return b;
}

static void trim_device(int d) {         /* caller holds the lock */
    for (int c = 0; c < NCLASSES; c++) {
        while (A.free_list[d][c]) {
            block *b = A.free_list[d][c];
            A.free_list[d][c] = b->next;
            cudaFree(b->ptr);
            A.info[d].cached -= (int64_t)b->size;
            free(b);
        }
    }
}

/* A block of at least n bytes on the current device for its current
 * stream, or NULL after ds_kernel_fail. */
static void *block_alloc(size_t n) {
    int d = ds_cuda_current_device();
    if (d < 0) return ds_kernel_fail("no current CUDA device"), NULL;
    if (n > ((size_t)1 << 62)) return ds_kernel_fail("%zu bytes is more than any GPU has", n), NULL;
    size_t size;
    int c = size_class(n, &size);
    cudaStream_t st = ds_cuda_stream();
    pthread_mutex_lock(&A.lock);
    block **at = &A.free_list[d][c];
    while (*at && (*at)->stream != st) at = &(*at)->next;
    block *b = *at;
    if (b) {
        *at = b->next;
        A.info[d].cached -= (int64_t)size;
        A.info[d].cache_hits++;
    } else {
        b = malloc(sizeof *b);
        void *p = NULL;
        cudaError_t e = b ? cudaMalloc(&p, size) : cudaErrorMemoryAllocation;
        if (b && e == cudaErrorMemoryAllocation) {
            cudaGetLastError();              /* out of memory is not sticky */
            trim_device(d);
            e = cudaMalloc(&p, size);
        }
        if (e != cudaSuccess) {
            cudaGetLastError();
            free(b);
            pthread_mutex_unlock(&A.lock);
            ds_kernel_fail("cudaMalloc(%zu bytes) on cuda:%d: %s", size, d, cudaGetErrorString(e));
            return NULL;
        }
        *b = (block){ p, size, d, st, NULL };
        A.info[d].device_allocs++;
    }
    if (live_put(b) != 0) {
        b->next = A.free_list[d][c];
        A.free_list[d][c] = b;
        A.info[d].cached += (int64_t)size;
        pthread_mutex_unlock(&A.lock);
        ds_kernel_fail("out of host memory for the block table");
        return NULL;
    }
    A.info[d].allocated += (int64_t)size;
    if (A.info[d].allocated > A.info[d].peak) A.info[d].peak = A.info[d].allocated;
    pthread_mutex_unlock(&A.lock);
    return b->ptr;
}

static void block_free(void *ptr) {
    if (!ptr) return;
    pthread_mutex_lock(&A.lock);
    block *b = live_take(ptr);
    if (b) {
        size_t size;
        int c = size_class(b->size, &size);
        b->next = A.free_list[b->device][c];
        A.free_list[b->device][c] = b;
        A.info[b->device].allocated -= (int64_t)b->size;
        A.info[b->device].cached += (int64_t)b->size;
    }
    pthread_mutex_unlock(&A.lock);
    if (!b) fprintf(stderr, "dslua: freeing %p, which the CUDA allocator did not hand out\n", ptr);
}

static void *cuda_alloc(ds_allocator *self, size_t nbytes) {
    (void)self;
    void *p = block_alloc(nbytes);
    if (!p) ds_fail(DS_ERR_NOMEM, "%s", ds_kernel_error());
    return p;
}

static void cuda_free(ds_allocator *self, void *ptr, size_t nbytes) {
    (void)self;
    (void)nbytes;
    block_free(ptr);
}

ds_allocator ds_cuda_allocator = { "cuda", cuda_alloc, cuda_free, true };

void *ds_cuda_block_alloc(size_t nbytes) { return block_alloc(nbytes); }

void ds_cuda_block_free(void *p) { block_free(p); }

/* ---- page-locked host memory ----
 * What the loader gathers batches into, so an upload reads them directly
 * (pageable memory goes through a staging copy of the driver's, in the
 * calling thread). cudaHostAlloc costs milliseconds and cudaFreeHost
 * synchronises the device, while each batch has the size of the last, so
 * freed blocks wait in a list per size class for the next request. The
 * blocks are portable: every device reads them. Whoever frees a block
 * has waited for the copies that read it (ds_upload_take). */
typedef struct host_block {
    void *ptr;
    size_t size;                 /* the class size */
    struct host_block *next;
} host_block;

static struct {
    pthread_mutex_t lock;
    host_block *free_list[NCLASSES];
    int64_t held, allocs;        /* bytes, live and cached; cudaHostAlloc calls */
} H = { .lock = PTHREAD_MUTEX_INITIALIZER };

static void host_trim(void) {
    pthread_mutex_lock(&H.lock);
    for (int c = 0; c < NCLASSES; c++) {
        while (H.free_list[c]) {
            host_block *b = H.free_list[c];
            H.free_list[c] = b->next;
            cudaFreeHost(b->ptr);
            H.held -= (int64_t)b->size;
            free(b);
        }
    }
    pthread_mutex_unlock(&H.lock);
}

void ds_cuda_alloc_reset_peak(int index) {
    pthread_mutex_lock(&A.lock);
    A.info[index].peak = A.info[index].allocated;
    pthread_mutex_unlock(&A.lock);
}

static void *host_alloc(ds_allocator *self, size_t nbytes) {
    (void)self;
    size_t size;
    int c = size_class(nbytes, &size);
    pthread_mutex_lock(&H.lock);
    host_block *b = H.free_list[c];
    if (b) H.free_list[c] = b->next;
    pthread_mutex_unlock(&H.lock);
    if (b) {
        void *p = b->ptr;
        free(b);
        return p;
    }
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, size, cudaHostAllocPortable);
    if (e == cudaErrorMemoryAllocation) {
        cudaGetLastError();                  /* out of memory is not sticky */
        host_trim();
        e = cudaHostAlloc(&p, size, cudaHostAllocPortable);
    }
    if (e != cudaSuccess) {
        cudaGetLastError();
        return ds_fail(DS_ERR_NOMEM, "cudaHostAlloc(%zu bytes): %s", size, cudaGetErrorString(e));
    }
    pthread_mutex_lock(&H.lock);
    H.held += (int64_t)size;
    H.allocs++;
    pthread_mutex_unlock(&H.lock);
    return p;
}

static void host_free(ds_allocator *self, void *ptr, size_t nbytes) {
    (void)self;
    size_t size;
    int c = size_class(nbytes, &size);
    host_block *b = malloc(sizeof *b);
    pthread_mutex_lock(&H.lock);
    if (b) {
        *b = (host_block){ ptr, size, H.free_list[c] };
        H.free_list[c] = b;
    } else {
        cudaFreeHost(ptr);
        H.held -= (int64_t)size;
    }
    pthread_mutex_unlock(&H.lock);
}

ds_allocator ds_cuda_host_allocator = { "cuda_host", host_alloc, host_free, false };

void ds_cuda_alloc_trim(int index) {
    pthread_mutex_lock(&A.lock);
    for (int d = 0; d < DS_CUDA_MAX_DEVICES; d++)
        if (index < 0 || d == index) trim_device(d);
    pthread_mutex_unlock(&A.lock);
    if (index < 0) host_trim();
}

void ds_cuda_alloc_info(int index, ds_cuda_mem_info *out) {
    pthread_mutex_lock(&A.lock);
    *out = A.info[index];
    pthread_mutex_unlock(&A.lock);
    pthread_mutex_lock(&H.lock);
    out->pinned = H.held;
    out->pinned_allocs = H.allocs;
    pthread_mutex_unlock(&H.lock);
}
