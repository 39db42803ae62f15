/* The emulated warpgroup MMA (tests/warp_emulator_wgmma.h) against a plain
 * matrix product: wgmma m64nNk16 (N = 64, 128; bf16, f16) with A and B
 * from shared memory (both K-major) or A from registers and B MN-major,
 * for each swizzle mode (none, 32B, 64B, 128B), the tiles written here
 * from the PTX ISA's description (dense rows of the swizzle's width,
 * 16-byte chunks xor-ed by address bits 7..; 8x8 core matrices without
 * one) and the descriptors encoded here bit by bit; over four k16 steps,
 * so a K-major start address moves within a swizzled row. Also: the
 * accumulators are NaN until the wait that covers them and wait_group 1
 * leaves the newest group pending; and each misuse the emulator must catch
 * aborts (in a child process), named barriers' among them. */
#include "warp_emulator.h"

extern "C" {
#include "check.h"
}

#include <random>

namespace {

const int KTOT = 64;   /* four k16 steps */

enum { SW_NONE = 0, SW_128 = 1, SW_64 = 2, SW_32 = 3 };

int row_bytes(int mode) { return mode == SW_128 ? 128 : mode == SW_64 ? 64 : mode == SW_32 ? 32 : 16; }

/* The PTX ISA's swizzle: bits 4.. of a byte offset (from a tile aligned
 * to the pattern) xor-ed with bits 7.., as many as the mode has. */
uint32_t swizzled(uint32_t a, int mode) {
    int bits = mode == SW_128 ? 3 : mode == SW_64 ? 2 : mode == SW_32 ? 1 : 0;
    return a ^ ((a >> 7 & ((1u << bits) - 1)) << 4);
}

uint64_t encode(uint32_t addr, uint32_t lbo, uint32_t sbo, int mode) {
    return (uint64_t)(addr >> 4 & 0x3fff) | (uint64_t)(lbo >> 4 & 0x3fff) << 16 |
           (uint64_t)(sbo >> 4 & 0x3fff) << 32 | (uint64_t)mode << 62;
}

/* Byte offset of element (r, k) of an R x KTOT operand stored K-major. */
uint32_t kmajor_at(int r, int k, int R, int mode) {
    if (mode == SW_NONE) return (uint32_t)(((k / 8) * (R / 8) + r / 8) * 128 + (r % 8) * 16 + (k % 8) * 2);
    int S = row_bytes(mode), per = S / 2;
    return swizzled((uint32_t)((k / per) * R * S + r * S + (k % per) * 2), mode);
}

/* Its descriptor for k16 step s, the tile at base. */
uint64_t kmajor_desc(uint32_t base, int s, int R, int mode) {
    if (mode == SW_NONE) return encode(base + 2 * s * (R / 8) * 128, (R / 8) * 128, 128, mode);
    int S = row_bytes(mode), per = S / 2, k0 = 16 * s;
    return encode(base + (k0 / per) * R * S + (k0 % per) * 2, 16, 8 * S, mode);
}

/* Element (n, k) of an N x KTOT operand stored MN-major ([k][n]). */
uint32_t mnmajor_at(int n, int k, int N, int mode) {
    if (mode == SW_NONE) return (uint32_t)(((k / 8) * (N / 8) + n / 8) * 128 + (k % 8) * 16 + (n % 8) * 2);
    int S = row_bytes(mode), per = S / 2;
    return swizzled((uint32_t)((n / per) * KTOT * S + k * S + (n % per) * 2), mode);
}

uint64_t mnmajor_desc(uint32_t base, int s, int N, int mode) {
    if (mode == SW_NONE) return encode(base + 2 * s * (N / 8) * 128, (N / 8) * 128, 128, mode);
    int S = row_bytes(mode);
    return encode(base + 16 * s * S, KTOT * S, 8 * S, mode);
}

template <typename T> uint16_t bits_of(float x) {
    return std::is_same<T, __nv_bfloat16>::value ? ds_f32_to_bf16(x) : ds_f32_to_f16(x);
}

/* Copies the image into shared memory the way kernels must: cp.async,
 * wait, fence.proxy.async, barrier. */
void stage(const std::vector<unsigned char> &image) {
    for (size_t c = threadIdx.x; c < image.size() / 16; c += blockDim.x)
        cp_async_16(smem + 16 * c, image.data() + 16 * c, true);
    cp_async_commit();
    cp_async_wait(0);
    fence_proxy_async();
    __syncthreads();
}

/* Each thread's accumulators into out[64][N] by the m64nNk16 layout. */
template <int N> void spill(const float d[N / 8][4], std::vector<float> &out) {
    int t = threadIdx.x % 128, w = t / 32, g = t % 32 / 4, c = t % 4;
    for (int i = 0; i < N / 8; i++)
        for (int e = 0; e < 4; e++)
            out[(size_t)(16 * w + g + (e >= 2 ? 8 : 0)) * N + 8 * i + 2 * c + (e & 1)] = d[i][e];
}

/* C + A B over KTOT (four steps, the first with scale-d 1 on C) for one
 * layout; A from registers when a_regs (B then MN-major). */
template <typename T, int N> void product(int mode, bool a_regs, std::mt19937 &rng) {
    const bool bf = std::is_same<T, __nv_bfloat16>::value;
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<float> A(64 * KTOT), B(N * KTOT), C(64 * N), got(64 * N, NAN), early(64 * N, 0.f);
    for (float &x : A) x = emu::f16bits(bits_of<T>(normal(rng)), bf);
    for (float &x : B) x = emu::f16bits(bits_of<T>(normal(rng)), bf);
    for (float &x : C) x = normal(rng);
    const uint32_t abase = 0, bbase = 64 * KTOT * 2;   /* both 1024-byte aligned */
    std::vector<unsigned char> image(bbase + N * KTOT * 2);
    for (int r = 0; r < 64; r++)
        for (int k = 0; k < KTOT; k++) {
            uint16_t b = bits_of<T>(A[r * KTOT + k]);
            memcpy(&image[abase + kmajor_at(r, k, 64, mode)], &b, 2);
        }
    for (int n = 0; n < N; n++)
        for (int k = 0; k < KTOT; k++) {
            uint16_t b = bits_of<T>(B[n * KTOT + k]);
            memcpy(&image[bbase + (a_regs ? mnmajor_at(n, k, N, mode) : kmajor_at(n, k, N, mode))], &b, 2);
        }
    emu::launch("wgmma_product", 1, 128, image.size(), [&] {
        stage(image);
        int t = threadIdx.x, w = t / 32, g = t % 32 / 4, c = t % 4;
        float d[N / 8][4];
        for (int i = 0; i < N / 8; i++)
            for (int e = 0; e < 4; e++)
                d[i][e] = C[(size_t)(16 * w + g + (e >= 2 ? 8 : 0)) * N + 8 * i + 2 * c + (e & 1)];
        uint32_t a[KTOT / 16][4];
        for (int s = 0; s < KTOT / 16; s++)
            for (int i = 0; i < 4; i++) {
                int row = 16 * w + g + (i % 2) * 8, col = 16 * s + 2 * c + (i / 2) * 8;
                a[s][i] = bits_of<T>(A[row * KTOT + col]) | (uint32_t)bits_of<T>(A[row * KTOT + col + 1]) << 16;
            }
        wgmma_fence();
        for (int s = 0; s < KTOT / 16; s++) {
            if (a_regs) wgmma_rs<N>(d, a[s], mnmajor_desc(bbase, s, N, mode), 1, T());
            else wgmma_ss<N>(d, kmajor_desc(abase, s, 64, mode), kmajor_desc(bbase, s, N, mode), 1, T());
        }
        wgmma_commit();
        spill<N>(d, early);
        wgmma_wait<0>();
        spill<N>(d, got);
    });
    double worst = 0;
    bool nan_early = true;
    for (int r = 0; r < 64; r++)
        for (int n = 0; n < N; n++) {
            double want = C[r * N + n], mag = fabs(want);
            for (int k = 0; k < KTOT; k++) {
                want += (double)A[r * KTOT + k] * B[n * KTOT + k];
                mag += fabs((double)A[r * KTOT + k] * B[n * KTOT + k]);
            }
            /* four f32 roundings of partial sums, each within 2^-24 of the magnitude */
            double e = fabs(got[r * N + n] - want) / (4 * 0x1p-24 * mag + 1e-30);
            worst = e > worst || e != e ? e : worst;
            nan_early = nan_early && isnan(early[r * N + n]);
        }
    const char *modes[] = { "none", "128B", "64B", "32B" };
    check(worst <= 1, "%s N=%d swizzle %s A from %s: off by %.3g times the f32 bound", bf ? "bf16" : "f16", N,
          modes[mode], a_regs ? "registers" : "shared memory", worst);
    check(nan_early, "%s N=%d swizzle %s: accumulators readable before the wait", bf ? "bf16" : "f16", N,
          modes[mode]);
}

/* Two groups, scale-d 0 on garbage: after wait_group 1 the first group's
 * accumulators hold A B and the second's are still NaN; after wait_group 0
 * both hold it. */
void groups() {
    std::vector<unsigned char> image(2 * 64 * 16 * 2);
    std::vector<float> A(64 * 16);
    for (int r = 0; r < 64; r++)
        for (int k = 0; k < 16; k++) {
            A[r * 16 + k] = (float)((r + 3 * k) % 7 - 3);
            uint16_t b = ds_f32_to_bf16(A[r * 16 + k]);
            memcpy(&image[kmajor_at(r, k, 64, SW_NONE)], &b, 2);
            memcpy(&image[64 * 16 * 2 + kmajor_at(r, k, 64, SW_NONE)], &b, 2);
        }
    std::vector<float> first(64 * 64), second(64 * 64), last(64 * 64);
    emu::launch("wgmma_groups", 1, 128, image.size(), [&] {
        stage(image);
        float x[8][4], y[8][4];
        for (int i = 0; i < 8; i++)
            for (int e = 0; e < 4; e++) x[i][e] = y[i][e] = 12345.f;
        uint64_t a = encode(0, 8 * 128, 128, SW_NONE);
        uint64_t b = encode(64 * 16 * 2, 8 * 128, 128, SW_NONE);
        wgmma_fence();
        wgmma_ss<64>(x, a, b, 0, __nv_bfloat16());
        wgmma_commit();
        wgmma_fence();
        wgmma_ss<64>(y, a, b, 0, __nv_bfloat16());
        wgmma_commit();
        wgmma_wait<1>();
        spill<64>(x, first);
        spill<64>(y, second);
        wgmma_wait<0>();
        spill<64>(y, last);
    });
    bool ok1 = true, ok2 = true, ok3 = true;
    for (int r = 0; r < 64; r++)
        for (int n = 0; n < 64; n++) {
            double want = 0;
            for (int k = 0; k < 16; k++) want += (double)A[r * 16 + k] * A[n * 16 + k];
            ok1 = ok1 && first[r * 64 + n] == want;
            ok2 = ok2 && isnan(second[r * 64 + n]);
            ok3 = ok3 && last[r * 64 + n] == want;
        }
    check(ok1, "wait_group 1: the older group's accumulators hold A B (scale-d 0)");
    check(ok2, "wait_group 1: the newest group's accumulators are still NaN");
    check(ok3, "wait_group 0: the newest group's accumulators hold A B");
}

/* A misuse: body run as a one-warpgroup kernel in a child must abort. */
void must_abort(const char *what, const std::function<void()> &body) {
    check(emu::launch_aborts(what, 128, 4096, body), "the emulator aborts on %s", what);
}

void misuse() {
    static unsigned char src[4096] __attribute__((aligned(16)));
    auto staged = [] {
        for (int c = threadIdx.x; c < 256; c += 128) cp_async_16(smem + 16 * c, src + 16 * c, true);
        cp_async_commit();
        cp_async_wait(0);
        fence_proxy_async();
        __syncthreads();
    };
    uint64_t plain = encode(0, 1024, 128, SW_NONE);
    must_abort("an mma without wgmma.fence", [&] {
        staged();
        float d[8][4] = {};
        wgmma_ss<64>(d, plain, plain, 1, __nv_bfloat16());
    });
    must_abort("a swizzled operand off its pattern's first row", [&] {
        staged();
        float d[8][4] = {};
        wgmma_fence();
        wgmma_ss<64>(d, encode(128, 16, 1024, SW_128), encode(0, 16, 1024, SW_128), 1, __nv_bfloat16());
    });
    must_abort("a descriptor past the shared memory", [&] {
        staged();
        float d[8][4] = {};
        wgmma_fence();
        wgmma_ss<64>(d, encode(2048, 16, 1024, SW_128), plain, 1, __nv_bfloat16());
    });
    must_abort("cp.async data without fence.proxy.async", [&] {
        for (int c = threadIdx.x; c < 256; c += 128) cp_async_16(smem + 16 * c, src + 16 * c, true);
        cp_async_commit();
        cp_async_wait(0);
        __syncthreads();
        float d[8][4] = {};
        wgmma_fence();
        wgmma_ss<64>(d, plain, plain, 1, __nv_bfloat16());
    });
    must_abort("shared memory overwritten under a pending mma", [&] {
        staged();
        float d[8][4] = {};
        wgmma_fence();
        wgmma_ss<64>(d, plain, plain, 1, __nv_bfloat16());
        wgmma_commit();
        smem[threadIdx.x] = 1;
        wgmma_wait<0>();
    });
    must_abort("named barriers with different thread counts", [&] {
        if (threadIdx.x < 32) named_barrier_sync(1, 64);
        else if (threadIdx.x < 64) named_barrier_arrive(1, 128);
    });
    must_abort("a warpgroup at different wgmma instructions", [&] {
        staged();
        float d[8][4] = {};
        wgmma_fence();
        if (threadIdx.x < 64) wgmma_commit();
        else wgmma_ss<64>(d, plain, plain, 1, __nv_bfloat16());
    });
}

} /* namespace */

int main() {
    std::mt19937 rng(11);
    for (int mode : { SW_NONE, SW_32, SW_64, SW_128 }) {
        for (bool a_regs : { false, true }) {
            product<__nv_bfloat16, 64>(mode, a_regs, rng);
            product<__half, 128>(mode, a_regs, rng);
        }
    }
    groups();
    misuse();
    return check_summary("test_wgmma");
}
