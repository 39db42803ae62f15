/* Which kernels run the tensor-core attention forward and backward: on a
 * device of compute capability 9.0, in a build with an sm_90a target, the
 * Hopper ones on wgmma (cuda_attention_wgmma.cuh, cuda_attention_wgmma_bwd.cuh),
 * each pass once it has agreed with the mma.sync kernels on its first-call
 * check (the kernels fed by TMA first, then those staging by cp.async);
 * elsewhere, or with their switch off, mma.sync. Plain C, so core
 * includes it too. */
#ifndef CUDA_ATTENTION_CHOICE_H
#define CUDA_ATTENTION_CHOICE_H

#include "../ds_kview.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The Hopper kernels' switch (on by default, forward and backward alike):
 * on 1 or 0 sets it, -1 only asks. Returns the setting. */
int ds_cuda_attention_set_wgmma(int on);

/* The kernel a bf16 or f16 forward (or, with backward, backward) at head
 * dim D runs on the current device: "wgmma-tma", "wgmma"
 * or "mma.sync" (running the checks that have not run), and *why, why not
 * the pass's first choice ("switched off", "not compute capability 9.0",
 * "off from mma.sync on its check", "stalled: an mbarrier wait ran out",
 * ...; "" for the first choice); NULL
 * after ds_kernel_fail when CUDA fails. */
const char *ds_cuda_attention_pass_kernel(ds_dtype dt, int D, int backward, const char **why);

#ifdef __cplusplus
}
#endif

#endif
