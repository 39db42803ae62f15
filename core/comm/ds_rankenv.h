/* The environment of a rank started by mpirun, as DeepSpeed's launcher sets
 * it: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK (this rank's node)
 * and CROSS_SIZE (how many nodes), MASTER_ADDR, MASTER_PORT. Read from Open
 * MPI's OMPI_COMM_WORLD_* variables before anything else runs, so a script
 * sees the same environment under `dslua -n N` and under plain mpirun. */
#ifndef DS_RANKENV_H
#define DS_RANKENV_H

#define DS_RANKENV_MASTER_PORT 29500    /* torch.distributed's default */

/* Does nothing outside mpirun. Under it, sets the rank variables from
 * mpirun's (overwriting stale ones), MASTER_ADDR (127.0.0.1 on one node)
 * and MASTER_PORT when not given, and DSLUA_NUM_THREADS to this rank's share
 * of the cores when neither it nor OMP_NUM_THREADS is set, so N ranks on a
 * machine do not each start a thread per core. */
void ds_rankenv_init(void);

#endif
