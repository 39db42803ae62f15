#include "ds_order.h"
#include "ds_error.h"
#include "ds_philox.h"

#include <stddef.h>

size_t ds_order_size(int nruns) { return offsetof(ds_order, runs) + sizeof(ds_order_run) * (size_t)nruns; }

int ds_order_init(ds_order *o, int64_t n, int64_t first, int64_t span, bool shuffle, uint64_t seed, int nruns,
                  const ds_order_run *runs) {
    if (first < 0 || span < 0 || first > n - span) {
        ds_fail(DS_ERR_ARG, "order: the window [%lld, %lld) is not inside [0, %lld)", (long long)first,
                (long long)first + span, (long long)n);
        return -1;
    }
    o->n = n;
    o->first = first;
    o->span = span;
    o->shuffle = shuffle;
    o->seed = seed;
    if (shuffle) ds_shuffle_init(&o->perm, n, seed);
    o->nruns = nruns;
    o->len = 0;
    for (int k = 0; k < nruns; k++) {
        const ds_order_run *r = &runs[k];
        if (r->start < 0 || r->stride < 0 || r->block < 0 || r->count < 0) {
            ds_fail(DS_ERR_ARG, "order: run %d has a negative start, stride, block or count", k + 1);
            return -1;
        }
        if (r->block && r->count > (INT64_MAX - o->len) / r->block) {
            ds_fail(DS_ERR_ARG, "order: run %d makes the order longer than 2^63 positions", k + 1);
            return -1;
        }
        o->len += r->block * r->count;
        o->runs[k] = *r;
    }
    if (o->len > 0 && span <= 0) {
        ds_fail(DS_ERR_ARG, "order: %lld positions over an empty %s", (long long)o->len, n ? "window" : "dataset");
        return -1;
    }
    return 0;
}

void ds_shuffle_init(ds_shuffle *s, int64_t n, uint64_t seed) {
    s->n = n;
    s->h = 0;
    while (s->h < 32 && ((uint64_t)1 << 2 * s->h) < (uint64_t)n) s->h++;
    for (uint64_t k = 0; k < DS_SHUFFLE_ROUNDS; k++) {
        ds_philox4 r = ds_philox_block(seed, k);
        s->key[k] = (uint64_t)r.v[1] << 32 | r.v[0];
        if (k == 0) s->odd = r.v[2] & 1;
    }
}

/* The round function: MurmurHash3's 64-bit finaliser of the half and the
 * round's key, a cheap mix where every input bit flips half the output's. */
static uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ x >> 33;
}

int64_t ds_shuffle_at(const ds_shuffle *s, int64_t p) {
    int h = s->h;
    uint64_t mask = ((uint64_t)1 << h) - 1, x = (uint64_t)p;
    do {                                             /* a cycle through x comes back below n */
        if (s->odd && x < 2) x ^= 1;
        uint64_t l = x >> h, r = x & mask;
        for (int k = 0; k < DS_SHUFFLE_ROUNDS; k++) {
            uint64_t t = (l ^ mix(r ^ s->key[k])) & mask;
            l = r;
            r = t;
        }
        x = l << h | r;
    } while (x >= (uint64_t)s->n);
    return (int64_t)x;
}

/* Position k's run position, wrapped into the window. */
static int64_t position(const ds_order *o, int64_t k) {
    for (int i = 0; i < o->nruns; i++) {
        const ds_order_run *r = &o->runs[i];
        int64_t size = r->block * r->count;
        if (k < size) {
            uint64_t p = (uint64_t)r->start + (uint64_t)(k / r->block) * (uint64_t)r->stride + (uint64_t)(k % r->block);
            return o->first + (int64_t)(p % (uint64_t)o->span);
        }
        k -= size;
    }
    return -1;                                       /* not reached: the caller keeps k below len */
}

void ds_order_fill(const ds_order *o, int64_t from, int64_t count, int64_t *out) {
    for (int64_t b = 0; b < count; b++) {
        int64_t p = position(o, from + b);
        out[b] = o->shuffle ? ds_shuffle_at(&o->perm, p) : p;
    }
}
