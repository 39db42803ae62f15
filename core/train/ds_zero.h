/* The step engine: data parallel and ZeRO stages 0-3 with mixed precision,
 * one C object per engine, driven from Lua once per backward and once per
 * step (the Lua engine keeps the decisions: stage, sizes, schedule).
 *
 * Two ways to hold the optimizer's weights:
 *   flat     fp32 stage 0 (plain data parallel): the optimizer steps the
 *            model's own parameters; their gradients are views into its
 *            flat gradient buffers, reduced in place, bucket by bucket.
 *   masters  bf16/fp16 or stage >= 1: each param group has one fp32 master,
 *            this rank's shard of every parameter back to back (a parameter
 *            of n elements is cut into P shards of ceil(n / P), the last
 *            padded with zeros; P is the group's size from stage 1, else 1),
 *            on the master device (the model's, or the CPU for
 *            offload_optimizer). The optimizer is built over the masters.
 *
 * The layout is chosen once, here (ds_zero_config.masters), and asked
 * afterwards: ds_zero_reduces, ds_zero_holds, ds_zero_parts.
 *
 * Buckets are runs of neighbouring parameters of one group, from the last
 * to the first (backward's order), of at least bucket_size elements. A
 * parameter's leaf hook counts its gradient complete; a full bucket is
 * launched (asynchronously) once every earlier one has been, so every rank
 * launches the same collectives in the same order while backward runs.
 * With masters a bucket travels as [P, width] rows, row r holding shard r
 * of each gradient, in the communication dtype: a reduce-scatter (P > 1)
 * or an all-reduce (P = 1) whose result is added into the fp32 master
 * gradient; the parameters' gradients are dropped once copied.
 *
 * Stage 3 also partitions the parameters: each keeps only its shard and is
 * gathered when a module's forward (ds_zero_pre_forward) or any op or
 * backward node reads it (the autograd fetch hook), with prefetch along the
 * module order recorded in the first forward, and released after its
 * module's forward and as soon as its gradient is complete. A parameter
 * built partitioned (ds.zero.Init) arrives released, with its shard in
 * c.shards: taken as it is, never whole here.
 *
 * The step: wait for the buckets; one fused pass over the gradients (sum of
 * squares and inf/nan count, kept on the device); one agreement across
 * ranks (the only host synchronisation); the overflow skip; the fused
 * optimizer on this rank's shard, which takes the unscale and clip factor
 * in its pass and, with nothing partitioned, writes the 16-bit parameters
 * there too; otherwise the new weights back into the parameters (cast,
 * all-gathered from stage 1). */
#ifndef DS_ZERO_H
#define DS_ZERO_H

#include "ds_comm.h"
#include "ds_optim.h"
#include "ds_tensor.h"

#include <stdbool.h>

typedef struct ds_zero ds_zero;

typedef struct {
    int stage;                    /* 0-3 */
    ds_comm_group *group;         /* the data-parallel ranks (a pipeline stage's); NULL: the world */
    ds_comm_group *stages;        /* the model-parallel ranks of this data index (a pipeline's stages, a
                                   * tensor group, or both): the gradient norm and the overflow count sum
                                   * over them too; NULL: none */
    bool masters;                 /* fp32 masters (see above); false: flat */
    ds_dtype comm_dtype;          /* masters: gradients travel in it */
    ds_device master_device;      /* masters: where masters, their gradients and state live */
    int64_t bucket_size;          /* reduce_bucket_size, in elements */
    bool prescale;                /* flat: prescale_gradients */
    double predivide;             /* flat: gradient_predivide_factor */
    /* stage 3 */
    int64_t persistence_threshold;    /* parameters this small stay whole */
    int64_t prefetch_bucket_size;     /* elements gathered ahead */
    int64_t max_live_parameters;      /* gathered elements at most */
    int64_t max_reuse_distance;       /* kept after forward when backward needs them within this */
    ds_tensor **shards;               /* NULL, or per parameter NULL or this rank's shard of a parameter
                                       * built partitioned (released, no data): borrowed by ds_zero_new */
} ds_zero_config;

/* One engine over n_groups lists of parameters (counts[g] each, back to
 * back in params; borrowed): leaves that require grad, no tensor twice, one
 * dtype, on one device. flat: the optimizer over them (borrowed; outlives
 * z), each list a subset of its group g in its order; NULL with masters,
 * which are built here from the parameters (already in their compute
 * dtype); stage 3 then releases the parameters. Sets the leaf hooks. NULL
 * with the error set. */
ds_zero *ds_zero_new(const ds_zero_config *c, int n_groups, const int *counts, ds_tensor *const *params,
                     ds_optim *flat);
/* What holds the fp32 weights the optimizer steps (what a checkpoint's
 * fp32 is): the flat optimizer's own buffers over the parameters, the
 * engine's masters, or a streaming optimizer's (ds_zero_stream). */
typedef enum { DS_ZERO_HOLDS_PARAMS, DS_ZERO_HOLDS_MASTERS, DS_ZERO_HOLDS_STREAMED } ds_zero_holding;
ds_zero_holding ds_zero_holds(const ds_zero *z);
/* Does a backward reduce its gradients? boundary: it ends an accumulation
 * window. Flat: at the boundary, on more than one rank; masters: at the
 * boundary, and at every micro step from stage 2. */
bool ds_zero_reduces(const ds_zero *z, bool boundary);
/* P: the shards each parameter is cut into (1: every rank holds it whole). */
int ds_zero_parts(const ds_zero *z);

/* Removes the hooks (and stage 3's fetch) and drops every reference.
 * Released parameters stay released. */
void ds_zero_free(ds_zero *z);

/* masters: group g's master (new reference), for the optimizer to be
 * built over, one parameter per group. */
ds_tensor *ds_zero_master(ds_zero *z, int g);
/* masters: the optimizer streams its own masters (nvme): the ones in
 * memory go; steps stop after unscaling (see ds_zero_step). */
int ds_zero_stream(ds_zero *z);
/* masters: the optimizer built over them (borrowed; outlives z), group g
 * over master g alone; its flat buffers become the masters and their
 * gradients, cut for Lamb into the parameters' shards. */
int ds_zero_attach(ds_zero *z, ds_optim *o);

/* loss's backward (loss NULL: none, as for a rank with no data that still
 * takes part). reduce: this backward's gradients are reduced now (what
 * ds_zero_reduces answers); else they accumulate in the parameters'
 * gradients. */
int ds_zero_backward(ds_zero *z, ds_tensor *loss, bool reduce);

/* Multiplies every gradient accumulated so far by f (sample weighting). */
int ds_zero_scale_grads(ds_zero *z, double f);

typedef struct {
    bool overflow;        /* inf/nan with check_overflow: skipped, gradients zeroed */
    double grad_norm;     /* of the averaged, unscaled gradients (NAN when skipped) */
} ds_zero_result;

/* Stage 0: fn steps instead of the optimizer (ds_optim_step over each
 * group) at every ds_zero_step, once the gradients are unscaled and
 * clipped; h: one per group. NULL: the optimizer's own step again. The
 * 1-bit optimizers step this way (ds_onebit.h). 0, or -1 past stage 0. */
typedef int (*ds_zero_step_fn)(void *ud, const ds_optim_hparams *h);
int ds_zero_set_step_fn(ds_zero *z, ds_zero_step_fn fn, void *ud);
/* masters at stage 0, before a step whose backward did not reduce: this
 * rank's own gradients (left in the parameters) into the master gradients,
 * an overflow on any rank made every rank's (ds_zero_local.c). */
int ds_zero_take_local_grads(ds_zero *z);

/* The step of an accumulation boundary. h: the optimizer's hyperparameters,
 * one per group (read by the caller at this step). loss_scale: what the
 * loss was multiplied by (1 without fp16); clip: gradient_clipping (0:
 * none). With no optimizer attached (nvme streams its own) the step stops
 * after unscaling: the caller steps ds_zero_master_grad and hands the new
 * masters to ds_zero_refresh. */
int ds_zero_step(ds_zero *z, const ds_optim_hparams *h, double loss_scale, double clip, bool check_overflow,
                 ds_zero_result *out);
/* masters: group g's master gradient (new reference). */
ds_tensor *ds_zero_master_grad(ds_zero *z, int g);
/* masters without optimizer: the parameters from n new masters (one per
 * group, laid out as ds_zero_master's), then the gradients zeroed. */
int ds_zero_refresh(ds_zero *z, int n, ds_tensor *const *masters);

/* masters with an optimizer attached: the parameters from the masters as
 * they are now (a checkpoint load wrote them), as a step refreshes them. */
int ds_zero_sync_params(ds_zero *z);

/* What the reduced backwards since the gradients were last zeroed did
 * (false before any). */
typedef struct {
    int buckets;
    int64_t bytes;
    int launched_in_backward;      /* buckets launched before backward returned */
    int leaves_after_first_launch; /* gradients completed after the first launch */
    double comm_ms;                /* sum over buckets of launch to completion */
    double hidden_ms;              /* of that, the part before backward returned */
    double wait_ms;                /* the waits for them, at the step and at later micro steps */
} ds_zero_stats;
bool ds_zero_stats_get(const ds_zero *z, ds_zero_stats *out);

int ds_zero_n_params(const ds_zero *z);
/* param (one of the engine's) stays out of the gradient norm and the
 * overflow count: a pipeline's tied weight on every stage but the first
 * that holds it, a weight replicated across a tensor group on every
 * tensor rank but the first, so the norm counts it once. */
int ds_zero_exclude_from_norm(ds_zero *z, const ds_tensor *param);
/* The optimizer stepping the weights, NULL while none is attached. */
ds_optim *ds_zero_optimizer(const ds_zero *z);

/* The collectives the engine ran since the last call, for the comms
 * logger: while logging is on, each is recorded with the name DeepSpeed
 * logs it under, its bytes and its milliseconds from launch to completion.
 * *n is set; the records stay valid until the engine logs again. */
typedef struct { const char *name; int64_t bytes; double ms; } ds_zero_comm_record;
void ds_zero_set_logging(ds_zero *z, bool on);
const ds_zero_comm_record *ds_zero_comm_records(ds_zero *z, int *n);

/* Bucket b (0-based, launch order): its first parameter (global index, 0
 * based, groups back to back), parameter count and elements. */
int ds_zero_n_buckets(const ds_zero *z);
void ds_zero_bucket(const ds_zero *z, int b, int *first, int *count, int64_t *numel);

/* Stage 3. Modules in the model's module order, each with the parameters
 * it owns (global indices); the first owner of a parameter gathers it. */
int ds_zero_add_module(ds_zero *z, int n, const int *params);
int ds_zero_pre_forward(ds_zero *z, int module);
int ds_zero_post_forward(ds_zero *z, int module);
/* Every parameter whole (every rank calls it), and released again. */
int ds_zero_gather_all(ds_zero *z);
int ds_zero_release_all(ds_zero *z);
/* Stage 3's offload_param: each rank's shards leave the device, into host
 * memory (page-locked when the device is a GPU, where a prefetch's shards
 * then go up on a copy stream; file NULL) or into file
 * (nvme: written back to back, read for each gather, rewritten at each
 * step's refresh). 0, or -1 with the error naming the file. */
int ds_zero_offload_params(ds_zero *z, const char *file);
/* The test hook of CPU ranks (DSLUA_TEST_OFFLOAD_CPU): ZeRO-Offload's
 * pipeline with the host's stand-in copier (ds_zero_offload.h), chunks
 * of chunk elements, for parameters and masters on the CPU. counts: the
 * chunks it has stepped, the reduced rows it has fetched (in backward as
 * each is seen complete, the rest at the drain) and stage 3's shards it
 * has loaded ahead of their all-gather (offload_param cpu) since the
 * engine began; false without the pipeline. */
int ds_zero_offload_on_host(ds_zero *z, int64_t chunk);
bool ds_zero_offload_counts(const ds_zero *z, int64_t *chunks, int64_t *rows, int64_t *shards);
/* Does parameter i stay whole (small)? Its shard size in elements. */
bool ds_zero_persistent(const ds_zero *z, int i);
int64_t ds_zero_shard(const ds_zero *z, int i);

#endif
