/* Random tensors and ranges. A generator is a seed plus a Philox counter
 * offset: each draw reserves a counter range, so the numbers depend only on
 * the seed and the order of draws, never on threads or devices. */
#ifndef DS_RNG_H
#define DS_RNG_H

#include "ds_tensor.h"

typedef struct { uint64_t seed, offset; } ds_generator;

ds_generator *ds_default_generator(void);
void ds_manual_seed(uint64_t seed);
/* Reserves counters for n elements; returns the first block offset. */
uint64_t ds_generator_reserve(ds_generator *g, int64_t n);

ds_tensor *ds_rand(int ndim, const int64_t *shape, ds_dtype dtype, ds_device dev, ds_generator *g);
ds_tensor *ds_randn(int ndim, const int64_t *shape, ds_dtype dtype, ds_device dev, ds_generator *g);
/* Elements lo .. lo + n - 1 (1-D) of a draw of total elements, as ds_rand
 * (normal false) or ds_randn of total elements would give them; the whole
 * draw's counters are reserved, so later draws do not depend on the range:
 * a shard of a tensor drawn whole, made without the whole. */
ds_tensor *ds_rand_range(bool normal, int64_t total, int64_t lo, int64_t n, ds_dtype dtype, ds_device dev,
                         ds_generator *g);
/* [start, end) by step, as torch.arange */
ds_tensor *ds_arange(double start, double end, double step, ds_dtype dtype, ds_device dev);

#endif
