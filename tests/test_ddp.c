/* Leaf hooks (ds_autograd_set_leaf_hook) and data-parallel gradient
 * buckets (ds_ddp) from C, without MPI: when hooks fire and with what
 * gradient, how buckets cut an optimizer's flat gradients, and that they
 * launch in order during backward. */
#include "ds_ddp.h"
#include "ds_ops.h"
#include "ds_optim.h"
#include "ds_error.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "check.h"

static ds_tensor *leaf(int n, double v, ds_dtype dt) {
    int64_t shape[1] = { n };
    ds_tensor *t = ds_tensor_full(1, shape, dt, DS_CPU_DEVICE, v);
    t->requires_grad = true;
    return t;
}

static ds_tensor *sum(ds_tensor *t) { return ds_sum(t, -1, NULL, false); }

/* a + b, releasing both */
static ds_tensor *plus(ds_tensor *a, ds_tensor *b) {
    ds_tensor *s = ds_add(a, b);
    ds_tensor_release(a);
    ds_tensor_release(b);
    return s;
}

/* ---- leaf hooks ---- */

typedef struct {
    int calls;
    double grad0;            /* the leaf's grad[0] when the hook ran */
    ds_tensor *other;        /* a leaf whose grad must not exist yet */
    bool other_had_grad;
    int fail;
} probe;

static int probe_hook(ds_tensor *t, void *ud) {
    probe *p = ud;
    p->calls++;
    p->grad0 = t->grad ? ds_tensor_get(t->grad, 0) : NAN;
    if (p->other) p->other_had_grad = p->other->grad != NULL;
    if (p->fail) ds_fail(DS_ERR_STATE, "probe says no");
    return p->fail ? -1 : 0;
}

static void test_leaf_hooks(void) {
    /* loss = sum(a * exp(exp(b))) + sum(a * a): a gets three gradient
     * contributions, and they are all in before b's chain is walked */
    ds_tensor *a = leaf(3, 0.5, DS_F64), *b = leaf(3, -1.0, DS_F64);
    probe pa = { .other = b }, pb = {0};
    check(ds_autograd_set_leaf_hook(a, probe_hook, &pa) == 0, "set hook on a");
    check(ds_autograd_set_leaf_hook(b, probe_hook, &pb) == 0, "set hook on b");
    for (int pass = 1; pass <= 2; pass++) {
        ds_tensor *e1 = ds_unary(DS_UN_EXP, b, 0), *e2 = ds_unary(DS_UN_EXP, e1, 0);
        ds_tensor *loss = plus(sum(ds_mul(a, e2)), sum(ds_mul(a, a)));
        if (pass == 1) {
            ds_tensor *m = ds_mul(a, e2);
            check(ds_autograd_set_leaf_hook(m, probe_hook, &pa) == -1 && strstr(ds_error_message(), "not a leaf"),
                  "a hook on a non-leaf is refused: %s", ds_error_message());
            ds_tensor_release(m);
        }
        ds_tensor_release(e1);
        ds_tensor_release(e2);
        check(ds_backward(loss, NULL, false) == 0, "backward: %s", ds_error_message());
        ds_tensor_release(loss);
        double ga = pass * (exp(exp(-1.0)) + 2 * 0.5);
        check(pa.calls == pass && pb.calls == pass, "pass %d: each hook ran once (a %d, b %d)", pass, pa.calls, pb.calls);
        check(fabs(pa.grad0 - ga) < 1e-12, "pass %d: a's hook saw its complete gradient %g, got %g", pass, ga,
              pa.grad0);
        check(fabs(ds_tensor_get(a->grad, 0) - ga) < 1e-12, "pass %d: a's gradient accumulates", pass);
        if (pass == 1) check(!pa.other_had_grad, "a's hook ran before b's chain was walked");
    }
    /* removal with another ud leaves the hook; with its own removes it */
    ds_autograd_set_leaf_hook(a, NULL, &pb);
    ds_tensor *loss = sum(ds_mul(a, a));
    check(ds_backward(loss, NULL, false) == 0 && pa.calls == 3, "a hook survives removal by someone else");
    ds_tensor_release(loss);
    ds_autograd_set_leaf_hook(a, NULL, &pa);
    loss = sum(ds_mul(a, a));
    check(ds_backward(loss, NULL, false) == 0 && pa.calls == 3, "a removed hook does not run");
    ds_tensor_release(loss);
    /* a root that is a leaf; a failing hook fails backward with its message */
    ds_tensor *s = leaf(1, 2.0, DS_F64);
    probe ps = { .fail = 1 };
    ds_autograd_set_leaf_hook(s, probe_hook, &ps);
    ds_error_clear();
    check(ds_backward(s, NULL, false) == -1 && ps.calls == 1 && strstr(ds_error_message(), "probe says no"),
          "a failing hook on a root leaf fails backward: %s", ds_error_message());
    ps.fail = 0;
    loss = sum(ds_mul(b, b));
    ds_tensor *sb = ds_mul_scalar(loss, 1.0);
    ds_tensor_release(loss);
    ds_autograd_set_leaf_hook(b, probe_hook, &ps);
    ps.fail = 1;
    check(ds_backward(sb, NULL, false) == -1 && strstr(ds_error_message(), "probe says no"),
          "a failing hook fails backward: %s", ds_error_message());
    ds_tensor_release(sb);
    ds_autograd_set_leaf_hook(s, NULL, &ps);
    ds_autograd_set_leaf_hook(b, NULL, &ps);
    ds_autograd_set_leaf_hook(b, NULL, &pb);
    ds_tensor_release(s);
    ds_tensor_release(a);
    ds_tensor_release(b);
}

/* ---- buckets ---- */

typedef struct {
    int n, order[8];
    int64_t numel[8];
    double first[8];         /* flat[0] at launch */
    int polls;
} launches;

static int record_launch(int b, ds_tensor *flat, void *ud) {
    launches *l = ud;
    l->order[l->n] = b;
    l->numel[l->n] = ds_tensor_numel(flat);
    l->first[l->n++] = ds_tensor_get(flat, 0);
    return 0;
}

static int count_poll(void *ud) {
    ((launches *)ud)->polls++;
    return 0;
}

/* loss = sum over used params of (k+1) * sum(p_k), as a chain from the
 * last parameter back, so backward completes p3 first and p0 last */
static ds_tensor *chain_loss(ds_tensor **p, int n, bool skip2) {
    ds_tensor *acc = NULL;
    for (int k = n - 1; k >= 0; k--) {
        if (skip2 && k == 2) continue;
        ds_tensor *m = ds_mul_scalar(p[k], k + 1);
        ds_tensor *t = sum(m);
        ds_tensor_release(m);
        acc = acc ? plus(t, acc) : t;
    }
    return acc;
}

static void test_buckets(void) {
    int sizes[4] = { 6, 4, 10, 3 };
    ds_tensor *p[4];
    for (int k = 0; k < 4; k++) p[k] = leaf(sizes[k], 1.0, DS_F32);
    ds_optim *o = ds_optim_new(DS_OPTIM_SGD);
    ds_optim_hparams h = { .lr = 0.1 };
    check(ds_optim_add_group(o, 4, p, &h) == 0, "optimizer: %s", ds_error_message());
    ds_tensor *flat = o->groups[0].flat_grads;

    /* 8 elements: {p2, p3} = 13, then {p0, p1} = 10 */
    ds_ddp *d = ds_ddp_new(4, p, 8);
    check(d && ds_ddp_n_buckets(d) == 2, "two buckets: %s", ds_error_message());
    int first, count;
    ds_ddp_bucket_params(d, 0, &first, &count);
    check(first == 2 && count == 2, "bucket 0 holds p2, p3 (first %d count %d)", first, count);
    ds_ddp_bucket_params(d, 1, &first, &count);
    check(first == 0 && count == 2, "bucket 1 holds p0, p1");
    ds_tensor *b0 = ds_ddp_bucket(d, 0), *b1 = ds_ddp_bucket(d, 1);
    check(b0->storage == flat->storage && b0->offset == flat->offset + 10 && ds_tensor_numel(b0) == 13,
          "bucket 0 is the tail of the optimizer's flat gradients");
    check(b1->storage == flat->storage && b1->offset == flat->offset && ds_tensor_numel(b1) == 10,
          "bucket 1 is its head");
    ds_tensor_release(b0);
    ds_tensor_release(b1);
    check(p[0]->grad->storage == flat->storage, "the optimizer's gradient views stay");

    /* during backward, in order, each with its complete gradient */
    launches l = {0};
    ds_ddp_counts c;
    ds_tensor *loss = chain_loss(p, 4, false);
    check(ds_ddp_arm(d, record_launch, count_poll, &l) == 0, "arm");
    check(ds_ddp_arm(d, record_launch, count_poll, &l) == -1, "arming twice is refused");
    check(ds_backward(loss, NULL, false) == 0, "backward: %s", ds_error_message());
    check(ds_ddp_flush(d, &c) == 0, "flush");
    ds_tensor_release(loss);
    check(l.n == 2 && l.order[0] == 0 && l.order[1] == 1, "both buckets launched in order (%d)", l.n);
    check(c.launched_in_backward == 2, "both during backward (%d)", c.launched_in_backward);
    check(c.leaves_after_first_launch == 2, "p0 and p1 completed after bucket 0 went (%d)", c.leaves_after_first_launch);
    check(l.first[0] == 3.0f && l.first[1] == 1.0f, "launched with complete gradients (%g, %g)", l.first[0], l.first[1]);
    check(l.polls == 4, "a poll after each gradient (%d)", l.polls);

    /* not armed: hooks do nothing; a parameter without gradient: its bucket goes after backward */
    ds_optim_zero_grad(o);
    loss = chain_loss(p, 4, false);
    l = (launches){0};
    check(ds_backward(loss, NULL, false) == 0 && l.n == 0, "no launches when not armed");
    ds_tensor_release(loss);
    ds_optim_zero_grad(o);
    loss = chain_loss(p, 4, true);
    ds_tensor_release(p[1]->grad);       /* a dropped gradient comes back as zeros in its slot */
    p[1]->grad = NULL;
    ds_tensor_set(flat, 6, 5.0);
    ds_ddp_arm(d, record_launch, NULL, &l);
    check(p[1]->grad && p[1]->grad->storage == flat->storage && ds_tensor_get(flat, 6) == 0.0,
          "arm puts a dropped gradient back as zeros in its slot");
    check(ds_backward(loss, NULL, false) == 0, "backward: %s", ds_error_message());
    check(ds_ddp_flush(d, &c) == 0 && c.launched_in_backward == 0 && l.n == 2 && l.order[0] == 0,
          "p2 unused: bucket 0 waits, and bucket 1 after it, until flush (%d during)", c.launched_in_backward);
    ds_tensor_release(loss);
    ds_ddp_free(d);

    /* bucket size 0: one parameter per bucket; parameters without gradient get a buffer */
    ds_tensor *q[3] = { leaf(2, 1.0, DS_F32), leaf(3, 1.0, DS_F32), leaf(4, 1.0, DS_F64) };
    d = ds_ddp_new(3, q, 0);
    check(d && ds_ddp_n_buckets(d) == 3, "one bucket per parameter");
    check(q[0]->grad && q[1]->grad && q[0]->grad->storage == q[1]->grad->storage &&
          q[2]->grad->storage != q[0]->grad->storage && q[2]->grad->dtype == DS_F64,
          "gradients made: one buffer per dtype run");
    ds_ddp_free(d);
    d = ds_ddp_new(2, (ds_tensor *[]){ q[0], q[0] }, 8);
    check(!d && strstr(ds_error_message(), "parameter 2 is the same tensor as parameter 1"), "duplicates refused: %s",
          ds_error_message());
    for (int k = 0; k < 3; k++) ds_tensor_release(q[k]);
    ds_optim_free(o);
    for (int k = 0; k < 4; k++) ds_tensor_release(p[k]);
}

int main(void) {
    test_leaf_hooks();
    test_buckets();
    return check_summary("test_ddp");
}
