/* The Hopper attention backward (kernels/cuda/cuda_attention_wgmma_bwd.cuh)
 * on the CPU through tests/warp_emulator.h: dq, dk and dv against the
 * gradients in double of the same bf16/f16 inputs and of the forward's
 * out and lse as a kernel wrote them, held to test_attention_mma's bound
 * for 16-bit inputs with f32 sums (a few units of the last place of the
 * largest value; a wrong fragment, transpose or mask is off by O(1));
 * head dims 64 and 128, causal or not, lengths that leave partial tiles
 * (down to a few queries and keys), cross attention both ways, q/k/v as views into one packed qkv buffer,
 * and k and v with 2 and 4 query heads per kv head (grouped-query: dk and
 * dv summed over the group's queries).
 * And the check the dispatch runs before trusting the kernels on a GPU
 * (cuda_attention_check.h) on the emulated kernels: the Hopper backward
 * and the mma.sync one agree within its bound in every variant, and
 * gradients without the causal mask are past it. A healthy TMA backward
 * leaves its stall records unwritten; with Q's map of half the rows its
 * expect_tx announces, both kernels return with their bounded waits run
 * out, the records naming the dQ kernel's mbarrier of its own tiles and
 * the dK/dV kernel's full[0], dq, dk and dv untouched, and the first-call
 * check's reading of a record says it stalled. */
#include "warp_emulator.h"
#include "wgmma_cases.h"
#include "cuda/cuda_attention_check.h"
#include "cuda/cuda_attention_wgmma_bwd.cuh"

extern "C" {
#include "check.h"
}

#include <random>
#include <type_traits>

namespace {

using wgmma_cases::shape;
using wgmma_cases::elem;

/* The tensors of one backward: q, k, v views into one buffer, the rest
 * [B, T, H, D] seen as [B, H, T, D]. */
template <typename T> struct problem {
    std::vector<T> qkv, obuf, gbuf, dqb, dkb, dvb;
    std::vector<float> lsebuf;
    ds_kview q, k, v, out, dout, dq, dk, dv, lse;
};

/* The forward on p (mma.sync's or wgmma's): out and lse. */
template <typename T, int D> void run_forward(problem<T> &p, const mma_geom &g, bool wgmma) {
    if (wgmma)
        emu::launch("wgmma_forward_kernel", wgmma_query_blocks(g), WG_THREADS, wg_forward_smem<D>(),
                    [&] { wgmma_forward_kernel<T, D>(p.out, p.lse, p.q, p.k, p.v, g); });
    else
        emu::launch("mma_forward_kernel", mma_query_blocks(g), MMA_THREADS, mma_forward_smem<T>(D),
                    [&] { mma_forward_kernel<T, D>(p.out, p.lse, p.q, p.k, p.v, g); });
}

/* The backwards under test: mma.sync's, the Hopper one staging its tiles
 * by cp.async, and the one fed by TMA from a producer warpgroup. */
enum kernel { MMA_SYNC, CP_ASYNC, TMA };

/* The TMA backward's kernels on p: their tensor maps from the emulated
 * driver (Q's boxes of q_rows rows), their stall records in stall[0]
 * (dQ) and stall[1] (dK/dV). */
template <typename T, int D>
void launch_tma(problem<T> &p, const mma_geom &g, float *stats, wt_stall stall[2], unsigned q_rows = WGB_TILE) {
    wtb_maps m;
    auto map = [](CUtensorMap *x, const ds_kview &v, unsigned rows = WGB_TILE) {
        return !wt_map(x, v, cuTensorMapEncodeTiled, rows);
    };
    check(map(&m.q, p.q, q_rows) && map(&m.k, p.k) && map(&m.v, p.v) && map(&m.dout, p.dout),
          "q, k, v and dout have tensor maps");
    emu::launch("wgmma_tma_dq_kernel", wgmma_dq_blocks(g), WT_THREADS, wtb_dq_smem<D>(),
                [&] { wgmma_tma_dq_kernel<T, D>(p.dq, m, stats, g, &stall[0]); });
    emu::launch("wgmma_tma_dkdv_kernel", wgmma_dkdv_blocks(g), WT_THREADS, wtb_dkdv_smem<D>(),
                [&] { wgmma_tma_dkdv_kernel<T, D>(p.dk, p.dv, m, stats, g, &stall[1]); });
}

/* The backward on p by kernel kn: dq, dk, dv. */
template <typename T, int D> void run_backward(problem<T> &p, const mma_geom &g, kernel kn) {
    std::vector<float> stats(mma_stats_bytes(g) / sizeof(float), NAN);
    emu::launch("mma_stats_kernel", mma_stats_blocks(g), MMA_STATS_THREADS, 0,
                [&] { mma_stats_kernel<T, D>(stats.data(), p.dout, p.out, p.lse, g); });
    if (kn == TMA) {
        wt_stall stall[2] = { { -1, -1 }, { -1, -1 } };
        launch_tma<T, D>(p, g, stats.data(), stall);
        check(stall[0].pos == -1 && stall[1].pos == -1, "a healthy TMA backward writes no stall record");
    } else if (kn == CP_ASYNC) {
        emu::launch("wgmma_dq_kernel", wgmma_dq_blocks(g), WG_THREADS, wgb_dq_smem<D>(),
                    [&] { wgmma_dq_kernel<T, D>(p.dq, p.dout, p.q, p.k, p.v, stats.data(), g); });
        emu::launch("wgmma_dkdv_kernel", wgmma_dkdv_blocks(g), WG_THREADS, wgb_dkdv_smem<D>(),
                    [&] { wgmma_dkdv_kernel<T, D>(p.dk, p.dv, p.dout, p.q, p.k, p.v, stats.data(), g); });
    } else {
        emu::launch("mma_dq_kernel", mma_dq_blocks<T>(g, D), MMA_THREADS, mma_dq_smem<T>(D),
                    [&] { mma_dq_kernel<T, D>(p.dq, p.dout, p.q, p.k, p.v, stats.data(), g); });
        emu::launch("mma_dkdv_kernel", mma_dkdv_blocks(g, D), MMA_THREADS, mma_dkdv_smem<T>(D),
                    [&] { mma_dkdv_kernel<T, D>(p.dk, p.dv, p.dout, p.q, p.k, p.v, stats.data(), g); });
    }
}

template <typename T, int D> void run_case(const shape &s, bool wgmma_fwd, std::mt19937 &rng) {
    const bool bf = std::is_same<T, __nv_bfloat16>::value;
    const ds_dtype dt = bf ? DS_BF16 : DS_F16;
    const int64_t KV = s.kv(), G = s.H / KV, C = s.H * D, W = C + 2 * KV * D, Tmax = std::max(s.Tq, s.Tk);
    const double scale = 1.0 / sqrt((double)D);
    problem<T> p;
    std::normal_distribution<float> normal(0.f, 1.f);
    /* [B, T, H + 2 KV, D]: q, k, v as GPT-2's attention passes them (KV = H) */
    p.qkv.resize((size_t)(s.B * Tmax * W));
    for (T &x : p.qkv) x = elem<T>(normal(rng));
    auto heads = [&](void *data, int64_t H, int64_t T_, int64_t sb, int64_t st) {
        int64_t sz[4] = { s.B, H, T_, D }, sd[4] = { sb, D, st, 1 };
        return emu::view(data, dt, 4, sz, sd);
    };
    auto inner = [&](std::vector<T> &buf, int64_t H, int64_t T_) {
        buf.assign((size_t)(s.B * T_ * H * D), elem<T>(NAN));
        return heads(buf.data(), H, T_, T_ * H * D, H * D);
    };
    p.q = heads(p.qkv.data(), s.H, s.Tq, Tmax * W, W);
    p.k = heads(p.qkv.data() + C, KV, s.Tk, Tmax * W, W);
    p.v = heads(p.qkv.data() + C + KV * D, KV, s.Tk, Tmax * W, W);
    p.out = inner(p.obuf, s.H, s.Tq), p.dout = inner(p.gbuf, s.H, s.Tq), p.dq = inner(p.dqb, s.H, s.Tq);
    p.dk = inner(p.dkb, KV, s.Tk), p.dv = inner(p.dvb, KV, s.Tk);
    for (T &x : p.gbuf) x = elem<T>(normal(rng));
    p.lsebuf.assign((size_t)(s.B * s.H * s.Tq), NAN);
    int64_t lsz[3] = { s.B, s.H, s.Tq }, lst[3] = { s.H * s.Tq, s.Tq, 1 };
    p.lse = emu::view(p.lsebuf.data(), DS_F32, 3, lsz, lst);
    mma_geom g = mma_geom_of(p.q, p.k, scale, s.causal);
    run_forward<T, D>(p, g, wgmma_fwd);

    auto A = [](const ds_kview &x, int64_t b, int64_t h, int64_t t, int d) {
        return (double)(float)((const T *)x.data)[b * x.stride[0] + h * x.stride[1] + t * x.stride[2] + d];
    };
    /* the gradients in double of the kernels' own inputs: P = exp(s - lse)
     * with the lse the forward wrote, delta = dO . O of its out; laid out
     * as dq (want[0]) and dk, dv (want[1], want[2]) are */
    std::vector<double> want[3] = { std::vector<double>(p.dqb.size()), std::vector<double>(p.dkb.size()),
                                    std::vector<double>(p.dkb.size()) };
    auto at = [](const ds_kview &x, int64_t b, int64_t h, int64_t t, int d) {
        return (size_t)(b * x.stride[0] + h * x.stride[1] + t * x.stride[2] + d);
    };
    std::vector<double> P((size_t)(s.Tq * s.Tk)), dS(P.size());
    for (int64_t b = 0; b < s.B; b++)
        for (int64_t kh = 0; kh < KV; kh++)
            /* dk and dv of kv head kh: sums over its group's query heads */
            for (int64_t h = kh * G; h < (kh + 1) * G; h++) {
                for (int64_t i = 0; i < s.Tq; i++) {
                    double di = 0, lk = p.lsebuf[(size_t)((b * s.H + h) * s.Tq + i)];
                    for (int d = 0; d < D; d++) di += A(p.out, b, h, i, d) * A(p.dout, b, h, i, d);
                    for (int64_t j = 0; j < s.Tk; j++) {
                        double dot = 0, dp = 0;
                        for (int d = 0; d < D; d++)
                            dot += A(p.q, b, h, i, d) * A(p.k, b, kh, j, d),
                            dp += A(p.dout, b, h, i, d) * A(p.v, b, kh, j, d);
                        double pr = s.causal && j > i ? 0 : exp(dot * scale - lk);
                        P[i * s.Tk + j] = pr, dS[i * s.Tk + j] = pr * (dp - di);
                    }
                }
                for (int64_t i = 0; i < s.Tq; i++)
                    for (int d = 0; d < D; d++) {
                        double a = 0;
                        for (int64_t j = 0; j < s.Tk; j++) a += dS[i * s.Tk + j] * A(p.k, b, kh, j, d);
                        want[0][at(p.dq, b, h, i, d)] = a * scale;
                    }
                for (int64_t j = 0; j < s.Tk; j++)
                    for (int d = 0; d < D; d++)
                        for (int64_t i = 0; i < s.Tq; i++) {
                            want[1][at(p.dk, b, kh, j, d)] += dS[i * s.Tk + j] * A(p.q, b, h, i, d) * scale;
                            want[2][at(p.dv, b, kh, j, d)] += P[i * s.Tk + j] * A(p.dout, b, h, i, d);
                        }
            }
    const double tol = bf ? 2e-2 : 4e-3;
    const char *name = bf ? "bf16" : "f16", *what[3] = { "dq", "dk", "dv" };
    for (kernel kn : { CP_ASYNC, TMA }) {
        std::vector<T> *got[3] = { &p.dqb, &p.dkb, &p.dvb };
        for (std::vector<T> *x : got) std::fill(x->begin(), x->end(), elem<T>(NAN));
        run_backward<T, D>(p, g, kn);
        double worst[3] = {}, big[3] = {};
        for (int w = 0; w < 3; w++)
            for (size_t e = 0; e < want[w].size(); e++) {
                double err = fabs((double)(float)(*got[w])[e] - want[w][e]);
                worst[w] = err <= worst[w] ? worst[w] : err;   /* NaN sticks */
                big[w] = fmax(big[w], fabs(want[w][e]));
            }
        const char *kname = kn == TMA ? "tma" : "cp.async";
        for (int w = 0; w < 3; w++)
            check(worst[w] <= tol * big[w],
                  "%s %s D=%d B=%lld H=%lld KV=%lld Tq=%lld Tk=%lld causal=%d: %s off by %.3g of its largest %.3g",
                  kname, name, D, (long long)s.B, (long long)s.H, (long long)KV, (long long)s.Tq, (long long)s.Tk,
                  s.causal, what[w], worst[w] / big[w], big[w]);
        printf("%s %s D=%d H=%lld KV=%lld Tq=%lld Tk=%lld causal=%d (%s forward): dq %.1e dk %.1e dv %.1e\n", kname,
               name, D, (long long)s.H, (long long)KV, (long long)s.Tq, (long long)s.Tk, s.causal,
               wgmma_fwd ? "wgmma" : "mma.sync", worst[0] / big[0], worst[1] / big[1], worst[2] / big[2]);
    }
}

/* The three backwards of the check problem, emulated, on the mma.sync
 * forward's out and lse: grads[w] the dq, dk, dv of kernel w (mma.sync,
 * cp.async, TMA) as floats, and out and lse. */
template <typename T, int D>
void check_backwards(const std::vector<float> &x, int causal, std::vector<float> grads[3][3], std::vector<float> &out,
                     std::vector<float> &lse) {
    const ds_dtype dt = std::is_same<T, __nv_bfloat16>::value ? DS_BF16 : DS_F16;
    const size_t n = (size_t)CHECK_H * CHECK_T * D;
    problem<T> p;
    p.qkv.resize(4 * n);
    for (size_t i = 0; i < 4 * n; i++) p.qkv[i] = elem<T>(x[i]);
    p.obuf.assign(n, elem<T>(NAN));
    p.lsebuf.assign((size_t)CHECK_H * CHECK_T, NAN);
    int64_t sz[4] = { 1, CHECK_H, CHECK_T, D }, st[4] = { CHECK_H * CHECK_T * D, CHECK_T * D, D, 1 };
    int64_t lsz[3] = { 1, CHECK_H, CHECK_T }, lst[3] = { CHECK_H * CHECK_T, CHECK_T, 1 };
    p.q = emu::view(p.qkv.data(), dt, 4, sz, st), p.k = emu::view(p.qkv.data() + n, dt, 4, sz, st);
    p.v = emu::view(p.qkv.data() + 2 * n, dt, 4, sz, st), p.dout = emu::view(p.qkv.data() + 3 * n, dt, 4, sz, st);
    p.out = emu::view(p.obuf.data(), dt, 4, sz, st);
    p.lse = emu::view(p.lsebuf.data(), DS_F32, 3, lsz, lst);
    mma_geom g = mma_geom_of(p.q, p.k, 1.0 / sqrt((double)D), causal);
    run_forward<T, D>(p, g, false);
    for (int w = MMA_SYNC; w <= TMA; w++) {
        p.dqb.assign(n, elem<T>(NAN)), p.dkb = p.dvb = p.dqb;
        p.dq = emu::view(p.dqb.data(), dt, 4, sz, st), p.dk = emu::view(p.dkb.data(), dt, 4, sz, st);
        p.dv = emu::view(p.dvb.data(), dt, 4, sz, st);
        run_backward<T, D>(p, g, (kernel)w);
        const std::vector<T> *bufs[3] = { &p.dqb, &p.dkb, &p.dvb };
        for (int i = 0; i < 3; i++) {
            grads[w][i].resize(n);
            for (size_t e = 0; e < n; e++) grads[w][i][e] = (float)(*bufs[i])[e];
        }
    }
    out.resize(n);
    for (size_t i = 0; i < n; i++) out[i] = (float)p.obuf[i];
    lse = p.lsebuf;
}

template <typename T, int D> void first_call_check() {
    const bool bf = std::is_same<T, __nv_bfloat16>::value;
    const double u = bf ? 1.0 / 256 : 1.0 / 2048, scale = 1.0 / sqrt((double)D);
    const char *name = bf ? "bf16" : "f16", *what[3] = { "dq", "dk", "dv" };
    std::vector<float> x = attn_check_inputs(bf ? DS_BF16 : DS_F16, D, 4), g[2][3][3], out[2], lse[2];
    for (int causal = 0; causal < 2; causal++) check_backwards<T, D>(x, causal, g[causal], out[causal], lse[causal]);
    for (int causal = 0; causal < 2; causal++)
        for (int kn = CP_ASYNC; kn <= TMA; kn++) {
            int which = 0;
            long at = 0;
            const char *kname = kn == TMA ? "tma" : "cp.async";
            double e = attn_check_backward_compare(x, D, causal, scale, u, out[causal], lse[causal], g[causal][0],
                                                   g[causal][kn], &which, &at);
            check(e <= 1, "%s %s D=%d causal=%d: the backward's first-call check fails the emulated kernels (%.3g of "
                  "its bound at %s %ld)", kname, name, D, causal, e, what[which], at);
            printf("backward first-call check %s %s D=%d causal=%d: %.3g of its bound\n", kname, name, D, causal, e);
        }
    int which = 0;
    long at = 0;
    double wrong = attn_check_backward_compare(x, D, 1, scale, u, out[1], lse[1], g[1][0], g[0][TMA], &which, &at);
    check(wrong > 1, "%s D=%d: the backward's first-call check passes gradients without the causal mask (%.3g of "
          "its bound)", name, D, wrong);
    printf("backward first-call check %s D=%d without the mask: %.3g of its bound\n", name, D, wrong);
}

/* The TMA backward with Q's map of half the rows a box announces, 100
 * queries and keys (the producers' loads all issued before any wait on
 * "empty", so the consumers' waits are the ones that run out): its waits
 * run out instead of hanging. */
void stalled() {
    const int D = 64;
    const size_t n = (size_t)CHECK_H * 100 * D;
    std::vector<float> x = attn_check_inputs(DS_BF16, D, 4);
    problem<__nv_bfloat16> p;
    p.qkv.resize(4 * n);
    for (size_t i = 0; i < 4 * n; i++) p.qkv[i] = elem<__nv_bfloat16>(x[i]);
    p.obuf.assign(n, elem<__nv_bfloat16>(NAN));
    p.dqb.assign(n, elem<__nv_bfloat16>(NAN)), p.dkb = p.dvb = p.dqb;
    const std::vector<__nv_bfloat16> untouched = p.dqb;
    p.lsebuf.assign((size_t)CHECK_H * 100, NAN);
    int64_t sz[4] = { 1, CHECK_H, 100, D }, st[4] = { CHECK_H * 100 * D, 100 * D, D, 1 };
    int64_t lsz[3] = { 1, CHECK_H, 100 }, lst[3] = { CHECK_H * 100, 100, 1 };
    ds_kview *views[7] = { &p.q, &p.k, &p.v, &p.dout, &p.dq, &p.dk, &p.dv };
    __nv_bfloat16 *data[7] = { p.qkv.data(), p.qkv.data() + n, p.qkv.data() + 2 * n, p.qkv.data() + 3 * n,
                               p.dqb.data(), p.dkb.data(), p.dvb.data() };
    for (int i = 0; i < 7; i++) *views[i] = emu::view(data[i], DS_BF16, 4, sz, st);
    p.out = emu::view(p.obuf.data(), DS_BF16, 4, sz, st);
    p.lse = emu::view(p.lsebuf.data(), DS_F32, 3, lsz, lst);
    mma_geom g = mma_geom_of(p.q, p.k, 0.125, 0);
    run_forward<__nv_bfloat16, D>(p, g, false);
    std::vector<float> stats(mma_stats_bytes(g) / sizeof(float), NAN);
    emu::launch("mma_stats_kernel", mma_stats_blocks(g), MMA_STATS_THREADS, 0,
                [&] { mma_stats_kernel<__nv_bfloat16, D>(stats.data(), p.dout, p.out, p.lse, g); });
    wt_stall stall[2] = { { -1, -1 }, { -1, -1 } };
    launch_tma<__nv_bfloat16, D>(p, g, stats.data(), stall, WGB_TILE / 2);
    check(stall[0].pos == 0 && stall[0].value == WT_KERNEL_DQ * WT_STALL_BARS + WTB_ONCE,
          "the stalled dQ kernel's record names block 0 and its own tiles' mbarrier (block %lld, value %lld)",
          stall[0].pos, stall[0].value);
    check(stall[1].pos == 0 && stall[1].value == WT_KERNEL_DKDV * WT_STALL_BARS + WTB_FULL,
          "the stalled dK/dV kernel's record names block 0 and full[0] (block %lld, value %lld)", stall[1].pos,
          stall[1].value);
    check(!memcmp(p.dqb.data(), untouched.data(), n * 2) && !memcmp(p.dkb.data(), untouched.data(), n * 2) &&
          !memcmp(p.dvb.data(), untouched.data(), n * 2), "the stalled backward leaves dq, dk and dv untouched");
    char line[512];
    bool off = wt_check_stalled(stall[1], "TMA backward", true, D, 0, "the backward runs the cp.async kernels", line,
                                sizeof line);
    check(off && strstr(line, "stalled: an mbarrier wait ran out") &&
          strstr(line, "wgmma_tma_dkdv_kernel's full[0], block 0"),
          "the first-call check reads the stall and takes the kernels as off: %s", line);
    printf("%s\n", line);
}

} /* namespace */

int main() {
    std::mt19937 rng(11);
    /* partial last tiles, a causal diagonal inside each block, several
     * tiles each way, cross attention with more keys than queries and the
     * other way round; out and lse from either forward */
    run_case<__nv_bfloat16, 64>({ 2, 2, 130, 130, true }, false, rng);
    run_case<__nv_bfloat16, 64>({ 1, 2, 200, 200, false }, true, rng);
    run_case<__nv_bfloat16, 64>({ 1, 1, 70, 290, false }, false, rng);
    run_case<__nv_bfloat16, 64>({ 1, 1, 70, 290, true }, false, rng);   /* key blocks no query sees */
    run_case<__nv_bfloat16, 64>({ 1, 1, 290, 70, true }, true, rng);
    run_case<__half, 64>({ 1, 2, 257, 257, true }, false, rng);
    run_case<__nv_bfloat16, 128>({ 1, 1, 300, 300, true }, true, rng);
    run_case<__half, 128>({ 1, 1, 90, 200, false }, false, rng);
    run_case<__nv_bfloat16, 64>({ 1, 3, 3, 2, true }, true, rng);   /* a few queries and keys: every tile partial */
    /* grouped-query: 2 and 4 query heads per kv head, causal or not, both
     * head dims; under a causal mask key blocks past the first skip the
     * group's early query tiles, and cross attention leaves key blocks no
     * query sees */
    run_case<__nv_bfloat16, 64>({ 1, 4, 150, 150, true, 2 }, true, rng);
    run_case<__half, 64>({ 1, 4, 100, 100, false, 1 }, false, rng);
    run_case<__nv_bfloat16, 128>({ 1, 2, 100, 100, false, 1 }, false, rng);
    run_case<__half, 128>({ 1, 4, 100, 100, true, 1 }, true, rng);
    run_case<__nv_bfloat16, 64>({ 1, 4, 70, 290, true, 1 }, false, rng);
    /* both dtypes and both head dims (the check costs the most emulated time) */
    first_call_check<__nv_bfloat16, 64>();
    first_call_check<__half, 128>();
    stalled();
    return check_summary("test_wgmma_backward");
}
