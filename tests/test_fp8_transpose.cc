/* The fp8 cast into both layouts (kernels/cuda/cuda_fp8.cuh) on the CPU,
 * through tests/warp_emulator.h: every code of q and of qt against
 * ds_fp8.h's conversion of x * scale, bit for bit, for shapes that are
 * not multiples of the tile, f32 and bf16 input, e4m3 and e5m2, a grid
 * of fewer blocks than tiles; NaN, zeros and values past the format's
 * max among the inputs; meta as the cast leaves it under current scaling
 * (the scale from the amax given) and delayed (the amax folded in). */
#include "warp_emulator.h"
#include "cuda/cuda_fp8.cuh"

extern "C" {
#include "check.h"
}

#include <random>
#include <vector>

namespace {

/* x [m, k] of dt, a few special values among normal ones of spread 40 */
std::vector<unsigned char> input(ds_dtype dt, int64_t m, int64_t k, std::mt19937 &rng) {
    std::normal_distribution<float> normal(0.f, 40.f);
    std::vector<unsigned char> x((size_t)(m * k) * ds_dtype_size(dt));
    for (int64_t i = 0; i < m * k; i++) ds_store(dt, x.data(), i, normal(rng));
    const double special[] = { NAN, 0.0, -0.0, 1e6, -7e4 };
    for (int j = 0; j < 5 && j < m * k; j++) ds_store(dt, x.data(), (int64_t)(rng() % (m * k)), special[j]);
    return x;
}

void run_case(ds_dtype dt, ds_fp8_format f, int64_t m, int64_t k, bool current, unsigned grid, std::mt19937 &rng) {
    std::vector<unsigned char> x = input(dt, m, k, rng);
    float amax = 0.f;
    for (int64_t i = 0; i < m * k; i++) amax = fmaxf(amax, fabsf((float)ds_load(dt, x.data(), i)));
    float meta[3] = { 0.5f, 2.0f, 3.0f }, before = meta[2];
    float s = current ? ds_fp8_scale(amax, f, 1, 1.0f) : meta[0];
    std::vector<uint8_t> q((size_t)(m * k), 0xaa), qt((size_t)(m * k), 0xaa);
    emu::launch("fp8_cast_transpose_kernel", grid, CT_THREADS, CT_SMEM, [&] {
        fp8_cast_transpose_kernel(q.data(), qt.data(), x.data(), dt, m, k, meta, 1, f, current ? &amax : nullptr,
                                  1);
    });
    int64_t wrong = 0, wrong_t = 0;
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < k; c++) {
            uint8_t want = ds_f32_to_fp8((float)ds_load(dt, x.data(), r * k + c) * s, f);
            wrong += q[r * k + c] != want;
            wrong_t += qt[c * m + r] != want;
        }
    const char *name = dt == DS_BF16 ? "bf16" : "f32";
    const char *fmt = f == DS_FP8_E4M3 ? "e4m3" : "e5m2";
    check(wrong == 0 && wrong_t == 0, "%s %s [%lld, %lld] %s, %u blocks: %lld codes of q and %lld of qt differ",
          name, fmt, (long long)m, (long long)k, current ? "current" : "delayed", grid, (long long)wrong,
          (long long)wrong_t);
    if (current)
        check(meta[0] == s && meta[1] == 1.0f / s && meta[2] == fmaxf(before, amax),
              "%s [%lld, %lld] current: meta %g %g %g, expected %g %g %g", fmt, (long long)m, (long long)k, meta[0],
              meta[1], meta[2], s, 1.0f / s, fmaxf(before, amax));
    else
        check(meta[0] == 0.5f && meta[1] == 2.0f && meta[2] == fmaxf(before, amax),
              "%s [%lld, %lld] delayed: meta %g %g %g, expected the scales kept and amax %g", fmt, (long long)m,
              (long long)k, meta[0], meta[1], meta[2], fmaxf(before, amax));
}

unsigned tiles(int64_t m, int64_t k) { return (unsigned)((m + CT_TILE - 1) / CT_TILE * ((k + CT_TILE - 1) / CT_TILE)); }

} /* namespace */

int main() {
    std::mt19937 rng(5);
    const int64_t shapes[][2] = { { 1, 1 }, { 3, 70 }, { 33, 65 }, { 64, 32 }, { 97, 7 } };
    for (const auto &sh : shapes)
        for (ds_fp8_format f : { DS_FP8_E4M3, DS_FP8_E5M2 })
            for (bool current : { true, false }) {
                run_case(DS_F32, f, sh[0], sh[1], current, tiles(sh[0], sh[1]), rng);
                run_case(DS_BF16, f, sh[0], sh[1], current, 2, rng);    /* blocks stride over the tiles */
            }
    run_case(DS_F32, DS_FP8_E4M3, 0, 5, true, 1, rng);                 /* empty: the scale still set */
    return check_summary("test_fp8_transpose");
}
