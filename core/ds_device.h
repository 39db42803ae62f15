/* Devices and the backends behind them. core/ asks here for the kernel table
 * and allocator of a device; a backend (CPU now, CUDA later) registers both. */
#ifndef DS_DEVICE_H
#define DS_DEVICE_H

#include "ds_alloc.h"
#include "../kernels/ds_kernels.h"

#include <stdbool.h>

typedef enum { DS_DEV_CPU, DS_DEV_CUDA, DS_NDEVICE_TYPES } ds_device_type;

typedef struct { ds_device_type type; int index; } ds_device;

#define DS_CPU_DEVICE ((ds_device){ DS_DEV_CPU, 0 })

typedef struct {
    const ds_kernels *kernels;
    ds_allocator *allocator;
    int count;                  /* devices of this type present */
} ds_backend;

void ds_backend_register(ds_device_type type, const ds_backend *b);
const ds_backend *ds_backend_get(ds_device dev);     /* NULL if not available */
bool ds_device_equal(ds_device a, ds_device b);
/* "cpu", "cuda", "cuda:1"; returns -1 and sets the error on bad names */
int ds_device_parse(const char *s, ds_device *out);
void ds_device_name(ds_device d, char *buf, size_t n);

#endif
