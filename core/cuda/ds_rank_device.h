/* The device a rank trains on (ds.device(), the engine), in both builds.
 *
 * The --device flag, else DSLUA_DEVICE ("cpu", "cuda" or "cuda:N"), else
 * the GPU LOCAL_RANK picks when this process sees one, else the CPU;
 * "cuda" alone is also the GPU LOCAL_RANK picks. CUDA_VISIBLE_DEVICES
 * applies as the CUDA runtime applies it: cuda:N is the N-th visible GPU.
 *
 * A rank that takes the GPU of its local rank first checks that this host
 * has a GPU for each of its ranks (LOCAL_SIZE): NCCL refuses two ranks on
 * one GPU, saying only "invalid usage", so the error comes here, before
 * any communicator, naming the ranks, the GPUs and the ways out.
 *
 * DSLUA_TEST_GPU_COUNT is a test hook: it replaces the number of GPUs in
 * that check, and nowhere else, so specs exercise the error on machines
 * without GPUs. */
#ifndef DS_RANK_DEVICE_H
#define DS_RANK_DEVICE_H

#include "ds_device.h"

/* flag: the --device value, or NULL. 0 with *out set, or -1 with the error
 * set naming the flag or variable at fault. The first success of the
 * process says on stderr which device the rank uses and why. */
int ds_rank_device(const char *flag, ds_device *out);

/* This rank's GPU among count visible ones, unchecked: its local rank
 * (core/tensor/ds_env.h) wrapped by count; 0 without GPUs. The default of
 * t:cuda() and ds.cuda.memory_stats(). */
int ds_rank_device_index(int count);

#endif
