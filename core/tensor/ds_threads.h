/* How many threads the CPU kernels and BLAS use, and how idle ones wait. */
#ifndef DS_THREADS_H
#define DS_THREADS_H

/* First thing in main. libgomp and OpenBLAS read their settings when they
 * load, before main, so a setenv there is too late. When the environment
 * lacks OMP_WAIT_POLICY (and GOMP_SPINCOUNT, which overrides it) or
 * OPENBLAS_NUM_THREADS, this sets PASSIVE (idle OpenMP threads sleep
 * instead of spinning) and 1 (no OpenBLAS thread pool) and execs the
 * binary again with argv. That second process takes them out again, so
 * scripts and the processes they start see the user's environment.
 * Returns; on a failed exec, after saying why. */
void ds_threads_exec_env(char **argv);
/* Applies DSLUA_NUM_THREADS (else OMP_NUM_THREADS, else all cores). */
void ds_threads_init(void);
void ds_set_num_threads(int n);
int ds_get_num_threads(void);
/* The wait policy this process started with and who chose it, for
 * `dslua --report`: "PASSIVE (dslua's default)", "ACTIVE (OMP_WAIT_POLICY)",
 * "spin count 1000 (GOMP_SPINCOUNT)", "libgomp's default". */
const char *ds_threads_wait_policy(void);

#endif
