/* The dispatch table: every op reaches its device through one of these.
 * Each backend (kernels/cpu, kernels/cuda) fills one table; core picks the
 * table by the tensor's device and never calls a kernel directly.
 * A kernel returns 0, or -1 after ds_kernel_fail() says why. */
#ifndef DS_KERNELS_H
#define DS_KERNELS_H

#include "ds_kview.h"

#include <stdbool.h>

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

/* A piece of a multi-tensor copy: n contiguous elements from src (of
 * dtype src_dtype; NULL: zeros) to dst. */
typedef struct {
    void *dst;
    const void *src;
    int64_t n;
    ds_dtype src_dtype;
} ds_copy_piece;

typedef struct ds_kernels_core {
    /* dst = src converted to dst's dtype, any strides on both sides */
    int (*copy)(ds_kview dst, ds_kview src);
    /* Every piece (host memory) as copy moves it into dst_dtype, or added
     * into f32 (f32 += the source's value, as a binary add rounds) when
     * accumulate, a zero piece then adding nothing: one launch for many
     * tensors (a bucket's gradients into their rows or their master
     * gradient). Pieces do not overlap. src and dst are bf16, f16 or f32. */
    int (*copy_pieces)(ds_dtype dst_dtype, const ds_copy_piece *pieces, int n, int accumulate);
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
    /* SwiGLU (ds_swiglu_elem): out = silu(gate) up over one shape and
     * float dtype, any strides; backward writes dgate and dup together
     * from g, the output's gradient (ds_swiglu_elem_backward). */
    int (*swiglu)(ds_kview out, ds_kview gate, ds_kview up);
    int (*swiglu_backward)(ds_kview dgate, ds_kview dup, ds_kview g, ds_kview gate, ds_kview up);
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
    /* The step engine's one pass over flat f32 gradients: acc (2 contiguous
     * f64 on x's device) gets the sum of squares added to acc[0] and the
     * count of inf/nan elements added to acc[1]. The sums stay on the
     * device, so many buffers cost one host synchronisation in all. */
    int (*sum_squares)(ds_kview acc, ds_kview x);
} ds_kernels_reduce;

/* What a check of index values found: pos, the first row-major position
 * whose value is out of range (-1 when none), and that value. */
typedef struct { int64_t pos, value; } ds_index_hit;

/* Indexing. Index views are i64 or i32 and hold 0-based values that core
 * checks with check_index. On the CPU the check is over before the others
 * run, so they never read out of bounds; a GPU's check is read back later
 * (core/tensor/ds_fault.h), so its kernels skip a value out of range (a
 * row read as zeros, an add dropped) rather than read past the data. x,
 * src and dst share one dtype. */
typedef struct ds_kernels_index {
    /* What idx holds outside [0, limit) into *hit, a value equal to *skip
     * (when skip is not NULL: cross-entropy's ignore_index) let through.
     * The CPU writes it before returning; a GPU by the time its stream
     * has done the work queued so far (hit is then page-locked memory). */
    int (*check_index)(ds_kview idx, int64_t limit, const int64_t *skip, ds_index_hit *hit);
    /* x contiguous [outer, n, inner], idx 1-D [m], out contiguous
     * [outer, m, inner]: out[o, j, :] = x[o, idx[j], :]. Any dtype. */
    int (*index_select)(ds_kview out, ds_kview x, ds_kview idx, int64_t outer, int64_t n, int64_t inner);
    /* The reverse, accumulating: dst[o, idx[j], :] += src[o, j, :];
     * dst and src contiguous, duplicate indices sum. */
    int (*index_add)(ds_kview dst, ds_kview src, ds_kview idx, int64_t outer, int64_t n, int64_t inner);
    /* out and idx share a shape; out[p] = x[p with coordinate dim
     * replaced by idx[p]]. Any strides. */
    int (*gather)(ds_kview out, ds_kview x, ds_kview idx, int dim);
    /* dst[p with coordinate dim replaced by idx[p]] += src[p] for every
     * position p of idx (src may be larger than idx). Any strides. */
    int (*scatter_add)(ds_kview dst, ds_kview src, ds_kview idx, int dim);
} ds_kernels_index;

/* Fused scaled dot-product attention, flash style (the Tq x Tk scores never
 * exist in memory). q [B,H,Tq,D], k [B,KV,Tk,D], v [B,KV,Tk,Dv] share one
 * float dtype, any strides; KV is H, or where grouped says so a divisor of
 * H (grouped-query attention: query head h reads kv head h / (H/KV)). forward writes out [B,H,Tq,Dv] (that dtype)
 * and lse [B,H,Tq], the log-sum-exp of each query row's scaled scores (f64
 * for f64 inputs, else f32). Causal hides key j from query i when j > i.
 * backward recomputes the probabilities from q, k and lse and writes dq,
 * dk, dv, shaped and typed like q, k, v; dout is shaped like out. */
typedef struct ds_kernels_attention {
    /* Whether these inputs run at the device's full rate (a GPU's tensor
     * cores); where not, core may prefer GEMMs around a softmax. */
    bool (*full_rate)(ds_kview q, ds_kview k, ds_kview v);
    /* Whether forward and backward take these k and v with fewer heads than
     * q; where not, core repeats them to q's heads first. */
    bool (*grouped)(ds_kview q, ds_kview k, ds_kview v);
    int (*forward)(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, double scale, int causal);
    int (*backward)(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k,
                    ds_kview v, ds_kview out, ds_kview lse, double scale, int causal);
} ds_kernels_attention;

/* Fused row ops of neural networks. Tensors arrive contiguous; rows are
 * computed in f32 for f32 data and in f64 otherwise (bf16/f16 included).
 * Saved statistics (lse, mean, rstd) are f64 for f64 inputs, else f32. */
typedef struct ds_kernels_nn {
    /* softmax (log_softmax when as_log) over the middle axis of
     * [outer, n, inner]; backward from the saved output y. */
    int (*softmax)(ds_kview y, ds_kview x, int64_t outer, int64_t n, int64_t inner, int as_log);
    int (*softmax_backward)(ds_kview dx, ds_kview g, ds_kview y, int64_t outer, int64_t n, int64_t inner,
                            int as_log);
    /* logits: contiguous rows of ld >= C values of which the first C are
     * the classes (the rest, a padded vocab's columns, are never read);
     * target (rows elements) i64 or i32 class ids, checked by core first.
     * Writes each row's loss (0 where target == ignore_index, and on a GPU
     * where it is out of range) and log-sum-exp. */
    int (*cross_entropy)(ds_kview loss, ds_kview lse, ds_kview logits, ds_kview target, int64_t rows, int64_t C,
                         int64_t ld, int64_t ignore_index, double smoothing);
    /* dlogits (rows of ld, like logits) = dloss[r] (softmax - (1-smoothing)
     * onehot - smoothing/C) over the first C columns, 0 past them and on
     * the rows the forward gave 0; dloss is 1-D [rows], stride 0 for a
     * reduced loss. */
    int (*cross_entropy_backward)(ds_kview dlogits, ds_kview dloss, ds_kview logits, ds_kview lse,
                                  ds_kview target, int64_t rows, int64_t C, int64_t ld, int64_t ignore_index,
                                  double smoothing);
    /* x, y, g, dx [rows, n]; w, b [n] with data NULL when absent; mean and
     * rstd [rows]. dw, db with data NULL are not computed. With res given
     * (a residual [rows, n]), sum = x + res in sum's dtype and y is the
     * norm of sum: a residual add and the next norm in one pass. With gres
     * given, dx = gres + the norm's gradient (the residual's own gradient
     * added where a separate sum would take a pass). */
    int (*layer_norm)(ds_kview y, ds_kview mean, ds_kview rstd, ds_kview x, ds_kview w, ds_kview b,
                      ds_kview res, ds_kview sum, int64_t rows, int64_t n, double eps);
    int (*layer_norm_backward)(ds_kview dx, ds_kview dw, ds_kview db, ds_kview g, ds_kview x, ds_kview w,
                               ds_kview mean, ds_kview rstd, ds_kview gres, int64_t rows, int64_t n);
    /* The same for RMS norm, res and gres as layer_norm's. */
    int (*rms_norm)(ds_kview y, ds_kview rstd, ds_kview x, ds_kview w, ds_kview res, ds_kview sum, int64_t rows,
                    int64_t n, double eps);
    int (*rms_norm_backward)(ds_kview dx, ds_kview dw, ds_kview g, ds_kview x, ds_kview w, ds_kview rstd, ds_kview gres,
                             int64_t rows, int64_t n);
    /* Rotary embedding (ds_rope_elem) over the last dim (even) of y's shape,
     * which x, cos and sin share (any strides; cos and sin broadcast by
     * stride 0). backward: y = dx from x = the output's gradient
     * (ds_rope_elem_backward). */
    int (*rope)(ds_kview y, ds_kview x, ds_kview cos, ds_kview sin, bool backward);
    /* y = x keep / (1 - p) with keep from Philox (seed, offset) per element
     * (ds_dropout_keep); the backward is the same call on the gradient. */
    int (*dropout)(ds_kview y, ds_kview x, uint64_t seed, uint64_t offset, double p);
} ds_kernels_nn;

/* Batched matrix products. */
typedef struct ds_kernels_blas {
    /* c = alpha * a @ b + beta * c with a [batch..., m, k], b [batch..., k, n],
     * c [batch..., m, n]: one float dtype, one ndim >= 2, equal batch sizes.
     * Strides are free: a transposed operand is a view with swapped strides
     * and becomes the BLAS transpose flag, not a copy. a and b may repeat a
     * matrix over batch dims (stride 0); batch dims where c has stride 0 are
     * summed into c (beta applies once), which is how a backward reduces
     * broadcast dims. c's matrices need a unit stride in one of their dims. */
    int (*gemm)(ds_kview c, ds_kview a, ds_kview b, double alpha, double beta);
    /* GEMMs with a fused epilogue (cuBLASLt's), alpha 1 and beta 0, for a
     * linear and an MLP (the CPU's bias pair: the copy or the reduction
     * and the GEMM it runs apart, in one call). NULL where the backend has
     * none (the CPU's GELU ones), and -1
     * after ds_kernel_fail() where a call does not apply: the caller runs
     * gemm and the separate kernels then. c's matrices row-major, no summed
     * (stride 0) batch dims of c, k > 0; a bias or gradient vector is c's
     * dtype, unit stride, starting on 16 bytes (data NULL: none). */
    /* c = a @ b + bias [n], added to every row (BIAS). */
    int (*gemm_bias)(ds_kview c, ds_kview a, ds_kview b, ds_kview bias);
    /* c = a @ b (2-D) and grad [m] = the sums of a's rows over k (BGRADB):
     * a linear's weight gradient g^T x with its bias gradient on the way. */
    int (*gemm_bias_grad)(ds_kview c, ds_kview a, ds_kview b, ds_kview grad);
    /* c = gelu(a @ b + bias), GELU's tanh form, writing aux = a @ b + bias
     * for the backward (GELU_AUX_BIAS). c and aux 2-D, nonempty, one shape
     * and dtype; aux's row stride a multiple of 8 elements, its start on 16
     * bytes. */
    int (*gemm_bias_gelu)(ds_kview c, ds_kview aux, ds_kview a, ds_kview b, ds_kview bias);
    /* c = (a @ b) * gelu'(aux), GELU's tanh form (DGELU): the GELU's
     * backward out of the GEMM that makes the hidden gradient. Views as
     * gemm_bias_gelu takes them. */
    int (*gemm_gelu_grad)(ds_kview c, ds_kview aux, ds_kview a, ds_kview b);
} ds_kernels_blas;

/* 2-D convolution and pooling over contiguous NCHW tensors (PyTorch's
 * layouts and output sizes, floor mode). */
typedef struct { int64_t stride[2], padding[2], dilation[2], groups; } ds_conv2d_params;
typedef struct { int64_t kernel[2], stride[2], padding[2]; int count_include_pad; } ds_pool2d_params;

typedef struct ds_kernels_conv {
    /* y [N,O,OH,OW] = x [N,C,H,W] (*) w [O,C/groups,kh,kw] + bias [O]; no bias when bias.data is NULL */
    int (*conv2d)(ds_kview y, ds_kview x, ds_kview w, ds_kview bias, const ds_conv2d_params *p);
    int (*conv2d_backward_data)(ds_kview dx, ds_kview dy, ds_kview w, const ds_conv2d_params *p);
    /* dw, and db unless db.data is NULL */
    int (*conv2d_backward_weight)(ds_kview dw, ds_kview db, ds_kview dy, ds_kview x, const ds_conv2d_params *p);
    /* indices (i64, h*W+w within each plane, as PyTorch) unless indices.data is NULL */
    int (*max_pool2d)(ds_kview y, ds_kview indices, ds_kview x, const ds_pool2d_params *p);
    int (*max_pool2d_backward)(ds_kview dx, ds_kview dy, ds_kview indices);
    int (*avg_pool2d)(ds_kview y, ds_kview x, const ds_pool2d_params *p);
    int (*avg_pool2d_backward)(ds_kview dx, ds_kview dy, const ds_pool2d_params *p);
} ds_kernels_conv;

/* Fused optimizer steps over flat buffers: p, g and every state buffer are
 * contiguous 1-D f32 views of one length. One call updates a whole
 * parameter group. Step-dependent factors come precomputed (ds_optim_elem.h
 * has the per-element math and says which library each one follows).
 * grad_scale (sgd, adam, adagrad, lion): each gradient is taken times it,
 * the product rounded to f32 as a separate scaling pass would round it
 * (1: as it is), so a clip or mean factor costs no pass of its own. */
typedef struct { double lr, weight_decay, momentum, dampening, grad_scale; int nesterov, first; } ds_sgd_params;
typedef struct {
    double beta1, beta2, eps, weight_decay, grad_scale;
    double decay;         /* 1 - lr wd, the decoupled (AdamW) factor */
    double step_size;     /* lr / (1 - beta1^t), or lr without bias correction */
    double sqrt_bc2;      /* sqrt(1 - beta2^t), or 1 */
    int decoupled;
} ds_adam_params;
typedef struct { double clr, eps, weight_decay, grad_scale; } ds_adagrad_params;   /* clr: the decayed lr */
typedef struct {
    double step_size;     /* lr sqrt(1 - beta2^t) / (1 - beta1^t), or lr */
    double beta1, beta2, eps, weight_decay;
    double grad_scale;    /* FusedLamb's: the gradients are divided by it */
    int eps_inside_sqrt;
} ds_lamb_params;
typedef struct { double lr, beta1, beta2, decay, grad_scale; } ds_lion_params;   /* decay: 1 - lr wd */
/* The 1-bit optimizers' pointwise steps (core/train/ds_onebit.h; the
 * per-element math is ds_onebit_elem in ds_optim_elem.h). */
typedef enum {
    DS_ONEBIT_MOMENTUM,   /* m = beta1 m + (1 - beta1) g */
    DS_ONEBIT_APPLY,      /* u = m / (sqrt v + eps) + wd p; p -= lr u; acc -= lr u when acc is given */
    DS_ONEBIT_UNDO,       /* 0/1 Adam's sync, before: p -= acc; acc *= sqrt v + eps */
    DS_ONEBIT_REDO,       /* and after: m = -acc / lrs; p += acc / (sqrt v + eps); acc = 0 */
} ds_onebit_op;
typedef struct { double beta1, eps, lr, weight_decay, lrs; } ds_onebit_params;

typedef struct ds_kernels_optim {
    /* shadow (sgd, adam, adagrad, lion): data NULL, or a contiguous bf16
     * or f16 view of p's length that gets each updated p[i] in the same
     * pass, rounded as copy rounds it (mixed precision's 16-bit parameters
     * without a pass of their own). buf.data is NULL when momentum is 0;
     * first starts the buffer. */
    int (*sgd)(ds_kview p, ds_kview g, ds_kview buf, ds_kview shadow, const ds_sgd_params *h);
    int (*adam)(ds_kview p, ds_kview g, ds_kview m, ds_kview v, ds_kview shadow, const ds_adam_params *h);
    int (*adagrad)(ds_kview p, ds_kview g, ds_kview sum, ds_kview shadow, const ds_adagrad_params *h);
    /* Lamb in two calls, so that the norms can be summed over ranks in
     * between. Piece k is elements [seg[k], seg[k+1]) (seg: nseg + 1
     * offsets from 0 to the length, host memory; a piece may be empty).
     * lamb_norms updates the moments and writes each piece's |p|^2 and
     * |u|^2 (u: the update before the trust ratio) to w_sq[k], u_sq[k] in
     * host memory; lamb_apply then does p -= step_size coeff[k] u over
     * piece k (coeff: host memory). */
    int (*lamb_norms)(ds_kview p, ds_kview g, ds_kview m, ds_kview v, const int64_t *seg, int nseg, double *w_sq,
                      double *u_sq, const ds_lamb_params *h);
    int (*lamb_apply)(ds_kview p, ds_kview m, ds_kview v, const int64_t *seg, int nseg, const double *coeff,
                      const ds_lamb_params *h);
    int (*lion)(ds_kview p, ds_kview g, ds_kview m, ds_kview shadow, const ds_lion_params *h);
    /* 1-bit compression: bits (u8, x's length / 8; the length a multiple
     * of 8) get x's signs, element i in bit i % 8 of byte i / 8, set when
     * x >= 0 (as torch's sign() + 1 is true), and err = x - scale sign(x).
     * unpack: out = scale sign(bits), added to out when accumulate. */
    int (*onebit_pack)(ds_kview x, ds_kview err, ds_kview bits, double scale);
    int (*onebit_unpack)(ds_kview out, ds_kview bits, double scale, int accumulate);
    /* p, g, m, v, acc of one length; g and acc have NULL data where op
     * does not read them */
    int (*onebit_update)(ds_onebit_op op, ds_kview p, ds_kview g, ds_kview m, ds_kview v, ds_kview acc,
                         const ds_onebit_params *h);
} ds_kernels_optim;

/* FP8 (ds_fp8.h's formats, fmt a ds_fp8_format). meta is a tensor's three
 * f32 (scale, scale_inv, amax) at stride meta.stride[0], on the device.
 * cast: q (u8) = x * scale in fmt, x and q contiguous, x f32/bf16/f16, and
 * amax = max(amax, max |x|); where current, scale is first made
 * ds_fp8_scale(m) (1 where that is 0 or not finite) and scale_inv its
 * inverse, m max |x| or, where given (data not NULL), the f32 *given (the
 * max over the ranks holding pieces of one tensor). cast_transpose: cast
 * of x [m, k] that writes q [m, k] and its transpose qt [k, m] in one pass
 * (the layouts of an fp8 GEMM's forward and backward operands). amax: out
 * (f32 [1]) = max |x|, NaNs left out as cast leaves them. uncast: y
 * (contiguous, float) = q's values * scale_inv.
 * gemm: c [m, n] = (a [m, k] * a's scale_inv) @ (b [n, k] * b's scale_inv)^T
 * (+ bias [n]: data NULL for none), a and b u8 row-major, accumulated in
 * f32; NULL where the backend has none (the CPU) and -1 after
 * ds_kernel_fail() where a call does not apply: the caller uncasts and runs
 * gemm then. */
typedef struct ds_kernels_fp8 {
    int (*cast)(ds_kview q, ds_kview x, ds_kview meta, int fmt, int current, int margin, ds_kview given);
    int (*cast_transpose)(ds_kview q, ds_kview qt, ds_kview x, ds_kview meta, int fmt, int current, int margin,
                          ds_kview given);
    int (*amax)(ds_kview out, ds_kview x);
    int (*uncast)(ds_kview y, ds_kview q, ds_kview meta, int fmt);
    int (*gemm)(ds_kview c, ds_kview a, ds_kview b, ds_kview a_meta, ds_kview b_meta, int a_fmt, int b_fmt,
                ds_kview bias);
} ds_kernels_fp8;

/* The instruction set of the CPU optimizer loops: the widest this CPU runs
 * ("avx512", "avx2", "sse2"), picked at first use. Every one writes the same
 * bits. ds_cpu_optim_use picks one by name (tests, benchmarks); -1 where
 * the CPU lacks it or the name is unknown. */
const char *ds_cpu_optim_isa(void);
int ds_cpu_optim_use(const char *isa);

typedef struct ds_kernels {
    const char *name;
    const ds_kernels_core *core;
    const ds_kernels_elementwise *elementwise;
    const ds_kernels_reduce *reduce;
    const ds_kernels_blas *blas;
    const ds_kernels_conv *conv;
    const ds_kernels_attention *attention;
    const ds_kernels_index *index;
    const ds_kernels_nn *nn;
    const ds_kernels_optim *optim;
    const ds_kernels_fp8 *fp8;
} ds_kernels;

/* Kernel-side error reporting; core turns it into the op's error. */
#ifdef __cplusplus
extern "C" {
#endif
int ds_kernel_fail(const char *fmt, ...);
const char *ds_kernel_error(void);
#ifdef __cplusplus
}
#endif

#endif
