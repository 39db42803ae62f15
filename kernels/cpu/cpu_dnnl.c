#include "cpu_dnnl.h"
#include "../ds_kernels.h"

#include <oneapi/dnnl/dnnl_debug.h>
#include <pthread.h>

static pthread_once_t dnnl_once = PTHREAD_ONCE_INIT;
static dnnl_engine_t dnnl_eng;
static dnnl_stream_t dnnl_strm;

static void dnnl_init(void) {
    if (dnnl_engine_create(&dnnl_eng, dnnl_cpu, 0) != dnnl_success) { dnnl_eng = NULL; return; }
    if (dnnl_stream_create(&dnnl_strm, dnnl_eng, dnnl_stream_default_flags) != dnnl_success) dnnl_strm = NULL;
}

dnnl_engine_t cpu_dnnl_engine(void) {
    pthread_once(&dnnl_once, dnnl_init);
    return dnnl_eng;
}

dnnl_stream_t cpu_dnnl_stream(void) {
    pthread_once(&dnnl_once, dnnl_init);
    return dnnl_strm;
}

dnnl_data_type_t cpu_dnnl_type(ds_dtype t) {
    switch (t) {
    case DS_F32: return dnnl_f32;
    case DS_BF16: return dnnl_bf16;
    case DS_F16: return dnnl_f16;
    case DS_I32: return dnnl_s32;
    default: return dnnl_data_type_undef;
    }
}

dnnl_status_t cpu_dnnl_md(dnnl_memory_desc_t *md, int ndim, const int64_t *dims, const int64_t *strides,
                          ds_dtype t) {
    dnnl_dims_t d, s;
    for (int i = 0; i < ndim; i++) { d[i] = dims[i]; s[i] = strides[i]; }
    return dnnl_memory_desc_init_by_strides(md, ndim, d, cpu_dnnl_type(t), s);
}

dnnl_status_t cpu_dnnl_exec(const_dnnl_primitive_t prim, int nargs, const cpu_dnnl_arg *args) {
    dnnl_engine_t eng = cpu_dnnl_engine();
    dnnl_stream_t strm = cpu_dnnl_stream();
    if (!eng || !strm) return dnnl_runtime_error;
    dnnl_memory_t mem[CPU_DNNL_MAX_ARGS] = {0};
    dnnl_exec_arg_t exec[CPU_DNNL_MAX_ARGS];
    dnnl_status_t st = nargs <= CPU_DNNL_MAX_ARGS ? dnnl_success : dnnl_invalid_arguments;
    for (int i = 0; i < nargs && st == dnnl_success; i++) {
        st = dnnl_memory_create(&mem[i], args[i].md, eng, args[i].data);
        exec[i].arg = args[i].arg;
        exec[i].memory = mem[i];
    }
    if (st == dnnl_success) st = dnnl_primitive_execute(prim, strm, nargs, exec);
    if (st == dnnl_success) st = dnnl_stream_wait(strm);
    for (int i = 0; i < nargs && i < CPU_DNNL_MAX_ARGS; i++)
        if (mem[i]) dnnl_memory_destroy(mem[i]);
    return st;
}

dnnl_status_t cpu_dnnl_run(const_dnnl_primitive_desc_t pd, int nargs, const cpu_dnnl_arg *args) {
    dnnl_primitive_t prim;
    dnnl_status_t st = dnnl_primitive_create(&prim, pd);
    if (st != dnnl_success) return st;
    st = cpu_dnnl_exec(prim, nargs, args);
    dnnl_primitive_destroy(prim);
    return st;
}

int cpu_dnnl_fail(const char *what, dnnl_status_t st) {
    return ds_kernel_fail("oneDNN %s failed: %s", what, dnnl_status2str(st));
}
