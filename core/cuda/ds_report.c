#include "ds_report.h"
#include "ds_cuda.h"
#include "ds_threads.h"

#include <cblas.h>
#include <mpi.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>
#include <string.h>

/* Whether /proc/cpuinfo lists the CPU flag (a whole word). */
static int cpu_flag(const char *flag) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return 0;
    char line[8192];
    int found = 0;
    size_t n = strlen(flag);
    while (!found && fgets(line, sizeof line, f)) {
        if (strncmp(line, "flags", 5) != 0) continue;
        for (char *p = strstr(line, flag); p && !found; p = strstr(p + 1, flag))
            found = (p == line || p[-1] == ' ') && (p[n] == ' ' || p[n] == '\n' || p[n] == '\0');
        break;
    }
    fclose(f);
    return found;
}

void ds_report(FILE *f, const char *luajit) {
    fprintf(f, "--- libraries\n");
    fprintf(f, "LuaJIT: %s\n", luajit);
    fprintf(f, "OpenBLAS: %s (core %s)\n", openblas_get_config(), openblas_get_corename());
    const dnnl_version_t *d = dnnl_version();
    fprintf(f, "oneDNN: %d.%d.%d (%s)\n", d->major, d->minor, d->patch, d->hash);
    char mpi[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    if (MPI_Get_library_version(mpi, &len) == MPI_SUCCESS) {
        mpi[strcspn(mpi, "\n")] = '\0';       /* Open MPI's first line names it */
        fprintf(f, "MPI: %s\n", mpi);
    } else {
        fprintf(f, "MPI: unknown\n");
    }
    fprintf(f, "--- CUDA\n");
    ds_cuda_report(f);
    fprintf(f, "--- features\n");
    int gpus = ds_cuda_device_count();
    if (!ds_cuda_built()) fprintf(f, "CUDA: not built\nNCCL: not built\n");
    else if (gpus == 0) fprintf(f, "CUDA: built, off (%s)\nNCCL: built, off\n", ds_cuda_unavailable_reason());
    else fprintf(f, "CUDA: on (%d GPU%s)\nNCCL: on\n", gpus, gpus == 1 ? "" : "s");
    fprintf(f, "CPU bf16: avx512_bf16 %s, amx_bf16 %s\n", cpu_flag("avx512_bf16") ? "yes" : "no",
            cpu_flag("amx_bf16") ? "yes" : "no");
    fprintf(f, "CPU SIMD: avx2 %s, avx512f %s\n", cpu_flag("avx2") ? "yes" : "no", cpu_flag("avx512f") ? "yes" : "no");
    fprintf(f, "OpenMP threads: %d (of %d processors), wait policy %s\n", ds_get_num_threads(), omp_get_num_procs(),
            ds_threads_wait_policy());
}
