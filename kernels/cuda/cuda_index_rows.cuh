/* index_add of whole rows into a float destination, without atomics: the row indices are sorted first (a stable radix sort keeps
 * each index's positions in order), then a block per run of equal indices
 * sums that run's source rows in double, in position order, and adds the
 * sum into its destination row with one rounding. The result is the same
 * on every run, and only the rows the indices name are read and written
 * (an embedding's gradient touches B*T rows of a V-row table). Plain CUDA,
 * so tests/test_index_rows.cc runs it on the CPU. */
#ifndef CUDA_INDEX_ROWS_CUH
#define CUDA_INDEX_ROWS_CUH

#include "../ds_half.h"

#define INDEX_RUNS_THREADS 128

/* Block b is sorted position r = b % m of outer slice o = b / m of dst
 * [outer, n, inner] and src [outer, m, inner] (both contiguous); keys are
 * the sorted indices (n for one out of range: skipped), pos their
 * positions in src. The block whose r starts a run adds the run's rows. */
static __global__ void index_add_runs_kernel(ds_kview dst, ds_kview src, const unsigned *keys, const unsigned *pos,
                                      int64_t m, int64_t n, int64_t inner) {
    int64_t r = blockIdx.x % m, o = blockIdx.x / m;
    int64_t key = keys[r];
    if (key >= n || (r > 0 && keys[r - 1] == keys[r])) return;
    int64_t end = r + 1;
    while (end < m && keys[end] == keys[r]) end++;
    int64_t drow = (o * n + key) * inner, sbase = o * m * inner;
    for (int64_t c = threadIdx.x; c < inner; c += blockDim.x) {
        double sum = ds_load(dst.dtype, dst.data, drow + c);
        for (int64_t j = r; j < end; j++) sum += ds_load(src.dtype, src.data, sbase + pos[j] * inner + c);
        ds_store(dst.dtype, dst.data, drow + c, sum);
    }
}

#endif
