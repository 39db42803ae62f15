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
} ds_backend;

void ds_backend_register(ds_device_type type, const ds_backend *b);
const ds_backend *ds_backend_get(ds_device dev);     /* NULL if not available */
bool ds_device_equal(ds_device a, ds_device b);
/* dst = src between two different devices: 0, or -1 with the error set
 * naming op. */
int ds_device_transfer(const char *op, ds_kview dst, ds_device ddev, ds_kview src, ds_device sdev);
/* "cpu", "cuda", "cuda:1"; returns -1 and sets the error on bad names */
int ds_device_parse(const char *s, ds_device *out);
void ds_device_name(ds_device d, char *buf, size_t n);

#endif
