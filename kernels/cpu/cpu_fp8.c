/* FP8 casts on the CPU (ds_fp8.h's conversions). No GEMM of its own: the
 * op uncasts the operands and runs the f32 GEMM, whose products of fp8
 * values are exact, so only the order of the sums differs from a GPU's. */
#include "cpu_kernels.h"
#include "cpu_iter.h"
#include "../ds_fp8.h"

#include <math.h>

static float meta_at(ds_kview m, int k) { return ((const float *)m.data)[k * m.stride[0]]; }
static void meta_set(ds_kview m, int k, float v) { ((float *)m.data)[k * m.stride[0]] = v; }

static float abs_max(ds_kview x, int64_t n) {
    float amax = 0.0f;
    #pragma omp parallel for reduction(max:amax) schedule(static) if (n > CPU_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf((float)ds_load(x.dtype, x.data, i)));
    return amax;
}

/* The scale x casts with: meta's, or under current scaling one made from
 * max |x| (or the given amax) and written into meta; meta's amax takes
 * max |x| in either case. */
static float cast_scale(ds_kview x, int64_t n, ds_kview meta, int fmt, int current, int margin, ds_kview given) {
    float amax = abs_max(x, n);
    if (current) {
        if (given.data) amax = *(const float *)given.data;
        float s = ds_fp8_scale(amax, fmt, margin, 1.0f);
        meta_set(meta, 0, s);
        meta_set(meta, 1, 1.0f / s);
    }
    meta_set(meta, 2, fmaxf(meta_at(meta, 2), amax));
    return meta_at(meta, 0);
}

static int cpu_fp8_cast(ds_kview q, ds_kview x, ds_kview meta, int fmt, int current, int margin, ds_kview given) {
    int64_t n = ds_kview_numel(&x);
    float scale = cast_scale(x, n, meta, fmt, current, margin, given);
    uint8_t *out = q.data;
    #pragma omp parallel for schedule(static) if (n > CPU_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) out[i] = ds_f32_to_fp8((float)ds_load(x.dtype, x.data, i) * scale, fmt);
    return 0;
}

/* A tile of x a step, as the GPU's kernel: its codes written along q's
 * rows and kept, then written along qt's rows, a cache line at a time
 * (a column of q straight into qt would touch one line per code). */
#define CT_TILE 64

static int cpu_fp8_cast_transpose(ds_kview q, ds_kview qt, ds_kview x, ds_kview meta, int fmt, int current,
                                  int margin, ds_kview given) {
    int64_t m = x.shape[0], k = x.shape[1];
    float scale = cast_scale(x, m * k, meta, fmt, current, margin, given);
    uint8_t *out = q.data, *tout = qt.data;
    int64_t across = (k + CT_TILE - 1) / CT_TILE, tiles = (m + CT_TILE - 1) / CT_TILE * across;
    #pragma omp parallel for schedule(static) if (m * k > CPU_PARALLEL_MIN)
    for (int64_t b = 0; b < tiles; b++) {
        uint8_t tile[CT_TILE][CT_TILE];
        int64_t r0 = b / across * CT_TILE, c0 = b % across * CT_TILE;
        int rows = (int)(m - r0 < CT_TILE ? m - r0 : CT_TILE), cols = (int)(k - c0 < CT_TILE ? k - c0 : CT_TILE);
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) {
                int64_t i = (r0 + r) * k + c0 + c;
                out[i] = tile[r][c] = ds_f32_to_fp8((float)ds_load(x.dtype, x.data, i) * scale, fmt);
            }
        for (int c = 0; c < cols; c++)
            for (int r = 0; r < rows; r++) tout[(c0 + c) * m + r0 + r] = tile[r][c];
    }
    return 0;
}

static int cpu_fp8_amax(ds_kview out, ds_kview x) {
    *(float *)out.data = abs_max(x, ds_kview_numel(&x));
    return 0;
}

static int cpu_fp8_uncast(ds_kview y, ds_kview q, ds_kview meta, int fmt) {
    int64_t n = ds_kview_numel(&y);
    float inv = meta_at(meta, 1);
    const uint8_t *in = q.data;
    #pragma omp parallel for schedule(static) if (n > CPU_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) ds_store(y.dtype, y.data, i, ds_fp8_to_f32(in[i], fmt) * inv);
    return 0;
}

const ds_kernels_fp8 ds_cpu_fp8 = { .cast = cpu_fp8_cast, .cast_transpose = cpu_fp8_cast_transpose, .amax = cpu_fp8_amax,
                                    .uncast = cpu_fp8_uncast };
