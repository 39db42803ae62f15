#include "ds_upload.h"
#include "ds_error.h"

#include <stdlib.h>

struct ds_upload {
    ds_device dev;
    int n;
    ds_tensor *src[DS_UPLOAD_MAX_TENSORS], *dst[DS_UPLOAD_MAX_TENSORS];
    void *fence[DS_UPLOAD_MAX_TENSORS];   /* NULL: nothing in flight */
};

static int fail(ds_device dev) {
    char name[16];
    ds_device_name(dev, name, sizeof name);
    ds_fail(DS_ERR_STATE, "upload to %s: %s", name, ds_kernel_error());
    return -1;
}

/* Waits for every copy in flight: 0, or -1 with the first failure. */
static int wait_all(ds_upload *u) {
    const ds_backend *b = ds_backend_get(u->dev);
    int rc = 0;
    for (int i = 0; i < u->n; i++) {
        if (!u->fence[i]) continue;
        if (b->upload_wait(u->fence[i], u->dev.index) && rc == 0) rc = fail(u->dev);
        u->fence[i] = NULL;
    }
    return rc;
}

static void release(ds_upload *u) {
    for (int i = 0; i < u->n; i++) {
        ds_tensor_release(u->src[i]);
        ds_tensor_release(u->dst[i]);
    }
    free(u);
}

ds_upload *ds_upload_start(ds_tensor *const *src, int n, ds_device dev) {
    if (n < 0 || n > DS_UPLOAD_MAX_TENSORS)
        return ds_fail(DS_ERR_ARG, "upload: %d tensors, expected 0 to %d", n, DS_UPLOAD_MAX_TENSORS);
    for (int i = 0; i < n; i++)
        if (ds_tensor_device(src[i]).type != DS_DEV_CPU || !ds_tensor_is_contiguous(src[i]))
            return ds_fail(DS_ERR_ARG, "upload: tensor %d is not a contiguous CPU tensor", i + 1);
    ds_upload *u = calloc(1, sizeof *u);
    if (!u) return ds_fail(DS_ERR_NOMEM, "upload: out of memory");
    u->dev = dev;
    for (int i = 0; i < n; i++) {
        ds_tensor *d = ds_tensor_new(src[i]->ndim, src[i]->shape, src[i]->dtype, dev);
        if (!d) {
            ds_upload_free(u);
            return NULL;
        }
        ds_tensor_retain(src[i]);
        u->src[i] = src[i];
        u->dst[i] = d;
        u->n = i + 1;
        const ds_backend *b = ds_backend_get(dev);     /* ds_tensor_new found it: not NULL */
        size_t nb = (size_t)ds_tensor_numel(d) * ds_dtype_size(d->dtype);
        int rc = 0;
        if (nb > 0 && b->upload) {
            if (b->upload(ds_tensor_data(d), ds_tensor_data(src[i]), nb, dev.index, &u->fence[i])) rc = fail(dev);
        } else if (nb > 0) {
            rc = ds_device_transfer("upload", ds_tensor_kview(d), dev, ds_tensor_kview(src[i]), DS_CPU_DEVICE);
        }
        if (rc) {
            ds_upload_free(u);
            return NULL;
        }
    }
    return u;
}

int ds_upload_take(ds_upload *u, ds_tensor **out) {
    int rc = wait_all(u);
    for (int i = 0; i < u->n; i++) {
        out[i] = rc ? NULL : u->dst[i];
        if (rc == 0) u->dst[i] = NULL;
    }
    release(u);
    return rc;
}

void ds_upload_free(ds_upload *u) {
    if (!u) return;
    wait_all(u);
    release(u);
}
