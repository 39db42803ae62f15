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

ds_cuda_copier *ds_cuda_copier_new(int index) { return ds_cuda_check_device("offload copies", index), NULL; }

/* the rest take a copier, which this build never makes */
void ds_cuda_copier_free(ds_cuda_copier *c) { (void)c; }

int ds_cuda_copier_start(ds_cuda_copier *c) { return c ? 0 : -1; }

int ds_cuda_copier_copy(ds_cuda_copier *c, int up, void *dst, const void *src, size_t nb) {
    (void)up;
    (void)dst;
    (void)src;
    (void)nb;
    return c ? 0 : -1;
}

int ds_cuda_copier_mark(ds_cuda_copier *c, int up, int slot) {
    (void)up;
    (void)slot;
    return c ? 0 : -1;
}

int ds_cuda_copier_wait(ds_cuda_copier *c, int up, int slot) {
    (void)up;
    (void)slot;
    return c ? 0 : -1;
}

int ds_cuda_copier_join(ds_cuda_copier *c, int up) {
    (void)up;
    return c ? 0 : -1;
}

/* kept and answered, as PyTorch's flags are without a GPU */
int ds_cuda_allow_tf32(bool conv, int on) {
    static int tf32[2];
    if (on >= 0) tf32[conv] = on != 0;
    return tf32[conv];
}

int ds_cuda_allow_wgmma(int on) {
    static int wgmma = 1;
    if (on >= 0) wgmma = on != 0;
    return wgmma;
}

const char *ds_cuda_attention_kernel(ds_dtype dt, int D, bool backward, const char **why) {
    (void)dt, (void)D, (void)backward, (void)why;
    ds_cuda_check_device("attention_kernel", 0);
    return NULL;
}

void ds_cuda_report(FILE *f) {
    fprintf(f, "CUDA: not built (configure with -DDSLUA_CUDA=ON where nvcc is installed)\n");
}
