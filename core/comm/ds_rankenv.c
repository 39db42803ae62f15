#include "ds_rankenv.h"
#include "ds_env.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

static void set_int(const char *name, int v, int overwrite) {
    char buf[16];
    snprintf(buf, sizeof buf, "%d", v);
    setenv(name, buf, overwrite);
}

/* This rank's node, -1 when the environment cannot tell. dslua's launcher
 * starts one app context per host (`mpirun -np 2 --host a:2 ... : -np 2
 * --host b:2 ...`), so with as many contexts as nodes the context is the
 * node (OMPI_APP_CTX_NUM_PROCS lists the ranks of each context in order).
 * A plain mpirun fills node after node (its default mapping); with equal
 * blocks that gives the node from the rank. */
static int cross_rank(int rank, int local_rank, int local_size, int size, int nodes) {
    if (nodes <= 1) return 0;
    if (ds_env_int("OMPI_NUM_APP_CTX", 1) == nodes) {
        const char *p = getenv("OMPI_APP_CTX_NUM_PROCS");
        int first = 0;
        for (int k = 0; p && k < nodes; k++) {
            char *end;
            long n = strtol(p, &end, 10);
            if (end == p) break;
            if (rank < first + n) return k;
            first += (int)n;
            p = end;
        }
        return -1;
    }
    if (local_size > 0 && size == local_size * nodes && rank % local_size == local_rank) return rank / local_size;
    return -1;
}

void ds_rankenv_init(void) {
    if (!getenv("OMPI_COMM_WORLD_SIZE")) return;
    int rank = ds_env_int("OMPI_COMM_WORLD_RANK", 0), size = ds_env_int("OMPI_COMM_WORLD_SIZE", 1);
    int local_rank = ds_env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    int local_size = ds_env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
    int nodes = ds_env_int("OMPI_MCA_orte_num_nodes", 1);
    set_int("RANK", rank, 1);
    set_int("WORLD_SIZE", size, 1);
    set_int("LOCAL_RANK", local_rank, 1);
    set_int("LOCAL_SIZE", local_size, 1);
    set_int("CROSS_SIZE", nodes, 1);
    int cross = cross_rank(rank, local_rank, local_size, size, nodes);
    if (cross >= 0) set_int("CROSS_RANK", cross, 1); else unsetenv("CROSS_RANK");
    if (nodes <= 1) setenv("MASTER_ADDR", "127.0.0.1", 0);
    set_int("MASTER_PORT", DS_RANKENV_MASTER_PORT, 0);
    const char *t = getenv("DSLUA_NUM_THREADS"), *o = getenv("OMP_NUM_THREADS");
    if ((!t || !*t) && (!o || !*o)) {
        int share = omp_get_num_procs() / (local_size > 0 ? local_size : 1);
        set_int("DSLUA_NUM_THREADS", share > 0 ? share : 1, 1);
    }
}
