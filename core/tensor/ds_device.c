#include "ds_device.h"
#include "ds_cuda.h"
#include "ds_error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern const ds_kernels ds_cpu_kernels;

static ds_backend backends[DS_NDEVICE_TYPES] = {
    [DS_DEV_CPU] = { &ds_cpu_kernels, &ds_cpu_allocator, 1 },
};

void ds_backend_register(ds_device_type type, const ds_backend *b) { backends[type] = *b; }

const ds_backend *ds_backend_get(ds_device dev) {
    if (dev.type == DS_DEV_CUDA) ds_cuda_device_count();      /* registers the backend on first use */
    const ds_backend *b = &backends[dev.type];
    if (!b->kernels || dev.index < 0 || dev.index >= b->count) return NULL;
    if (b->activate) b->activate(dev.index);
    return b;
}

int ds_device_check(const char *op, ds_device dev) {
    if (ds_backend_get(dev)) return 0;
    if (dev.type == DS_DEV_CUDA && ds_cuda_check_device(op, dev.index)) return -1;
    char name[16];
    ds_device_name(dev, name, sizeof name);
    return ds_fail(DS_ERR_ARG, "%s: device %s is not available", op, name), -1;
}

int ds_device_transfer(const char *op, ds_kview dst, ds_device ddev, ds_kview src, ds_device sdev) {
    const ds_backend *b = ds_backend_get(ddev.type != DS_DEV_CPU ? ddev : sdev);
    char dn[16], sn[16];
    ds_device_name(ddev, dn, sizeof dn);
    ds_device_name(sdev, sn, sizeof sn);
    if (!b || !b->transfer || !ds_backend_get(ddev) || !ds_backend_get(sdev))
        return ds_fail(DS_ERR_ARG, "%s: cannot copy from %s to %s: device not available", op, sn, dn), -1;
    if (b->transfer(dst, ddev, src, sdev))
        return ds_fail(DS_ERR_STATE, "%s: copy from %s to %s: %s", op, sn, dn, ds_kernel_error()), -1;
    return 0;
}

bool ds_device_equal(ds_device a, ds_device b) { return a.type == b.type && a.index == b.index; }

int ds_device_parse(const char *s, ds_device *out) {
    if (strcmp(s, "cpu") == 0) { *out = DS_CPU_DEVICE; return 0; }
    if (strncmp(s, "cuda", 4) == 0) {
        const char *rest = s + 4;
        int idx = 0;
        if (*rest == ':') {
            char *end;
            long v = strtol(rest + 1, &end, 10);
            if (end == rest + 1 || *end || v < 0) goto bad;
            idx = (int)v;
        } else if (*rest) goto bad;
        *out = (ds_device){ DS_DEV_CUDA, idx };
        return 0;
    }
bad:
    ds_fail(DS_ERR_ARG, "unknown device '%s' (expected 'cpu', 'cuda' or 'cuda:N')", s);
    return -1;
}

void ds_device_name(ds_device d, char *buf, size_t n) {
    if (d.type == DS_DEV_CPU) snprintf(buf, n, "cpu");
    else snprintf(buf, n, "cuda:%d", d.index);
}
