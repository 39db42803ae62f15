/* ZeRO-Offload's step from a GPU (ds_zero_offload.c): the masters, their
 * gradients and the optimizer state in page-locked host memory; the
 * optimizer steps them a chunk at a time while the copies run on the
 * device's streams: chunk i+1's gradients come down while chunk i steps,
 * and chunk i-1's parameters go up. */
#ifndef DS_ZERO_OFFLOAD_H
#define DS_ZERO_OFFLOAD_H

#include <stddef.h>
#include <stdint.h>

/* The copies the pipeline orders (ds_cuda_copier on a GPU; host memcpys
 * in tests): start orders both directions after the device's work queued
 * so far; copy starts one (up: host to device); mark puts an event in slot
 * 0 or 1 of a direction after the copies started so far; wait: the host
 * waits for one; join: the device's work queued from now on waits for
 * the copies started so far in a direction (NULL: none can). Each 0, or
 * -1 with the error set. */
typedef struct {
    int (*start)(void *ud);
    int (*copy)(void *ud, int up, void *dst, const void *src, size_t nb);
    int (*mark)(void *ud, int up, int slot);
    int (*wait)(void *ud, int up, int slot);
    void *ud;
    void (*release)(void *ud);      /* frees ud with the engine that took it; NULL: ud is the caller's */
    int (*join)(void *ud, int up);
} ds_offload_copier;

/* The host's stand-in for a device's streams: each copy made only when a
 * wait reaches the mark after it, so whatever reads a buffer before its
 * copy was waited for reads it stale, as on a GPU. CPU ranks run the
 * pipeline through it under the test hook (ds_zero_offload_on_host). 0,
 * or -1 with the error set. */
int ds_offload_host_copier(ds_offload_copier *c);

/* One pass over n elements, chunk at a time: chunk i's gradients come
 * from grad_src into grad_dst (grad_src NULL: on the host already), then
 * step(ud, lo, len) updates it on the host, then its parameters go from
 * param_src to param_dst. Sizes are bytes per element. */
typedef struct {
    int64_t n, chunk;
    const char *grad_src;
    char *grad_dst;
    size_t grad_size;
    const char *param_src;
    char *param_dst;
    size_t param_size;
    int (*step)(void *ud, int64_t lo, int64_t len);
    void *ud;
} ds_offload_plan;

/* Runs p through c; on return every copy has finished. 0, or -1 with the
 * error (the copies started have finished then too). */
int ds_offload_run(const ds_offload_copier *c, const ds_offload_plan *p);

#endif
