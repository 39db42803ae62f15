/* DeepSpeed's LR schedule formulas (deepspeed/runtime/lr_schedules.py),
 * operation for operation, so values match Python's doubles bit for bit. */
#include "ds_lr.h"
#include "ds_error.h"

#include <math.h>

/* Python rounds every operation; a fused multiply-add (which -march=native
 * lets GCC contract a*b+c into) would move results by an ulp. */
#pragma GCC optimize("fp-contract=off")

static int want_nonneg(const char *name, double v) {
    if (!isfinite(v) || v < 0) {
        ds_fail(DS_ERR_ARG, "%s must be a finite number >= 0, got %g", name, v);
        return -1;
    }
    return 0;
}

static int want_finite(const char *name, double v) {
    if (!isfinite(v)) {
        ds_fail(DS_ERR_ARG, "%s must be a finite number, got %g", name, v);
        return -1;
    }
    return 0;
}

static int want_positive(const char *name, double v) {
    if (!isfinite(v) || v <= 0) {
        ds_fail(DS_ERR_ARG, "%s must be a number > 0, got %g", name, v);
        return -1;
    }
    return 0;
}

static int want_count(const char *name, double v, double least) {
    if (!isfinite(v) || v != floor(v) || v < least) {
        ds_fail(DS_ERR_ARG, "%s must be %s integer, got %g", name, least > 0 ? "a positive" : "a non-negative", v);
        return -1;
    }
    return 0;
}

static int want_ratio(const char *name, double v) {
    if (!(v >= 0 && v <= 1)) {
        ds_fail(DS_ERR_ARG, "%s must be in [0, 1], got %g", name, v);
        return -1;
    }
    return 0;
}

/* ---- LRRangeTest: min_lr * (1 + step_rate * (it + 1) / step_size), the
 * interval floored with staircase */

int ds_lr_range_test_check(const ds_lr_range_test *p) {
    if (want_nonneg("lr_range_test_min_lr", p->min_lr) ||
        want_count("lr_range_test_step_size", p->step_size, 1) ||
        want_finite("lr_range_test_step_rate", p->step_rate))
        return -1;
    return 0;
}

double ds_lr_range_test_lr(const ds_lr_range_test *p, int64_t iteration) {
    double interval = (double)(iteration + 1) / p->step_size;
    if (p->staircase) interval = floor(interval);
    return p->min_lr * (1 + p->step_rate * interval);
}

/* ---- OneCycle */

int ds_lr_one_cycle_check(const ds_lr_one_cycle *p) {
    if (want_nonneg("cycle_min_lr", p->min_lr) || want_nonneg("cycle_max_lr", p->max_lr) ||
        want_positive("cycle_first_step_size", p->first_step_size) ||
        want_nonneg("cycle_second_step_size", p->second_step_size) ||
        want_count("cycle_first_stair_count", p->first_stair_count, 0) ||
        want_count("cycle_second_stair_count", p->second_stair_count, 0) ||
        want_nonneg("decay_step_size", p->decay_step_size) ||
        want_nonneg("decay_lr_rate", p->decay_lr_rate) || want_nonneg("decay_mom_rate", p->decay_mom_rate) ||
        want_finite("cycle_min_mom", p->min_mom) || want_finite("cycle_max_mom", p->max_mom))
        return -1;
    return 0;
}

/* Python's float %, which takes the divisor's sign */
static double py_mod(double a, double b) {
    double r = fmod(a, b);
    if (r != 0 && (r < 0) != (b < 0)) r += b;
    return r;
}

/* OneCycle._get_scale_factor: where the batch after `iteration` sits in the
 * triangle, 0 at the ends and 1 at the peak; with a stair count it moves
 * in that many flat steps per half, quantised from the integer offset. */
static double one_cycle_scale(const ds_lr_one_cycle *p, int64_t iteration) {
    double total = p->first_step_size + p->second_step_size;
    double step_ratio = p->first_step_size / total;
    double batch = (double)(iteration + 1);
    double cycle = floor(1 + batch / total);
    double x = 1. + batch / total - cycle;
    double scale, stairs;
    if (x <= step_ratio) {
        scale = x / step_ratio;
        stairs = p->first_stair_count;
    } else {
        scale = (x - 1) / (step_ratio - 1);
        stairs = p->second_stair_count;
    }
    if (stairs > 0) {
        double at = py_mod(batch, total), position;
        if (at <= p->first_step_size) position = at * stairs / p->first_step_size;
        else position = (total - at) * stairs / p->second_step_size;
        scale = floor(position) / stairs;
    }
    return scale;
}

void ds_lr_one_cycle_at(const ds_lr_one_cycle *p, int64_t iteration, double *lr, double *mom) {
    double total = p->first_step_size + p->second_step_size;
    if ((double)iteration < total) {
        double scale = one_cycle_scale(p, iteration);
        *lr = p->min_lr + (p->max_lr - p->min_lr) * scale;
        *mom = p->max_mom - (p->max_mom - p->min_mom) * scale;
        return;
    }
    /* after the cycle: decay from the bounds, unless a rate or the step is 0 */
    double interval = p->decay_step_size == 0 ? 0 : ((double)iteration - total + 1) / p->decay_step_size;
    bool no_decay = p->decay_step_size == 0;
    *lr = no_decay || p->decay_lr_rate == 0 ? p->min_lr : p->min_lr / (1 + p->decay_lr_rate * interval);
    *mom = no_decay || p->decay_mom_rate == 0 ? p->max_mom : p->max_mom * (1 + p->decay_mom_rate * interval);
}

/* ---- WarmupLR and WarmupDecayLR */

static int check_warmup_type(ds_warmup_type t) {
    if (t != DS_WARMUP_LOG && t != DS_WARMUP_LINEAR) {
        ds_fail(DS_ERR_ARG, "warmup_type must be 'log' or 'linear'");
        return -1;
    }
    return 0;
}

int ds_lr_warmup_check(const ds_lr_warmup *p, bool with_decay) {
    if (want_nonneg("warmup_min_lr", p->min_lr) || want_nonneg("warmup_max_lr", p->max_lr) ||
        want_count("warmup_num_steps", p->num_steps, 1) || check_warmup_type(p->type))
        return -1;
    if (with_decay && want_count("total_num_steps", p->total_num_steps, 0)) return -1;
    return 0;
}

/* the warmup fraction at iteration < steps: log(it + 1) / log(steps) or
 * it / steps; DeepSpeed keeps steps at least 2 so that log(steps) > 0 */
static double warmup_gamma(ds_warmup_type type, double steps, int64_t iteration) {
    if (type == DS_WARMUP_LOG) {
        double inverse_log_warm_up = 1.0 / log(steps);
        return inverse_log_warm_up * log((double)(iteration + 1));
    }
    return (double)iteration / steps;
}

double ds_lr_warmup_lr(const ds_lr_warmup *p, int64_t iteration) {
    if (iteration < 0) return p->min_lr;
    double steps = fmax(2, p->num_steps);
    double gamma = (double)iteration < steps ? warmup_gamma(p->type, steps, iteration) : 1.0;
    return p->min_lr + (p->max_lr - p->min_lr) * gamma;
}

double ds_lr_warmup_decay_lr(const ds_lr_warmup *p, int64_t iteration) {
    if (iteration < 0) return p->min_lr;
    double steps = fmax(2, p->num_steps), gamma;
    if ((double)iteration < steps) gamma = warmup_gamma(p->type, steps, iteration);
    else gamma = fmax(0.0, (p->total_num_steps - (double)iteration) / fmax(1.0, p->total_num_steps - steps));
    return p->min_lr + (p->max_lr - p->min_lr) * gamma;
}

/* ---- WarmupCosineLR */

int ds_lr_warmup_cosine_check(const ds_lr_warmup_cosine *p) {
    if (want_count("total_num_steps", p->total_num_steps, 0) ||
        want_ratio("warmup_min_ratio", p->warmup_min_ratio) ||
        want_count("warmup_num_steps", p->warmup_num_steps, 1) ||
        want_ratio("cos_min_ratio", p->cos_min_ratio) || check_warmup_type(p->type))
        return -1;
    return 0;
}

double ds_lr_warmup_cosine_ratio(const ds_lr_warmup_cosine *p, int64_t iteration) {
    if (iteration < 0) return 0.0;
    double steps = fmax(2, p->warmup_num_steps);
    if ((double)iteration < steps) {
        double ratio = warmup_gamma(p->type, steps, iteration);
        return p->warmup_min_ratio + ratio * (1. - p->warmup_min_ratio);
    }
    double real_last_step = (double)iteration - steps + 1;
    double real_total_steps = fmax(1, p->total_num_steps - steps);
    /* clamped: past the end the ratio stays at cos_min_ratio */
    double progress = fmin(1.0, real_last_step / real_total_steps);
    double ratio = (1 + cos(M_PI * progress)) / 2;
    return fmax(0.0, p->cos_min_ratio + (1. - p->cos_min_ratio) * ratio);
}
