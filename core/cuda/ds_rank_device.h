/* The device a rank trains on (ds.device(), the engine), in both builds.
 *
 * The --device flag, else DSLUA_DEVICE ("cpu", "cuda" or "cuda:N"), else
 * the GPU LOCAL_RANK picks when this process sees one, else the CPU;
 * "cuda" alone is also the GPU LOCAL_RANK picks. CUDA_VISIBLE_DEVICES
 * applies as the CUDA runtime applies it: cuda:N is the N-th visible GPU.
 *
 * A host with more ranks (LOCAL_SIZE) than GPUs puts them on the GPUs in
 * blocks (local rank r on GPU r * gpus / ranks): the ranks of a block
 * share a GPU, and the comm layer carries their device tensors over MPI
 * (NCCL takes one GPU per rank).
 *
 * DSLUA_TEST_GPU_COUNT is a test hook: it replaces the number of GPUs in
 * ds_rank_device_shared, and nowhere else, so specs exercise the sharing
 * on machines without GPUs. */
#ifndef DS_RANK_DEVICE_H
#define DS_RANK_DEVICE_H

#include "ds_device.h"

#include <stdbool.h>

/* flag: the --device value, or NULL. 0 with *out set, or -1 with the error
 * set naming the flag or variable at fault. The first success of the
 * process says on stderr which device the rank uses and why. */
int ds_rank_device(const char *flag, ds_device *out);

/* This rank's GPU among count visible ones, unchecked: its local rank
 * (core/tensor/ds_env.h) wrapped by count; 0 without GPUs. The default of
 * t:cuda() and ds.cuda.memory_stats(). */
int ds_rank_device_index(int count);

/* Whether this host has more ranks than GPUs, so that ranks share them:
 * then *gpu is this rank's GPU and *first to *last the world ranks on it
 * (first == last: this rank alone, the blocks being uneven). */
bool ds_rank_device_shared(int *first, int *last, int *gpu);
/* This rank in the world from the launcher's variables (RANK, Open MPI's,
 * PMIx's), without starting MPI. */
int ds_rank_device_world_rank(void);

#endif
