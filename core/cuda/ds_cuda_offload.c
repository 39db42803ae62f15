/* ds_cuda_copier: ZeRO-Offload's copies on two streams beside the compute
 * stream, with two events per direction (chunk i's and chunk i+1's), and
 * the joins that order the compute stream after them (stage 3's shards
 * loaded ahead of their all-gather). */
#include "ds_cuda_impl.h"
#include "ds_error.h"

#include <stdlib.h>

struct ds_cuda_copier {
    int index;
    cudaStream_t down;                  /* device to host, its own */
    cudaEvent_t marks[2][2];            /* [up][slot] */
};

static int fail(const ds_cuda_copier *c, const char *what, cudaError_t e) {
    cudaGetLastError();
    return ds_fail(DS_ERR_STATE, "cuda:%d: offload copies: %s: %s", c->index, what, cudaGetErrorString(e)), -1;
}

static cudaStream_t stream(const ds_cuda_copier *c, int up) { return up ? ds_cuda_copy_stream(c->index) : c->down; }

ds_cuda_copier *ds_cuda_copier_new(int index) {
    if (ds_cuda_check_device("offload copies", index)) return NULL;
    if (ds_cuda_set_device(index)) return ds_fail(DS_ERR_STATE, "cuda:%d: %s", index, ds_kernel_error()), NULL;
    ds_cuda_copier *c = calloc(1, sizeof *c);
    if (!c) return ds_fail(DS_ERR_NOMEM, "offload copies: out of memory"), NULL;
    c->index = index;
    cudaError_t e = cudaStreamCreateWithFlags(&c->down, cudaStreamNonBlocking);
    int made = 0;
    for (; e == cudaSuccess && made < 4; made++)
        e = cudaEventCreateWithFlags(&c->marks[made / 2][made % 2], cudaEventDisableTiming);
    if (e == cudaSuccess) return c;
    fail(c, "creating its stream and events", e);
    for (int k = 0; k < made - 1; k++) cudaEventDestroy(c->marks[k / 2][k % 2]);
    if (c->down) cudaStreamDestroy(c->down);
    free(c);
    return NULL;
}

void ds_cuda_copier_free(ds_cuda_copier *c) {
    if (!c) return;
    ds_cuda_set_device(c->index);
    cudaStreamSynchronize(c->down);
    for (int k = 0; k < 4; k++) cudaEventDestroy(c->marks[k / 2][k % 2]);
    cudaStreamDestroy(c->down);
    free(c);
}

/* Each of n streams waits for the work queued on from so far. */
static int order_after(ds_cuda_copier *c, cudaStream_t from, const cudaStream_t *to, int n, const char *what) {
    cudaEvent_t before;
    if (ds_cuda_set_device(c->index)) return ds_fail(DS_ERR_STATE, "cuda:%d: %s", c->index, ds_kernel_error()), -1;
    cudaError_t e = cudaEventCreateWithFlags(&before, cudaEventDisableTiming);
    if (e != cudaSuccess) return fail(c, what, e);
    e = cudaEventRecord(before, from);
    for (int k = 0; k < n && e == cudaSuccess; k++) e = cudaStreamWaitEvent(to[k], before, 0);
    cudaEventDestroy(before);              /* released once the waits have used it */
    return e == cudaSuccess ? 0 : fail(c, what, e);
}

int ds_cuda_copier_start(ds_cuda_copier *c) {
    cudaStream_t both[2] = { stream(c, 0), stream(c, 1) };
    return order_after(c, ds_cuda_compute_stream(c->index), both, 2, "start");
}

int ds_cuda_copier_join(ds_cuda_copier *c, int up) {
    cudaStream_t compute = ds_cuda_compute_stream(c->index);
    return order_after(c, stream(c, up), &compute, 1, "join");
}

int ds_cuda_copier_copy(ds_cuda_copier *c, int up, void *dst, const void *src, size_t nb) {
    cudaError_t e = cudaMemcpyAsync(dst, src, nb, up ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, stream(c, up));
    return e == cudaSuccess ? 0 : fail(c, up ? "host to device" : "device to host", e);
}

int ds_cuda_copier_mark(ds_cuda_copier *c, int up, int slot) {
    cudaError_t e = cudaEventRecord(c->marks[up][slot], stream(c, up));
    return e == cudaSuccess ? 0 : fail(c, "cudaEventRecord", e);
}

int ds_cuda_copier_wait(ds_cuda_copier *c, int up, int slot) {
    cudaError_t e = cudaEventSynchronize(c->marks[up][slot]);
    return e == cudaSuccess ? 0 : fail(c, "cudaEventSynchronize", e);
}
