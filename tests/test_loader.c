/* The loader on a device, without a GPU: a stand-in "cuda" backend made of
 * the CPU kernels, whose staging memory is counted and poisoned when freed
 * and whose uploads copy only when waited for, as an asynchronous copy
 * may. Batches come back in order and intact on the device (so no staging
 * buffer went before its copy), batch k+1 is on its way when batch k is
 * handed out, a drain or a free waits for what is in flight, an error of
 * batch k+1 waits for its own take, and a CPU loader uploads nothing. */
#include "ds_loader.h"
#include "ds_upload.h"
#include "ds_error.h"
#include "cpu/cpu_kernels.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static struct {
    int staging_allocs, staging_live;
    int fail_after, fail_allocs;       /* after fail_after allocations, fail_allocs fail */
    int uploads, waits, in_flight;
} F;

/* the loader's threads allocate and free staging at once: the counts under a lock */
static pthread_mutex_t staging_lock = PTHREAD_MUTEX_INITIALIZER;

static void *staging_alloc(ds_allocator *self, size_t nbytes) {
    (void)self;
    bool fail = false;
    pthread_mutex_lock(&staging_lock);
    if (F.fail_after > 0) F.fail_after--;
    else if (F.fail_allocs > 0) {
        F.fail_allocs--;
        fail = true;
    }
    if (!fail) {
        F.staging_allocs++;
        F.staging_live++;
    }
    pthread_mutex_unlock(&staging_lock);
    return fail ? NULL : ds_cpu_allocator.alloc(&ds_cpu_allocator, nbytes);
}

/* poisoned: a copy that reads it after the free shows */
static void staging_free(ds_allocator *self, void *ptr, size_t nbytes) {
    (void)self;
    memset(ptr, 0xAB, nbytes);
    pthread_mutex_lock(&staging_lock);
    F.staging_live--;
    pthread_mutex_unlock(&staging_lock);
    ds_cpu_allocator.free(&ds_cpu_allocator, ptr, nbytes);
}

static ds_allocator staging = { "fake staging", staging_alloc, staging_free, false };

typedef struct {
    void *dst;
    const void *src;
    size_t nb;
} fake_fence;

static int fake_upload(void *dst, const void *src, size_t nb, int index, void **fence) {
    (void)index;
    fake_fence *f = malloc(sizeof *f);
    if (!f) return ds_kernel_fail("out of memory");
    *f = (fake_fence){ dst, src, nb };
    *fence = f;
    F.uploads++;
    F.in_flight++;
    return 0;
}

static int fake_wait(void *fence, int index) {
    (void)index;
    fake_fence *f = fence;
    memcpy(f->dst, f->src, f->nb);      /* the copy lands only now */
    free(f);
    F.waits++;
    F.in_flight--;
    return 0;
}

static int fake_transfer(ds_kview dst, ds_device ddev, ds_kview src, ds_device sdev) {
    (void)ddev;
    (void)sdev;
    return ds_cpu_core.copy(dst, src);
}

static const ds_device GPU = { DS_DEV_CUDA, 0 };

static void install_fake(void) {
    ds_backend fake = { .kernels = &ds_cpu_kernels, .allocator = &ds_cpu_allocator, .count = 1,
                        .transfer = fake_transfer, .host_allocator = &staging, .upload = fake_upload,
                        .upload_wait = fake_wait };
    ds_backend_register(DS_DEV_CUDA, &fake);
}

/* rows: x[i] = {i, i + 0.5} (f32), y[i] = 100 + i (i64), n of them */
static ds_dataset *rows(int64_t n) {
    int64_t xs[2] = { n, 2 };
    ds_tensor *x = ds_tensor_new(2, xs, DS_F32, DS_CPU_DEVICE), *y = ds_tensor_new(1, &n, DS_I64, DS_CPU_DEVICE);
    for (int64_t i = 0; i < n; i++) {
        ds_tensor_set(x, 2 * i, (double)i);
        ds_tensor_set(x, 2 * i + 1, (double)i + 0.5);
        ds_tensor_set(y, i, 100.0 + (double)i);
    }
    const char *names[2] = { "x", "y" };
    ds_tensor *fields[2] = { x, y };
    ds_dataset *d = ds_dataset_rows(2, names, fields);
    ds_tensor_release(x);
    ds_tensor_release(y);
    return d;
}

/* batch b (0-based) of batch_size consecutive samples starting at sample first */
static void check_batch(ds_tensor **out, int64_t first, int64_t b, const char *what) {
    check(out[0] && out[1], "%s: a batch", what);
    if (!out[0] || !out[1]) return;
    check(ds_tensor_device(out[0]).type == DS_DEV_CUDA && ds_tensor_device(out[1]).type == DS_DEV_CUDA,
          "%s: on the device", what);
    int ok = 1;
    for (int64_t i = 0; i < b; i++) {
        ok &= ds_tensor_get(out[0], 2 * i) == (double)(first + i);
        ok &= ds_tensor_get(out[0], 2 * i + 1) == (double)(first + i) + 0.5;
        ok &= ds_tensor_get(out[1], i) == 100.0 + (double)(first + i);
    }
    check(ok, "%s: samples %lld.. intact", what, (long long)first);
}

/* Rows first .. first + 3 as one batch. */
static void submit_rows(ds_loader *l, int64_t first) {
    int64_t idx[4];
    for (int i = 0; i < 4; i++) idx[i] = first + i;
    ds_loader_submit(l, idx, 4);
}

static void release2(ds_tensor **out) {
    ds_tensor_release(out[0]);
    ds_tensor_release(out[1]);
}

static void test_one_ahead(int workers) {
    char what[64];
    memset(&F, 0, sizeof F);
    ds_dataset *d = rows(40);
    ds_loader *l = ds_loader_new(d, workers, 2, GPU);
    check(l != NULL, "loader on the device: %s", ds_error_message());
    int64_t idx[4];
    int64_t next_sub = 0;
    for (int k = 0; k < 10; k++) {
        while (ds_loader_queued(l) < 2 && next_sub < 10) {     /* as data.lua submits */
            for (int i = 0; i < 4; i++) idx[i] = next_sub * 4 + i;
            check(ds_loader_submit(l, idx, 4) == 0, "submit: %s", ds_error_message());
            next_sub++;
        }
        ds_tensor *out[2];
        snprintf(what, sizeof what, "%d workers, batch %d", workers, k + 1);
        check(ds_loader_next(l, out) == 0, "%s: %s", what, ds_error_message());
        check_batch(out, 4 * k, 4, what);
        /* batch k+1 is on its way when batch k is handed out, the last has none after it */
        check(F.uploads == 2 * (k < 9 ? k + 2 : 10) && F.waits == 2 * (k + 1),
              "%s: %d uploads started, %d taken", what, F.uploads, F.waits);
        check(F.in_flight == (k < 9 ? 2 : 0), "%s: %d copies in flight", what, F.in_flight);
        release2(out);
    }
    check(F.staging_allocs >= 20 && F.staging_live == 0, "%d staging buffers, %d still held", F.staging_allocs,
          F.staging_live);
    ds_loader_free(l);
    ds_dataset_release(d);
}

static void test_drain_and_free(void) {
    memset(&F, 0, sizeof F);
    ds_dataset *d = rows(40);
    ds_loader *l = ds_loader_new(d, 1, 4, GPU);
    for (int b = 0; b < 3; b++) submit_rows(l, b * 4);
    ds_tensor *out[2];
    check(ds_loader_next(l, out) == 0, "first batch: %s", ds_error_message());
    release2(out);
    check(F.in_flight == 2, "the second batch is on its way");
    ds_loader_drain(l);           /* an epoch left early */
    check(F.in_flight == 0 && F.staging_live == 0, "a drain waits for the copy in flight and frees its staging");
    check(ds_loader_next(l, out) != 0 && strstr(ds_error_message(), "no batch was submitted"),
          "nothing after a drain: %s", ds_error_message());
    submit_rows(l, 20);
    submit_rows(l, 20);
    check(ds_loader_next(l, out) == 0, "after the drain: %s", ds_error_message());
    check_batch(out, 20, 4, "after the drain");
    release2(out);
    ds_loader_free(l);             /* with a batch on its way */
    check(F.in_flight == 0 && F.staging_live == 0, "free waits for the copy in flight and frees its staging");
    ds_dataset_release(d);
}

/* batch 2's gather fails while batch 1 is handed out: batch 1 arrives,
 * batch 2's take says why, batch 3 arrives */
static void test_error_waits(void) {
    memset(&F, 0, sizeof F);
    ds_dataset *d = rows(40);
    ds_loader *l = ds_loader_new(d, 0, 4, GPU);
    for (int b = 0; b < 3; b++) submit_rows(l, b * 4);
    /* no workers: the first next gathers batch 1 (x, y), then batch 2,
     * whose x fails (twice: the allocator's retry) */
    F.fail_after = 2;
    F.fail_allocs = 2;
    ds_tensor *out[2];
    check(ds_loader_next(l, out) == 0, "batch 1 despite batch 2's failure: %s", ds_error_message());
    check_batch(out, 0, 4, "batch 1");
    release2(out);
    check(ds_loader_next(l, out) != 0 && strstr(ds_error_message(), "out of memory") &&
          strstr(ds_error_message(), "fake staging"), "batch 2 fails at its take: %s", ds_error_message());
    check(!out[0] && !out[1], "no tensors from a failed take");
    check(ds_loader_next(l, out) == 0, "batch 3 after the failure: %s", ds_error_message());
    check_batch(out, 8, 4, "batch 3");
    release2(out);
    ds_loader_free(l);
    check(F.in_flight == 0 && F.staging_live == 0, "nothing left in flight or held");
    ds_dataset_release(d);
}

static void test_cpu_unchanged(void) {
    memset(&F, 0, sizeof F);
    ds_dataset *d = rows(8);
    ds_loader *l = ds_loader_new(d, 1, 2, DS_CPU_DEVICE);
    int64_t idx[4] = { 4, 5, 6, 7 };
    ds_loader_submit(l, idx, 4);
    ds_tensor *out[2];
    check(ds_loader_next(l, out) == 0, "cpu loader: %s", ds_error_message());
    check(ds_tensor_device(out[0]).type == DS_DEV_CPU && ds_tensor_get(out[1], 0) == 104, "cpu batch");
    check(F.uploads == 0 && F.staging_allocs == 0, "a CPU loader neither stages nor uploads");
    release2(out);
    ds_loader_free(l);
    ds_dataset_release(d);
}

int main(void) {
    install_fake();
    test_one_ahead(0);
    test_one_ahead(2);
    test_drain_and_free();
    test_error_waits();
    test_cpu_unchanged();
    return check_summary("test_loader");
}
