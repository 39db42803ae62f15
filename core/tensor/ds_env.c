#include "ds_env.h"

#include <stdlib.h>

int ds_env_int(const char *name, int dflt) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) : dflt;
}

int ds_env_local_rank(void) { return ds_env_int("LOCAL_RANK", ds_env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0)); }

int ds_env_local_size(void) { return ds_env_int("LOCAL_SIZE", ds_env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1)); }
