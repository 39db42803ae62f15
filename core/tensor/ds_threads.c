#include "ds_threads.h"

#include <cblas.h>
#include <errno.h>
#include <omp.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Names the variables the first process added, for the second to take out;
 * its presence also stops a second exec. */
#define ADDED "DSLUA_THREADS_ADDED"

static const char *const defaults[][2] = {
    /* libgomp's default spins ~3 ms after each parallel region: on a core
     * shared with another rank or job that spinning takes the time the
     * work needs (the MNIST MLP beside one busy core: half the samples/s
     * of sleeping threads). */
    { "OMP_WAIT_POLICY", "PASSIVE" },
    /* OpenBLAS runs on the calling thread (ds_set_num_threads); its
     * pthreads build would otherwise start a pool at load that spins
     * ~0.1 s of CPU and then idles for good. */
    { "OPENBLAS_NUM_THREADS", "1" },
};
#define NDEFAULTS (sizeof defaults / sizeof *defaults)

static char wait_policy[64] = "libgomp's default";

/* Whether name is an entry of the comma list. */
static bool listed(const char *list, const char *name) {
    size_t n = strlen(name);
    for (const char *p = list; (p = strstr(p, name)) != NULL; p += n)
        if ((p == list || p[-1] == ',') && (p[n] == ',' || p[n] == '\0')) return true;
    return false;
}

static void unset_listed(const char *list) {
    for (size_t k = 0; k < NDEFAULTS; k++)
        if (listed(list, defaults[k][0])) unsetenv(defaults[k][0]);
    unsetenv(ADDED);
}

/* Whether the user chose the variable's setting; GOMP_SPINCOUNT overrides
 * the wait policy in libgomp, so it is a choice of policy too. */
static bool chosen(const char *name) {
    return getenv(name) || (strcmp(name, "OMP_WAIT_POLICY") == 0 && getenv("GOMP_SPINCOUNT"));
}

/* ours: dslua's default is in force, else the user's setting if any. */
static void note_wait_policy(bool ours) {
    const char *spin = getenv("GOMP_SPINCOUNT"), *user = getenv("OMP_WAIT_POLICY");
    if (ours) snprintf(wait_policy, sizeof wait_policy, "PASSIVE (dslua's default)");
    else if (spin) snprintf(wait_policy, sizeof wait_policy, "spin count %.24s (GOMP_SPINCOUNT)", spin);
    else if (user) snprintf(wait_policy, sizeof wait_policy, "%.24s (OMP_WAIT_POLICY)", user);
}

void ds_threads_exec_env(char **argv) {
    const char *added = getenv(ADDED);
    if (added) {
        note_wait_policy(listed(added, "OMP_WAIT_POLICY"));
        unset_listed(added);
        return;
    }
    note_wait_policy(false);
    char list[128] = "";
    for (size_t k = 0; k < NDEFAULTS; k++) {
        if (chosen(defaults[k][0])) continue;
        setenv(defaults[k][0], defaults[k][1], 1);
        if (*list) strcat(list, ",");
        strcat(list, defaults[k][0]);
    }
    if (!*list) return;
    setenv(ADDED, list, 1);
    execv("/proc/self/exe", argv);
    fprintf(stderr, "dslua: cannot start again with %s set (exec /proc/self/exe: %s); running on without\n",
            list, strerror(errno));
    unset_listed(list);
}

const char *ds_threads_wait_policy(void) { return wait_policy; }

/* OpenBLAS runs on the calling thread: cpu_blas.c cuts big GEMMs into
 * pieces for the OpenMP threads, so one thread team serves every kernel.
 * Two pools on the same cores (OpenBLAS's pthreads and OpenMP's) spin
 * against each other at every switch between a GEMM and another op. */
void ds_set_num_threads(int n) {
    if (n < 1) n = 1;
    omp_set_num_threads(n);
    openblas_set_num_threads(1);
}

int ds_get_num_threads(void) { return omp_get_max_threads(); }

void ds_threads_init(void) {
    const char *v = getenv("DSLUA_NUM_THREADS");
    if (!v || !*v) v = getenv("OMP_NUM_THREADS");
    ds_set_num_threads(v && atoi(v) > 0 ? atoi(v) : omp_get_max_threads());
}
