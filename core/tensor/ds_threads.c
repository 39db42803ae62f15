#include "ds_threads.h"

#include <cblas.h>
#include <omp.h>
#include <stdlib.h>

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
