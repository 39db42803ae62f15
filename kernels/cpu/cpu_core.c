/* Copies, fills and random numbers on the CPU. */
#include "cpu_kernels.h"
#include "cpu_iter.h"
#include "cpu_half.h"
#include "../ds_philox.h"

#include <math.h>
#include <string.h>

/* Rows are cut into tiles of at most CORE_TILE columns and the tiles shared
 * among threads, so a contiguous tensor (one long row once coalesced: a
 * zeroed 150 MB embedding gradient, say) still uses every thread. */
#define CORE_TILE 16384
/* Elements a half source is widened by at a time, on the stack. */
#define CORE_BLOCK 1024

static int64_t tile_count(int64_t rows, int64_t cols) { return rows * ((cols + CORE_TILE - 1) / CORE_TILE); }

/* Row r and columns [c0, c1) of tile t. */
static void tile_at(int64_t cols, int64_t t, int64_t *r, int64_t *c0, int64_t *c1) {
    int64_t per_row = (cols + CORE_TILE - 1) / CORE_TILE;
    *r = t / per_row;
    *c0 = t % per_row * CORE_TILE;
    *c1 = *c0 + CORE_TILE < cols ? *c0 + CORE_TILE : cols;
}

static bool half(ds_dtype t) { return t == DS_BF16 || t == DS_F16; }

static void copy_tile(const ds_kview *dst, const ds_kview *src, int64_t t) {
    int64_t r, c0, c1, cols = cpu_cols(dst), sd = cpu_col_stride(dst), ss = cpu_col_stride(src);
    tile_at(cols, t, &r, &c0, &c1);
    int64_t od = cpu_row_offset(dst, r) + c0 * sd, os = cpu_row_offset(src, r) + c0 * ss, w = c1 - c0;
    if (half(dst->dtype) && src->dtype == DS_F32 && sd == 1 && ss == 1) {
        cpu_f32_to_half((uint16_t *)dst->data + od, (const float *)src->data + os, w, dst->dtype);
    } else if (dst->dtype == DS_F32 && half(src->dtype) && sd == 1 && ss == 1) {
        cpu_half_to_f32((float *)dst->data + od, (const uint16_t *)src->data + os, w, src->dtype);
    } else if (dst->dtype == src->dtype && half(dst->dtype)) {    /* the bits as they are */
        uint16_t *d = (uint16_t *)dst->data + od;
        const uint16_t *s = (const uint16_t *)src->data + os;
        for (int64_t c = 0; c < w; c++) d[c * sd] = s[c * ss];
    } else if (dst->dtype == src->dtype && dst->dtype == DS_F32) {
        float *d = (float *)dst->data + od;
        const float *s = (const float *)src->data + os;
        if (sd == 1 && ss == 1) memcpy(d, s, (size_t)w * sizeof *d);
        else if (sd == 1) for (int64_t c = 0; c < w; c++) d[c] = s[c * ss];
        else for (int64_t c = 0; c < w; c++) d[c * sd] = s[c * ss];
    } else {
        for (int64_t c = 0; c < w; c++)
            ds_store(dst->dtype, dst->data, od + c * sd, ds_load(src->dtype, src->data, os + c * ss));
    }
}

static int cpu_copy(ds_kview dst, ds_kview src) {
    ds_kview *v[2] = { &dst, &src };
    cpu_coalesce(v, 2);
    int64_t n = ds_kview_numel(&dst), cols = cpu_cols(&dst), rows = n / (cols ? cols : 1);
    if (n == 0) return 0;
    int64_t sd = cpu_col_stride(&dst), ss = cpu_col_stride(&src);
    if (dst.dtype == src.dtype && rows == 1 && sd == 1 && ss == 1) {
        size_t es = ds_dtype_size(dst.dtype), nb = (size_t)n * es;
        char *d = dst.data;
        const char *s = src.data;
        /* memmove: a copy_ between overlapping slices of one storage
         * (t:narrow(1,1,n):copy_(t:narrow(1,2,n))) stays well defined */
        if (n <= CPU_PARALLEL_MIN || (d < s + nb && s < d + nb)) {
            memmove(d, s, nb);
            return 0;
        }
        size_t chunk = (size_t)CORE_TILE * es;
        int64_t chunks = (int64_t)((nb + chunk - 1) / chunk);
        #pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < chunks; i++) {
            size_t at = (size_t)i * chunk;
            memcpy(d + at, s + at, nb - at < chunk ? nb - at : chunk);
        }
        return 0;
    }
    int64_t tiles = tile_count(rows, cols);
    #pragma omp parallel for schedule(static) if (n > CPU_PARALLEL_MIN)
    for (int64_t t = 0; t < tiles; t++) copy_tile(&dst, &src, t);
    return 0;
}

static void fill_tile(const ds_kview *dst, double value, int64_t t) {
    int64_t r, c0, c1, cols = cpu_cols(dst), sd = cpu_col_stride(dst);
    tile_at(cols, t, &r, &c0, &c1);
    int64_t od = cpu_row_offset(dst, r) + c0 * sd, w = c1 - c0;
    if (dst->dtype == DS_F32) {
        float *d = (float *)dst->data + od, f = (float)value;
        if (sd == 1) for (int64_t c = 0; c < w; c++) d[c] = f;     /* unit stride: vectorised */
        else for (int64_t c = 0; c < w; c++) d[c * sd] = f;
    } else {
        for (int64_t c = 0; c < w; c++) ds_store(dst->dtype, dst->data, od + c * sd, value);
    }
}

static int cpu_fill(ds_kview dst, double value) {
    ds_kview *v[1] = { &dst };
    cpu_coalesce(v, 1);
    int64_t n = ds_kview_numel(&dst), cols = cpu_cols(&dst), rows = n / (cols ? cols : 1);
    if (n == 0) return 0;
    int64_t tiles = tile_count(rows, cols);
    #pragma omp parallel for schedule(static) if (n > CPU_PARALLEL_MIN)
    for (int64_t t = 0; t < tiles; t++) fill_tile(&dst, value, t);
    return 0;
}

/* Piece k's elements [lo, hi) added into f32, widened a block at a time. */
static void add_piece(const ds_copy_piece *pc, int64_t lo, int64_t hi) {
    float *d = (float *)pc->dst, ws[CORE_BLOCK];
    for (; lo < hi; lo += CORE_BLOCK) {
        int64_t n = hi - lo < CORE_BLOCK ? hi - lo : CORE_BLOCK;
        const float *s = ws;
        if (pc->src_dtype == DS_F32) s = (const float *)pc->src + lo;
        else cpu_half_to_f32(ws, (const uint16_t *)pc->src + lo, n, pc->src_dtype);
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) d[lo + i] += s[i];
    }
}

static ds_kview flat_view(void *data, ds_dtype t, int64_t n) {
    return (ds_kview){ .data = data, .dtype = t, .ndim = 1, .shape = { n }, .stride = { 1 } };
}

/* A loop over the pieces: copy's and fill's own paths, or the add. */
static int cpu_copy_pieces(ds_dtype dt, const ds_copy_piece *pc, int n, int accumulate) {
    if (accumulate && dt != DS_F32) return ds_kernel_fail("copy_pieces: accumulates into f32 only");
    for (int k = 0; k < n; k++) {
        ds_kview d = flat_view(pc[k].dst, dt, pc[k].n);
        if (!pc[k].src) {
            if (!accumulate) cpu_fill(d, 0);
        } else if (accumulate) {
            int64_t len = pc[k].n, tiles = (len + CORE_TILE - 1) / CORE_TILE;
            #pragma omp parallel for schedule(static) if (len > CPU_PARALLEL_MIN)
            for (int64_t t = 0; t < tiles; t++)
                add_piece(&pc[k], t * CORE_TILE, len - t * CORE_TILE < CORE_TILE ? len : (t + 1) * CORE_TILE);
        } else {
            cpu_copy(d, flat_view((void *)pc[k].src, pc[k].src_dtype, pc[k].n));
        }
    }
    return 0;
}

/* dst must be contiguous: element i is start + i * step. */
static int cpu_arange(ds_kview dst, double start, double step) {
    int64_t n = ds_kview_numel(&dst);
    for (int64_t i = 0; i < n; i++) ds_store(dst.dtype, dst.data, i, start + (double)i * step);
    return 0;
}

/* Element i takes word i%4 of Philox block offset + i/4: the same numbers
 * whatever the thread split. dst must be contiguous. */
static int cpu_uniform(ds_kview dst, uint64_t seed, uint64_t offset, double lo, double hi) {
    int64_t n = ds_kview_numel(&dst);
    #pragma omp parallel for schedule(static) if (n > CPU_PARALLEL_MIN)
    for (int64_t b = 0; b < (n + 3) / 4; b++) {
        ds_philox4 r = ds_philox_block(seed, offset + (uint64_t)b);
        for (int j = 0; j < 4 && b * 4 + j < n; j++)
            ds_store(dst.dtype, dst.data, b * 4 + j, lo + (hi - lo) * (double)ds_u32_to_unit(r.v[j]));
    }
    return 0;
}

/* Box-Muller on word pairs: block b yields elements 4b..4b+3. */
static int cpu_normal(ds_kview dst, uint64_t seed, uint64_t offset, double mean, double std) {
    int64_t n = ds_kview_numel(&dst);
    #pragma omp parallel for schedule(static) if (n > CPU_PARALLEL_MIN)
    for (int64_t b = 0; b < (n + 3) / 4; b++) {
        ds_philox4 r = ds_philox_block(seed, offset + (uint64_t)b);
        double z[4];
        for (int j = 0; j < 4; j += 2) {
            double rad = sqrt(-2.0 * log((double)ds_u32_to_unit(r.v[j])));
            double th = 6.283185307179586 * (double)ds_u32_to_unit(r.v[j + 1]);
            z[j] = rad * cos(th);
            z[j + 1] = rad * sin(th);
        }
        for (int j = 0; j < 4 && b * 4 + j < n; j++)
            ds_store(dst.dtype, dst.data, b * 4 + j, mean + std * z[j]);
    }
    return 0;
}

const ds_kernels_core ds_cpu_core = {
    cpu_copy, cpu_copy_pieces, cpu_fill, cpu_arange, cpu_uniform, cpu_normal,
};
