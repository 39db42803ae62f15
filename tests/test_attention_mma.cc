/* The tensor-core attention kernels (kernels/cuda/cuda_attention_mma.cuh)
 * on the CPU, through tests/warp_emulator.h: forward (out, lse) and
 * backward (dq, dk, dv) against attention computed in double from the
 * same 16-bit inputs; bf16 and f16, head dims 64 and 128, causal or not,
 * lengths that leave partial tiles, q/k/v as views into one packed qkv
 * buffer as GPT-2's attention passes them. No GPU needed: what runs is
 * the kernels' own code, with ldmatrix, mma and cp.async emulated from
 * the PTX ISA's definitions. */
#include "warp_emulator.h"
#include "cuda/cuda_attention_mma.cuh"

extern "C" {
#include "check.h"
}

#include <random>

namespace {

struct shape { int64_t B, H, Tq, Tk; int D; bool causal; };

/* A [B, H, T, D] view with the given element strides. */
ds_kview heads_view(void *data, ds_dtype dt, const shape &s, int64_t T, int64_t sb, int64_t sh, int64_t st) {
    int64_t sz[4] = { s.B, s.H, T, s.D }, sd[4] = { sb, sh, st, 1 };
    return emu::view(data, dt, 4, sz, sd);
}

/* [B, T, H, D] memory seen as [B, H, T, D]: the fused op's layout. */
ds_kview heads_inner(std::vector<uint16_t> &buf, ds_dtype dt, const shape &s, int64_t T) {
    buf.assign((size_t)(s.B * T * s.H * s.D), 0xffff);
    return heads_view(buf.data(), dt, s, T, T * s.H * s.D, s.D, s.H * s.D);
}

float at(const ds_kview &v, int64_t b, int64_t h, int64_t t, int64_t d) {
    uint16_t x = ((const uint16_t *)v.data)[b * v.stride[0] + h * v.stride[1] + t * v.stride[2] + d];
    return v.dtype == DS_BF16 ? ds_bf16_to_f32(x) : ds_f16_to_f32(x);
}

/* max |got - want| over max |want|, for one result. */
struct error { double worst = 0, scale = 0; void add(double got, double want) {
    if (!(fabs(got - want) <= worst)) worst = fabs(got - want);   /* NaN sticks */
    scale = fmax(scale, fabs(want));
} double rel() const { return worst / fmax(scale, 1e-30); } };

template <typename T, int D> void run_case(const shape &s, ds_dtype dt, std::mt19937 &rng) {
    const int64_t C = s.H * D;
    const double scale = 1.0 / sqrt((double)D);
    /* q, k and v inside one [B, T, 3, H, D] buffer when the lengths agree, as
     * qkv_attention passes them; separate [B, T, H, D] buffers otherwise */
    int64_t Tmax = s.Tq > s.Tk ? s.Tq : s.Tk;
    std::vector<uint16_t> qkv((size_t)(s.B * Tmax * 3 * C));
    std::normal_distribution<float> normal(0.f, 1.f);
    for (uint16_t &x : qkv) x = dt == DS_BF16 ? ds_f32_to_bf16(normal(rng)) : ds_f32_to_f16(normal(rng));
    ds_kview q = heads_view(qkv.data(), dt, s, s.Tq, Tmax * 3 * C, D, 3 * C);
    ds_kview k = heads_view(qkv.data() + C, dt, s, s.Tk, Tmax * 3 * C, D, 3 * C);
    ds_kview v = heads_view(qkv.data() + 2 * C, dt, s, s.Tk, Tmax * 3 * C, D, 3 * C);
    std::vector<uint16_t> gbuf, obuf, dqb, dkb, dvb;
    ds_kview dout = heads_inner(gbuf, dt, s, s.Tq);
    for (uint16_t &x : gbuf) x = dt == DS_BF16 ? ds_f32_to_bf16(normal(rng)) : ds_f32_to_f16(normal(rng));
    ds_kview out = heads_inner(obuf, dt, s, s.Tq), dq = heads_inner(dqb, dt, s, s.Tq);
    ds_kview dk = heads_inner(dkb, dt, s, s.Tk), dv = heads_inner(dvb, dt, s, s.Tk);
    std::vector<float> lsebuf((size_t)(s.B * s.H * s.Tq), NAN);
    int64_t lsz[3] = { s.B, s.H, s.Tq }, lst[3] = { s.H * s.Tq, s.Tq, 1 };
    ds_kview lse = emu::view(lsebuf.data(), DS_F32, 3, lsz, lst);

    mma_geom g = mma_geom_of(q, k, scale, s.causal);
    emu::launch("mma_forward_kernel", mma_query_blocks(g), MMA_THREADS, mma_forward_smem(D),
                [&] { mma_forward_kernel<T, D>(out, lse, q, k, v, g); });
    std::vector<float> stats(mma_stats_bytes(g) / sizeof(float), NAN);
    emu::launch("mma_stats_kernel", mma_stats_blocks(g), MMA_STATS_THREADS, 0,
                [&] { mma_stats_kernel<T, D>(stats.data(), dout, out, lse, g); });
    emu::launch("mma_dq_kernel", mma_query_blocks(g), MMA_THREADS, mma_dq_smem(D),
                [&] { mma_dq_kernel<T, D>(dq, dout, q, k, v, stats.data(), g); });
    emu::launch("mma_dkdv_kernel", mma_dkdv_blocks(g, D), MMA_THREADS, mma_dkdv_smem(D),
                [&] { mma_dkdv_kernel<T, D>(dk, dv, dout, q, k, v, stats.data(), g); });

    /* the reference, in double, per (b, h) */
    error e_out, e_lse, e_dq, e_dk, e_dv;
    std::vector<double> P((size_t)(s.Tq * s.Tk)), dS((size_t)(s.Tq * s.Tk));
    for (int64_t b = 0; b < s.B; b++)
        for (int64_t h = 0; h < s.H; h++) {
            for (int64_t i = 0; i < s.Tq; i++) {
                double mx = -INFINITY;
                for (int64_t j = 0; j < s.Tk; j++) {
                    double dot = 0;
                    for (int d = 0; d < D; d++) dot += (double)at(q, b, h, i, d) * at(k, b, h, j, d);
                    P[i * s.Tk + j] = s.causal && j > i ? -INFINITY : dot * scale;
                    mx = fmax(mx, P[i * s.Tk + j]);
                }
                double sum = 0;
                for (int64_t j = 0; j < s.Tk; j++) sum += P[i * s.Tk + j] = exp(P[i * s.Tk + j] - mx);
                for (int64_t j = 0; j < s.Tk; j++) P[i * s.Tk + j] /= sum;
                e_lse.add(((float *)lse.data)[(b * s.H + h) * s.Tq + i], mx + log(sum));
                double di = 0;
                for (int d = 0; d < D; d++) {
                    double o = 0;
                    for (int64_t j = 0; j < s.Tk; j++) o += P[i * s.Tk + j] * at(v, b, h, j, d);
                    e_out.add(at(out, b, h, i, d), o);
                    di += o * at(dout, b, h, i, d);
                }
                for (int64_t j = 0; j < s.Tk; j++) {
                    double dp = 0;
                    for (int d = 0; d < D; d++) dp += (double)at(dout, b, h, i, d) * at(v, b, h, j, d);
                    dS[i * s.Tk + j] = P[i * s.Tk + j] * (dp - di);
                }
            }
            for (int64_t i = 0; i < s.Tq; i++)
                for (int d = 0; d < D; d++) {
                    double a = 0;
                    for (int64_t j = 0; j < s.Tk; j++) a += dS[i * s.Tk + j] * at(k, b, h, j, d);
                    e_dq.add(at(dq, b, h, i, d), a * scale);
                }
            for (int64_t j = 0; j < s.Tk; j++)
                for (int d = 0; d < D; d++) {
                    double a = 0, c = 0;
                    for (int64_t i = 0; i < s.Tq; i++) {
                        a += dS[i * s.Tk + j] * at(q, b, h, i, d);
                        c += P[i * s.Tk + j] * at(dout, b, h, i, d);
                    }
                    e_dk.add(at(dk, b, h, j, d), a * scale);
                    e_dv.add(at(dv, b, h, j, d), c);
                }
        }
    /* 16-bit inputs and outputs: a few units of the last place of the
     * largest value; a wrong fragment or mask is off by O(1) */
    double tol = dt == DS_BF16 ? 2e-2 : 4e-3;
    const char *name = dt == DS_BF16 ? "bf16" : "f16";
    struct { const char *what; const error &e; } rows[] = {
        { "out", e_out }, { "lse", e_lse }, { "dq", e_dq }, { "dk", e_dk }, { "dv", e_dv },
    };
    for (const auto &r : rows)
        check(r.e.rel() <= tol, "%s D=%d B=%lld H=%lld Tq=%lld Tk=%lld causal=%d: %s off by %.3g of its largest %.3g",
              name, D, (long long)s.B, (long long)s.H, (long long)s.Tq, (long long)s.Tk, s.causal, r.what, r.e.rel(),
              r.e.scale);
    printf("%s D=%d Tq=%lld Tk=%lld causal=%d: out %.1e lse %.1e dq %.1e dk %.1e dv %.1e\n", name, D,
           (long long)s.Tq, (long long)s.Tk, s.causal, e_out.rel(), e_lse.rel(), e_dq.rel(), e_dk.rel(), e_dv.rel());
}

} /* namespace */

int main() {
    std::mt19937 rng(7);
    /* partial last tiles, whole tiles off the diagonal, cross attention
     * with more keys than queries and the other way round */
    run_case<__nv_bfloat16, 64>({ 2, 2, 130, 130, 64, true }, DS_BF16, rng);
    run_case<__nv_bfloat16, 64>({ 1, 2, 130, 130, 64, false }, DS_BF16, rng);
    run_case<__nv_bfloat16, 64>({ 1, 1, 70, 150, 64, false }, DS_BF16, rng);
    run_case<__nv_bfloat16, 64>({ 1, 1, 300, 300, 64, false }, DS_BF16, rng);
    run_case<__nv_bfloat16, 64>({ 1, 3, 320, 320, 64, true }, DS_BF16, rng);
    run_case<__nv_bfloat16, 64>({ 1, 1, 150, 70, 64, true }, DS_BF16, rng);
    run_case<__half, 64>({ 1, 2, 100, 100, 64, true }, DS_F16, rng);
    run_case<__nv_bfloat16, 128>({ 1, 1, 128, 128, 128, true }, DS_BF16, rng);
    run_case<__half, 128>({ 1, 1, 90, 90, 128, false }, DS_F16, rng);
    return check_summary("test_attention_mma");
}
