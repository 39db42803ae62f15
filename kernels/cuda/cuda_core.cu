/* Copies, fills and random numbers on the GPU: the CPU's semantics
 * (kernels/cpu/cpu_core.c) element for element, with the same Philox
 * counters, so random tensors are equal on both devices. */
#include "cuda_pointwise.cuh"
#include "../ds_philox.h"

/* ---- copy ---- */

/* Same dtype: elements move as raw words of their size, exact for every
 * dtype (an i64 above 2^53, a NaN payload). */
template <typename W>
static __global__ void copy_raw(ds_kview dst, ds_kview src, int64_t n, int dflat, int sflat) {
    DS_CUDA_LOOP(i, n) {
        int64_t od = dflat ? i : ds_cuda_offset(dst, i), os = sflat ? i : ds_cuda_offset(src, i);
        ((W *)dst.data)[od] = ((const W *)src.data)[os];
    }
}

/* Same dtype, strided, with rows of whole 16-byte words: each thread
 * moves one word (8 bf16, 4 f32), its offsets found once per word instead
 * of once per element (a transposed [B, T, H, D] made contiguous). */
static __global__ void copy_words(ds_kview dst, ds_kview src, int64_t words, int per) {
    size_t es = ds_dtype_size(dst.dtype);
    DS_CUDA_LOOP(w, words) {
        int64_t i = w * per;
        *(uint4 *)((char *)dst.data + ds_cuda_offset(dst, i) * es) =
            *(const uint4 *)((const char *)src.data + ds_cuda_offset(src, i) * es);
    }
}

/* Whether v's rows (its last dim, unit stride) are whole 16-byte words on
 * 16-byte boundaries, however the other dims stride. */
static bool rows_of_words(const ds_kview &v) {
    int64_t es = (int64_t)ds_dtype_size(v.dtype);
    if (v.ndim == 0 || v.stride[v.ndim - 1] != 1 || v.shape[v.ndim - 1] * es % 16 || !pw_aligned(v.data)) return false;
    for (int d = 0; d < v.ndim - 1; d++)
        if (v.stride[d] * es % 16) return false;
    return true;
}

/* Across float dtypes on the fast path: through f32, the same bits as
 * through double (f32, bf16 and f16 all convert exactly to f32). */
struct cast_f {
    __device__ float operator()(const float *a) const { return a[0]; }
};

/* Across dtypes: through double, as ds_load/ds_store do on the CPU. */
static __global__ void copy_cast(ds_kview dst, ds_kview src, int64_t n, int dflat, int sflat) {
    DS_CUDA_LOOP(i, n) {
        int64_t od = dflat ? i : ds_cuda_offset(dst, i), os = sflat ? i : ds_cuda_offset(src, i);
        ds_store(dst.dtype, dst.data, od, ds_load(src.dtype, src.data, os));
    }
}

static int launch_copy_raw(ds_kview dst, ds_kview src, int64_t n, int dflat, int sflat) {
    unsigned blocks = ds_cuda_blocks(n, DS_CUDA_THREADS);
    cudaStream_t s = ds_cuda_stream();
    switch (ds_dtype_size(dst.dtype)) {
    case 8: copy_raw<uint64_t><<<blocks, DS_CUDA_THREADS, 0, s>>>(dst, src, n, dflat, sflat); break;
    case 4: copy_raw<uint32_t><<<blocks, DS_CUDA_THREADS, 0, s>>>(dst, src, n, dflat, sflat); break;
    case 2: copy_raw<uint16_t><<<blocks, DS_CUDA_THREADS, 0, s>>>(dst, src, n, dflat, sflat); break;
    default: copy_raw<uint8_t><<<blocks, DS_CUDA_THREADS, 0, s>>>(dst, src, n, dflat, sflat); break;
    }
    return ds_cuda_launched("copy_raw");
}

/* Both flat and one dtype: a memcpy, through scratch when the two ranges
 * overlap (t:narrow(1,1,n):copy_(t:narrow(1,2,n)) is defined on the CPU). */
static int copy_bytes(void *d, const void *s, size_t nb) {
    cudaStream_t st = ds_cuda_stream();
    const char *dc = (const char *)d, *sc = (const char *)s;
    if (dc == sc) return 0;
    if (dc < sc + nb && sc < dc + nb) {
        void *tmp = ds_cuda_scratch(nb);
        if (!tmp) return -1;
        int rc = ds_cuda_ok(cudaMemcpyAsync(tmp, s, nb, cudaMemcpyDeviceToDevice, st), "cudaMemcpyAsync");
        if (rc == 0) rc = ds_cuda_ok(cudaMemcpyAsync(d, tmp, nb, cudaMemcpyDeviceToDevice, st), "cudaMemcpyAsync");
        ds_cuda_scratch_free(tmp);
        return rc;
    }
    return ds_cuda_ok(cudaMemcpyAsync(d, s, nb, cudaMemcpyDeviceToDevice, st), "cudaMemcpyAsync");
}

static int cuda_copy(ds_kview dst, ds_kview src) {
    ds_kview *v[2] = { &dst, &src };
    cpu_coalesce(v, 2);
    int64_t n = ds_kview_numel(&dst);
    if (n == 0) return 0;
    int dflat = ds_cuda_is_flat(dst), sflat = ds_cuda_is_flat(src);
    if (dst.dtype == src.dtype && dflat && sflat)
        return copy_bytes(dst.data, src.data, (size_t)n * ds_dtype_size(dst.dtype));
    if (dst.dtype == src.dtype && rows_of_words(dst) && rows_of_words(src)) {
        int per = 16 / (int)ds_dtype_size(dst.dtype);
        copy_words<<<ds_cuda_blocks(n / per, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(dst, src, n / per,
                                                                                                     per);
        return ds_cuda_launched("copy_words");
    }
    if (dst.dtype == src.dtype) return launch_copy_raw(dst, src, n, dflat, sflat);
    const ds_kview *in[1] = { &src };
    int rc;
    if (pw_fast_try<1>(cast_f{}, dst, in, n, "copy_cast fast kernel", &rc)) return rc;
    copy_cast<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(dst, src, n, dflat,
                                                                                            sflat);
    return ds_cuda_launched("copy_cast");
}

/* ---- copy_pieces ---- */

/* A launch's table, passed by value (under the 4 KB of kernel
 * parameters): each piece cut into chunks of PIECE_CHUNK elements, a block
 * a chunk, first[k] piece k's first chunk. More pieces take more launches
 * of one call. */
#define PIECES_MAX 80
#define PIECE_CHUNK 4096

struct pieces_args {
    void *dst[PIECES_MAX];
    const void *src[PIECES_MAX];
    int64_t n[PIECES_MAX];
    int64_t first[PIECES_MAX + 1];
    unsigned char src_dtype[PIECES_MAX];
    int count, dst_dtype, accumulate;
};

/* One piece's elements [lo, hi), the block's threads side by side: raw
 * words of one dtype, */
template <typename W>
static __device__ void piece_words(W *d, const W *s, int64_t lo, int64_t hi) {
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) d[i] = s[i];
}

/* or added into f32, the source's dtype chosen once (an f32 or bf16
 * gradient, the common cases, without the switch in the loop). */
static __device__ void piece_add(float *d, const void *s, ds_dtype st, int64_t lo, int64_t hi) {
    if (st == DS_F32)
        for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) d[i] += ((const float *)s)[i];
    else if (st == DS_BF16)
        for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) d[i] += ds_bf16_to_f32(((const uint16_t *)s)[i]);
    else
        for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) d[i] += (float)ds_load(st, s, i);
}

/* A block a chunk: through f32, as copy converts and a binary add rounds;
 * one dtype as raw words. */
static __global__ void copy_pieces_kernel(pieces_args a) {
    for (int64_t c = blockIdx.x; c < a.first[a.count]; c += gridDim.x) {
        int k = ds_cuda_piece_of(a.first, a.count, c);
        ds_dtype st = (ds_dtype)a.src_dtype[k], dt = (ds_dtype)a.dst_dtype;
        int64_t lo = (c - a.first[k]) * PIECE_CHUNK, hi = lo + PIECE_CHUNK < a.n[k] ? lo + PIECE_CHUNK : a.n[k];
        const void *s = a.src[k];
        void *d = a.dst[k];
        if (!s) {
            for (int64_t i = lo + threadIdx.x; i < hi && !a.accumulate; i += blockDim.x) ds_store(dt, d, i, 0.0);
        } else if (a.accumulate) {
            piece_add((float *)d, s, st, lo, hi);
        } else if (st == dt) {
            if (dt == DS_F32) piece_words((uint32_t *)d, (const uint32_t *)s, lo, hi);
            else piece_words((uint16_t *)d, (const uint16_t *)s, lo, hi);
        } else {
            for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) ds_store(dt, d, i, ds_load(st, s, i));
        }
    }
}

static int cuda_copy_pieces(ds_dtype dt, const ds_copy_piece *pc, int n, int accumulate) {
    if (accumulate && dt != DS_F32) return ds_kernel_fail("copy_pieces: accumulates into f32 only");
    for (int at = 0; at < n; at += PIECES_MAX) {
        pieces_args a;
        a.count = n - at < PIECES_MAX ? n - at : PIECES_MAX;
        a.dst_dtype = dt;
        a.accumulate = accumulate;
        a.first[0] = 0;
        for (int k = 0; k < a.count; k++) {
            const ds_copy_piece *p = &pc[at + k];
            a.dst[k] = p->dst;
            a.src[k] = p->src;
            a.n[k] = p->n;
            a.src_dtype[k] = (unsigned char)p->src_dtype;
            a.first[k + 1] = a.first[k] + (p->n + PIECE_CHUNK - 1) / PIECE_CHUNK;
        }
        if (a.first[a.count] == 0) continue;
        copy_pieces_kernel<<<ds_cuda_blocks(a.first[a.count], 1), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(a);
        if (ds_cuda_launched("copy_pieces")) return -1;
    }
    return 0;
}

/* ---- fill and arange ---- */

static __global__ void fill_kernel(ds_kview dst, int64_t n, double value, int flat) {
    DS_CUDA_LOOP(i, n) ds_store(dst.dtype, dst.data, flat ? i : ds_cuda_offset(dst, i), value);
}

static int cuda_fill(ds_kview dst, double value) {
    ds_kview *v[1] = { &dst };
    cpu_coalesce(v, 1);
    int64_t n = ds_kview_numel(&dst);
    if (n == 0) return 0;
    int flat = ds_cuda_is_flat(dst);
    if (flat && value == 0 && !signbit(value))     /* +0 is all-zero bits in every dtype */
        return ds_cuda_ok(cudaMemsetAsync(dst.data, 0, (size_t)n * ds_dtype_size(dst.dtype), ds_cuda_stream()),
                          "cudaMemsetAsync");
    fill_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(dst, n, value, flat);
    return ds_cuda_launched("fill");
}

/* Rounded multiply then add, never a fused multiply-add: the CPU's
 * start + i * step, bit for bit. */
static __global__ void arange_kernel(ds_kview dst, int64_t n, double start, double step) {
    DS_CUDA_LOOP(i, n) ds_store(dst.dtype, dst.data, i, __dadd_rn(start, __dmul_rn((double)i, step)));
}

/* dst is contiguous, as on the CPU. */
static int cuda_arange(ds_kview dst, double start, double step) {
    int64_t n = ds_kview_numel(&dst);
    if (n == 0) return 0;
    arange_kernel<<<ds_cuda_blocks(n, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(dst, n, start, step);
    return ds_cuda_launched("arange");
}

/* ---- random numbers: one thread per Philox block of four elements ---- */

static __global__ void uniform_kernel(ds_kview dst, int64_t n, uint64_t seed, uint64_t offset, double lo, double hi) {
    DS_CUDA_LOOP(b, (n + 3) / 4) {
        ds_philox4 r = ds_philox_block(seed, offset + (uint64_t)b);
        for (int j = 0; j < 4 && b * 4 + j < n; j++) {
            double u = (double)ds_u32_to_unit(r.v[j]);
            ds_store(dst.dtype, dst.data, b * 4 + j, __dadd_rn(lo, __dmul_rn(__dadd_rn(hi, -lo), u)));
        }
    }
}

/* Box-Muller on word pairs, in double as on the CPU. */
static __global__ void normal_kernel(ds_kview dst, int64_t n, uint64_t seed, uint64_t offset, double mean, double std) {
    DS_CUDA_LOOP(b, (n + 3) / 4) {
        ds_philox4 r = ds_philox_block(seed, offset + (uint64_t)b);
        double z[4];
        for (int j = 0; j < 4; j += 2) {
            double rad = sqrt(__dmul_rn(-2.0, log((double)ds_u32_to_unit(r.v[j]))));
            double th = __dmul_rn(6.283185307179586, (double)ds_u32_to_unit(r.v[j + 1]));
            z[j] = __dmul_rn(rad, cos(th));
            z[j + 1] = __dmul_rn(rad, sin(th));
        }
        for (int j = 0; j < 4 && b * 4 + j < n; j++)
            ds_store(dst.dtype, dst.data, b * 4 + j, __dadd_rn(mean, __dmul_rn(std, z[j])));
    }
}

/* dst is contiguous, as on the CPU. */
static int cuda_uniform(ds_kview dst, uint64_t seed, uint64_t offset, double lo, double hi) {
    int64_t n = ds_kview_numel(&dst);
    if (n == 0) return 0;
    uniform_kernel<<<ds_cuda_blocks((n + 3) / 4, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        dst, n, seed, offset, lo, hi);
    return ds_cuda_launched("uniform");
}

static int cuda_normal(ds_kview dst, uint64_t seed, uint64_t offset, double mean, double std) {
    int64_t n = ds_kview_numel(&dst);
    if (n == 0) return 0;
    normal_kernel<<<ds_cuda_blocks((n + 3) / 4, DS_CUDA_THREADS), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        dst, n, seed, offset, mean, std);
    return ds_cuda_launched("normal");
}

extern "C" const ds_kernels_core ds_cuda_core = {
    cuda_copy, cuda_copy_pieces, cuda_fill, cuda_arange, cuda_uniform, cuda_normal,
};
