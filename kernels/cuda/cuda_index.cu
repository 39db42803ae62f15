/* Indexing kernels on the GPU, one thread per element moved. index_add
 * into a float dtype (an embedding's gradient) sums sorted runs of equal
 * indices (cuda_index_rows.cuh): the same result on every run. The other
 * scatter-adds use atomics: f32, f64, i32 and i64 add in place (integers
 * exactly; float sums in an order that may vary run to run); the narrow
 * dtypes (bf16, f16, u8, bool) have no such atomics, so dst is widened
 * into a double scratch, summed there and rounded back once. Core's range check
 * (check_index) is read back only at the next synchronisation, so every
 * kernel here skips an index value out of range instead of reading or
 * writing past the data. */
#include "cuda_pointwise.cuh"
#include "cuda_index_rows.cuh"

#include <cub/device/device_radix_sort.cuh>
#include <limits.h>

/* ---- check_index: the first bad position, found with atomicMin ---- */

static __global__ void check_index_kernel(ds_kview idx, int64_t limit, bool skip, int64_t let, int64_t n,
                                          unsigned long long *first) {
    DS_CUDA_LOOP(i, n) {
        int64_t v = pw_index(idx, ds_cuda_offset(idx, i));
        if ((v < 0 || v >= limit) && !(skip && v == let)) atomicMin(first, (unsigned long long)i);
    }
}

/* res[0]: the first bad position (all ones, -1 as a signed value, when
 * none); res[1] its value */
static __global__ void bad_value_kernel(ds_kview idx, unsigned long long *res) {
    res[1] = res[0] != ~0ull ? (unsigned long long)pw_index(idx, ds_cuda_offset(idx, (int64_t)res[0])) : 0;
}

/* Queued, not waited for: the result lands in hit (page-locked) when the
 * stream gets there, and core reads it at the next synchronisation. */
static int cuda_check_index(ds_kview idx, int64_t limit, const int64_t *skip, ds_index_hit *hit) {
    if (idx.dtype != DS_I64 && idx.dtype != DS_I32) return ds_kernel_fail("indices must be i64 or i32");
    int64_t n = ds_kview_numel(&idx);
    if (n == 0) {
        *hit = (ds_index_hit){ -1, 0 };
        return 0;
    }
    cudaStream_t st = ds_cuda_stream();
    unsigned long long *res = (unsigned long long *)ds_cuda_scratch(2 * sizeof *res);
    if (!res) return -1;
    int rc = ds_cuda_ok(cudaMemsetAsync(res, 0xff, sizeof *res, st), "cudaMemsetAsync");
    if (rc == 0) {
        check_index_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, st>>>(idx, limit, skip != NULL,
                                                                                         skip ? *skip : 0, n, res);
        rc = ds_cuda_launched("check_index_kernel");
    }
    if (rc == 0) {
        bad_value_kernel<<<1, 1, 0, st>>>(idx, res);
        rc = ds_cuda_launched("bad_value_kernel");
    }
    static_assert(sizeof *hit == 2 * sizeof *res, "ds_index_hit is two 8-byte values");
    if (rc == 0) rc = ds_cuda_ok(cudaMemcpyAsync(hit, res, sizeof *hit, cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync");
    ds_cuda_scratch_free(res);
    return rc;
}

/* ---- moving and adding single elements ---- */

/* One element of any dtype, moved as raw bytes. */
static __device__ __forceinline__ void copy_elem(void *dst, int64_t di, const void *src, int64_t si, int es) {
    switch (es) {
    case 8: ((uint64_t *)dst)[di] = ((const uint64_t *)src)[si]; break;
    case 4: ((uint32_t *)dst)[di] = ((const uint32_t *)src)[si]; break;
    case 2: ((uint16_t *)dst)[di] = ((const uint16_t *)src)[si]; break;
    default: ((uint8_t *)dst)[di] = ((const uint8_t *)src)[si]; break;
    }
}

/* What a skipped index reads: zero in every dtype. */
static __device__ const uint64_t zero = 0;

/* The dtypes atomics add in place. */
static bool atomic_dtype(ds_dtype t) { return t == DS_F32 || t == DS_F64 || t == DS_I32 || t == DS_I64; }

/* dst[di] += src[si] for an atomic dtype, or wide[wi] += src[si] when
 * dst is narrow and wide is its double scratch. */
static __device__ __forceinline__ void add_elem(const ds_kview &dst, int64_t di, double *wide, int64_t wi,
                                                const ds_kview &src, int64_t si) {
    if (wide) {
        atomicAdd(wide + wi, ds_load(src.dtype, src.data, si));
        return;
    }
    switch (dst.dtype) {
    case DS_F32: atomicAdd((float *)dst.data + di, ((const float *)src.data)[si]); break;
    case DS_F64: atomicAdd((double *)dst.data + di, ((const double *)src.data)[si]); break;
    case DS_I32: atomicAdd((int *)dst.data + di, ((const int *)src.data)[si]); break;
    /* two's complement: the unsigned sum is the signed one */
    default: atomicAdd((unsigned long long *)dst.data + di, (unsigned long long)((const int64_t *)src.data)[si]); break;
    }
}

/* wide[i] = dst's i-th element (row-major) and back. */
static __global__ void widen_kernel(double *wide, ds_kview dst, int64_t n) {
    DS_CUDA_LOOP(i, n) wide[i] = ds_load(dst.dtype, dst.data, ds_cuda_offset(dst, i));
}

static __global__ void narrow_kernel(ds_kview dst, const double *wide, int64_t n) {
    DS_CUDA_LOOP(i, n) ds_store(dst.dtype, dst.data, ds_cuda_offset(dst, i), wide[i]);
}

/* A double copy of a narrow dst (NULL with *wide NULL for atomic dtypes). */
static int widen(ds_kview dst, double **wide) {
    *wide = NULL;
    int64_t n = ds_kview_numel(&dst);
    if (atomic_dtype(dst.dtype) || n == 0) return 0;
    *wide = (double *)ds_cuda_scratch((size_t)n * sizeof(double));
    if (!*wide) return -1;
    widen_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(*wide, dst, n);
    if (ds_cuda_launched("widen_kernel") == 0) return 0;
    ds_cuda_scratch_free(*wide);
    return -1;
}

/* Rounds the sums back into dst and frees the scratch; rc passes through. */
static int narrow(ds_kview dst, double *wide, int rc) {
    if (!wide) return rc;
    int64_t n = ds_kview_numel(&dst);
    if (rc == 0) {
        narrow_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(dst, wide, n);
        rc = ds_cuda_launched("narrow_kernel");
    }
    ds_cuda_scratch_free(wide);
    return rc;
}

/* ---- index_select and index_add over contiguous [outer, n, inner] ---- */

static __global__ void index_select_kernel(ds_kview out, ds_kview x, ds_kview idx, int64_t outer, int64_t n,
                                           int64_t inner, int64_t m) {
    int64_t is = idx.ndim ? idx.stride[0] : 0;
    int es = (int)ds_dtype_size(x.dtype);
    DS_CUDA_LOOP(e, outer * m * inner) {
        int64_t k = e % inner, r = e / inner, j = r % m, o = r / m, i = pw_index(idx, j * is);
        if (i >= 0 && i < n) copy_elem(out.data, e, x.data, (o * n + i) * inner + k, es);
        else copy_elem(out.data, e, &zero, 0, es);
    }
}

static int cuda_index_select(ds_kview out, ds_kview x, ds_kview idx, int64_t outer, int64_t n, int64_t inner) {
    int64_t m = ds_kview_numel(&idx), total = outer * m * inner;
    if (total == 0) return 0;
    index_select_kernel<<<ds_cuda_blocks(total, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        out, x, idx, outer, n, inner, m);
    return ds_cuda_launched("index_select_kernel");
}

static __global__ void index_add_kernel(ds_kview dst, double *wide, ds_kview src, ds_kview idx, int64_t outer,
                                        int64_t n, int64_t inner, int64_t m) {
    int64_t is = idx.ndim ? idx.stride[0] : 0;
    DS_CUDA_LOOP(e, outer * m * inner) {
        int64_t k = e % inner, r = e / inner, j = r % m, o = r / m, i = pw_index(idx, j * is);
        int64_t d = (o * n + i) * inner + k;
        if (i >= 0 && i < n) add_elem(dst, d, wide, d, src, e);
    }
}

/* keys[j] = idx[j] as a sort key, n when out of range (sorted last, then
 * skipped); pos[j] = j. */
static __global__ void row_keys_kernel(unsigned *keys, unsigned *pos, ds_kview idx, int64_t m, int64_t n) {
    int64_t is = idx.ndim ? idx.stride[0] : 0;
    DS_CUDA_LOOP(j, m) {
        int64_t i = pw_index(idx, j * is);
        keys[j] = (unsigned)(i >= 0 && i < n ? i : n);
        pos[j] = (unsigned)j;
    }
}

/* index_add into a float dtype by sorted runs (cuda_index_rows.cuh). */
static int index_add_sorted(ds_kview dst, ds_kview src, ds_kview idx, int64_t outer, int64_t n, int64_t inner,
                            int64_t m) {
    cudaStream_t st = ds_cuda_stream();
    int bits = 1;                                   /* keys 0..n, n the out-of-range mark */
    while (bits < 32 && ((int64_t)1 << bits) <= n) bits++;
    size_t sort_bytes = 0;
    if (ds_cuda_ok(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, (const unsigned *)nullptr, (unsigned *)nullptr,
                                                   (const unsigned *)nullptr, (unsigned *)nullptr, (int)m, 0, bits, st),
                   "index_add: cub::DeviceRadixSort")) return -1;
    size_t keys_bytes = ((size_t)m * sizeof(unsigned) + 255) / 256 * 256;
    unsigned char *scratch = (unsigned char *)ds_cuda_scratch(4 * keys_bytes + sort_bytes);
    if (!scratch) return -1;
    unsigned *keys = (unsigned *)scratch, *pos = (unsigned *)(scratch + keys_bytes);
    unsigned *sorted_keys = (unsigned *)(scratch + 2 * keys_bytes), *sorted_pos = (unsigned *)(scratch + 3 * keys_bytes);
    row_keys_kernel<<<ds_cuda_blocks(m, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, st>>>(keys, pos, idx, m, n);
    int rc = ds_cuda_launched("row_keys_kernel");
    if (rc == 0)
        rc = ds_cuda_ok(cub::DeviceRadixSort::SortPairs(scratch + 4 * keys_bytes, sort_bytes, keys, sorted_keys, pos,
                                                        sorted_pos, (int)m, 0, bits, st),
                        "index_add: cub::DeviceRadixSort");
    if (rc == 0) {
        index_add_runs_kernel<<<(unsigned)(outer * m), INDEX_RUNS_THREADS, 0, st>>>(dst, src, sorted_keys, sorted_pos,
                                                                                   m, n, inner);
        rc = ds_cuda_launched("index_add_runs_kernel");
    }
    ds_cuda_scratch_free(scratch);
    return rc;
}

static int cuda_index_add(ds_kview dst, ds_kview src, ds_kview idx, int64_t outer, int64_t n, int64_t inner) {
    int64_t m = ds_kview_numel(&idx), total = outer * m * inner;
    if (total == 0) return 0;
    /* floats (an embedding's gradient): sorted runs, deterministic and
     * touching only the named rows, wherever the sizes fit the sort's keys
     * and the grid */
    if (ds_dtype_is_float(dst.dtype) && n < UINT_MAX && outer * m <= INT_MAX)
        return index_add_sorted(dst, src, idx, outer, n, inner, m);
    double *wide;
    if (widen(dst, &wide)) return -1;
    index_add_kernel<<<ds_cuda_blocks(total, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        dst, wide, src, idx, outer, n, inner, m);
    return narrow(dst, wide, ds_cuda_launched("index_add_kernel"));
}

/* ---- gather and scatter_add along dim, any strides ---- */

/* Coordinates of the i-th (row-major) position of idx's shape. */
static __device__ __forceinline__ void coords(const ds_kview &idx, int64_t i, int64_t *c) {
    for (int d = idx.ndim - 1; d >= 0; d--) {
        c[d] = i % idx.shape[d];
        i /= idx.shape[d];
    }
}

static __device__ __forceinline__ int64_t offset_at(const ds_kview &v, const int64_t *c) {
    int64_t off = 0;
    for (int d = 0; d < v.ndim; d++) off += c[d] * v.stride[d];
    return off;
}

static __global__ void gather_kernel(ds_kview out, ds_kview x, ds_kview idx, int dim, int64_t n) {
    int es = (int)ds_dtype_size(x.dtype);
    DS_CUDA_LOOP(p, n) {
        int64_t c[DS_MAX_DIMS];
        coords(idx, p, c);
        int64_t oo = offset_at(out, c);
        c[dim] = pw_index(idx, offset_at(idx, c));
        if (c[dim] >= 0 && c[dim] < x.shape[dim]) copy_elem(out.data, oo, x.data, offset_at(x, c), es);
        else copy_elem(out.data, oo, &zero, 0, es);
    }
}

static int cuda_gather(ds_kview out, ds_kview x, ds_kview idx, int dim) {
    int64_t n = ds_kview_numel(&idx);
    if (n == 0) return 0;
    gather_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(out, x, idx, dim, n);
    return ds_cuda_launched("gather_kernel");
}

/* wide is indexed row-major in dst's shape */
static __global__ void scatter_add_kernel(ds_kview dst, double *wide, ds_kview src, ds_kview idx, int dim,
                                          int64_t n) {
    DS_CUDA_LOOP(p, n) {
        int64_t c[DS_MAX_DIMS];
        coords(idx, p, c);
        int64_t os = offset_at(src, c);
        c[dim] = pw_index(idx, offset_at(idx, c));
        if (c[dim] < 0 || c[dim] >= dst.shape[dim]) continue;
        int64_t wi = 0;
        for (int d = 0; d < dst.ndim; d++) wi = wi * dst.shape[d] + c[d];
        add_elem(dst, offset_at(dst, c), wide, wi, src, os);
    }
}

static int cuda_scatter_add(ds_kview dst, ds_kview src, ds_kview idx, int dim) {
    int64_t n = ds_kview_numel(&idx);
    if (n == 0) return 0;
    double *wide;
    if (widen(dst, &wide)) return -1;
    scatter_add_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        dst, wide, src, idx, dim, n);
    return narrow(dst, wide, ds_cuda_launched("scatter_add_kernel"));
}

extern "C" const ds_kernels_index ds_cuda_index = {
    cuda_check_index, cuda_index_select, cuda_index_add, cuda_gather, cuda_scatter_add,
};
