/* The CUDA runtime as the rest of core sees it. Both builds provide these:
 * core/ds_cuda*.c with CUDA, core/ds_nocuda.c without (every device count
 * is then 0 and the reason is "CUDA not built"). The runtime starts on the
 * first call that needs it and registers the CUDA kernel, allocator, copy
 * and NCCL backends when it finds a device. */
#ifndef DS_CUDA_H
#define DS_CUDA_H

#include "ds_device.h"
#include "ds_kview.h"

#include <stdio.h>

/* 1 in a build with CUDA (whether or not a GPU is there), else 0. */
int ds_cuda_built(void);
/* Devices present; 0 without a CUDA build, a driver or a GPU. */
int ds_cuda_device_count(void);
/* Why the count is 0 ("CUDA not built", the runtime's message), or "". */
const char *ds_cuda_unavailable_reason(void);
/* The GPU's name ("NVIDIA H100 80GB HBM3") into buf: 0, or -1 when
 * cuda:index does not exist. */
int ds_cuda_device_name(int index, char *buf, size_t n);
/* 0 when cuda:index exists, else -1 with the error
 * "<op>: no CUDA device available (<reason>)" or naming the count. */
int ds_cuda_check_device(const char *op, int index);
/* Waits for the queued work of every device; 0, or -1 with the error set,
 * also when a device found a fault in a check (core/tensor/ds_fault.h). */
int ds_cuda_synchronize(void);

typedef struct {
    int64_t allocated;     /* bytes in live blocks (size classes, tensors and scratch) */
    int64_t peak;          /* the most `allocated` has been since start or the last reset */
    int64_t cached;        /* bytes in freed blocks kept for reuse */
    int64_t device_allocs; /* cudaMalloc calls so far */
    int64_t cache_hits;    /* allocations served from the cache */
    int64_t pinned;        /* page-locked host bytes, live and cached (every device's) */
    int64_t pinned_allocs; /* cudaHostAlloc calls so far */
} ds_cuda_mem_info;

/* The caching allocator of cuda:index; 0 or -1 with the error set. */
int ds_cuda_memory_info(int index, ds_cuda_mem_info *out);
/* Starts cuda:index's peak again from what is allocated now. */
int ds_cuda_reset_peak(int index);
/* Returns every cached block of every device to the driver. */
void ds_cuda_empty_cache(void);

/* Copies beside the compute stream, for ZeRO-Offload's step
 * (core/train/ds_zero_offload.c): device to host on a stream of its own,
 * host to device on the device's copy stream, so the two directions and
 * the host's work all run at once. Host memory should be page-locked
 * (ds_tensor_new_staging), or the driver copies it again in the calling
 * thread. start: both streams wait for the work queued on cuda:index's
 * compute stream so far. mark: an event after the copies started so far
 * in one direction (up: host to device), in slot 0 or 1; wait: the host
 * waits for it; join: the compute stream waits for the copies started so
 * far in one direction (the host does not). Each returns 0, or -1 with
 * the error set. */
typedef struct ds_cuda_copier ds_cuda_copier;
ds_cuda_copier *ds_cuda_copier_new(int index);
void ds_cuda_copier_free(ds_cuda_copier *c);
int ds_cuda_copier_start(ds_cuda_copier *c);
int ds_cuda_copier_copy(ds_cuda_copier *c, int up, void *dst, const void *src, size_t nb);
int ds_cuda_copier_mark(ds_cuda_copier *c, int up, int slot);
int ds_cuda_copier_wait(ds_cuda_copier *c, int up, int slot);
int ds_cuda_copier_join(ds_cuda_copier *c, int up);

/* f32 matmuls (conv: convolutions) on the GPU may round inputs to TF32
 * (off by default): on 1 or 0 sets it, -1 only asks. Returns the setting.
 * Accepted without a GPU, where it changes nothing. */
int ds_cuda_allow_tf32(bool conv, int on);

/* bf16 and f16 attention forwards and backwards may run on Hopper's wgmma
 * kernels, the TMA forward among them (on by default; each pass runs
 * there on a device of compute capability 9.0 once it has agreed with the
 * mma.sync kernels on its first-call check): on 1 or 0 sets it, -1 only
 * asks. Returns the setting. Accepted without a GPU. */
int ds_cuda_allow_wgmma(int on);

/* The kernel a `dt` attention forward (or backward) at head dim D runs on
 * tensor cores on this rank's GPU: "wgmma-tma" (the kernels fed by TMA),
 * "wgmma" or "mma.sync" (running the checks that have not run), with *why
 * saying why not the pass's first choice, its kernels fed by TMA ("" when
 * it is); NULL with the error set for a dtype other than
 * bf16 and f16, a head dim other than 64 and 128, no GPU or a failing one. */
const char *ds_cuda_attention_kernel(ds_dtype dt, int D, bool backward, const char **why);

/* `dslua --report`: CUDA runtime and driver, cuBLAS, cuDNN and NCCL
 * versions and the GPUs, one "name: value" line each. */
void ds_cuda_report(FILE *f);

#endif
