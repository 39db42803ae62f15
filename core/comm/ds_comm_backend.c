/* Which backend carries a tensor's collectives: MPI for CPU tensors; for
 * device tensors NCCL where every rank has its own GPU, else MPI through
 * page-locked host memory (the staged backend), or what the job chose
 * (dist_backend, DSLUA_COMM_BACKEND). */
#include "ds_comm_impl.h"
#include "ds_env.h"
#include "ds_error.h"
#include "ds_rank_device.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const ds_comm_backend *const backends[DS_NDEVICE_TYPES] = {
    [DS_DEV_CPU] = &ds_comm_mpi_backend,
#ifdef DSLUA_CUDA
    [DS_DEV_CUDA] = &ds_comm_nccl_backend,
#endif
};

enum { DEV_AUTO = -2, DEV_UNKNOWN = -1, DEV_NCCL, DEV_MPI };
static const char *dev_names[] = { "nccl", "mpi" };
static struct {
    int choice;                     /* DEV_AUTO until chosen */
    bool used;                      /* device tensors have moved on it */
    char source[96];                /* "dist_backend=mpi", "ranks 0-3 share cuda:0" */
} D = { .choice = DEV_AUTO };

/* nccl, mpi or gloo, auto or empty; PyTorch's "cpu:gloo,cuda:nccl" by its cuda part */
static int parse_backend(const char *name) {
    const char *cuda = strstr(name, "cuda:");
    char word[16];
    snprintf(word, sizeof word, "%s", cuda ? cuda + 5 : name);
    word[strcspn(word, ",")] = 0;
    if (strcmp(word, "nccl") == 0) return DEV_NCCL;
    if (strcmp(word, "mpi") == 0 || strcmp(word, "gloo") == 0) return DEV_MPI;
    if (strcmp(word, "auto") == 0 || word[0] == 0) return DEV_AUTO;
    return DEV_UNKNOWN;
}

int ds_comm_set_device_backend(const char *name, const char *source) {
    int c = parse_backend(name);
    if (c == DEV_UNKNOWN)
        return ds_fail(DS_ERR_ARG, "%s=%s: not a backend for device tensors (expected nccl, mpi, gloo (MPI through "
                       "host memory, as mpi) or auto)", source, name), -1;
    if (D.used && c == DEV_AUTO) return 0;     /* auto chose already */
    if (D.used && c != D.choice)
        return ds_fail(DS_ERR_STATE, "%s=%s: device tensors already travel over %s (%s); choose the backend before "
                       "the first collective", source, name, dev_names[D.choice], D.source), -1;
    D.choice = c;
    snprintf(D.source, sizeof D.source, "%s=%s", source, name);
    return 0;
}

const char *ds_comm_device_backend(void) {
    if (D.choice == DEV_AUTO) {
        const char *env = getenv("DSLUA_COMM_BACKEND");
        if (env && *env && ds_comm_set_device_backend(env, "DSLUA_COMM_BACKEND")) return NULL;
    }
    int first, last, gpu;
    bool shared = ds_rank_device_shared(&first, &last, &gpu);
    if (D.choice == DEV_AUTO) {
        D.choice = shared ? DEV_MPI : DEV_NCCL;
        if (shared) snprintf(D.source, sizeof D.source, "NCCL needs a GPU per rank");
        else snprintf(D.source, sizeof D.source, "a GPU per rank");
    }
    static bool said;
    if (shared && !said && first < last && ds_rank_device_world_rank() == first)
        fprintf(stderr, "dslua: ranks %d-%d share cuda:%d: collectives of device tensors over %s (%s)\n", first, last,
                gpu, D.choice == DEV_MPI ? "MPI" : "NCCL", D.source);
    said = true;
    return dev_names[D.choice];
}

/* DSLUA_TEST_STAGE_CPU=1, a test hook: CPU tensors through the staged
 * backend with memcpy for copies, so its pieces and order run without a
 * GPU. */
static bool stage_cpu(void) {
    static int on = -1;
    if (on < 0) on = ds_env_int("DSLUA_TEST_STAGE_CPU", 0) != 0;
    return on;
}

const ds_comm_backend *ds_comm_backend_of(const ds_tensor *t, const char *op) {
    ds_device d = ds_tensor_device(t);
    if (d.type == DS_DEV_CPU && stage_cpu()) return &ds_comm_staged_backend;
    if (d.type != DS_DEV_CPU && backends[d.type]) {
        const char *name = ds_comm_device_backend();
        if (!name) return NULL;
        D.used = true;
        return D.choice == DEV_MPI ? &ds_comm_staged_backend : backends[d.type];
    }
    if (backends[d.type]) return backends[d.type];
    char name[32];
    ds_device_name(d, name, sizeof name);
    return ds_fail(DS_ERR_ARG, "%s: no comm backend for %s tensors in this build", op, name);
}
