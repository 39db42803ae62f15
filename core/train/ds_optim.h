/* Fused optimizers over flat fp32 buffers.
 *
 * Adding a parameter group flattens it: one contiguous f32 buffer holds all
 * its parameters and each parameter tensor is re-seated as a view into it;
 * a matching gradient buffer is attached as the parameters' .grad views, so
 * autograd accumulates straight into it; the state buffers (moments,
 * momentum, sums) are flat too. A lone f32 parameter that is the whole of
 * its storage already is such a buffer and is adopted, not copied, and so
 * is its .grad when that is the whole of its own (the step engine's
 * masters: one copy of each, at every moment). A step is one kernel call per group (two
 * for Lamb, whose norms may be summed over ranks in between). The
 * flat buffers stay reachable for what comes later (mixed precision
 * masters, ZeRO partitions) through the group struct. */
#ifndef DS_OPTIM_H
#define DS_OPTIM_H

#include "ds_tensor.h"

typedef enum {
    DS_OPTIM_SGD, DS_OPTIM_ADAM, DS_OPTIM_ADAMW, DS_OPTIM_ADAGRAD, DS_OPTIM_LAMB, DS_OPTIM_LION,
    DS_NOPTIM
} ds_optim_kind;

/* One group's hyperparameters, read afresh at every step so schedules can
 * change them. Each kind reads the fields it names. */
typedef struct {
    double lr, weight_decay;
    double momentum, dampening;                 /* SGD */
    bool nesterov;                              /* SGD */
    double beta1, beta2;                        /* Adam, AdamW, Lamb, Lion */
    double eps;                                 /* Adam, AdamW, Lamb, Adagrad */
    bool bias_correction;                       /* Adam, AdamW, Lamb */
    double lr_decay, initial_accumulator_value; /* Adagrad */
    double max_coeff, min_coeff;                /* Lamb */
    bool eps_inside_sqrt;                       /* Lamb */
} ds_optim_hparams;

#define DS_OPTIM_MAX_STATE 2

typedef struct {
    int n_params;
    ds_tensor **params;          /* re-seated into flat_params */
    ds_tensor **grads;           /* the .grad views into flat_grads */
    int64_t *offsets;            /* n_params + 1 element offsets */
    ds_tensor *flat_params, *flat_grads;          /* 1-D f32 */
    ds_tensor *state[DS_OPTIM_MAX_STATE];         /* 1-D f32; NULL while unused */
    bool momentum_started;       /* SGD: the buffer holds a momentum */
    int64_t step;
    int n_seg;                   /* Lamb's pieces, one trust ratio each: */
    int64_t *seg;                /* n_seg + 1 element offsets (the parameters' at first) */
    double *lamb_coeffs;         /* Lamb: each piece's last trust ratio */
} ds_optim_group;

typedef struct ds_optim {
    ds_optim_kind kind;
    int n_groups;
    ds_optim_group *groups;
} ds_optim;

const char *ds_optim_name(ds_optim_kind k);
int ds_optim_parse(const char *name);                  /* -1 if unknown */
int ds_optim_n_state(ds_optim_kind k);
const char *ds_optim_state_name(ds_optim_kind k, int slot);
int ds_optim_state_slot(ds_optim_kind k, const char *name);   /* -1 if none */

/* 0, or -1 with an error naming the optimizer, the group (0-based here,
 * 1-based in messages; none when negative) and the bad value. */
int ds_optim_check_hparams(ds_optim_kind k, const ds_optim_hparams *h, int group);

ds_optim *ds_optim_new(ds_optim_kind kind);
void ds_optim_free(ds_optim *o);
/* Flattens params (borrowed; float32 leaves needing grad, all on one
 * device, none already in this optimizer) into a new group. A grad they
 * already have is kept (copied into the flat gradient buffer). */
int ds_optim_add_group(ds_optim *o, int n, ds_tensor *const *params, const ds_optim_hparams *h);
/* One update of group g. A parameter's .grad that was dropped counts as
 * zero; one that was replaced by another tensor of its shape is copied in;
 * both get the flat view back. */
int ds_optim_step(ds_optim *o, int g, const ds_optim_hparams *h);
/* Cuts group g into the pieces Lamb takes a trust ratio for: seg holds
 * nseg + 1 element offsets, 0 = seg[0] <= seg[1] <= ... <= seg[nseg] = the
 * group's length (a piece may be empty: a rank's shard of a small
 * parameter can be). A new group's pieces are its parameters. Any kind
 * takes them; only Lamb reads them. The last trust ratios start over at 0.
 * 0, or -1 with an error naming the group. */
int ds_optim_set_segments(ds_optim *o, int g, int nseg, const int64_t *seg);
/* Replaces n doubles in host memory by their sums over every rank that
 * holds a part of the same pieces (the engine all-reduces them). 0, or -1
 * with the error set. */
typedef int (*ds_optim_sum_fn)(double *values, int n, void *ud);
/* ds_optim_step on the gradients times grad_scale (1: as they are), the
 * product rounded to f32 as a scaling op would round it but taken inside
 * the kernel's one pass; shadow (NULL: none), a bf16 or f16 tensor of the
 * group's length on its device, gets the updated parameters in that pass,
 * rounded as ds_copy_ rounds them. Lamb takes only 1 and NULL. Each piece
 * may be one rank's part of a larger parameter: Lamb's squared norms of
 * the weights and of the update are summed over the ranks by `sum` before
 * the trust ratios are taken, so every rank applies the ratio of the whole
 * parameter. sum gets 2 nseg values, the pieces' |w|^2 then their |u|^2,
 * once per step, so every rank must cut its group into as many pieces,
 * piece k being its part of the same parameter everywhere. A failed sum
 * leaves the moments stepped and the weights not. Other kinds never call
 * sum; sum NULL sums nothing. */
int ds_optim_step_shared(ds_optim *o, int g, const ds_optim_hparams *h, double grad_scale, ds_tensor *shadow,
                         ds_optim_sum_fn sum, void *ud);
/* One stateless update of p (and shadow) from g times grad_scale: the
 * kernel call ds_optim_step_shared makes, for callers that keep the
 * buffers themselves (a streamed optimizer that steps a group in pieces).
 * p, g, s0, s1: contiguous 1-D f32 views of one length on one device; a
 * state view the kind has no slot for (or SGD without momentum) may be
 * NULL. t: the 1-based step (bias correction, Adagrad's lr decay); first:
 * SGD's momentum buffer starts here. Lamb is refused: its trust ratio
 * needs whole parameters. 0, or -1 with the error. */
int ds_optim_apply(ds_optim_kind kind, const ds_optim_hparams *h, int64_t t, bool first, ds_tensor *p,
                   ds_tensor *g, ds_tensor *s0, ds_tensor *s1, double grad_scale, ds_tensor *shadow);
/* ds_optim_step_shared in pieces the caller orders (ZeRO-Offload's
 * pipeline steps a chunk while others are copied): begin checks h and
 * takes in the gradients; step_piece updates elements [lo, lo + n) of the
 * group as the whole step would (shadow: NULL, or the 16-bit copy of that
 * piece); end counts the step once every element has been stepped. Not
 * Lamb (ds_optim_apply refuses it). 0, or -1 with the error. */
int ds_optim_begin_pieces(ds_optim *o, int g, const ds_optim_hparams *h);
int ds_optim_step_piece(ds_optim *o, int g, const ds_optim_hparams *h, int64_t lo, int64_t n, double grad_scale,
                        ds_tensor *shadow);
void ds_optim_end_pieces(ds_optim *o, int g, const ds_optim_hparams *h);
/* Moves group g's flat parameters and gradients into params and grads
 * (contiguous 1-D f32 of the group's length, on a device of the same
 * type: ZeRO-Offload's page-locked host buffers), the parameters and their
 * .grad views re-seated there. 0, or -1 with the error. */
int ds_optim_move_flat(ds_optim *o, int g, ds_tensor *params, ds_tensor *grads);
/* Zeros every group's flat gradients and re-attaches the .grad views. */
int ds_optim_zero_grad(ds_optim *o);

/* State of parameter i of group g in slot (a view shaped like the
 * parameter), or NULL without an error when that slot holds nothing yet. */
ds_tensor *ds_optim_state_view(ds_optim *o, int g, int i, int slot);
/* Back to the state a new group has: step 0, fresh buffers. */
int ds_optim_reset_state(ds_optim *o, int g, const ds_optim_hparams *h);
/* Copies src (shaped like the parameter) into its slot. */
int ds_optim_load_state(ds_optim *o, int g, int i, int slot, ds_tensor *src);

#endif
