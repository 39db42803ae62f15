/* Inside the step engine (ds_zero.c: layout, backward, step;
 * ds_zero_gather.c: stage 3's gathers and releases). */
#ifndef DS_ZERO_IMPL_H
#define DS_ZERO_IMPL_H

#include "ds_zero.h"
#include "ds_aio.h"
#include "ds_comm.h"

typedef struct zgather zgather;

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

typedef struct {
    int first, count;       /* parameters first .. first + count - 1 */
    int group;
    int64_t offset, width;  /* in the group's master (shards) or flat gradients (elements) */
    int64_t numel;
    int pending;            /* gradients not complete in the armed backward */
} zbucket;

typedef struct {
    int bucket;
    ds_comm_work *work;
    ds_tensor *buf;         /* masters: [P, width] rows; flat: the bucket's view */
    double launched, done;  /* seconds; done 0 while in flight */
} zflight;

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
    ds_comm_work *work;
    double started;
};

struct ds_zero {
    ds_zero_config c;
    int rank, world, parts;         /* parts: P */
    ds_dtype dtype;                 /* the model's */
    int n_groups, n;
    zparam *p;
    int nb;
    zbucket *b;
    ds_optim *optim;
    ds_zero_step_fn step_fn;        /* flat: steps instead of optim (ds_zero_set_step_fn) */
    void *step_ud;
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
int ds_zero_param_index(const ds_zero *z, const ds_tensor *t);

/* stage 3 (ds_zero_gather.c) */
int ds_zero_partition(ds_zero *z);
int ds_zero_gather_now(ds_zero *z, int n, const int *params);
void ds_zero_release(ds_zero *z, int i);
/* q's shard = src's shard elements from at (a step's refresh), wherever it lives. */
int ds_zero_store_shard(ds_zero *z, zparam *q, ds_tensor *src, int64_t at);
int ds_zero_finish_recording(ds_zero *z);
int ds_zero_after_backward(ds_zero *z);
void ds_zero_free_stage3(ds_zero *z);

#endif
