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

/* t filled with the numbers of Philox blocks from at on. */
static int fill_random(ds_tensor *t, bool normal, uint64_t seed, uint64_t at) {
    const ds_kernels_core *k = ds_tensor_kernels(t)->core;
    int rc = normal ? k->normal(ds_tensor_kview(t), seed, at, 0.0, 1.0)
                    : k->uniform(ds_tensor_kview(t), seed, at, 0.0, 1.0);
    if (rc) ds_fail(DS_ERR_STATE, "random: %s", ds_kernel_error());
    return rc;
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
    if (fill_random(t, normal, g->seed, at)) {
        ds_tensor_release(t);
        return NULL;
    }
    return t;
}

ds_tensor *ds_rand(int ndim, const int64_t *shape, ds_dtype dtype, ds_device dev, ds_generator *g) {
    return random_tensor(false, ndim, shape, dtype, dev, g);
}

ds_tensor *ds_randn(int ndim, const int64_t *shape, ds_dtype dtype, ds_device dev, ds_generator *g) {
    return random_tensor(true, ndim, shape, dtype, dev, g);
}

ds_tensor *ds_rand_range(bool normal, int64_t total, int64_t lo, int64_t n, ds_dtype dtype, ds_device dev,
                         ds_generator *g) {
    if (!ds_dtype_is_float(dtype))
        return ds_fail(DS_ERR_ARG, "%s: needs a floating point dtype, got %s", normal ? "randn" : "rand",
                       ds_dtype_name(dtype));
    if (total < 0 || lo < 0 || n < 0 || lo > total - n)
        return ds_fail(DS_ERR_ARG, "random range: elements %lld..%lld are not within a draw of %lld",
                       (long long)lo, (long long)(lo + n), (long long)total);
    if (!g) g = &default_gen;
    uint64_t at = ds_generator_reserve(g, total);
    /* element i is word i % 4 of block i / 4: the draw starts at lo's block,
     * and the words before lo in it are cut off */
    int64_t head = lo % 4, len = head + n;
    ds_tensor *t = ds_tensor_new(1, &len, dtype, dev);
    if (!t || fill_random(t, normal, g->seed, at + (uint64_t)(lo / 4))) {
        ds_tensor_release(t);
        return NULL;
    }
    if (head == 0) return t;
    ds_tensor *v = ds_tensor_view_of(t, 1, &n, (int64_t[]){ 1 }, head), *out = ds_tensor_new(1, &n, dtype, dev);
    int rc = v && out ? 0 : -1;
    if (rc == 0 && ds_tensor_kernels(out)->core->copy(ds_tensor_kview(out), ds_tensor_kview(v)))
        rc = -1, ds_fail(DS_ERR_STATE, "random: %s", ds_kernel_error());
    ds_tensor_release(v);
    ds_tensor_release(t);
    if (rc) {
        ds_tensor_release(out);
        return NULL;
    }
    return out;
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
