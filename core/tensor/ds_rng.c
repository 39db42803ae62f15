#include "ds_rng.h"
#include "ds_error.h"

#include <math.h>

static ds_generator default_gen = { 0x2545F4914F6CDD1Dull, 0 };

ds_generator *ds_default_generator(void) { return &default_gen; }

void ds_manual_seed(uint64_t seed) { default_gen = (ds_generator){ seed, 0 }; }

uint64_t ds_generator_reserve(ds_generator *g, int64_t n) {
    uint64_t at = g->offset;
    g->offset += (uint64_t)(n + 3) / 4;
    return at;
}

static ds_tensor *random_tensor(bool normal, int ndim, const int64_t *shape, ds_dtype dtype, ds_device dev,
                                ds_generator *g) {
    if (!ds_dtype_is_float(dtype))
        return ds_fail(DS_ERR_ARG, "%s: needs a floating point dtype, got %s", normal ? "randn" : "rand",
                       ds_dtype_name(dtype));
    ds_tensor *t = ds_tensor_new(ndim, shape, dtype, dev);
    if (!t) return NULL;
    if (!g) g = &default_gen;
    uint64_t at = ds_generator_reserve(g, ds_tensor_numel(t));
    const ds_kernels_core *k = ds_tensor_kernels(t)->core;
    int rc = normal ? k->normal(ds_tensor_kview(t), g->seed, at, 0.0, 1.0)
                    : k->uniform(ds_tensor_kview(t), g->seed, at, 0.0, 1.0);
    if (rc) {
        ds_tensor_release(t);
        return ds_fail(DS_ERR_STATE, "random: %s", ds_kernel_error());
    }
    return t;
}

ds_tensor *ds_rand(int ndim, const int64_t *shape, ds_dtype dtype, ds_device dev, ds_generator *g) {
    return random_tensor(false, ndim, shape, dtype, dev, g);
}

ds_tensor *ds_randn(int ndim, const int64_t *shape, ds_dtype dtype, ds_device dev, ds_generator *g) {
    return random_tensor(true, ndim, shape, dtype, dev, g);
}

ds_tensor *ds_arange(double start, double end, double step, ds_dtype dtype, ds_device dev) {
    if (step == 0 || !isfinite(start) || !isfinite(end) || !isfinite(step))
        return ds_fail(DS_ERR_ARG, "arange: invalid range start=%g end=%g step=%g", start, end, step);
    double count = ceil((end - start) / step);
    if (!(count < 0x1p60))      /* also inf: converting it to int64 is undefined */
        return ds_fail(DS_ERR_ARG, "arange: start=%g end=%g step=%g gives too many elements", start, end, step);
    int64_t n = count > 0 ? (int64_t)count : 0;
    ds_tensor *t = ds_tensor_new(1, &n, dtype, dev);
    if (t && ds_tensor_kernels(t)->core->arange(ds_tensor_kview(t), start, step)) {
        ds_tensor_release(t);
        return ds_fail(DS_ERR_STATE, "arange: %s", ds_kernel_error());
    }
    return t;
}
