#include "ds_threads.h"

#include <cblas.h>
#include <omp.h>
#include <stdlib.h>

void ds_set_num_threads(int n) {
    if (n < 1) n = 1;
    omp_set_num_threads(n);
    openblas_set_num_threads(n);
}

int ds_get_num_threads(void) { return omp_get_max_threads(); }

void ds_threads_init(void) {
    const char *v = getenv("DSLUA_NUM_THREADS");
    if (!v || !*v) v = getenv("OMP_NUM_THREADS");
    if (v && atoi(v) > 0) ds_set_num_threads(atoi(v));
}
