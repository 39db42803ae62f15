/* The step engine without Lua, on one rank: buckets over an optimizer's
 * flat gradients, an SGD step with torch's clipping, and a mixed-precision
 * (bf16 parameters, fp32 masters) SGD step under a loss scale against the
 * fp32 step; the overflow skip; and ZeRO-Offload's layout (parameters on
 * a device, masters and optimizer on the CPU) on a stand-in "cuda" device
 * made of the CPU kernels, through stages 1 and 3; a parameter left out of
 * the gradient norm; what each layout answers; shards given for parameters
 * built partitioned; ZeRO-Offload's pipeline of chunks with copies that
 * happen only when waited for, alone and in the engine's step (stages
 * 1-3, the gradient rows fetched in backward), and stage 3's shards in
 * host memory loaded ahead of their all-gather. */
#include "ds_ops.h"
#include "ds_optim.h"
#include "ds_zero.h"
#include "ds_zero_impl.h"
#include "ds_cuda.h"
#include "ds_error.h"

#include <math.h>
#include <string.h>

#include "check.h"

extern const ds_kernels ds_cpu_kernels;

enum { NP = 4 };
static const int64_t SIZES[NP] = { 6, 4, 10, 3 };

static void make_params(ds_tensor **p, ds_dtype dt) {
    for (int k = 0; k < NP; k++) {
        p[k] = ds_tensor_new(1, &SIZES[k], dt, DS_CPU_DEVICE);
        for (int64_t i = 0; i < SIZES[k]; i++) ds_tensor_set(p[k], i, 0.25 * (double)(i + 1) / (k + 1));
        p[k]->requires_grad = true;
    }
}

/* sum over k of (k + 1) * scale * sum(p[k] * p[k]); gradients 2 (k + 1) scale p */
static ds_tensor *loss_of(ds_tensor **p, double scale) {
    ds_tensor *loss = NULL;
    for (int k = NP - 1; k >= 0; k--) {
        ds_tensor *sq = ds_mul(p[k], p[k]);
        ds_tensor *w = ds_mul_scalar(sq, (k + 1) * scale);
        ds_tensor *s = ds_sum(w, 0, NULL, false);
        ds_tensor *f = ds_to_dtype(s, DS_F32);
        ds_tensor *next = loss ? ds_add(loss, f) : f;
        if (loss) ds_tensor_release(f);
        ds_tensor_release(loss);
        ds_tensor_release(s);
        ds_tensor_release(w);
        ds_tensor_release(sq);
        loss = next;
    }
    return loss;
}

static ds_zero_config config(bool masters) {
    return (ds_zero_config){ .masters = masters, .comm_dtype = DS_F32, .master_device = DS_CPU_DEVICE,
                             .bucket_size = 8, .predivide = 1, .persistence_threshold = 0,
                             .prefetch_bucket_size = 1000, .max_live_parameters = 1000000, .max_reuse_distance = 0 };
}

/* A flat engine over fp32 parameters p and an SGD of h over them (*o). */
static ds_zero *flat_engine(ds_tensor **p, ds_optim **o, const ds_optim_hparams *h) {
    make_params(p, DS_F32);
    *o = ds_optim_new(DS_OPTIM_SGD);
    check(ds_optim_add_group(*o, NP, p, h) == 0, "add_group: %s", ds_error_message());
    ds_zero_config c = config(false);
    int counts[1] = { NP };
    ds_zero *z = ds_zero_new(&c, 1, counts, p, *o);
    check(z != NULL, "flat engine: %s", ds_error_message());
    return z;
}

static void test_flat_buckets_and_clip(void) {
    ds_tensor *p[NP];
    ds_optim *o;
    ds_optim_hparams h = { .lr = 0.1 };
    ds_zero *z = flat_engine(p, &o, &h);
    if (!z) return;
    /* from the last parameter back, each bucket holding at least 8 elements */
    int first, count;
    int64_t numel;
    check(ds_zero_n_buckets(z) == 2, "2 buckets, got %d", ds_zero_n_buckets(z));
    ds_zero_bucket(z, 0, &first, &count, &numel);
    check(first == 2 && count == 2 && numel == 13, "bucket 1: params 3-4, 13 elements (got %d %d %lld)", first,
          count, (long long)numel);
    ds_zero_bucket(z, 1, &first, &count, &numel);
    check(first == 0 && count == 2 && numel == 10, "bucket 2: params 1-2, 10 elements");
    double before[NP][10], sq = 0;
    for (int k = 0; k < NP; k++)
        for (int64_t i = 0; i < SIZES[k]; i++) {
            before[k][i] = ds_tensor_get(p[k], i);
            double g = 2 * (k + 1) * before[k][i];
            sq += g * g;
        }
    ds_tensor *loss = loss_of(p, 1);
    check(ds_zero_backward(z, loss, false) == 0, "backward: %s", ds_error_message());
    ds_zero_result r;
    double clip = 0.5;
    check(ds_zero_step(z, &h, 1, clip, false, &r) == 0, "step: %s", ds_error_message());
    double norm = sqrt(sq), coef = clip / (norm + 1e-6);
    check(!r.overflow && fabs(r.grad_norm - norm) < 1e-5 * norm, "norm %g, want %g", r.grad_norm, norm);
    double worst = 0;
    for (int k = 0; k < NP; k++)
        for (int64_t i = 0; i < SIZES[k]; i++) {
            double want = before[k][i] - 0.1 * coef * 2 * (k + 1) * before[k][i];
            worst = fmax(worst, fabs(ds_tensor_get(p[k], i) - want));
        }
    check(worst < 1e-6, "clipped SGD step off by %g", worst);
    ds_tensor_release(loss);
    ds_zero_free(z);
    ds_optim_free(o);
    for (int k = 0; k < NP; k++) ds_tensor_release(p[k]);
}

/* The stand-in device moves bytes with the CPU's copy kernel. */
static int fake_transfer(ds_kview dst, ds_device ddev, ds_kview src, ds_device sdev) {
    (void)ddev;
    (void)sdev;
    return ds_cpu_kernels.core->copy(dst, src);
}

static void test_offload(void) {
    /* one rank's collectives on the stand-in device go through the comm
     * layer's CUDA entry, which only a CUDA build has */
    if (!ds_cuda_built()) {
        printf("test_zero: offload skipped: a CPU-only build has no comm entry for cuda tensors\n");
        return;
    }
    ds_kernels kernels = ds_cpu_kernels;
    kernels.name = "stand-in cuda";
    ds_backend fake = { .kernels = &kernels, .allocator = &ds_cpu_allocator, .count = 1, .transfer = fake_transfer };
    ds_backend_register(DS_DEV_CUDA, &fake);
    ds_device cuda = { DS_DEV_CUDA, 0 };
    for (int stage = 1; stage <= 3; stage += 2) {
        ds_tensor *host[NP], *p[NP];
        make_params(host, DS_F32);
        for (int k = 0; k < NP; k++) {
            p[k] = ds_tensor_new(1, &SIZES[k], DS_F32, cuda);
            ds_copy_(p[k], host[k]);
            p[k]->requires_grad = true;
        }
        ds_zero_config c = config(true);
        c.stage = stage;
        int counts[1] = { NP };
        ds_zero *z = ds_zero_new(&c, 1, counts, p, NULL);
        check(z != NULL, "offload stage %d: %s", stage, ds_error_message());
        if (!z) return;
        ds_tensor *master = ds_zero_master(z, 0);
        check(ds_tensor_device(master).type == DS_DEV_CPU, "the master lives on the CPU");
        ds_optim *o = ds_optim_new(DS_OPTIM_SGD), *ref = ds_optim_new(DS_OPTIM_SGD);
        ds_optim_hparams h = { .lr = 0.05 };
        check(ds_optim_add_group(o, 1, &master, &h) == 0 && ds_zero_attach(z, o) == 0, "attach: %s",
              ds_error_message());
        for (int k = 0; k < NP; k++) host[k]->requires_grad = true;
        check(ds_optim_add_group(ref, NP, host, &h) == 0, "reference: %s", ds_error_message());
        for (int step = 0; step < 2; step++) {
            /* stage 3: the parameters come whole for the forward */
            if (stage == 3) check(ds_zero_gather_all(z) == 0, "gather: %s", ds_error_message());
            ds_tensor *loss = loss_of(p, 1), *rloss = loss_of(host, 1);
            ds_zero_result r;
            check(ds_zero_backward(z, loss, true) == 0 && ds_zero_step(z, &h, 1, 0, false, &r) == 0,
                  "offload stage %d step: %s", stage, ds_error_message());
            check(ds_backward(rloss, NULL, false) == 0 && ds_optim_step(ref, 0, &h) == 0 &&
                  ds_optim_zero_grad(ref) == 0, "reference step: %s", ds_error_message());
            ds_tensor_release(loss);
            ds_tensor_release(rloss);
        }
        if (stage == 3) check(ds_zero_gather_all(z) == 0, "gather: %s", ds_error_message());
        double worst = 0;
        for (int k = 0; k < NP; k++) {
            check(ds_tensor_device(p[k]).type == DS_DEV_CUDA, "parameters stay on the device");
            for (int64_t i = 0; i < SIZES[k]; i++)
                worst = fmax(worst, fabs(ds_tensor_get(p[k], i) - ds_tensor_get(host[k], i)));
        }
        check(worst < 1e-6, "offload stage %d differs from the plain step by %g", stage, worst);
        ds_tensor_release(master);
        ds_zero_free(z);
        ds_optim_free(o);
        ds_optim_free(ref);
        for (int k = 0; k < NP; k++) {
            ds_tensor_release(p[k]);
            ds_tensor_release(host[k]);
        }
    }
}

/* bf16 parameters, fp32 masters, SGD under a loss scale: the masters
 * follow the fp32 step on the unscaled gradients (to bf16's rounding of
 * the gradients), the parameters are the masters rounded to bf16. */
static void test_masters_step(void) {
    ds_tensor *p[NP];
    double want[NP][10];
    make_params(p, DS_BF16);
    for (int k = 0; k < NP; k++)
        for (int64_t i = 0; i < SIZES[k]; i++) want[k][i] = ds_tensor_get(p[k], i);
    ds_zero_config c = config(true);
    c.stage = 1;
    int counts[1] = { NP };
    ds_zero *z = ds_zero_new(&c, 1, counts, p, NULL);
    check(z != NULL, "masters engine: %s", ds_error_message());
    if (!z) return;
    ds_tensor *master = ds_zero_master(z, 0);
    check(ds_tensor_numel(master) == 23, "one master of 23 elements");
    ds_optim *o = ds_optim_new(DS_OPTIM_SGD);
    ds_optim_hparams h = { .lr = 0.05 };
    check(ds_optim_add_group(o, 1, &master, &h) == 0 && ds_zero_attach(z, o) == 0, "attach: %s", ds_error_message());
    double scale = 1024;
    for (int step = 0; step < 3; step++) {
        ds_tensor *loss = loss_of(p, scale);
        ds_zero_result r;
        check(ds_zero_backward(z, loss, true) == 0 && ds_zero_step(z, &h, scale, 0, true, &r) == 0 && !r.overflow,
              "masters step %d: %s", step, ds_error_message());
        ds_tensor_release(loss);
        for (int k = 0; k < NP; k++)
            for (int64_t i = 0; i < SIZES[k]; i++) want[k][i] *= 1 - 0.05 * 2 * (k + 1);
    }
    double worst = 0, rounding = 0;
    int64_t at = 0;
    for (int k = 0; k < NP; k++)
        for (int64_t i = 0; i < SIZES[k]; i++, at++) {
            double m = ds_tensor_get(master, at);
            worst = fmax(worst, fabs(m - want[k][i]) / fabs(want[k][i]));
            ds_tensor *one = ds_tensor_full(0, NULL, DS_F32, DS_CPU_DEVICE, m);
            ds_tensor *b = ds_to_dtype(one, DS_BF16);
            rounding = fmax(rounding, fabs(ds_tensor_get(b, 0) - ds_tensor_get(p[k], i)));
            ds_tensor_release(b);
            ds_tensor_release(one);
        }
    check(worst < 2e-2, "masters off the unscaled fp32 step by %g (relative)", worst);
    check(rounding == 0, "parameters are not the masters in bf16 (off by %g)", rounding);
    /* an inf gradient with the overflow check skips the step: nothing moves */
    double w0 = ds_tensor_get(p[0], 0), m0 = ds_tensor_get(master, 0);
    ds_tensor *loss = loss_of(p, INFINITY);
    ds_zero_result r;
    check(ds_zero_backward(z, loss, true) == 0 && ds_zero_step(z, &h, 1, 0, true, &r) == 0, "overflow step: %s",
          ds_error_message());
    check(r.overflow && isnan(r.grad_norm), "an inf gradient is an overflow");
    check(ds_tensor_get(p[0], 0) == w0 && ds_tensor_get(master, 0) == m0, "the skipped step moves nothing");
    ds_tensor_release(loss);
    ds_tensor_release(master);
    ds_zero_free(z);
    ds_optim_free(o);
    for (int k = 0; k < NP; k++) ds_tensor_release(p[k]);
}

static void test_errors(void) {
    ds_tensor *p[NP];
    make_params(p, DS_F32);
    ds_zero_config c = config(false);
    int counts[1] = { NP };
    check(ds_zero_new(&c, 1, counts, p, NULL) == NULL &&
              strstr(ds_error_message(), "without masters only stage 0 runs") != NULL,
          "flat mode needs its optimizer: %s", ds_error_message());
    c = config(true);
    ds_tensor *twice[2] = { p[0], p[0] };
    int two[1] = { 2 };
    check(ds_zero_new(&c, 1, two, twice, NULL) == NULL &&
              strstr(ds_error_message(), "parameter 2 is the same tensor as parameter 1") != NULL,
          "a tensor twice: %s", ds_error_message());
    c.stage = 4;
    check(ds_zero_new(&c, 1, counts, p, NULL) == NULL && strstr(ds_error_message(), "stage 4 is not 0-3") != NULL,
          "stage 4: %s", ds_error_message());
    for (int k = 0; k < NP; k++) ds_tensor_release(p[k]);
}

/* Parameters built partitioned (ds.zero.Init): released, each with its
 * shard; taken as they are at stage 3 (one rank: the shard is the whole),
 * refused by name otherwise. */
static void test_given_shards(void) {
    ds_tensor *p[NP], *shards[NP] = { NULL };
    make_params(p, DS_F32);
    shards[0] = ds_tensor_full(1, &SIZES[0], DS_F32, DS_CPU_DEVICE, 1.5);
    ds_tensor_release_data(p[0]);
    int counts[1] = { NP };
    ds_zero_config c = config(true);
    c.stage = 3;
    check(ds_zero_new(&c, 1, counts, p, NULL) == NULL &&
              strstr(ds_error_message(), "parameter 1 ([6]) has no data and no shard") != NULL,
          "a released parameter without its shard: %s", ds_error_message());
    c.shards = shards;
    c.stage = 1;
    check(ds_zero_new(&c, 1, counts, p, NULL) == NULL &&
              strstr(ds_error_message(), "which only stage 3 takes (this is stage 1)") != NULL,
          "a shard at stage 1: %s", ds_error_message());
    c.stage = 3;
    ds_tensor *short_shard = ds_tensor_full(1, &SIZES[1], DS_F32, DS_CPU_DEVICE, 0);
    shards[0] = short_shard;
    check(ds_zero_new(&c, 1, counts, p, NULL) == NULL &&
              strstr(ds_error_message(), "needs a released parameter and its contiguous f32 shard [6]") != NULL,
          "a shard of another size: %s", ds_error_message());
    shards[0] = ds_tensor_full(1, &SIZES[0], DS_F32, DS_CPU_DEVICE, 1.5);
    double next = ds_tensor_get(p[1], 0);      /* the engine releases p[1] too */
    ds_zero *z = ds_zero_new(&c, 1, counts, p, NULL);
    check(z != NULL, "engine over a given shard: %s", ds_error_message());
    if (z) {
        ds_tensor *master = ds_zero_master(z, 0);
        check(ds_tensor_get(master, 0) == 1.5 && ds_tensor_get(master, 5) == 1.5 &&
                  ds_tensor_get(master, 6) == next,
              "the master starts from the shard, then the next parameter");
        check(ds_zero_gather_all(z) == 0 && ds_tensor_get(p[0], 3) == 1.5, "gathered from the shard: %s",
              ds_error_message());
        ds_zero_release_all(z);
        ds_tensor_release(master);
        ds_zero_free(z);
    }
    ds_tensor_release(short_shard);
    ds_tensor_release(shards[0]);
    for (int k = 0; k < NP; k++) ds_tensor_release(p[k]);
}

/* A parameter left out of the norm (a pipeline's tied copy), flat and with
 * masters: the norm is the others' alone; a foreign tensor is refused. */
static void test_exclude_from_norm(void) {
    for (int masters = 0; masters <= 1; masters++) {
        ds_tensor *p[NP];
        make_params(p, DS_F32);
        ds_optim *o = ds_optim_new(DS_OPTIM_SGD);
        ds_optim_hparams h = { .lr = 0.1 };
        ds_zero_config c = config(masters);
        int counts[1] = { NP };
        ds_zero *z = masters ? ds_zero_new(&c, 1, counts, p, NULL)
                             : (ds_optim_add_group(o, NP, p, &h) == 0 ? ds_zero_new(&c, 1, counts, p, o) : NULL);
        check(z != NULL, "engine: %s", ds_error_message());
        if (!z) return;
        ds_tensor *master = masters ? ds_zero_master(z, 0) : NULL;
        if (masters) {
            check(ds_optim_add_group(o, 1, &master, &h) == 0 && ds_zero_attach(z, o) == 0, "attach: %s",
                  ds_error_message());
        }
        check(ds_zero_exclude_from_norm(z, p[1]) == 0, "exclude: %s", ds_error_message());
        ds_tensor *other = ds_tensor_new(1, &SIZES[0], DS_F32, DS_CPU_DEVICE);
        check(ds_zero_exclude_from_norm(z, other) == -1 && strstr(ds_error_message(), "not one of its parameters"),
              "a foreign tensor: %s", ds_error_message());
        double sq = 0;
        for (int k = 0; k < NP; k++)
            for (int64_t i = 0; i < SIZES[k] && k != 1; i++) {
                double g = 2 * (k + 1) * ds_tensor_get(p[k], i);
                sq += g * g;
            }
        ds_tensor *loss = loss_of(p, 1);
        check(ds_zero_backward(z, loss, masters) == 0, "backward: %s", ds_error_message());
        ds_zero_result r;
        check(ds_zero_step(z, &h, 1, 1e9, false, &r) == 0, "step: %s", ds_error_message());
        check(fabs(r.grad_norm - sqrt(sq)) < 1e-5 * sqrt(sq), "%s: norm %g without parameter 2, want %g",
              masters ? "masters" : "flat", r.grad_norm, sqrt(sq));
        ds_tensor_release(other);
        ds_tensor_release(loss);
        ds_tensor_release(master);
        ds_zero_free(z);
        ds_optim_free(o);
        for (int k = 0; k < NP; k++) ds_tensor_release(p[k]);
    }
}

/* What the layout chosen at ds_zero_new answers: when a backward reduces,
 * what holds the fp32 weights, the parts; a masters-only call on the flat
 * layout is refused by name. */
static void test_layout_answers(void) {
    ds_tensor *p[NP];
    ds_optim *o;
    ds_optim_hparams h = { .lr = 0.1 };
    ds_zero *z = flat_engine(p, &o, &h);
    if (!z) return;
    check(!ds_zero_reduces(z, true) && !ds_zero_reduces(z, false), "flat on one rank reduces nothing");
    check(ds_zero_holds(z) == DS_ZERO_HOLDS_PARAMS && ds_zero_parts(z) == 1, "flat: the optimizer's own buffers");
    check(ds_zero_master(z, 0) == NULL && strstr(ds_error_message(), "master needs fp32 masters") != NULL,
          "flat has no master: %s", ds_error_message());
    check(ds_zero_take_local_grads(z) == -1 && strstr(ds_error_message(), "take_local_grads needs fp32 masters"),
          "flat has no local gradients to take: %s", ds_error_message());
    ds_zero_free(z);
    ds_optim_free(o);
    int counts[1] = { NP };
    for (int stage = 0; stage <= 2; stage++) {
        ds_zero_config c = config(true);
        c.stage = stage;
        z = ds_zero_new(&c, 1, counts, p, NULL);
        check(z != NULL, "masters engine at stage %d: %s", stage, ds_error_message());
        if (!z) continue;
        check(ds_zero_reduces(z, true) && ds_zero_reduces(z, false) == (stage >= 2),
              "stage %d: reduces at the boundary, inside a window from stage 2", stage);
        check(ds_zero_holds(z) == DS_ZERO_HOLDS_MASTERS, "stage %d: the engine's masters", stage);
        check(ds_zero_stream(z) == 0 && ds_zero_holds(z) == DS_ZERO_HOLDS_STREAMED, "streamed: %s",
              ds_error_message());
        ds_zero_free(z);
    }
    for (int k = 0; k < NP; k++) ds_tensor_release(p[k]);
}

/* copy_pieces against copy_ and add_ on the same values, bit for bit:
 * bf16, f16 and f32 sources into f32 and bf16 (rounded as copy rounds),
 * zero pieces, and the add into f32 (as a binary add rounds). */
static void test_copy_pieces(void) {
    enum { N = 37 };
    ds_dtype src_t[3] = { DS_BF16, DS_F16, DS_F32 };
    ds_tensor *src[3], *dst32 = ds_tensor_full(1, (int64_t[]){ 3 * N + 5 }, DS_F32, DS_CPU_DEVICE, 0.5);
    ds_tensor *dst16 = ds_tensor_full(1, (int64_t[]){ 3 * N + 5 }, DS_BF16, DS_CPU_DEVICE, 7);
    ds_tensor *acc = ds_tensor_full(1, (int64_t[]){ 3 * N }, DS_F32, DS_CPU_DEVICE, 0);
    for (int k = 0; k < 3; k++) {
        src[k] = ds_tensor_new(1, (int64_t[]){ N }, src_t[k], DS_CPU_DEVICE);
        for (int64_t i = 0; i < N; i++) ds_tensor_set(src[k], i, (i % 2 ? -1 : 1) * (1.0 + i / 3.0) * pow(2.0, (double)i - 18));
    }
    for (int64_t i = 0; i < 3 * N; i++) ds_tensor_set(acc, i, 1e-3 * (double)i - 0.05);
    ds_tensor *want32 = ds_clone(dst32), *want16 = ds_clone(dst16), *want_acc = ds_clone(acc);
    zpieces c32 = { 0 }, c16 = { 0 }, ca = { 0 };
    for (int k = 0; k < 3; k++) {
        check(ds_zero_piece(&c32, dst32, k * N, src[k], 0, N) == 0 && ds_zero_piece(&c16, dst16, k * N, src[k], 0, N) == 0 &&
              ds_zero_piece(&ca, acc, k * N, src[k], 0, N) == 0, "pieces: %s", ds_error_message());
        ds_zero_copy_elements(want32, k * N, src[k], 0, N);
        ds_zero_copy_elements(want16, k * N, src[k], 0, N);
        ds_tensor *seg = ds_zero_elements(want_acc, k * N, N);
        ds_add_(seg, src[k]);
        ds_tensor_release(seg);
    }
    check(ds_zero_piece(&c32, dst32, 3 * N, NULL, 0, 5) == 0 && ds_zero_piece(&c16, dst16, 3 * N + 2, NULL, 0, 3) == 0,
          "zero pieces: %s", ds_error_message());
    for (int64_t i = 0; i < 5; i++) ds_tensor_set(want32, 3 * N + i, 0);
    for (int64_t i = 2; i < 5; i++) ds_tensor_set(want16, 3 * N + i, 0);
    uint64_t k0 = ds_kernel_calls();
    check(ds_zero_pieces_run(&c32, 0, false) == 0 && ds_zero_pieces_run(&c16, 0, false) == 0 &&
              ds_zero_pieces_run(&ca, 0, true) == 0,
          "copy_pieces: %s", ds_error_message());
    check(ds_kernel_calls() - k0 == 3, "one kernel a run, not one a piece (%llu for 3 runs)",
          (unsigned long long)(ds_kernel_calls() - k0));
    ds_tensor *got[3] = { dst32, dst16, acc }, *want[3] = { want32, want16, want_acc };
    for (int t = 0; t < 3; t++)
        check(memcmp(ds_tensor_data(got[t]), ds_tensor_data(want[t]),
                     (size_t)ds_tensor_numel(got[t]) * ds_dtype_size(got[t]->dtype)) == 0,
              "copy_pieces %d differs from copy_ / add_", t);
    check(ds_zero_piece(&ca, dst16, 0, src[0], 0, 4) == 0 && ds_zero_pieces_run(&ca, 0, true) == -1 &&
              strstr(ds_error_message(), "accumulates into f32") != NULL,
          "an add into bf16 is refused: %s", ds_error_message());
    check(ds_zero_piece(&ca, acc, 3 * N - 2, src[0], 0, 4) == -1 && strstr(ds_error_message(), "does not fit") != NULL,
          "a piece past its tensor's end is refused: %s", ds_error_message());
    for (int k = 0; k < 3; k++) ds_tensor_release(src[k]);
    ds_tensor *all[] = { dst32, dst16, acc, want32, want16, want_acc };
    for (int k = 0; k < 6; k++) ds_tensor_release(all[k]);
}

/* Copies as a GPU's streams make them: queued, done only when a wait
 * reaches the mark after them, each step written to log. */
enum { Q_MAX = 64 };
typedef struct {
    struct { void *dst; const void *src; size_t nb; } q[2][Q_MAX];
    int queued[2], done[2], marks[2][2];
    char log[1024];
} deferred;

static void note(deferred *d, const char *fmt, int a, int b) {
    size_t at = strlen(d->log);
    snprintf(d->log + at, sizeof d->log - at, fmt, a, b);
}

static int d_start(void *ud) {
    note(ud, "start", 0, 0);
    return 0;
}

static int d_copy(void *ud, int up, void *dst, const void *src, size_t nb) {
    deferred *d = ud;
    if (d->queued[up] == Q_MAX) return -1;
    d->q[up][d->queued[up]++] = (typeof(d->q[0][0])){ dst, src, nb };
    note(d, " %c%d", up ? 'U' : 'D', d->queued[up] - 1);
    return 0;
}

static int d_mark(void *ud, int up, int slot) {
    deferred *d = ud;
    d->marks[up][slot] = d->queued[up];
    return 0;
}

static int d_wait(void *ud, int up, int slot) {
    deferred *d = ud;
    for (; d->done[up] < d->marks[up][slot]; d->done[up]++)
        memcpy(d->q[up][d->done[up]].dst, d->q[up][d->done[up]].src, d->q[up][d->done[up]].nb);
    note(d, " w%c%d", up ? 'U' : 'D', slot);
    return 0;
}

/* The host stands for the device: what it queues after a join comes
 * after every copy before it. */
static int d_join(void *ud, int up) {
    deferred *d = ud;
    for (; d->done[up] < d->queued[up]; d->done[up]++)
        memcpy(d->q[up][d->done[up]].dst, d->q[up][d->done[up]].src, d->q[up][d->done[up]].nb);
    note(d, " j%c", up ? 'U' : 'D', 0);
    return 0;
}

typedef struct {
    deferred *d;
    float *grads, *params;
    int fail_at;                    /* the chunk whose step fails, -1 none */
} pipe_case;

/* params = 2 grads + 1 over the chunk, from the host gradients as they are now */
static int p_step(void *ud, int64_t lo, int64_t n) {
    pipe_case *c = ud;
    note(c->d, " S%d", (int)lo, 0);
    if (c->fail_at >= 0 && lo >= c->fail_at) return -1;
    for (int64_t i = lo; i < lo + n; i++) c->params[i] = 2 * c->grads[i] + 1;
    return 0;
}

/* 10 elements in chunks of 4: chunk i+1's gradients go down before chunk i
 * steps, which waits for its own; each chunk's parameters go up after its
 * step; every copy has happened on return; a failed step stops the steps
 * after it and still waits for the copies started. */
static void test_offload_pipeline(void) {
    float dev_grads[10], host_grads[10] = { 0 }, host_params[10] = { 0 }, dev_params[10] = { 0 };
    for (int i = 0; i < 10; i++) dev_grads[i] = (float)i;
    deferred d = { 0 };
    pipe_case pc = { &d, host_grads, host_params, -1 };
    ds_offload_copier c = { d_start, d_copy, d_mark, d_wait, &d, NULL, NULL };
    ds_offload_plan p = { .n = 10, .chunk = 4, .grad_src = (const char *)dev_grads, .grad_dst = (char *)host_grads,
                          .grad_size = 4, .param_src = (const char *)host_params, .param_dst = (char *)dev_params,
                          .param_size = 4, .step = p_step, .ud = &pc };
    check(ds_offload_run(&c, &p) == 0, "pipeline: %s", ds_error_message());
    const char *order = "start D0 D1 wD0 S0 U0 D2 wD1 S4 U1 wD0 S8 U2 wD0 wU0";
    check(strcmp(d.log, order) == 0, "pipeline order: %s", d.log);
    for (int i = 0; i < 10; i++)
        check(dev_params[i] == 2 * i + 1, "pipeline: parameter %d is %g, not %d", i, dev_params[i], 2 * i + 1);
    check(d.done[0] == 3 && d.done[1] == 3, "every copy done on return");
    /* gradients on the host already: no copies down, no waits for them */
    deferred d2 = { 0 };
    pc.d = &d2;
    c.ud = &d2;
    p.grad_src = NULL;
    check(ds_offload_run(&c, &p) == 0 && strcmp(d2.log, "start S0 U0 S4 U1 S8 U2 wU0") == 0, "host gradients: %s",
          d2.log);
    deferred d3 = { 0 };
    pc.d = &d3;
    pc.fail_at = 4;
    c.ud = &d3;
    p.grad_src = (const char *)dev_grads;
    check(ds_offload_run(&c, &p) != 0 && strcmp(d3.log, "start D0 D1 wD0 S0 U0 D2 wD1 S4 wD0 wU0") == 0 &&
          d3.done[0] == d3.queued[0] && d3.done[1] == d3.queued[1], "a failed step: %s", d3.log);
}

/* An engine with masters at stage over p, its master (*master, a new
 * reference) and AdamW over it (*o, h) attached; a failure is reported,
 * naming what and e. */
static ds_zero *offload_engine(ds_tensor **p, int stage, const ds_optim_hparams *h, ds_optim **o, ds_tensor **master,
                               const char *what, int e) {
    ds_zero_config cfg = config(true);
    cfg.stage = stage;
    int counts[1] = { NP };
    ds_zero *z = ds_zero_new(&cfg, 1, counts, p, NULL);
    *master = z ? ds_zero_master(z, 0) : NULL;
    *o = ds_optim_new(DS_OPTIM_ADAMW);
    check(*master && ds_optim_add_group(*o, 1, master, h) == 0 && ds_zero_attach(z, *o) == 0, "%s %d: %s", what, e,
          ds_error_message());
    return z;
}

/* The two engines of a comparison, their optimizers, masters and parameters. */
static void free_engines(ds_zero **z, ds_optim **o, ds_tensor **master, ds_tensor *(*p)[NP]) {
    for (int e = 0; e < 2; e++) {
        ds_tensor_release(master[e]);
        ds_zero_free(z[e]);
        ds_optim_free(o[e]);
        for (int i = 0; i < NP; i++) ds_tensor_release(p[e][i]);
    }
}

/* One optimizer step of engine z over gas micro steps (loss scale 8,
 * clipping 1), stage 3 gathering for each forward; d: the copier of an
 * offloaded engine (NULL: none), whose gradient rows must each have
 * started down in the backward that reduced them, not before the step. */
static void offload_train_step(ds_zero *z, ds_tensor **p, int stage, int gas, deferred *d, const char *what) {
    const ds_optim_hparams h = { .lr = 0.01, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1,
                                 .bias_correction = true };
    if (d) *d = (deferred){ 0 };
    int rows = 0;
    for (int m = 0; m < gas; m++) {
        bool reduce = ds_zero_reduces(z, m == gas - 1);
        if (stage == 3) check(ds_zero_gather_all(z) == 0, "%s: gather: %s", what, ds_error_message());
        ds_tensor *loss = loss_of(p, 8);
        check(ds_zero_backward(z, loss, reduce) == 0, "%s backward %d: %s", what, m, ds_error_message());
        ds_tensor_release(loss);
        rows += reduce ? ds_zero_n_buckets(z) : 0;
        if (d)
            check(d->queued[0] == rows && d->done[0] == rows - (reduce ? ds_zero_n_buckets(z) : 0),
                  "%s micro step %d: %d rows started down in backward, %d done (want %d, %d): %s", what, m,
                  d->queued[0], d->done[0], rows, rows - ds_zero_n_buckets(z), d->log);
    }
    ds_zero_result r;
    check(ds_zero_step(z, &h, 8, 1.0, false, &r) == 0, "%s step: %s", what, ds_error_message());
    if (d) check(d->done[0] == rows && d->done[1] == 5, "%s: %d rows came down, 23 elements went up in %d chunks",
                 what, d->done[0], d->done[1]);
}

/* The engine's offload step through the pipeline (deferred copies, chunks
 * of 5 across the parameters' boundaries) writes the same bits as the
 * plain step, AdamW with a gradient factor and clipping, f32 and bf16
 * parameters, stages 1-3 (stage 3 through its shards' refresh), one and
 * three micro steps; each reduced row starts down in its backward. */
static void test_offload_engine(void) {
    const ds_dtype dts[2] = { DS_F32, DS_BF16 };
    const ds_optim_hparams h = { .lr = 0.01, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1,
                                 .bias_correction = true };
    for (int k = 0; k < 2; k++)
        for (int stage = 1; stage <= 3; stage++)
            for (int gas = 1; gas <= 3; gas += 2) {
                ds_tensor *p[2][NP], *master[2];
                ds_zero *z[2];
                ds_optim *o[2];
                deferred d = { 0 };
                ds_offload_copier c = { d_start, d_copy, d_mark, d_wait, &d, NULL, NULL };
                char what[64];
                snprintf(what, sizeof what, "offload %s stage %d gas %d", ds_dtype_name(dts[k]), stage, gas);
                for (int e = 0; e < 2; e++) {
                    make_params(p[e], dts[k]);
                    z[e] = offload_engine(p[e], stage, &h, &o[e], &master[e], what, e);
                }
                check(ds_zero_offload_use(z[1], &c, 5) == 0, "offload use: %s", ds_error_message());
                for (int step = 0; step < 3; step++) {
                    offload_train_step(z[0], p[0], stage, gas, NULL, what);
                    offload_train_step(z[1], p[1], stage, gas, &d, what);
                }
                for (int e = 0; e < 2 && stage == 3; e++)
                    check(ds_zero_gather_all(z[e]) == 0, "%s: gather: %s", what, ds_error_message());
                size_t es = ds_dtype_size(dts[k]);
                for (int i = 0; i < NP; i++)
                    check(memcmp(ds_tensor_data(p[0][i]), ds_tensor_data(p[1][i]), (size_t)SIZES[i] * es) == 0,
                          "%s parameter %d: the pipeline's bits", what, i);
                check(memcmp(ds_tensor_data(master[0]), ds_tensor_data(master[1]), 23 * 4) == 0,
                      "%s masters: the same bits", what);
                free_engines(z, o, master, p);
            }
}

/* Stage 3 with its shards in host memory (offload_param cpu): a
 * prefetch's shards go up on the copy stream (deferred copies with a
 * join) and their all-gather waits for the next prefetch or the gather
 * that needs them, after one join; training is bit for bit as without
 * the copier. Each parameter its own module; the first forward records
 * the order, the later ones prefetch along it. */
static void test_offload_param_loads(void) {
    const ds_optim_hparams h = { .lr = 0.01, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1,
                                 .bias_correction = true };
    ds_tensor *p[2][NP], *master[2];
    ds_zero *z[2];
    ds_optim *o[2];
    deferred d = { 0 };
    ds_offload_copier c = { d_start, d_copy, d_mark, d_wait, &d, NULL, d_join };
    for (int e = 0; e < 2; e++) {
        make_params(p[e], DS_BF16);
        z[e] = offload_engine(p[e], 3, &h, &o[e], &master[e], "param loads", e);
        check(ds_zero_offload_params(z[e], NULL) == 0, "offload_params: %s", ds_error_message());
        for (int i = 0; i < NP; i++) check(ds_zero_add_module(z[e], 1, &i) == i, "module %d", i);
    }
    check(ds_zero_offload_use(z[1], &c, 5) == 0, "offload use: %s", ds_error_message());
    for (int step = 0; step < 3; step++)
        for (int e = 0; e < 2; e++) {
            d = (deferred){ 0 };
            for (int m = 0; m < NP; m++) {
                check(ds_zero_pre_forward(z[e], m) == 0, "step %d pre_forward %d: %s", step, m, ds_error_message());
                /* from the second forward: modules 2-4's shards on their way at module 1, made at module 2 */
                if (e == 1 && step > 0 && m < 2)
                    check(d.queued[1] == NP - 1 && d.done[1] == (m == 0 ? 0 : NP - 1),
                          "step %d module %d: %d shards loading, %d made: %s", step, m, d.queued[1], d.done[1], d.log);
            }
            ds_tensor *loss = loss_of(p[e], 8);
            ds_zero_result r;
            check(ds_zero_backward(z[e], loss, true) == 0 && ds_zero_step(z[e], &h, 8, 1.0, false, &r) == 0,
                  "param loads %d step %d: %s", e, step, ds_error_message());
            ds_tensor_release(loss);
        }
    int64_t chunks, rows, shards;
    check(ds_zero_offload_counts(z[1], &chunks, &rows, &shards) && shards == 2 * (NP - 1),
          "two forwards loaded 3 shards ahead each (%lld)", (long long)shards);
    for (int e = 0; e < 2; e++) check(ds_zero_gather_all(z[e]) == 0, "gather: %s", ds_error_message());
    for (int i = 0; i < NP; i++)
        check(memcmp(ds_tensor_data(p[0][i]), ds_tensor_data(p[1][i]), (size_t)SIZES[i] * 2) == 0,
              "param loads: parameter %d's bits", i);
    free_engines(z, o, master, p);
}

/* On a GPU (a CUDA build on a machine with one): the engine's offloaded
 * AdamW step through ds_cuda_copier's streams, into page-locked host
 * memory, equal to the same engine on the CPU (the optimizer runs on the
 * host in both), f32 and bf16 parameters, stage 2 over three micro steps
 * (rows fetched in each backward) and stage 3 (the shards refreshed from
 * the device buffer the pipeline fills). Runs before test_offload, which
 * puts a stand-in in the CUDA backend's place. */
static void test_offload_gpu(void) {
    if (ds_cuda_device_count() == 0) {
        printf("test_zero: offload on a GPU skipped: %s\n", ds_cuda_unavailable_reason());
        return;
    }
    const ds_dtype dts[2] = { DS_F32, DS_BF16 };
    ds_device where[2] = { DS_CPU_DEVICE, { DS_DEV_CUDA, 0 } };
    ds_optim_hparams h = { .lr = 0.01, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1,
                           .bias_correction = true };
    for (int k = 0; k < 2; k++)
        for (int stage = 2; stage <= 3; stage++) {
            ds_tensor *p[2][NP], *master[2];
            ds_zero *z[2];
            ds_optim *o[2];
            char what[64];
            snprintf(what, sizeof what, "gpu offload %s stage %d", ds_dtype_name(dts[k]), stage);
            for (int e = 0; e < 2; e++) {
                ds_tensor *host[NP];
                make_params(host, dts[k]);
                for (int i = 0; i < NP; i++) {
                    p[e][i] = ds_to_device(host[i], where[e]);
                    p[e][i]->requires_grad = true;
                    ds_tensor_release(host[i]);
                }
                z[e] = offload_engine(p[e], stage, &h, &o[e], &master[e], what, e);
            }
            ds_cuda_mem_info info;
            check(ds_cuda_memory_info(0, &info) == 0 && info.pinned >= 2 * 23 * 4,
                  "the masters are page-locked (%lld bytes)", (long long)info.pinned);
            for (int step = 0; step < 3; step++)
                for (int e = 0; e < 2; e++) offload_train_step(z[e], p[e], stage, stage == 2 ? 3 : 1, NULL, what);
            int64_t chunks = 0, rows = 0, shards = 0;
            check(ds_zero_offload_counts(z[1], &chunks, &rows, &shards) && chunks == 3 && rows == (stage == 2 ? 18 : 6),
                  "%s: 3 steps of 1 chunk took the pipeline (%lld), their rows came through it (%lld)", what,
                  (long long)chunks, (long long)rows);
            for (int e = 0; e < 2 && stage == 3; e++)
                check(ds_zero_gather_all(z[e]) == 0, "%s: gather: %s", what, ds_error_message());
            /* f32: the same sums; bf16: the GPU's 16-bit gradients may round
             * apart by a step of bf16 (2^-8 relative), a step of AdamW moves
             * each parameter by about lr */
            double worst = 0, tol = k == 0 ? 1e-6 : 1.0 / 128;
            for (int i = 0; i < NP; i++) {
                ds_tensor *back = ds_to_device(p[1][i], DS_CPU_DEVICE);
                for (int64_t j = 0; back && j < SIZES[i]; j++) {
                    double want = ds_tensor_get(p[0][i], j), d = fabs(ds_tensor_get(back, j) - want);
                    worst = fmax(worst, k == 0 ? d : d / fabs(want));
                }
                ds_tensor_release(back);
            }
            check(worst < tol, "%s: the GPU's offloaded step is off the CPU's by %g", what, worst);
            free_engines(z, o, master, p);
        }
}

int main(void) {
    test_layout_answers();
    test_copy_pieces();
    test_flat_buckets_and_clip();
    test_exclude_from_norm();
    test_masters_step();
    test_errors();
    test_given_shards();
    test_offload_gpu();
    test_offload();
    test_offload_pipeline();
    test_offload_engine();
    test_offload_param_loads();
    return check_summary("test_zero");
}
