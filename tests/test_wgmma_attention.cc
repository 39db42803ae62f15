/* The Hopper attention forward (kernels/cuda/cuda_attention_wgmma.cuh) on
 * the CPU through tests/warp_emulator.h: out and lse against attention in
 * double from the same bf16/f16 inputs, held to test_attention_mma's
 * bound for 16-bit inputs with f32 sums (a few units of the last place of
 * the largest value; a wrong fragment, swizzle or mask is off by O(1));
 * head dims 64 and 128, causal or not, lengths that leave partial tiles,
 * cross attention both ways, q/k/v as views into one packed qkv buffer,
 * and k and v with 2 and 4 query heads per kv head (grouped-query).
 * Both Hopper forwards run every case: the one staging K and V by
 * cp.async and the one fed by TMA from a producer warpgroup (its tensor
 * maps from the emulated driver; a map of the wrong swizzle is caught).
 * And the check the dispatch runs before trusting a kernel on a GPU
 * (cuda_attention_check.h) on the emulated kernels: each Hopper forward
 * and the mma.sync one agree within its bound in every variant, and a
 * wrong mask is past it. A healthy TMA forward leaves its stall record
 * unwritten; one whose K map the kernel reads differently (boxes of half
 * the rows its expect_tx announces: a phase that never completes) returns
 * with its bounded waits run out, the record naming full[0] of K and
 * block 0, out and lse untouched, and the first-call check's reading of
 * the record says it stalled. */
#include "warp_emulator.h"
#include "wgmma_cases.h"
#include "cuda/cuda_attention_check.h"
#include "cuda/cuda_attention_wgmma.cuh"

extern "C" {
#include "check.h"
}

#include <random>
#include <type_traits>

namespace {

using wgmma_cases::shape;
using wgmma_cases::elem;

/* The kernels under test: the forward staging K and V by cp.async, the
 * one fed by TMA, and that one through a map of the wrong swizzle (which
 * must fail). */
enum kernel { CP_ASYNC, TMA, TMA_WRONG_SWIZZLE };

/* Runs the TMA forward: its tensor maps encoded by the emulated driver
 * (K's boxes of k_rows rows), its stall record in *stall. */
template <typename T, int D>
void launch_tma(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, const mma_geom &g, bool wrong,
                wt_stall *stall, unsigned k_rows = WG_KEYS) {
    wt_maps m;
    bool ok = !wt_map(&m.q, q, cuTensorMapEncodeTiled) && !wt_map(&m.k, k, cuTensorMapEncodeTiled, k_rows) &&
              !wt_map(&m.v, v, cuTensorMapEncodeTiled);
    check(ok, "q, k and v have tensor maps");
    if (wrong) {
        emu::tmap f;
        memcpy(&f, &m.k, sizeof f);
        f.swizzle = CU_TENSOR_MAP_SWIZZLE_NONE;
        memcpy(&m.k, &f, sizeof f);
    }
    emu::launch("wgmma_tma_forward_kernel", wgmma_query_blocks(g), WT_THREADS, wt_forward_smem<D>(),
                [&] { wgmma_tma_forward_kernel<T, D>(out, lse, m, g, stall); });
}

template <typename T, int D>
void launch(kernel kn, ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, const mma_geom &g) {
    if (kn != CP_ASYNC) {
        wt_stall stall = { -1, -1 };
        launch_tma<T, D>(out, lse, q, k, v, g, kn == TMA_WRONG_SWIZZLE, &stall);
        check(stall.pos == -1 && stall.value == -1, "a healthy TMA forward writes no stall record");
    } else emu::launch("wgmma_forward_kernel", wgmma_query_blocks(g), WG_THREADS, wg_forward_smem<D>(),
                     [&] { wgmma_forward_kernel<T, D>(out, lse, q, k, v, g); });
}

/* Runs case s on kernel kn; true when out and lse are within the bound. */
template <typename T, int D> bool run_case(const shape &s, std::mt19937 &rng, kernel kn) {
    const bool bf = std::is_same<T, __nv_bfloat16>::value;
    const ds_dtype dt = bf ? DS_BF16 : DS_F16;
    const int64_t KV = s.kv(), G = s.H / KV, C = s.H * D, W = C + 2 * KV * D, Tmax = std::max(s.Tq, s.Tk);
    const double scale = 1.0 / sqrt((double)D);
    /* [B, T, H + 2 KV, D]: q, k, v as GPT-2's attention passes them (KV = H) */
    std::vector<T> qkv((size_t)(s.B * Tmax * W)), obuf((size_t)(s.B * s.Tq * C), elem<T>(NAN));
    std::normal_distribution<float> normal(0.f, 1.f);
    for (T &x : qkv) x = elem<T>(normal(rng));
    auto heads = [&](void *data, int64_t H, int64_t T_, int64_t sb, int64_t st) {
        int64_t sz[4] = { s.B, H, T_, D }, sd[4] = { sb, D, st, 1 };
        return emu::view(data, dt, 4, sz, sd);
    };
    ds_kview q = heads(qkv.data(), s.H, s.Tq, Tmax * W, W), k = heads(qkv.data() + C, KV, s.Tk, Tmax * W, W);
    ds_kview v = heads(qkv.data() + C + KV * D, KV, s.Tk, Tmax * W, W);
    ds_kview out = heads(obuf.data(), s.H, s.Tq, s.Tq * C, C);
    std::vector<float> lsebuf((size_t)(s.B * s.H * s.Tq), NAN);
    int64_t lsz[3] = { s.B, s.H, s.Tq }, lst[3] = { s.H * s.Tq, s.Tq, 1 };
    ds_kview lse = emu::view(lsebuf.data(), DS_F32, 3, lsz, lst);

    mma_geom g = mma_geom_of(q, k, scale, s.causal);
    launch<T, D>(kn, out, lse, q, k, v, g);

    auto at = [](const ds_kview &x, int64_t b, int64_t h, int64_t t, int d) {
        return (double)(float)((const T *)x.data)[b * x.stride[0] + h * x.stride[1] + t * x.stride[2] + d];
    };
    double worst_o = 0, max_o = 0, worst_l = 0, max_l = 0;
    std::vector<double> P((size_t)s.Tk);
    for (int64_t b = 0; b < s.B; b++)
        for (int64_t h = 0; h < s.H; h++)
            for (int64_t i = 0; i < s.Tq; i++) {
                double mx = -INFINITY, sum = 0;
                for (int64_t j = 0; j < s.Tk; j++) {
                    double dot = 0;
                    for (int d = 0; d < D; d++) dot += at(q, b, h, i, d) * at(k, b, h / G, j, d);
                    P[j] = s.causal && j > i ? -INFINITY : dot * scale;
                    mx = fmax(mx, P[j]);
                }
                for (int64_t j = 0; j < s.Tk; j++) sum += P[j] = exp(P[j] - mx);
                double want_l = mx + log(sum), got_l = lsebuf[(size_t)((b * s.H + h) * s.Tq + i)];
                worst_l = fabs(got_l - want_l) <= worst_l ? worst_l : fabs(got_l - want_l);   /* NaN sticks */
                max_l = fmax(max_l, fabs(want_l));
                for (int d = 0; d < D; d++) {
                    double o = 0;
                    for (int64_t j = 0; j < s.Tk; j++) o += P[j] / sum * at(v, b, h / G, j, d);
                    double e = fabs(at(out, b, h, i, d) - o);
                    worst_o = e <= worst_o ? worst_o : e;
                    max_o = fmax(max_o, fabs(o));
                }
            }
    double tol = bf ? 2e-2 : 4e-3;
    const char *name = bf ? "bf16" : "f16";
    bool good = worst_o <= tol * max_o && worst_l <= tol * max_l;
    if (kn == TMA_WRONG_SWIZZLE) return good;
    check(worst_o <= tol * max_o,
          "%s D=%d B=%lld H=%lld KV=%lld Tq=%lld Tk=%lld causal=%d: out off by %.3g of its largest %.3g", name, D,
          (long long)s.B, (long long)s.H, (long long)KV, (long long)s.Tq, (long long)s.Tk, s.causal, worst_o / max_o,
          max_o);
    check(worst_l <= tol * max_l, "%s D=%d H=%lld KV=%lld Tq=%lld Tk=%lld causal=%d: lse off by %.3g of its largest "
          "%.3g", name, D, (long long)s.H, (long long)KV, (long long)s.Tq, (long long)s.Tk, s.causal, worst_l / max_l,
          max_l);
    printf("%s %s D=%d H=%lld KV=%lld Tq=%lld Tk=%lld causal=%d: out %.1e lse %.1e\n", kn == TMA ? "tma" : "cp.async",
           name, D, (long long)s.H, (long long)KV, (long long)s.Tq, (long long)s.Tk, s.causal, worst_o / max_o,
           worst_l / max_l);
    return good;
}

/* Case s on both kernels, from the same inputs. */
template <typename T, int D> void run_both(const shape &s, std::mt19937 &rng) {
    std::mt19937 again = rng;
    run_case<T, D>(s, rng, CP_ASYNC);
    run_case<T, D>(s, again, TMA);
}

/* One forward of the check problem, emulated: out and lse as floats. */
template <typename T, int D>
void check_forward(int which, const std::vector<float> &x, int causal, std::vector<float> &out,
                   std::vector<float> &lse) {
    const ds_dtype dt = std::is_same<T, __nv_bfloat16>::value ? DS_BF16 : DS_F16;
    const size_t n = (size_t)CHECK_H * CHECK_T * D;
    std::vector<T> qkv(3 * n), o(n, elem<T>(NAN));
    for (size_t i = 0; i < 3 * n; i++) qkv[i] = elem<T>(x[i]);
    lse.assign((size_t)CHECK_H * CHECK_T, NAN);
    int64_t sz[4] = { 1, CHECK_H, CHECK_T, D }, st[4] = { CHECK_H * CHECK_T * D, CHECK_T * D, D, 1 };
    int64_t lsz[3] = { 1, CHECK_H, CHECK_T }, lst[3] = { CHECK_H * CHECK_T, CHECK_T, 1 };
    ds_kview q = emu::view(qkv.data(), dt, 4, sz, st), k = emu::view(qkv.data() + n, dt, 4, sz, st);
    ds_kview v = emu::view(qkv.data() + 2 * n, dt, 4, sz, st), ov = emu::view(o.data(), dt, 4, sz, st);
    ds_kview lv = emu::view(lse.data(), DS_F32, 3, lsz, lst);
    mma_geom g = mma_geom_of(q, k, 1.0 / sqrt((double)D), causal);
    if (which)
        launch<T, D>(which == 1 ? CP_ASYNC : TMA, ov, lv, q, k, v, g);
    else
        emu::launch("mma_forward_kernel", mma_query_blocks(g), MMA_THREADS, mma_forward_smem<T>(D),
                    [&] { mma_forward_kernel<T, D>(ov, lv, q, k, v, g); });
    out.resize(n);
    for (size_t i = 0; i < n; i++) out[i] = (float)o[i];
}

/* which: 1 the cp.async Hopper forward, 2 the TMA one, against mma.sync. */
template <typename T, int D> void first_call_check(int which) {
    const bool bf = std::is_same<T, __nv_bfloat16>::value;
    const double u = bf ? 1.0 / 256 : 1.0 / 2048, scale = 1.0 / sqrt((double)D);
    std::vector<float> x = attn_check_inputs(bf ? DS_BF16 : DS_F16, D), o[2][2], l[2][2];
    for (int causal = 0; causal < 2; causal++)
        for (int w = 0; w < 2; w++) check_forward<T, D>(w ? which : 0, x, causal, o[causal][w], l[causal][w]);
    for (int causal = 0; causal < 2; causal++) {
        long at = 0;
        double e = attn_check_compare(x, D, causal, scale, u, o[causal][0], o[causal][1], l[causal][0], l[causal][1],
                                      &at);
        check(e <= 1, "%s D=%d causal=%d: the first-call check fails the emulated kernels (%.3g of its bound at %ld)",
              bf ? "bf16" : "f16", D, causal, e, at);
        printf("first-call check %s %s D=%d causal=%d: %.2f of its bound\n", which == 2 ? "tma" : "cp.async",
               bf ? "bf16" : "f16", D, causal, e);
    }
    long at = 0;
    double wrong = attn_check_compare(x, D, 1, scale, u, o[1][0], o[0][1], l[1][0], l[0][1], &at);
    check(wrong > 1, "%s D=%d: the first-call check passes a forward without the causal mask (%.3g of its bound)",
          bf ? "bf16" : "f16", D, wrong);
}

/* The TMA forward with K's map of half the rows a tile announces, on the
 * check problem: its waits run out instead of hanging. */
void stalled() {
    const size_t n = (size_t)CHECK_H * CHECK_T * 64;
    std::vector<float> x = attn_check_inputs(DS_BF16, 64);
    std::vector<__nv_bfloat16> qkv(3 * n), o(n, elem<__nv_bfloat16>(NAN)), o0 = o;
    for (size_t i = 0; i < 3 * n; i++) qkv[i] = elem<__nv_bfloat16>(x[i]);
    std::vector<float> lse((size_t)CHECK_H * CHECK_T, NAN), lse0 = lse;
    int64_t sz[4] = { 1, CHECK_H, CHECK_T, 64 }, st[4] = { CHECK_H * CHECK_T * 64, CHECK_T * 64, 64, 1 };
    int64_t lsz[3] = { 1, CHECK_H, CHECK_T }, lst[3] = { CHECK_H * CHECK_T, CHECK_T, 1 };
    ds_kview q = emu::view(qkv.data(), DS_BF16, 4, sz, st), k = emu::view(qkv.data() + n, DS_BF16, 4, sz, st);
    ds_kview v = emu::view(qkv.data() + 2 * n, DS_BF16, 4, sz, st), ov = emu::view(o.data(), DS_BF16, 4, sz, st);
    ds_kview lv = emu::view(lse.data(), DS_F32, 3, lsz, lst);
    mma_geom g = mma_geom_of(q, k, 0.125, 0);
    wt_stall stall = { -1, -1 };
    launch_tma<__nv_bfloat16, 64>(ov, lv, q, k, v, g, false, &stall, WG_KEYS / 2);
    check(stall.pos == 0 && stall.value == WT_KERNEL_FORWARD * WT_STALL_BARS + WT_FULL,
          "the stalled forward's record names block 0 and full[0] of K (block %lld, value %lld)", stall.pos,
          stall.value);
    check(!memcmp(o.data(), o0.data(), n * 2) && !memcmp(lse.data(), lse0.data(), lse.size() * 4),
          "the stalled forward leaves out and lse untouched");
    char line[512];
    bool off = wt_check_stalled(stall, "TMA forward", true, 64, 0, "the forward runs the cp.async kernel", line,
                                sizeof line);
    check(off && strstr(line, "stalled: an mbarrier wait ran out") &&
          strstr(line, "wgmma_tma_forward_kernel's full[0] of K, block 0"),
          "the first-call check reads the stall and takes the kernel as off: %s", line);
    printf("%s\n", line);
}

} /* namespace */

int main() {
    std::mt19937 rng(5);
    /* partial last tiles, a causal diagonal inside each block, several key
     * tiles per block, cross attention with more keys than queries and the
     * other way round */
    run_both<__nv_bfloat16, 64>({ 2, 2, 130, 130, true }, rng);
    run_both<__nv_bfloat16, 64>({ 1, 2, 300, 300, false }, rng);
    run_both<__nv_bfloat16, 64>({ 1, 1, 70, 290, false }, rng);
    run_both<__nv_bfloat16, 64>({ 1, 1, 290, 70, true }, rng);
    run_both<__half, 64>({ 1, 2, 257, 257, true }, rng);
    run_both<__nv_bfloat16, 128>({ 1, 1, 300, 300, true }, rng);
    run_both<__half, 128>({ 1, 1, 90, 200, false }, rng);
    /* grouped-query: 2 and 4 query heads per kv head, causal or not, both head dims */
    run_both<__nv_bfloat16, 64>({ 1, 4, 130, 130, true, 2 }, rng);
    run_both<__half, 64>({ 1, 4, 150, 150, false, 1 }, rng);
    run_both<__nv_bfloat16, 128>({ 1, 2, 140, 140, false, 1 }, rng);
    run_both<__half, 128>({ 1, 4, 130, 130, true, 1 }, rng);
    first_call_check<__nv_bfloat16, 64>(1);
    first_call_check<__nv_bfloat16, 64>(2);
    first_call_check<__half, 64>(1);
    first_call_check<__half, 64>(2);
    first_call_check<__nv_bfloat16, 128>(1);
    first_call_check<__nv_bfloat16, 128>(2);
    first_call_check<__half, 128>(1);
    first_call_check<__half, 128>(2);
    stalled();
    /* a map whose swizzle is not the one the descriptors read is caught */
    check(!run_case<__nv_bfloat16, 64>({ 1, 1, 130, 130, false }, rng, TMA_WRONG_SWIZZLE),
          "the TMA forward through an unswizzled K map is off");
    return check_summary("test_wgmma_attention");
}
