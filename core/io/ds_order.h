/* An epoch's order of sample indices without storing it: position k of the
 * order is a run position p (runs of positions over a window [first, first +
 * span) of [0, n), p taken mod span, the padding of a sampler that repeats
 * the order from its start, then offset by first) mapped through a seeded
 * bijection of [0, n). The window is the whole [0, n) but for the rest of an
 * epoch resumed on other ranks. Any position in O(runs). */
#ifndef DS_ORDER_H
#define DS_ORDER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Positions start + j * stride + i for j < count, i < block. */
typedef struct {
    int64_t start, stride, block, count;
} ds_order_run;

#define DS_SHUFFLE_ROUNDS 8

/* The seeded bijection of [0, n): a Feistel network over [0, 4^h), 4^h >= n,
 * its rounds keyed from the Philox stream `seed`, walked until it lands
 * below n (fewer than 4 steps expected). */
typedef struct {
    int64_t n;
    int h;
    bool odd;                /* 0 and 1 swapped first: Feistel networks make only even permutations */
    uint64_t key[DS_SHUFFLE_ROUNDS];
} ds_shuffle;

typedef struct {
    int64_t n, len;          /* the domain [0, n); positions in the order */
    int64_t first, span;     /* the window of [0, n) the run positions index */
    bool shuffle;
    uint64_t seed;
    ds_shuffle perm;
    int nruns;
    ds_order_run runs[];
} ds_order;

/* The size of an order with nruns runs, for the caller's allocation. */
size_t ds_order_size(int nruns);
/* Fills o (ds_order_size(nruns) bytes); -1 (ds_fail) when a run is negative,
 * the order is longer than INT64_MAX, the window is not inside [0, n), or
 * positions need an empty window. */
int ds_order_init(ds_order *o, int64_t n, int64_t first, int64_t span, bool shuffle, uint64_t seed, int nruns,
                  const ds_order_run *runs);
void ds_shuffle_init(ds_shuffle *s, int64_t n, uint64_t seed);
/* The image of p (in [0, n)). */
int64_t ds_shuffle_at(const ds_shuffle *s, int64_t p);
/* The dataset indices at positions [from, from + count) of the order. */
void ds_order_fill(const ds_order *o, int64_t from, int64_t count, int64_t *out);

#endif
