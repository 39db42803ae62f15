/* Which kernel runs the tensor-core attention forward: on a device of
 * compute capability 9.0, in a build with an sm_90a target, the Hopper one
 * on wgmma (cuda_attention_wgmma.cuh) once it has agreed with the mma.sync
 * kernel on its first-call check; elsewhere, or with its switch off,
 * mma.sync. Plain C, so core includes it too. */
#ifndef CUDA_ATTENTION_CHOICE_H
#define CUDA_ATTENTION_CHOICE_H

#include "../ds_kview.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The Hopper kernel's switch (on by default): on 1 or 0 sets it, -1 only
 * asks. Returns the setting. */
int ds_cuda_attention_set_wgmma(int on);

/* The kernel a bf16 or f16 forward at head dim D runs on the current
 * device: "wgmma" or "mma.sync" (running the check if it has not run),
 * and *why, for mma.sync, why not wgmma ("switched off", "not compute
 * capability 9.0", "off from mma.sync on its check", ...; "" for wgmma);
 * NULL after ds_kernel_fail when CUDA fails. */
const char *ds_cuda_attention_forward_kernel(ds_dtype dt, int D, const char **why);

#ifdef __cplusplus
}
#endif

#endif
