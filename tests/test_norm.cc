/* The warp-per-row norm kernels (kernels/cuda/cuda_norm.cuh) on the CPU,
 * through tests/warp_emulator.h, in f32 and bf16: the residual form (sum =
 * x + res, then the norm of sum) against the plain kernel run on the sum
 * rounded as the elementwise add rounds it, bit for bit; the backward with
 * the residual's gradient added against the plain backward plus that
 * gradient in f32, rounded once; and the plain kernel against the layer
 * norm's definition in f64. */
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

void forward(buf &y, buf &mean, buf &rstd, buf &x, buf &w, buf &b, const ds_kview &res, const ds_kview &sum,
             int64_t rows, int64_t n) {
    ds_kview yv = y.view(), mv = mean.view(), rv = rstd.view(), xv = x.view(), wv = w.view(), bv = b.view();
    emu::launch("norm_warp_kernel", blocks(rows), 32 * ROW_WARPS, 0,
                [&] { norm_warp_kernel(yv, mv, rv, xv, wv, bv, res, sum, rows, n, 1e-5f, true); });
}

void backward(buf &dx, buf &g, buf &x, buf &w, buf &mean, buf &rstd, const ds_kview &gres, int64_t rows, int64_t n) {
    ds_kview dv = dx.view(), gv = g.view(), xv = x.view(), wv = w.view(), mv = mean.view(), rv = rstd.view();
    emu::launch("norm_backward_warp_kernel", blocks(rows), 32 * ROW_WARPS, 0,
                [&] { norm_backward_warp_kernel(dv, gv, xv, wv, mv, rv, gres, rows, n); });
}

/* rows of n, more rows than a block's warps and n past a multiple of 256
 * (lanes whose last word is past the row) */
void run_case(ds_dtype dt, int64_t rows, int64_t n, std::mt19937 &rng) {
    const char *name = dt == DS_BF16 ? "bf16" : "f32";
    int64_t all = rows * n;
    buf x(dt, all), res(dt, all), w(dt, n), b(dt, n), g(dt, all), gres(dt, all);
    fill(x, rng, 2.f, 1.f);
    fill(res, rng, 1.f, 0.f);
    fill(w, rng, 1.f, 0.f);
    fill(b, rng, 1.f, 0.f);
    fill(g, rng, 1.f, 0.f);
    fill(gres, rng, 1.f, 0.f);

    buf sum(dt, all), y(dt, all), mean(DS_F32, rows), rstd(DS_F32, rows);
    forward(y, mean, rstd, x, w, b, res.view(), sum.view(), rows, n);
    buf want_sum(dt, all), want_y(dt, all), want_mean(DS_F32, rows), want_rstd(DS_F32, rows);
    for (int64_t i = 0; i < all; i++) want_sum.set(i, x.at(i) + res.at(i));
    forward(want_y, want_mean, want_rstd, want_sum, w, b, none, none, rows, n);
    check(differ(sum, want_sum) == 0, "%s %lldx%lld: the sum differs from x + res rounded", name, (long long)rows,
          (long long)n);
    check(differ(y, want_y) == 0 && differ(mean, want_mean) == 0 && differ(rstd, want_rstd) == 0,
          "%s %lldx%lld: the residual form differs from the norm of the sum", name, (long long)rows, (long long)n);

    /* the plain kernel against the definition: f32 sums of n terms */
    double worst = 0;
    for (int64_t r = 0; r < rows; r++) {
        double m = 0, v = 0;
        for (int64_t j = 0; j < n; j++) m += want_sum.at(r * n + j);
        m /= (double)n;
        for (int64_t j = 0; j < n; j++) v += (want_sum.at(r * n + j) - m) * (want_sum.at(r * n + j) - m);
        double rs = 1 / sqrt(v / (double)n + 1e-5);
        for (int64_t j = 0; j < n; j++) {
            double e = (want_sum.at(r * n + j) - m) * rs * w.at(j) + b.at(j);
            double tol = dt == DS_BF16 ? 1e-2 * (1 + fabs(e)) : 1e-4 * (1 + fabs(e));
            worst = std::max(worst, fabs(want_y.at(r * n + j) - e) / tol);
        }
    }
    check(worst <= 1, "%s %lldx%lld: the norm is off its definition (%.3g of the bound)", name, (long long)rows,
          (long long)n, worst);

    /* backward: dx = gres + the norm's gradient, rounded once */
    buf dx(dt, all), plain(DS_F32, all), want_dx(dt, all);
    backward(dx, g, sum, w, mean, rstd, gres.view(), rows, n);
    backward(plain, g, sum, w, mean, rstd, none, rows, n);
    for (int64_t i = 0; i < all; i++) want_dx.set(i, plain.at(i) + gres.at(i));
    check(differ(dx, want_dx) == 0, "%s %lldx%lld: dx with the residual's gradient differs from the plain dx + gres",
          name, (long long)rows, (long long)n);
}

} /* namespace */

int main() {
    std::mt19937 rng(7);
    for (ds_dtype dt : { DS_F32, DS_BF16 }) {
        run_case(dt, 19, 264, rng);
        run_case(dt, 3, 768, rng);
    }
    return check_summary("test_norm");
}
