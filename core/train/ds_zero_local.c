/* Steps without a reduction under masters (the 1-bit optimizers with bf16
 * or fp16, ZeRO stage 0): this rank's own gradients into the masters'. */
#include "ds_zero_impl.h"
#include "ds_autograd.h"
#include "ds_error.h"
#include "ds_ops.h"

#include <math.h>

/* Inf/NaN elements in every master gradient, summed over the ranks. */
static int bad_everywhere(ds_zero *z, double *local, double *global) {
    ds_tensor *acc = ds_tensor_full(1, (int64_t[]){ 2 }, DS_F64, z->c.master_device, 0.0);
    int rc = acc ? 0 : -1;
    for (int g = 0; g < z->n_groups && rc == 0; g++)
        if (ds_tensor_kernels(acc)->reduce->sum_squares(ds_tensor_kview(acc), ds_tensor_kview(z->master_grads[g]))) {
            ds_fail(DS_ERR_STATE, "step engine: gradient check: %s", ds_kernel_error());
            rc = -1;
        }
    ds_tensor *host = rc == 0 ? ds_to_device(acc, DS_CPU_DEVICE) : NULL;
    ds_tensor *bad = host ? ds_tensor_full(1, (int64_t[]){ 1 }, DS_F64, DS_CPU_DEVICE, ds_tensor_get(host, 1)) : NULL;
    ds_comm_work *w = bad ? ds_comm_all_reduce(bad, DS_COMM_SUM, NULL) : NULL;
    rc = w && ds_comm_work_wait(w) == 0 ? 0 : -1;
    if (rc == 0) {
        *local = ds_tensor_get(host, 1);
        *global = ds_tensor_get(bad, 0);
    }
    ds_comm_work_release(w);
    ds_tensor_release(bad);
    ds_tensor_release(host);
    ds_tensor_release(acc);
    return rc;
}

int ds_zero_take_local_grads(ds_zero *z) {
    if (ds_zero_need_masters(z, "take_local_grads")) return -1;
    if (z->parts != 1)
        return ds_fail(DS_ERR_STATE, "step engine: local gradients are for masters of one partition (stage 0)"), -1;
    bool prev = ds_set_grad_enabled(false);
    int rc = 0;
    for (int i = 0; i < z->n && rc == 0; i++) {
        zparam *q = &z->p[i];
        ds_tensor *g = q->param->grad;
        if (!g) continue;
        ds_tensor *c = ds_contiguous(g);
        ds_tensor *flat = c ? ds_tensor_view_of(c, 1, &q->numel, (int64_t[]){ 1 }, c->offset) : NULL;
        ds_tensor *f = flat ? ds_tensor_new(1, &q->numel, DS_F32, z->c.master_device) : NULL;
        ds_tensor *seg = f ? ds_zero_elements(z->master_grads[q->group], q->offset, q->numel) : NULL;
        /* the step divides by the world size, as for a reduced sum */
        ds_tensor *w = seg ? ds_scalar_like(f, z->world) : NULL;
        rc = w && ds_copy_(f, flat) == 0 && ds_binary_(DS_BIN_MUL, f, w) == 0 && ds_add_(seg, f) == 0 ? 0 : -1;
        ds_tensor *all[] = { c, flat, f, seg, w };
        for (int k = 0; k < 5; k++) ds_tensor_release(all[k]);
        q->param->grad = NULL;
        ds_tensor_release(g);
    }
    /* the step checks this rank's gradients alone: an overflow anywhere
     * must skip the step everywhere, so a rank without one gets a NaN */
    double local = 0, global = 0;
    if (rc == 0) rc = bad_everywhere(z, &local, &global);
    if (rc == 0 && global > 0 && local == 0 && z->n_groups > 0) {
        ds_tensor *first = ds_zero_elements(z->master_grads[0], 0, 1);
        rc = first ? ds_fill_(first, NAN) : -1;
        ds_tensor_release(first);
    }
    ds_set_grad_enabled(prev);
    return rc;
}
