/* Devices and the backends behind them. core/ asks here for the kernel table
 * and allocator of a device; a backend (CPU now, CUDA later) registers both. */
#ifndef DS_DEVICE_H
#define DS_DEVICE_H

#include "ds_alloc.h"
#include "ds_kernels.h"

#include <stdbool.h>

typedef enum { DS_DEV_CPU, DS_DEV_CUDA, DS_NDEVICE_TYPES } ds_device_type;

typedef struct { ds_device_type type; int index; } ds_device;

#define DS_CPU_DEVICE ((ds_device){ DS_DEV_CPU, 0 })

typedef struct {
    const ds_kernels *kernels;
    ds_allocator *allocator;
    int count;                  /* devices of this type present */
    /* Makes device `index` current for the calling thread before its
     * kernels or allocator run (ds_backend_get calls it); NULL for the CPU. */
    void (*activate)(int index);
    /* dst = src where one side is this device type and the other the CPU
     * or another device of this type; any strides and dtypes. 0, or -1
     * after ds_kernel_fail. NULL for the CPU. */
    int (*transfer)(ds_kview dst, ds_device ddev, ds_kview src, ds_device sdev);
    /* Batches sent ahead of the step (core/tensor/ds_upload.h). NULL for
     * the CPU, and upload may be NULL where transfer is all there is.
     * host_allocator: page-locked host memory, which the device reads
     * without the driver staging it again; it serves the device made
     * current on the calling thread. upload: dst = nb bytes of host
     * memory src on device index, queued behind the work already queued
     * for that device and ahead of the work queued later, so it overlaps
     * it; *fence tracks it. 0, or -1 after ds_kernel_fail. upload_wait:
     * the device's later work waits for it, the caller until src has been
     * read (src may go then), and the fence is freed. 0, or -1 after
     * ds_kernel_fail (the fence freed all the same). */
    ds_allocator *host_allocator;
    int (*upload)(void *dst, const void *src, size_t nb, int index, void **fence);
    int (*upload_wait)(void *fence, int index);
    /* Waits for the work queued on device index: 0, or -1 after
     * ds_kernel_fail. NULL for the CPU. */
    int (*synchronize)(int index);
} ds_backend;

void ds_backend_register(ds_device_type type, const ds_backend *b);
const ds_backend *ds_backend_get(ds_device dev);     /* NULL if not available */
/* 0 when dev is available, else -1 with an error naming op and saying why
 * ("<op>: no CUDA device available (no CUDA driver)"). */
int ds_device_check(const char *op, ds_device dev);
bool ds_device_equal(ds_device a, ds_device b);
/* dst = src between two different devices: 0, or -1 with the error set
 * naming op. */
int ds_device_transfer(const char *op, ds_kview dst, ds_device ddev, ds_kview src, ds_device sdev);
/* "cpu", "cuda", "cuda:1"; returns -1 and sets the error on bad names */
int ds_device_parse(const char *s, ds_device *out);
void ds_device_name(ds_device d, char *buf, size_t n);

#endif
