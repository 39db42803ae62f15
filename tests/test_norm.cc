/* The warp-per-row norm kernels (kernels/cuda/cuda_norm.cuh) on the CPU,
 * through tests/warp_emulator.h, in f32 and bf16, layer norm and RMS norm:
 * the residual form (sum = x + res, then the norm of sum) against the
 * plain kernel run on the sum rounded as the elementwise add rounds it,
 * bit for bit; the backward with the residual's gradient added against
 * the plain backward plus that gradient in f32, rounded once; the plain
 * kernel against the norm's definition in f64; and the backward with the
 * weight and bias gradients inside (norm_backward_params_kernel): its dx
 * as the plain backward's, its sums within f32's bound of f64's, the same
 * on every run. */
#include "warp_emulator.h"
#include "cuda/cuda_norm.cuh"

extern "C" {
#include "check.h"
}

#include <random>
#include <vector>

namespace {

/* n values of dt, 16-byte aligned as the warp kernels need */
struct buf {
    ds_dtype dt;
    int64_t n;
    std::vector<float4> words;
    buf(ds_dtype t, int64_t count) : dt(t), n(count), words((size_t)(count * 4 + 15) / 16 + 1) {}
    void *data() { return words.data(); }
    float at(int64_t i) { return (float)ds_load(dt, data(), i); }
    void set(int64_t i, double v) { ds_store(dt, data(), i, v); }
    ds_kview view() {
        int64_t one = 1;
        return emu::view(data(), dt, 1, &n, &one);
    }
};

const ds_kview none = {};

void fill(buf &b, std::mt19937 &rng, float scale, float shift) {
    std::normal_distribution<float> normal(shift, scale);
    for (int64_t i = 0; i < b.n; i++) b.set(i, normal(rng));
}

int64_t differ(buf &a, buf &b) {
    int64_t k = 0;
    for (int64_t i = 0; i < a.n; i++) k += memcmp((char *)a.data() + i * ds_dtype_size(a.dt),
                                                   (char *)b.data() + i * ds_dtype_size(b.dt), ds_dtype_size(a.dt)) != 0;
    return k;
}

unsigned blocks(int64_t rows) { return (unsigned)((rows + ROW_WARPS - 1) / ROW_WARPS); }

/* centered off: RMS norm (no mean, no bias) */
void forward(buf &y, buf &mean, buf &rstd, buf &x, buf &w, buf &b, const ds_kview &res, const ds_kview &sum,
             int64_t rows, int64_t n, bool centered = true) {
    ds_kview yv = y.view(), mv = centered ? mean.view() : none, rv = rstd.view(), xv = x.view(), wv = w.view();
    ds_kview bv = centered ? b.view() : none;
    emu::launch("norm_warp_kernel", blocks(rows), 32 * ROW_WARPS, 0,
                [&] { norm_warp_kernel(yv, mv, rv, xv, wv, bv, res, sum, rows, n, 1e-5f, centered); });
}

void backward(buf &dx, buf &g, buf &x, buf &w, buf &mean, buf &rstd, const ds_kview &gres, int64_t rows, int64_t n,
              bool centered = true) {
    ds_kview dv = dx.view(), gv = g.view(), xv = x.view(), wv = w.view(), rv = rstd.view();
    ds_kview mv = centered ? mean.view() : none;
    emu::launch("norm_backward_warp_kernel", blocks(rows), 32 * ROW_WARPS, 0,
                [&] { norm_backward_warp_kernel(dv, gv, xv, wv, mv, rv, gres, rows, n); });
}

/* dw and db from the one-kernel backward; dx into its own buffer */
void backward_params(buf &dx, buf &dw, buf &db, buf &g, buf &x, buf &w, buf &mean, buf &rstd, const ds_kview &gres,
                     int64_t rows, int64_t n, bool centered) {
    unsigned grid = std::min(blocks(rows), (unsigned)NORM_PARAM_BLOCKS);
    std::vector<float> part((size_t)(2 * grid * n));
    unsigned done = 0;
    ds_kview dv = dx.view(), wgv = dw.view(), bgv = db.view(), gv = g.view(), xv = x.view(), wv = w.view();
    ds_kview mv = centered ? mean.view() : none, rv = rstd.view();
    if (!centered) bgv = none;
    int64_t words = (n + 255) / 256;
    std::function<void()> body[4] = {
        [&] { norm_backward_params_kernel<1>(dv, wgv, bgv, gv, xv, wv, mv, rv, gres, part.data(), &done, rows, n); },
        [&] { norm_backward_params_kernel<2>(dv, wgv, bgv, gv, xv, wv, mv, rv, gres, part.data(), &done, rows, n); },
        [&] { norm_backward_params_kernel<3>(dv, wgv, bgv, gv, xv, wv, mv, rv, gres, part.data(), &done, rows, n); },
        [&] { norm_backward_params_kernel<4>(dv, wgv, bgv, gv, xv, wv, mv, rv, gres, part.data(), &done, rows, n); },
    };
    emu::launch("norm_backward_params_kernel", grid, 32 * ROW_WARPS, norm_params_smem(n), body[words - 1]);
    check(done == grid, "every block counted itself (%u of %u)", done, grid);
}

/* The weight and bias gradients: dx as the plain backward, dw = sum g xh
 * and db = sum g within f32's bound for sums of rows terms, and the same
 * bits on a second run; RMS norm (not centered) has no mean and no db. */
void check_params(ds_dtype dt, int64_t rows, int64_t n, bool centered, std::mt19937 &rng) {
    const char *name = dt == DS_BF16 ? (centered ? "bf16" : "bf16 rms") : (centered ? "f32" : "f32 rms");
    int64_t all = rows * n;
    buf x(dt, all), w(dt, n), b(dt, n), g(dt, all), gres(dt, all), y(dt, all), mean(DS_F32, rows), rstd(DS_F32, rows);
    fill(x, rng, 2.f, 1.f);
    fill(w, rng, 1.f, 0.f);
    fill(b, rng, 1.f, 0.f);
    fill(g, rng, 1.f, 0.f);
    fill(gres, rng, 1.f, 0.f);
    forward(y, mean, rstd, x, w, b, none, none, rows, n, centered);
    buf dx(dt, all), dw(DS_F32, n), db(DS_F32, n), want_dx(dt, all);
    for (int64_t r = 0; !centered && r < rows; r++) mean.set(r, 0);
    backward_params(dx, dw, db, g, x, w, mean, rstd, gres.view(), rows, n, centered);
    backward(want_dx, g, x, w, mean, rstd, gres.view(), rows, n, centered);
    check(differ(dx, want_dx) == 0, "%s %lldx%lld: the one-kernel dx differs from the plain one", name,
          (long long)rows, (long long)n);
    double worst = 0;
    for (int64_t j = 0; j < n; j++) {
        double sw = 0, sb = 0, aw = 0, ab = 0;
        for (int64_t r = 0; r < rows; r++) {
            double xh = (x.at(r * n + j) - mean.at(r)) * rstd.at(r), gv = g.at(r * n + j);
            sw += gv * xh;
            sb += gv;
            aw += fabs(gv * xh);
            ab += fabs(gv);
        }
        /* f32 sums of rows terms, each a product rounded a few times */
        double u = ldexp(1.0, -24), bw = (double)(rows + 4) * u * aw + 1e-30, bb = (double)rows * u * ab + 1e-30;
        worst = std::max(worst, fabs(dw.at(j) - sw) / bw);
        if (centered) worst = std::max(worst, fabs(db.at(j) - sb) / bb);
    }
    check(worst <= 1, "%s %lldx%lld: dw or db past f32's bound (%.3g of it)", name, (long long)rows, (long long)n,
          worst);
    buf dw2(DS_F32, n), db2(DS_F32, n);
    backward_params(dx, dw2, db2, g, x, w, mean, rstd, gres.view(), rows, n, centered);
    check(differ(dw, dw2) == 0 && differ(db, db2) == 0, "%s %lldx%lld: a second run differs", name,
          (long long)rows, (long long)n);
}

/* rows of n, more rows than a block's warps and n past a multiple of 256
 * (lanes whose last word is past the row); centered off: RMS norm */
void run_case(ds_dtype dt, int64_t rows, int64_t n, bool centered, std::mt19937 &rng) {
    const char *name = dt == DS_BF16 ? (centered ? "bf16" : "bf16 rms") : (centered ? "f32" : "f32 rms");
    int64_t all = rows * n;
    buf x(dt, all), res(dt, all), w(dt, n), b(dt, n), g(dt, all), gres(dt, all);
    fill(x, rng, 2.f, 1.f);
    fill(res, rng, 1.f, 0.f);
    fill(w, rng, 1.f, 0.f);
    fill(b, rng, 1.f, 0.f);
    fill(g, rng, 1.f, 0.f);
    fill(gres, rng, 1.f, 0.f);

    buf sum(dt, all), y(dt, all), mean(DS_F32, rows), rstd(DS_F32, rows);
    forward(y, mean, rstd, x, w, b, res.view(), sum.view(), rows, n, centered);
    buf want_sum(dt, all), want_y(dt, all), want_mean(DS_F32, rows), want_rstd(DS_F32, rows);
    for (int64_t i = 0; i < all; i++) want_sum.set(i, x.at(i) + res.at(i));
    forward(want_y, want_mean, want_rstd, want_sum, w, b, none, none, rows, n, centered);
    check(differ(sum, want_sum) == 0, "%s %lldx%lld: the sum differs from x + res rounded", name, (long long)rows,
          (long long)n);
    check(differ(y, want_y) == 0 && differ(mean, want_mean) == 0 && differ(rstd, want_rstd) == 0,
          "%s %lldx%lld: the residual form differs from the norm of the sum", name, (long long)rows, (long long)n);

    /* the plain kernel against the definition: f32 sums of n terms */
    double worst = 0;
    for (int64_t r = 0; r < rows; r++) {
        double m = 0, v = 0;
        for (int64_t j = 0; centered && j < n; j++) m += want_sum.at(r * n + j);
        m /= (double)n;
        for (int64_t j = 0; j < n; j++) v += (want_sum.at(r * n + j) - m) * (want_sum.at(r * n + j) - m);
        double rs = 1 / sqrt(v / (double)n + 1e-5);
        for (int64_t j = 0; j < n; j++) {
            double e = (want_sum.at(r * n + j) - m) * rs * w.at(j) + (centered ? b.at(j) : 0);
            double tol = dt == DS_BF16 ? 1e-2 * (1 + fabs(e)) : 1e-4 * (1 + fabs(e));
            worst = std::max(worst, fabs(want_y.at(r * n + j) - e) / tol);
        }
    }
    check(worst <= 1, "%s %lldx%lld: the norm is off its definition (%.3g of the bound)", name, (long long)rows,
          (long long)n, worst);

    /* backward: dx = gres + the norm's gradient, rounded once */
    buf dx(dt, all), plain(DS_F32, all), want_dx(dt, all);
    backward(dx, g, sum, w, mean, rstd, gres.view(), rows, n, centered);
    backward(plain, g, sum, w, mean, rstd, none, rows, n, centered);
    for (int64_t i = 0; i < all; i++) want_dx.set(i, plain.at(i) + gres.at(i));
    check(differ(dx, want_dx) == 0, "%s %lldx%lld: dx with the residual's gradient differs from the plain dx + gres",
          name, (long long)rows, (long long)n);
}

} /* namespace */

int main() {
    std::mt19937 rng(7);
    for (ds_dtype dt : { DS_F32, DS_BF16 }) {
        run_case(dt, 19, 264, true, rng);
        run_case(dt, 3, 768, true, rng);
        run_case(dt, 19, 264, false, rng);
        check_params(dt, 19, 264, true, rng);
        check_params(dt, 2100, 40, true, rng);     /* past NORM_PARAM_BLOCKS blocks: warps of several rows */
        check_params(dt, 300, 768, true, rng);
        check_params(dt, 5, 1024, true, rng);
        check_params(dt, 37, 512, false, rng);
    }
    return check_summary("test_norm");
}
