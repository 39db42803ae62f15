/* The dispatch table: every op reaches its device through one of these.
 * Each backend (kernels/cpu, kernels/cuda) fills one table; core picks the
 * table by the tensor's device and never calls a kernel directly.
 * A kernel returns 0, or -1 after ds_kernel_fail() says why. */
#ifndef DS_KERNELS_H
#define DS_KERNELS_H

#include "ds_kview.h"

/* Elementwise ops. Binary inputs arrive already broadcast to out's shape
 * (stride 0 along broadcast dims). */
typedef enum {
    DS_BIN_ADD, DS_BIN_SUB, DS_BIN_MUL, DS_BIN_DIV, DS_BIN_POW,
    DS_BIN_MAX, DS_BIN_MIN,
    DS_BIN_EQ, DS_BIN_NE, DS_BIN_LT, DS_BIN_LE, DS_BIN_GT, DS_BIN_GE,
    DS_NBINARY
} ds_binary_op;

typedef enum {
    DS_UN_NEG, DS_UN_EXP, DS_UN_LOG, DS_UN_SQRT, DS_UN_RSQRT, DS_UN_TANH,
    DS_UN_SIGMOID, DS_UN_ABS, DS_UN_POW_SCALAR, DS_UN_RELU, DS_UN_GELU_TANH,
    DS_UN_GELU_ERF, DS_UN_SILU,
    DS_NUNARY
} ds_unary_op;

typedef struct ds_kernels_core {
    /* dst = src converted to dst's dtype, any strides on both sides */
    int (*copy)(ds_kview dst, ds_kview src);
    int (*fill)(ds_kview dst, double value);
    int (*arange)(ds_kview dst, double start, double step);
    /* Counter-based random numbers: element i uses Philox counter
     * offset + i/4, so results do not depend on threads or devices. */
    int (*uniform)(ds_kview dst, uint64_t seed, uint64_t offset, double lo, double hi);
    int (*normal)(ds_kview dst, uint64_t seed, uint64_t offset, double mean, double std);
} ds_kernels_core;

typedef struct ds_kernels_elementwise {
    int (*binary)(ds_binary_op op, ds_kview out, ds_kview a, ds_kview b);
    int (*unary)(ds_unary_op op, ds_kview out, ds_kview x, double param);
    /* dx = g * d op(x)/dx; y = op(x) is passed for ops whose derivative
     * is cheapest from the output (exp, tanh, sigmoid, sqrt). */
    int (*unary_backward)(ds_unary_op op, ds_kview dx, ds_kview g, ds_kview x, ds_kview y, double param);
    int (*where)(ds_kview out, ds_kview cond, ds_kview a, ds_kview b);
} ds_kernels_elementwise;

typedef enum {
    DS_RED_SUM, DS_RED_MEAN, DS_RED_MAX, DS_RED_MIN, DS_RED_ARGMAX, DS_RED_ARGMIN,
    DS_RED_VAR, DS_RED_NORM,
    DS_NREDUCE
} ds_reduce_op;

typedef struct ds_kernels_reduce {
    /* x is contiguous and read as [outer, n, inner]; out is contiguous
     * [outer, inner] and gets op over the middle axis. param is the
     * correction for VAR and p for NORM (p = INFINITY for the max norm). */
    int (*reduce)(ds_reduce_op op, ds_kview out, ds_kview x, int64_t outer, int64_t n, int64_t inner,
                  double param);
} ds_kernels_reduce;

typedef struct ds_kernels {
    const char *name;
    const ds_kernels_core *core;
    const ds_kernels_elementwise *elementwise;
    const ds_kernels_reduce *reduce;
} ds_kernels;

/* Kernel-side error reporting; core turns it into the op's error. */
int ds_kernel_fail(const char *fmt, ...);
const char *ds_kernel_error(void);

#endif
