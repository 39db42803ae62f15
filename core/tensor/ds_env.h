/* Integers from the environment, and this rank's place on its host as the
 * launcher gives it. The one reader of LOCAL_RANK and LOCAL_SIZE: the GPU a
 * rank takes (core/cuda/ds_rank_device.h), ds.comm.local_rank(), the
 * script's --local_rank and ds.args.local_rank all come from here. */
#ifndef DS_ENV_H
#define DS_ENV_H

/* $name as an integer; dflt when unset or empty. */
int ds_env_int(const char *name, int dflt);

/* LOCAL_RANK, else Open MPI's OMPI_COMM_WORLD_LOCAL_RANK, else 0. Under
 * mpirun core/comm/ds_rankenv.c sets LOCAL_RANK from Open MPI's first. */
int ds_env_local_rank(void);
/* LOCAL_SIZE, else OMPI_COMM_WORLD_LOCAL_SIZE, else 1: this host's ranks. */
int ds_env_local_size(void);

#endif
