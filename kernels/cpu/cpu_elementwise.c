/* Elementwise kernels on the CPU: an f32 loop the compiler vectorises for
 * the common case, and a load-as-double loop for every other dtype mix. */
#include "cpu_kernels.h"
#include "cpu_iter.h"
#include "../ds_elem.h"
#include "../ds_half.h"
#include "cpu_half.h"
#include "../ds_expf.h"

/* Rows are cut into tiles of at most CPU_TILE columns and the tiles shared
 * among threads, so a contiguous tensor (one long row once coalesced) still
 * uses every thread. Small tensors run the tiles on the calling thread
 * without entering OpenMP at all: `parallel for if (0)` still goes through
 * libgomp, whose team setup (a futex wake) costs more than a 16-element add. */
#define CPU_TILE 8192

static int64_t tile_count(const ds_kview *v) {
    int64_t cols = cpu_cols(v), n = ds_kview_numel(v);
    return cols ? n / cols * ((cols + CPU_TILE - 1) / CPU_TILE) : 0;
}

/* Row r and columns [c0, c1) of tile t. */
static void tile_at(const ds_kview *v, int64_t t, int64_t *r, int64_t *c0, int64_t *c1) {
    int64_t cols = cpu_cols(v), per_row = (cols + CPU_TILE - 1) / CPU_TILE;
    *r = t / per_row;
    *c0 = t % per_row * CPU_TILE;
    *c1 = *c0 + CPU_TILE < cols ? *c0 + CPU_TILE : cols;
}

/* The f32 add, the hottest binary case. It is bound by memory, and on AMD
 * Zen 4 its loop runs 5-20% faster with 256-bit vectors than with 512-bit
 * ones (bench/README.md); GELU, bound by arithmetic, keeps the full width. */
__attribute__((noinline, target("prefer-vector-width=256")))
static void add_f32(float *o, const float *x, const float *y, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = x[i] + y[i];
}

/* o = x op y over n f32 values: a vectorised loop for each of + - * /
 * (the switch outside the loop: inside, it kept every op but the add
 * scalar), ds_binary_apply_f element by element for the rest. o may be x
 * or y. */
static void apply_f32(ds_binary_op op, float *o, const float *x, const float *y, int64_t n) {
    switch (op) {
    case DS_BIN_ADD:
        add_f32(o, x, y, n);
        break;
    case DS_BIN_SUB:
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = x[i] - y[i];
        break;
    case DS_BIN_MUL:
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = x[i] * y[i];
        break;
    case DS_BIN_DIV:
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = x[i] / y[i];
        break;
    default:
        for (int64_t i = 0; i < n; i++) o[i] = ds_binary_apply_f(op, x[i], y[i]);
        break;
    }
}

/* ---- binary ops over f32, bf16 and f16 ----
 * For + - * / the f32 result of two f32 values is the one the double route
 * gives once rounded to f32 (double holds more than twice f32's bits), so
 * a mix of these dtypes may be widened to f32, computed by the f32 loops
 * and narrowed once: bit for bit the double route, several times faster.
 * All-f32 operands take these loops for every op, as they always did. */
#define CPU_FLOAT_BLOCK 1024     /* scratch that stays in L1 */

static bool f32ish(ds_dtype t) { return t == DS_F32 || t == DS_BF16 || t == DS_F16; }

static bool exact_in_f32(ds_binary_op op) {
    return op == DS_BIN_ADD || op == DS_BIN_SUB || op == DS_BIN_MUL || op == DS_BIN_DIV;
}

/* Whether a tile of out = a op b takes the f32 loops: out and a contiguous,
 * b contiguous or one value, every dtype f32 or (for an exact op) a mix of
 * f32, bf16 and f16. */
static bool float_tile(ds_binary_op op, const ds_kview *out, const ds_kview *a, const ds_kview *b, int64_t so,
                       int64_t sa, int64_t sb) {
    if (so != 1 || sa != 1 || (sb != 1 && sb != 0)) return false;
    if (out->dtype == DS_F32 && a->dtype == DS_F32 && b->dtype == DS_F32) return true;
    return exact_in_f32(op) && f32ish(out->dtype) && f32ish(a->dtype) && f32ish(b->dtype);
}

/* n elements of v from offset off as f32: v's own memory when it is f32,
 * else widened into scratch. */
static const float *as_f32(const ds_kview *v, int64_t off, int64_t n, float *scratch) {
    if (v->dtype == DS_F32) return (const float *)v->data + off;
    cpu_half_to_f32(scratch, (const uint16_t *)v->data + off, n, v->dtype);
    return scratch;
}

static void store_f32(const ds_kview *v, int64_t off, int64_t n, const float *x) {
    cpu_f32_to_half((uint16_t *)v->data + off, x, n, v->dtype);
}

/* Columns [c0, c1) of one row of a float tile, a block at a time; b_one:
 * b is one value. out may be a or b: each block is read before it is
 * written. */
static void binary_floats(ds_binary_op op, const ds_kview *out, int64_t oo, const ds_kview *a, int64_t oa,
                          const ds_kview *b, int64_t ob, bool b_one, int64_t c0, int64_t c1) {
    float xs[CPU_FLOAT_BLOCK], ys[CPU_FLOAT_BLOCK], os[CPU_FLOAT_BLOCK], one[CPU_FLOAT_BLOCK];
    if (b_one) {
        float v = as_f32(b, ob, 1, ys)[0];
        for (int i = 0; i < CPU_FLOAT_BLOCK; i++) one[i] = v;
    }
    for (int64_t lo = c0; lo < c1; lo += CPU_FLOAT_BLOCK) {
        int64_t n = c1 - lo < CPU_FLOAT_BLOCK ? c1 - lo : CPU_FLOAT_BLOCK;
        const float *x = as_f32(a, oa + lo, n, xs), *y = b_one ? one : as_f32(b, ob + lo, n, ys);
        float *o = out->dtype == DS_F32 ? (float *)out->data + oo + lo : os;
        apply_f32(op, o, x, y, n);
        if (o == os) store_f32(out, oo + lo, n, os);
    }
}

static void binary_tile(ds_binary_op op, const ds_kview *out, const ds_kview *a, const ds_kview *b, int64_t t) {
    int64_t r, c0, c1;
    tile_at(out, t, &r, &c0, &c1);
    int64_t so = cpu_col_stride(out), sa = cpu_col_stride(a), sb = cpu_col_stride(b);
    int64_t oo = cpu_row_offset(out, r), oa = cpu_row_offset(a, r), ob = cpu_row_offset(b, r);
    if (float_tile(op, out, a, b, so, sa, sb)) {
        binary_floats(op, out, oo, a, oa, b, ob, sb == 0, c0, c1);
        return;
    }
    for (int64_t c = c0; c < c1; c++) {
        double xv = ds_load(a->dtype, a->data, oa + c * sa), yv = ds_load(b->dtype, b->data, ob + c * sb);
        ds_store(out->dtype, out->data, oo + c * so, ds_binary_apply(op, xv, yv));
    }
}

static int cpu_binary(ds_binary_op op, ds_kview out, ds_kview a, ds_kview b) {
    ds_kview *v[3] = { &out, &a, &b };
    cpu_coalesce(v, 3);
    int64_t tiles = tile_count(&out);
    if (ds_kview_numel(&out) <= CPU_PARALLEL_MIN) {
        for (int64_t t = 0; t < tiles; t++) binary_tile(op, &out, &a, &b, t);
    } else {
        #pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) binary_tile(op, &out, &a, &b, t);
    }
    return 0;
}

/* ---- unary ops and their backward over f32, bf16 and f16 ----
 * Contiguous tiles are widened to f32 a block at a time and computed by
 * the f32 loops: the op in f32 (GELU-tanh as ds_gelu_tanh_f; the GPU's
 * takes its exp and reciprocal from the hardware, a few ulps away),
 * GELU-tanh's gradient as ds_gelu_tanh_grad_f, every other gradient
 * through ds_unary_derivative in double, which equals the double route
 * since bf16 and f16 widen to f32 exactly. */
static void unary_f32(ds_unary_op op, float *o, const float *x, float p, int64_t n) {
    if (op == DS_UN_GELU_TANH) {
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = ds_gelu_tanh_f(x[i]);
    } else {
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = ds_unary_apply_f(op, x[i], p);
    }
}

static void unary_floats(ds_unary_op op, const ds_kview *out, int64_t oo, const ds_kview *x, int64_t ox, float p,
                         int64_t c0, int64_t c1) {
    float xs[CPU_FLOAT_BLOCK], os[CPU_FLOAT_BLOCK];
    for (int64_t lo = c0; lo < c1; lo += CPU_FLOAT_BLOCK) {
        int64_t n = c1 - lo < CPU_FLOAT_BLOCK ? c1 - lo : CPU_FLOAT_BLOCK;
        float *o = out->dtype == DS_F32 ? (float *)out->data + oo + lo : os;
        unary_f32(op, o, as_f32(x, ox + lo, n, xs), p, n);
        if (o == os) store_f32(out, oo + lo, n, os);
    }
}

static void unary_tile(ds_unary_op op, const ds_kview *out, const ds_kview *x, double param, int64_t t) {
    int64_t r, c0, c1;
    tile_at(out, t, &r, &c0, &c1);
    int64_t so = cpu_col_stride(out), sx = cpu_col_stride(x);
    int64_t oo = cpu_row_offset(out, r), ox = cpu_row_offset(x, r);
    if (so == 1 && sx == 1 && f32ish(out->dtype) && f32ish(x->dtype)) {
        unary_floats(op, out, oo, x, ox, (float)param, c0, c1);
        return;
    }
    for (int64_t c = c0; c < c1; c++)
        ds_store(out->dtype, out->data, oo + c * so, ds_unary_apply(op, ds_load(x->dtype, x->data, ox + c * sx), param));
}

static int cpu_unary(ds_unary_op op, ds_kview out, ds_kview x, double param) {
    ds_kview *v[2] = { &out, &x };
    cpu_coalesce(v, 2);
    int64_t tiles = tile_count(&out);
    if (ds_kview_numel(&out) <= CPU_PARALLEL_MIN / 4) {
        for (int64_t t = 0; t < tiles; t++) unary_tile(op, &out, &x, param, t);
    } else {
        #pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) unary_tile(op, &out, &x, param, t);
    }
    return 0;
}

/* d = g * d op(x)/dx over n f32 values; y = op(x) */
static void unary_backward_f32(ds_unary_op op, float *d, const float *g, const float *x, const float *y, double p,
                               int64_t n) {
    if (op == DS_UN_GELU_TANH) {
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = g[i] * ds_gelu_tanh_grad_f(x[i]);
    } else {
        for (int64_t i = 0; i < n; i++) d[i] = (float)((double)g[i] * ds_unary_derivative(op, x[i], y[i], p));
    }
}

static void unary_backward_floats(ds_unary_op op, const ds_kview *dx, int64_t od, const ds_kview *g, int64_t og,
                                  const ds_kview *x, int64_t ox, const ds_kview *y, int64_t oy, double p, int64_t c0,
                                  int64_t c1) {
    float gs[CPU_FLOAT_BLOCK], xs[CPU_FLOAT_BLOCK], ys[CPU_FLOAT_BLOCK], ds[CPU_FLOAT_BLOCK];
    for (int64_t lo = c0; lo < c1; lo += CPU_FLOAT_BLOCK) {
        int64_t n = c1 - lo < CPU_FLOAT_BLOCK ? c1 - lo : CPU_FLOAT_BLOCK;
        float *d = dx->dtype == DS_F32 ? (float *)dx->data + od + lo : ds;
        const float *yv = op == DS_UN_GELU_TANH ? NULL : as_f32(y, oy + lo, n, ys);   /* GELU reads x alone */
        unary_backward_f32(op, d, as_f32(g, og + lo, n, gs), as_f32(x, ox + lo, n, xs), yv, p, n);
        if (d == ds) store_f32(dx, od + lo, n, ds);
    }
}

static void unary_backward_tile(ds_unary_op op, const ds_kview *dx, const ds_kview *g, const ds_kview *x,
                                const ds_kview *y, double param, int64_t t) {
    int64_t r, c0, c1;
    tile_at(dx, t, &r, &c0, &c1);
    int64_t sd = cpu_col_stride(dx), sg = cpu_col_stride(g), sx = cpu_col_stride(x), sy = cpu_col_stride(y);
    int64_t od = cpu_row_offset(dx, r), og = cpu_row_offset(g, r);
    int64_t ox = cpu_row_offset(x, r), oy = cpu_row_offset(y, r);
    if (sd == 1 && sg == 1 && sx == 1 && sy == 1 && f32ish(dx->dtype) && f32ish(g->dtype) && f32ish(x->dtype)
        && f32ish(y->dtype)) {
        unary_backward_floats(op, dx, od, g, og, x, ox, y, oy, param, c0, c1);
        return;
    }
    for (int64_t c = c0; c < c1; c++) {
        double xv = ds_load(x->dtype, x->data, ox + c * sx);
        double yv = ds_load(y->dtype, y->data, oy + c * sy);
        double gv = ds_load(g->dtype, g->data, og + c * sg);
        ds_store(dx->dtype, dx->data, od + c * sd, gv * ds_unary_derivative(op, xv, yv, param));
    }
}

static int cpu_unary_backward(ds_unary_op op, ds_kview dx, ds_kview g, ds_kview x, ds_kview y, double param) {
    ds_kview *v[4] = { &dx, &g, &x, &y };
    cpu_coalesce(v, 4);
    int64_t tiles = tile_count(&dx);
    if (ds_kview_numel(&dx) <= CPU_PARALLEL_MIN / 4) {
        for (int64_t t = 0; t < tiles; t++) unary_backward_tile(op, &dx, &g, &x, &y, param, t);
    } else {
        #pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) unary_backward_tile(op, &dx, &g, &x, &y, param, t);
    }
    return 0;
}

static void where_tile(const ds_kview *out, const ds_kview *cond, const ds_kview *a, const ds_kview *b, int64_t t) {
    int64_t r, c0, c1;
    tile_at(out, t, &r, &c0, &c1);
    int64_t so = cpu_col_stride(out), sc = cpu_col_stride(cond);
    int64_t sa = cpu_col_stride(a), sb = cpu_col_stride(b);
    int64_t oo = cpu_row_offset(out, r), oc = cpu_row_offset(cond, r);
    int64_t oa = cpu_row_offset(a, r), ob = cpu_row_offset(b, r);
    for (int64_t c = c0; c < c1; c++) {
        double v = ds_load(cond->dtype, cond->data, oc + c * sc) != 0
                   ? ds_load(a->dtype, a->data, oa + c * sa) : ds_load(b->dtype, b->data, ob + c * sb);
        ds_store(out->dtype, out->data, oo + c * so, v);
    }
}

static int cpu_where(ds_kview out, ds_kview cond, ds_kview a, ds_kview b) {
    ds_kview *v[4] = { &out, &cond, &a, &b };
    cpu_coalesce(v, 4);
    int64_t tiles = tile_count(&out);
    if (ds_kview_numel(&out) <= CPU_PARALLEL_MIN) {
        for (int64_t t = 0; t < tiles; t++) where_tile(&out, &cond, &a, &b, t);
    } else {
        #pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) where_tile(&out, &cond, &a, &b, t);
    }
    return 0;
}

/* ---- SwiGLU each way in one pass, through ds_swiglu_elem and its
 * backward; v holds out (or dgate, dup), then the inputs. ---- */

/* Columns [c0, c1) of a row of contiguous f32, bf16 or f16 views, widened
 * to f32 a block at a time (exactly) and narrowed as ds_store rounds. */
static void swiglu_floats(ds_kview **v, int nv, const int64_t *o, int64_t c0, int64_t c1) {
    float in[3][CPU_FLOAT_BLOCK], res[2][CPU_FLOAT_BLOCK];
    int nout = nv == 3 ? 1 : 2;
    for (int64_t lo = c0; lo < c1; lo += CPU_FLOAT_BLOCK) {
        int64_t n = c1 - lo < CPU_FLOAT_BLOCK ? c1 - lo : CPU_FLOAT_BLOCK;
        const float *x[3];
        float *y[2];
        for (int k = nout; k < nv; k++) x[k - nout] = as_f32(v[k], o[k] + lo, n, in[k - nout]);
        for (int k = 0; k < nout; k++) y[k] = v[k]->dtype == DS_F32 ? (float *)v[k]->data + o[k] + lo : res[k];
        if (nout == 1) {
            for (int64_t i = 0; i < n; i++) y[0][i] = ds_swiglu_f(x[0][i], x[1][i]);
        } else {
            for (int64_t i = 0; i < n; i++) {
                double dg, du;
                ds_swiglu_elem_backward(x[0][i], x[1][i], x[2][i], &dg, &du);
                y[0][i] = (float)dg;
                y[1][i] = (float)du;
            }
        }
        for (int k = 0; k < nout; k++)
            if (y[k] == res[k]) store_f32(v[k], o[k] + lo, n, res[k]);
    }
}

static void swiglu_tile(ds_kview **v, int nv, int64_t t) {
    int64_t r, c0, c1, s[5], o[5];
    bool floats = true;
    tile_at(v[0], t, &r, &c0, &c1);
    for (int k = 0; k < nv; k++) {
        s[k] = cpu_col_stride(v[k]);
        o[k] = cpu_row_offset(v[k], r);
        floats = floats && s[k] == 1 && f32ish(v[k]->dtype);
    }
    if (floats) {
        swiglu_floats(v, nv, o, c0, c1);
        return;
    }
    for (int64_t c = c0; c < c1; c++) {
        double x[5];
        for (int k = nv == 3 ? 1 : 2; k < nv; k++) x[k] = ds_load(v[k]->dtype, v[k]->data, o[k] + c * s[k]);
        if (nv == 3) {
            ds_store(v[0]->dtype, v[0]->data, o[0] + c * s[0], ds_swiglu_elem(v[0]->dtype, x[1], x[2]));
            continue;
        }
        ds_swiglu_elem_backward(x[2], x[3], x[4], &x[0], &x[1]);
        for (int k = 0; k < 2; k++) ds_store(v[k]->dtype, v[k]->data, o[k] + c * s[k], x[k]);
    }
}

static int swiglu_run(ds_kview **v, int nv) {
    cpu_coalesce(v, nv);
    int64_t tiles = tile_count(v[0]);
    if (ds_kview_numel(v[0]) <= CPU_PARALLEL_MIN / 4) {
        for (int64_t t = 0; t < tiles; t++) swiglu_tile(v, nv, t);
    } else {
        #pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) swiglu_tile(v, nv, t);
    }
    return 0;
}

static int cpu_swiglu(ds_kview out, ds_kview gate, ds_kview up) {
    ds_kview *v[3] = { &out, &gate, &up };
    return swiglu_run(v, 3);
}

static int cpu_swiglu_backward(ds_kview dgate, ds_kview dup, ds_kview g, ds_kview gate, ds_kview up) {
    ds_kview *v[5] = { &dgate, &dup, &g, &gate, &up };
    return swiglu_run(v, 5);
}

const ds_kernels_elementwise ds_cpu_elementwise = {
    cpu_binary, cpu_unary, cpu_unary_backward, cpu_where, cpu_swiglu, cpu_swiglu_backward,
};
