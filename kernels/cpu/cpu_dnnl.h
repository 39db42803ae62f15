/* oneDNN on the CPU: one engine and one stream for the process, memory
 * descriptors straight from kviews, and a helper that runs a primitive
 * once. Primitive creation is cheap on repeat calls thanks to oneDNN's own
 * primitive cache, so callers build primitives per call. */
#ifndef CPU_DNNL_H
#define CPU_DNNL_H

#include "../ds_kview.h"

#include <oneapi/dnnl/dnnl.h>

dnnl_engine_t cpu_dnnl_engine(void);
dnnl_stream_t cpu_dnnl_stream(void);

/* oneDNN's type for a dtype; dnnl_data_type_undef where it has none. */
dnnl_data_type_t cpu_dnnl_type(ds_dtype t);

/* A plain memory descriptor with the view's dims and strides. */
dnnl_status_t cpu_dnnl_md(dnnl_memory_desc_t *md, int ndim, const int64_t *dims, const int64_t *strides,
                          ds_dtype t);

/* One argument of a primitive: its index (DNNL_ARG_*), descriptor and data. */
typedef struct { int arg; const dnnl_memory_desc_t *md; void *data; } cpu_dnnl_arg;

#define CPU_DNNL_MAX_ARGS 8

/* Runs prim on the args (user memory, no copies) and waits. */
dnnl_status_t cpu_dnnl_exec(const_dnnl_primitive_t prim, int nargs, const cpu_dnnl_arg *args);
/* The same with a primitive made from pd for this one run. */
dnnl_status_t cpu_dnnl_run(const_dnnl_primitive_desc_t pd, int nargs, const cpu_dnnl_arg *args);

/* ds_kernel_fail with the oneDNN status in words. */
int cpu_dnnl_fail(const char *what, dnnl_status_t st);

#endif
