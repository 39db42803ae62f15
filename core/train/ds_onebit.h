/* DeepSpeed's 1-bit optimizers on the step engine (ZeRO stage 0: plain
 * data parallel in fp32, or fp32 masters under bf16 and fp16, whose
 * compressed steps take this rank's gradients through
 * ds_zero_take_local_grads): OnebitAdam, ZeroOneAdam and OnebitLamb
 * (deepspeed/runtime/fp16/onebit/adam.py, zoadam.py, lamb.py), over an
 * AdamW (a Lamb for OnebitLamb) without bias correction (core/train/ds_optim.h) whose
 * flat moments they share.
 *
 * OnebitAdam: the first freeze_step steps are that AdamW over all-reduced
 * gradients (DeepSpeed's warm-up: update m / (sqrt v + eps) + wd p). From
 * then on the variance is frozen, backward no longer reduces, and each
 * step folds this rank's own gradient into the momentum, averages the
 * momentum with the compressed all-reduce below, and updates with it.
 *
 * OnebitLamb: freeze_step steps of that Lamb, keeping an average of each
 * parameter's trust ratio (coeff_beta). Then each parameter's momentum is
 * scaled to one common size before the compressed all-reduce and back
 * after; a fresh variance follows the gradients the averaged momentum
 * implies, and each parameter steps with its frozen trust ratio times a
 * factor: the largest ratio of the frozen to the fresh denominator, in
 * [factor_min, factor_max] and within factor_threshold of the last one.
 *
 * ZeroOneAdam: full-precision steps only every var_interval steps (which
 * doubles after each var_update_scaler of them); in between the gradient
 * itself travels compressed and the variance stays. After var_freeze_step
 * steps the variance is frozen and ranks take local steps, syncing the
 * accumulated update (compressed) every local_step_interval steps (which
 * doubles every local_step_scaler steps, up to local_step_clipper). These
 * fall on DeepSpeed's steps: its count includes its first call, which only
 * makes buffers (dslua's step t is its t + 1).
 *
 * The compressed all-reduce (deepspeed/runtime/comm/nccl.py), as DeepSpeed
 * calls it: once per parameter for OnebitAdam and ZeroOneAdam, once over
 * every group's momenta for OnebitLamb. A buffer of n elements is padded to
 * N, a multiple of W lcm(W, 8) for W ranks. Worker: x += worker error;
 * scale = |x| / sqrt(N); the signs of x (1 bit each), chunk j to rank j (an
 * all-to-all), and the scale to every rank; worker error = x - scale
 * sign(x). Server, for this rank's chunk j of N / W elements: the mean over
 * ranks of scale_r sign_r, plus the server error, compressed the same way
 * (one scale per chunk) and all-gathered; each rank unpacks every chunk.
 * Both errors feed back into the next call. */
#ifndef DS_ONEBIT_H
#define DS_ONEBIT_H

#include "ds_optim.h"

#include <stdbool.h>

typedef enum { DS_ONEBIT_ADAM, DS_ZERO_ONE_ADAM, DS_ONEBIT_LAMB } ds_onebit_kind;

typedef struct {
    ds_onebit_kind kind;
    int64_t freeze_step;              /* OnebitAdam, OnebitLamb: full-precision steps */
    double coeff_beta, factor_max, factor_min, factor_threshold;   /* OnebitLamb */
    int64_t var_freeze_step;          /* ZeroOneAdam: steps before the variance freezes */
    int64_t var_update_scaler;        /* full-precision steps per var_interval */
    int64_t local_step_scaler;        /* local steps per local_step_interval */
    int64_t local_step_clipper;       /* the largest local_step_interval */
} ds_onebit_config;

typedef struct ds_onebit ds_onebit;

/* Over o (borrowed; outlives b): an AdamW (OnebitLamb: a Lamb) with
 * bias_correction off, on one device. NULL with the error set. */
ds_onebit *ds_onebit_new(const ds_onebit_config *c, ds_optim *o);
void ds_onebit_free(ds_onebit *b);

/* Does the next step take all-reduced gradients? (false: backward leaves
 * this rank's own.) After a checkpoint load (the optimizer's step count
 * changed) b first takes up the schedule at that step, its errors zeroed
 * as DeepSpeed's load does; OnebitLamb past step 0 only with its own
 * state loaded for that step (ds_onebit_lamb_load; else the step fails). */
bool ds_onebit_reduces(ds_onebit *b);

/* OnebitLamb's own state of group g, which a checkpoint keeps beside its
 * Lamb's (DeepSpeed's exp_avg_sq_fresh, lamb_coeff_freeze, last_factor,
 * scaling_coeff): new copies of the fresh variance (f32 [n], on the
 * group's device) and of each piece's averaged trust ratio, last factor
 * and momentum scaling (f64 [3 pieces] on the host, in that order). */
int ds_onebit_lamb_state(const ds_onebit *b, int g, ds_tensor **fresh_v, ds_tensor **pieces);
/* Sets them back as saved when the optimizer had taken step steps. */
int ds_onebit_lamb_load(ds_onebit *b, int g, int64_t step, ds_tensor *fresh_v, ds_tensor *pieces);

/* One step over every group, h one per group, after the gradients are
 * clipped: the AdamW's own step when they were reduced, else the
 * compressed one. Every rank calls it. 0, or -1 with the error. */
int ds_onebit_step(ds_onebit *b, const ds_optim_hparams *h);

/* x (contiguous 1-D f32 of group g's length, on its device) replaced by
 * its compressed average over the ranks, parameter by parameter with
 * group g's error buffers (OnebitAdam, ZeroOneAdam). */
int ds_onebit_allreduce(ds_onebit *b, int g, ds_tensor *x);

typedef struct {
    int64_t steps;            /* steps taken */
    bool compressed;          /* the last step's communication was compressed */
    int64_t bytes;            /* bytes this rank handed to the compressed all-reduces since the last step began
                                 (of an all-to-all, the pieces for other ranks) */
} ds_onebit_stats;
void ds_onebit_stats_get(const ds_onebit *b, ds_onebit_stats *out);

#endif
