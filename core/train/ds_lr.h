/* LR schedules as pure formulas: DeepSpeed's deepspeed/runtime/lr_schedules.py
 * (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR), one
 * parameter group's value at an iteration. `iteration` is DeepSpeed's
 * last_batch_iteration: -1 before the first scheduler step, 0 after it.
 * Parameter structs hold resolved values (defaults filled by the caller);
 * each check function returns 0, or -1 with ds_fail() naming the field. */
#ifndef DS_LR_H
#define DS_LR_H

#include <stdbool.h>
#include <stdint.h>

typedef enum { DS_WARMUP_LOG = 0, DS_WARMUP_LINEAR } ds_warmup_type;

typedef struct {
    double min_lr;              /* lr_range_test_min_lr */
    double step_size;           /* lr_range_test_step_size */
    double step_rate;           /* lr_range_test_step_rate */
    bool staircase;             /* lr_range_test_staircase */
} ds_lr_range_test;

typedef struct {
    double min_lr, max_lr;      /* cycle_min_lr, cycle_max_lr */
    double first_step_size;     /* cycle_first_step_size */
    double second_step_size;    /* cycle_second_step_size (DeepSpeed: first's when None) */
    double first_stair_count;   /* cycle_first_stair_count, 0 = continuous */
    double second_stair_count;  /* cycle_second_stair_count (DeepSpeed: first's when None) */
    double decay_step_size;     /* 0 = no decay after the cycle */
    double decay_lr_rate, decay_mom_rate;
    double min_mom, max_mom;    /* cycle_min_mom, cycle_max_mom */
} ds_lr_one_cycle;

typedef struct {
    double min_lr, max_lr;      /* warmup_min_lr, warmup_max_lr */
    double num_steps;           /* warmup_num_steps (the formula uses max(2, it)) */
    ds_warmup_type type;        /* warmup_type */
    double total_num_steps;     /* WarmupDecayLR only */
} ds_lr_warmup;

typedef struct {
    double total_num_steps;
    double warmup_min_ratio, cos_min_ratio;
    double warmup_num_steps;
    ds_warmup_type type;
} ds_lr_warmup_cosine;

int ds_lr_range_test_check(const ds_lr_range_test *p);
double ds_lr_range_test_lr(const ds_lr_range_test *p, int64_t iteration);

/* lr and (the first beta's) momentum; decay phases follow DeepSpeed: lr is
 * min_lr / (1 + rate * k / decay_step_size), momentum max_mom * (1 + ...). */
int ds_lr_one_cycle_check(const ds_lr_one_cycle *p);
void ds_lr_one_cycle_at(const ds_lr_one_cycle *p, int64_t iteration, double *lr, double *mom);

int ds_lr_warmup_check(const ds_lr_warmup *p, bool with_decay);
double ds_lr_warmup_lr(const ds_lr_warmup *p, int64_t iteration);
double ds_lr_warmup_decay_lr(const ds_lr_warmup *p, int64_t iteration);

/* the factor on each group's initial lr */
int ds_lr_warmup_cosine_check(const ds_lr_warmup_cosine *p);
double ds_lr_warmup_cosine_ratio(const ds_lr_warmup_cosine *p, int64_t iteration);

#endif
