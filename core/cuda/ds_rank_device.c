#include "ds_rank_device.h"
#include "ds_cuda.h"
#include "ds_env.h"
#include "ds_error.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* "cuda:0 to cuda:3; CUDA_VISIBLE_DEVICES=0,1,2,3" for the messages */
static const char *gpu_list(int n, char *buf, size_t size) {
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    char which[32];
    if (n == 1) snprintf(which, sizeof which, "cuda:0; ");
    else if (n > 1) snprintf(which, sizeof which, "cuda:0 to cuda:%d; ", n - 1);
    else which[0] = '\0';
    if (vis) snprintf(buf, size, "%sCUDA_VISIBLE_DEVICES=%s", which, vis);
    else snprintf(buf, size, "%sCUDA_VISIBLE_DEVICES unset", which);
    return buf;
}

static void say_once(ds_device d, const char *why) {
    static atomic_flag said = ATOMIC_FLAG_INIT;
    if (atomic_flag_test_and_set(&said)) return;
    int rank = ds_rank_device_world_rank();
    if (d.type == DS_DEV_CPU) {
        fprintf(stderr, "dslua: rank %d uses the CPU (%s)\n", rank, why);
        return;
    }
    char gpu[256];
    if (ds_cuda_device_name(d.index, gpu, sizeof gpu)) snprintf(gpu, sizeof gpu, "name unknown");
    int first, last, shared;
    char with[64] = "";
    if (ds_rank_device_shared(&first, &last, &shared) && shared == d.index && first < last)
        snprintf(with, sizeof with, "; ranks %d-%d share it", first, last);
    fprintf(stderr, "dslua: rank %d uses cuda:%d, %s (%s%s)\n", rank, d.index, gpu, why, with);
}

/* This host's ranks (LOCAL_SIZE, at least local_rank + 1). */
static int host_ranks(int local_rank) {
    int ranks = ds_env_local_size();
    return ranks < local_rank + 1 ? local_rank + 1 : ranks;
}

/* Local rank r's GPU of gpus: its own while there are enough, else in
 * blocks, so that the ranks sharing a GPU are neighbours. */
static int gpu_of(int r, int ranks, int gpus) {
    return ranks <= gpus ? r : (int)((int64_t)r * gpus / ranks);
}

bool ds_rank_device_shared(int *first, int *last, int *gpu) {
    int lr = ds_env_local_rank(), ranks = host_ranks(lr);
    int gpus = ds_env_int("DSLUA_TEST_GPU_COUNT", ds_cuda_device_count());
    if (gpus <= 0 || ranks <= gpus) return false;
    int g = gpu_of(lr, ranks, gpus);
    int lo = (int)(((int64_t)g * ranks + gpus - 1) / gpus), hi = (int)(((int64_t)(g + 1) * ranks + gpus - 1) / gpus) - 1;
    int base = ds_rank_device_world_rank() - lr;
    *first = base + lo;
    *last = base + hi;
    *gpu = g;
    return true;
}

int ds_rank_device_world_rank(void) {
    return ds_env_int("RANK", ds_env_int("OMPI_COMM_WORLD_RANK", ds_env_int("PMIX_RANK", ds_env_local_rank())));
}

/* DSLUA_DEVICE or --device: the device it names, checked. */
static int chosen(const char *src, const char *sep, const char *want, ds_device *out) {
    bool mine = strcmp(want, "cuda") == 0;
    ds_device d = { DS_DEV_CUDA, 0 };
    if (!mine && ds_device_parse(want, &d))
        return ds_fail(DS_ERR_ARG, "%s%s%s: not a device (expected cpu, cuda for this rank's GPU, or cuda:N)", src,
                       sep, want), -1;
    if (d.type == DS_DEV_CPU) { *out = d; return 0; }
    int n = ds_cuda_device_count();
    char list[320];
    if (n == 0)
        return ds_fail(DS_ERR_ARG, "%s%s%s: no CUDA device available (%s); unset it or ask for cpu", src, sep, want,
                       ds_cuda_unavailable_reason()), -1;
    if (mine) d.index = ds_rank_device_index(n);
    if (d.index >= n)
        return ds_fail(DS_ERR_ARG, "%s%s%s: this process sees %d GPU%s (%s)", src, sep, want, n, n == 1 ? "" : "s",
                       gpu_list(n, list, sizeof list)), -1;
    *out = d;
    return 0;
}

int ds_rank_device(const char *flag, ds_device *out) {
    const char *env = getenv("DSLUA_DEVICE");
    int local_rank = ds_env_local_rank();
    char why[192];
    if (flag || (env && *env)) {
        const char *src = flag ? "--device" : "DSLUA_DEVICE", *sep = flag ? " " : "=", *want = flag ? flag : env;
        if (chosen(src, sep, want, out)) return -1;
        snprintf(why, sizeof why, "%s%s%s", src, sep, want);
    } else {
        int n = ds_cuda_device_count();
        if (n == 0) {
            *out = DS_CPU_DEVICE;
            snprintf(why, sizeof why, "no CUDA device: %s", ds_cuda_unavailable_reason());
        } else {
            *out = (ds_device){ DS_DEV_CUDA, ds_rank_device_index(n) };
            snprintf(why, sizeof why, "LOCAL_RANK %d", local_rank);
        }
    }
    say_once(*out, why);
    return 0;
}

int ds_rank_device_index(int count) {
    int r = ds_env_local_rank();
    return r >= 0 && count > 0 ? gpu_of(r, host_ranks(r), count) % count : 0;
}
