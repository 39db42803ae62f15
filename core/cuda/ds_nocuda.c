/* The CUDA runtime of a build without CUDA: no devices, and every request
 * for one says why. Compiled instead of core/ds_cuda*.c (CMakeLists.txt). */
#include "ds_cuda.h"
#include "ds_error.h"

int ds_cuda_built(void) { return 0; }

int ds_cuda_device_count(void) { return 0; }

const char *ds_cuda_unavailable_reason(void) { return "CUDA not built"; }

int ds_cuda_device_name(int index, char *buf, size_t n) {
    (void)index;
    (void)buf;
    (void)n;
    return -1;
}

int ds_cuda_check_device(const char *op, int index) {
    (void)index;
    return ds_fail(DS_ERR_ARG, "%s: no CUDA device available (CUDA not built)", op), -1;
}

int ds_cuda_synchronize(void) { return 0; }

int ds_cuda_memory_info(int index, ds_cuda_mem_info *out) {
    *out = (ds_cuda_mem_info){ 0 };
    return ds_cuda_check_device("memory_info", index);
}

int ds_cuda_reset_peak(int index) { return ds_cuda_check_device("reset_peak", index); }

void ds_cuda_empty_cache(void) {}

int ds_cuda_allow_tf32(int on) {
    (void)on;
    return 0;
}

void ds_cuda_report(FILE *f) {
    fprintf(f, "CUDA: not built (configure with -DDSLUA_CUDA=ON where nvcc is installed)\n");
}
