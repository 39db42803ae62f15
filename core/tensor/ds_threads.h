/* How many threads the CPU kernels and BLAS use. */
#ifndef DS_THREADS_H
#define DS_THREADS_H

/* Applies DSLUA_NUM_THREADS (else OMP_NUM_THREADS, else all cores). */
void ds_threads_init(void);
void ds_set_num_threads(int n);
int ds_get_num_threads(void);

#endif
