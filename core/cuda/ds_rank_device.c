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
    int rank = ds_env_int("RANK", 0);
    if (d.type == DS_DEV_CPU) {
        fprintf(stderr, "dslua: rank %d uses the CPU (%s)\n", rank, why);
        return;
    }
    char gpu[256];
    if (ds_cuda_device_name(d.index, gpu, sizeof gpu)) snprintf(gpu, sizeof gpu, "name unknown");
    fprintf(stderr, "dslua: rank %d uses cuda:%d, %s (%s)\n", rank, d.index, gpu, why);
}

/* Every rank of this host on a GPU of its own: 0, or -1 with the error. */
static int check_ranks(int local_rank, int gpus) {
    const char *hook = getenv("DSLUA_TEST_GPU_COUNT");
    gpus = ds_env_int("DSLUA_TEST_GPU_COUNT", gpus);
    int ranks = ds_env_local_size();
    if (ranks < local_rank + 1) ranks = local_rank + 1;
    if (gpus <= 0 || ranks <= gpus) return 0;
    char list[320];
    gpu_list(gpus, list, sizeof list);
    ds_fail(DS_ERR_STATE,
            "rank %d (LOCAL_RANK %d): %d ranks on this host (LOCAL_SIZE %d) but %d GPU%s (%s%s): NCCL needs a GPU "
            "of its own for each rank. Start at most %d rank%s per host (dslua -n %d), make more GPUs visible "
            "(CUDA_VISIBLE_DEVICES), or run the ranks on the CPU (DSLUA_DEVICE=cpu or --device cpu)",
            ds_env_int("RANK", 0), local_rank, ranks, ranks, gpus, gpus == 1 ? "" : "s", list,
            hook && *hook ? "; counted by DSLUA_TEST_GPU_COUNT, a test hook" : "", gpus, gpus == 1 ? "" : "s", gpus);
    return -1;
}

/* DSLUA_DEVICE or --device: the device it names, checked. */
static int chosen(const char *src, const char *sep, const char *want, int local_rank, ds_device *out) {
    bool mine = strcmp(want, "cuda") == 0;
    ds_device d = { DS_DEV_CUDA, local_rank };
    if (!mine && ds_device_parse(want, &d))
        return ds_fail(DS_ERR_ARG, "%s%s%s: not a device (expected cpu, cuda for this rank's GPU, or cuda:N)", src,
                       sep, want), -1;
    if (d.type == DS_DEV_CPU) { *out = d; return 0; }
    int n = ds_cuda_device_count();
    char list[320];
    if (n == 0)
        return ds_fail(DS_ERR_ARG, "%s%s%s: no CUDA device available (%s); unset it or ask for cpu", src, sep, want,
                       ds_cuda_unavailable_reason()), -1;
    if (mine && check_ranks(local_rank, n)) return -1;
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
        if (chosen(src, sep, want, local_rank, out)) return -1;
        snprintf(why, sizeof why, "%s%s%s", src, sep, want);
    } else {
        int n = ds_cuda_device_count();
        if (check_ranks(local_rank, n)) return -1;
        if (n == 0) {
            *out = DS_CPU_DEVICE;
            snprintf(why, sizeof why, "no CUDA device: %s", ds_cuda_unavailable_reason());
        } else {
            *out = (ds_device){ DS_DEV_CUDA, local_rank };
            snprintf(why, sizeof why, "LOCAL_RANK %d", local_rank);
        }
    }
    say_once(*out, why);
    return 0;
}

int ds_rank_device_index(int count) {
    int r = ds_env_local_rank();
    return r >= 0 && count > 0 ? r % count : 0;
}
