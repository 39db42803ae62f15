/* Inside the step engine: ds_zero.c the buckets, their flights, the
 * backward and the step's agreement; a layout file each for where the
 * gradients and the weights the optimizer steps live (ds_zero_flat.c,
 * ds_zero_masters.c with ds_zero_local.c); ds_zero_gather.c stage 3's
 * gathers and releases. */
#ifndef DS_ZERO_IMPL_H
#define DS_ZERO_IMPL_H

#include "ds_zero.h"
#include "ds_aio.h"
#include "ds_comm.h"
#include "ds_zero_offload.h"

typedef struct zgather zgather;
typedef struct zoffload zoffload;
typedef struct zbucket zbucket;
typedef struct zflight zflight;

/* A layout: chosen once by ds_zero_new, asked by everything after it. */
typedef struct {
    ds_zero_holding holds;
    /* parts, each parameter's shard and offset, where gradients live;
     * flat: the optimizer whose gradients they are */
    int (*build)(ds_zero *z, ds_optim *flat);
    void (*free)(ds_zero *z);
    /* does a backward reduce, at an accumulation boundary or not? */
    bool (*reduces)(const ds_zero *z, bool boundary);
    /* before and after every backward (NULL: nothing to do) */
    int (*arm)(ds_zero *z, bool reduce);
    int (*after)(ds_zero *z);
    /* nothing to communicate (NULL: never); then fold puts a bucket
     * straight where the step reads it, in place of launch and land */
    bool (*local)(const ds_zero *z);
    int (*fold)(ds_zero *z, zbucket *b);
    ds_comm_work *(*launch)(ds_zero *z, zbucket *b, ds_tensor **buf);
    int (*arrive)(ds_zero *z, zflight *f);              /* a bucket seen reduced: its row may start on its way */
    int (*land)(ds_zero *z, zflight *f);                /* a reduced bucket where the step reads it */
    const char *(*collective)(const ds_zero *z);        /* the comms logger's name for launch's */
    int (*scale)(ds_zero *z, double f);                 /* the buffers the step reads (a flat view with them) */
    ds_tensor *(*param_grad)(ds_zero *z, int i);        /* where the step reads parameter i's (new reference) */
    /* after the drain, gradients off: overflow, norm, optimizer, refresh */
    int (*step)(ds_zero *z, const ds_optim_hparams *h, double loss_scale, double clip, bool check_overflow,
                ds_zero_result *out);
    int (*zero_grad)(ds_zero *z);
} zlayout;

extern const zlayout ds_zero_flat_layout, ds_zero_masters_layout;

typedef struct {
    ds_zero *z;             /* for the leaf hook */
    ds_tensor *param;
    int group;
    int64_t numel;
    int64_t shard;          /* masters: ceil(numel / P); flat: numel */
    int64_t offset;         /* of its shard in the group's master, or of its gradient in the flat gradients */
    int bucket;
    bool done;              /* gradient complete in the armed backward */
    bool no_norm;           /* left out of the norm (ds_zero_exclude_from_norm) */
    ds_tensor *view;        /* flat: where its gradient lives */
    /* stage 3 */
    ds_tensor *own;         /* this rank's shard (model dtype); NULL when persistent; a released
                               placeholder when the shard lives in param_file */
    int64_t home;           /* its byte offset in param_file */
    int owner;              /* the module that gathers it, -1 none */
    zgather *in_flight;
} zparam;

struct zbucket {
    int first, count;       /* parameters first .. first + count - 1 */
    int group;
    int64_t offset, width;  /* in the group's master (shards) or flat gradients (elements) */
    int64_t numel;
    int pending;            /* gradients not complete in the armed backward */
};

struct zflight {
    int bucket;
    ds_comm_work *work;
    ds_tensor *buf;         /* masters: [P, width] rows; flat: the bucket's view */
    double launched, done;  /* seconds; done 0 while in flight */
    bool arrived;           /* arrive has seen it */
    ds_tensor *down;        /* offloaded: its reduced row on its way into host memory, or NULL */
};

typedef struct {
    int n;
    int *params;
    int position;           /* first place in the trace, -1 none */
    int at;                 /* trace place of the forward running now, -1 none */
} zmodule;

struct zgather {
    int n;
    int *params;
    ds_tensor *send;
    bool loading;           /* its shards on their way into send, its all-gather not launched */
    ds_comm_work *work;
    double started;
};

struct ds_zero {
    ds_zero_config c;
    const zlayout *layout;
    int rank, world, parts;         /* parts: P */
    ds_dtype dtype;                 /* the model's */
    int n_groups, n;
    zparam *p;
    int nb;
    zbucket *b;
    ds_optim *optim;
    bool streamed;                  /* masters without optimizer (ds_zero_stream) */
    ds_zero_step_fn step_fn;        /* flat: steps instead of optim (ds_zero_set_step_fn) */
    void *step_ud;
    /* the gradient buffers the step reads (borrowed): the flat optimizer's,
     * or the master gradients */
    int n_grads;
    ds_tensor **grads;
    ds_tensor **masters, **master_grads;   /* masters mode, per group */
    /* masters mode, nothing partitioned: each group's parameters back to
     * back in the model's dtype (NULL where a parameter could not move in),
     * so the copy from the masters is one cast per group */
    ds_tensor **flat_params;
    int64_t *group_len;             /* masters mode: elements of each group's master */
    /* the armed backward */
    bool armed, in_backward;
    int next;                       /* next bucket to launch */
    int leaves_after;
    bool in_window;                 /* a reduced backward since the gradients were zeroed */
    bool fresh;                     /* flat: the gradients zeroed, no backward since */
    zflight *flights;               /* launched, not yet drained: nb at most */
    int n_flights;
    double backward_end;
    bool have_stats;
    ds_zero_stats stats;
    bool logging;
    ds_zero_comm_record *log;       /* since the last read */
    int n_log, cap_log;
    /* stage 3 */
    int n_modules;
    zmodule *modules;
    bool recording;                 /* the first forward: its module order becomes the trace */
    int *trace, trace_len;
    bool *keep_after_forward;       /* per trace place */
    int64_t live;                   /* gathered elements of partitioned parameters */
    ds_aio_file *param_file;        /* offload_param nvme: every shard, back to back */
    bool params_on_host;            /* offload_param cpu: every shard in host memory */
    zoffload *offload;              /* ZeRO-Offload's pipeline (ds_zero_offload.c), or NULL */
};

double ds_zero_now(void);
/* A collective for the comms logger, when logging is on. */
void ds_zero_log(ds_zero *z, const char *name, const ds_tensor *t, double since);
/* n elements of contiguous t from element lo, as a 1-D view. */
ds_tensor *ds_zero_elements(ds_tensor *t, int64_t lo, int64_t n);
/* Elements of shard r of q that exist (the last may be short or empty). */
int64_t ds_zero_shard_len(const zparam *q, int r);
/* dst's n elements from lo = src's n from at: a copy that may change dtype
 * and device. */
int ds_zero_copy_elements(ds_tensor *dst, int64_t lo, ds_tensor *src, int64_t at, int64_t n);
/* A multi-tensor copy (the kernels' copy_pieces): pieces added, then run
 * as one kernel. */
typedef struct {
    ds_copy_piece *p;
    int n, cap;
    ds_tensor *on;          /* the first destination: every piece's device and dtype */
} zpieces;
/* dst's n elements from lo get src's from at (src NULL: zeros); both
 * contiguous, on one device, bf16, f16 or f32. src must live until the
 * run. */
int ds_zero_piece(zpieces *c, ds_tensor *dst, int64_t lo, ds_tensor *src, int64_t at, int64_t n);
/* Where rc is 0, every piece as one kernel (accumulate: added into f32);
 * the pieces freed either way. Returns rc, else the run's. */
int ds_zero_pieces_run(zpieces *c, int rc, bool accumulate);
int ds_zero_param_index(const ds_zero *z, const ds_tensor *t);
int ds_zero_scale(ds_tensor *t, double f);
int ds_zero_scale_all(int n, ds_tensor *const *t, double f);
/* n elements of src from at, as a new 1-D tensor of dtype on dev. */
ds_tensor *ds_zero_copy_out(ds_tensor *src, int64_t at, int64_t n, ds_dtype dtype, ds_device dev);
ds_device ds_zero_param_device(const ds_zero *z);
/* The step's gradients' sum of squares and inf/nan count on every rank
 * whose gradients differ from this one's: sharded, the data-parallel
 * group's too. The one host synchronisation of a step. */
int ds_zero_grad_stats(ds_zero *z, bool sharded, double *sq, double *bad);
/* The optimizer's step on the n gradient buffers times f; written[g]:
 * group g's 16-bit parameters its pass writes too (NULL: none). */
int ds_zero_optimizer_step(ds_zero *z, const ds_optim_hparams *h, int n, ds_tensor *const *grads, double f,
                           ds_tensor *const *written);
/* Whether the optimizer's pass takes the gradients' factor. */
bool ds_zero_fused_step(const ds_zero *z);
/* The end of an accumulation window. */
int ds_zero_zero_grads(ds_zero *z);
/* 0 when z holds masters, else -1 with the error naming what needs them. */
int ds_zero_need_masters(const ds_zero *z, const char *what);

/* stage 3 (ds_zero_gather.c) */
/* c.shards against the parameters (before the layout is built); a
 * released parameter needs its shard. */
int ds_zero_check_shards(ds_zero *z);
int ds_zero_partition(ds_zero *z);
int ds_zero_gather_now(ds_zero *z, int n, const int *params);
void ds_zero_release(ds_zero *z, int i);
/* q's shard = src's shard elements from at (a step's refresh), wherever it lives. */
int ds_zero_store_shard(ds_zero *z, zparam *q, ds_tensor *src, int64_t at);
int ds_zero_finish_recording(ds_zero *z);
int ds_zero_after_backward(ds_zero *z);
void ds_zero_free_stage3(ds_zero *z);

/* ZeRO-Offload from a GPU (ds_zero_offload.c). attach: the masters and
 * their gradients into page-locked host memory, and the pipeline's copier
 * where the device copies asynchronously. fetch: a reduced row (its
 * reduction complete) starts down into new page-locked memory (*host),
 * or *host NULL without the pipeline; settle: the host waits for the
 * rows fetched. takes: whether this step can take the pipeline (else the
 * caller steps as without). step: the optimizer's step through it, the
 * updated parameters written into dst[g] on the device, each group's
 * laid out as its master (dst NULL: into the parameters, nothing being
 * partitioned). use: the copier and chunk length the pipeline takes
 * (tests: copies on the host, any device). */
int ds_zero_offload_attach(ds_zero *z, ds_optim *o);
int ds_zero_offload_fetch(ds_zero *z, ds_tensor *row, ds_tensor **host);
int ds_zero_offload_settle(ds_zero *z);
bool ds_zero_offload_takes(const ds_zero *z);
int ds_zero_offload_step(ds_zero *z, const ds_optim_hparams *h, double f, ds_tensor *const *dst);
int ds_zero_offload_use(ds_zero *z, const ds_offload_copier *c, int64_t chunk);
void ds_zero_offload_free(ds_zero *z);
/* Stage 3's shards in host memory (offload_param cpu) loaded ahead of
 * their all-gather, on the copy stream. param_loads: from a GPU, the
 * copier made if there is none yet. joins: a copier that can order the
 * device's work after its copies. load: the listed parameters' shards
 * into send, back to back, after the device's work so far. join: the
 * device's work from now on after the shards loaded so far. settle_up:
 * the host waits for them. */
int ds_zero_offload_param_loads(ds_zero *z);
bool ds_zero_offload_joins(const ds_zero *z);
int ds_zero_offload_load(ds_zero *z, ds_tensor *send, int n, const int *list);
int ds_zero_offload_join(ds_zero *z);
int ds_zero_offload_settle_up(ds_zero *z);

#endif
