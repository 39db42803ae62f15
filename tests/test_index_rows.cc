/* index_add into float rows by sorted runs (kernels/cuda/cuda_index_rows.cuh)
 * on the CPU, through tests/warp_emulator.h: the kernel's result against
 * the same sums done here, bit for bit, with repeated indices, indices out
 * of range (skipped), several outer slices and a row longer than a block.
 * The sort is the stable one the GPU's radix sort performs. */
#include "warp_emulator.h"
#include "cuda/cuda_index_rows.cuh"

extern "C" {
#include "check.h"
}

#include <algorithm>
#include <random>

namespace {

ds_kview flat(void *data, ds_dtype dt, int64_t n) {
    int64_t one = 1;
    return emu::view(data, dt, 1, &n, &one);
}

/* With out_of_range, some indices are negative or past the end (sorted
 * last, skipped); without, the last run is a real one. */
void run_case(ds_dtype dt, int64_t outer, int64_t n, int64_t inner, int64_t m, bool out_of_range, std::mt19937 &rng) {
    std::uniform_int_distribution<int64_t> pick(out_of_range ? -3 : 0, n / 3);   /* few rows: long runs */
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<int64_t> idx((size_t)m);
    for (int64_t &i : idx) i = pick(rng);
    if (out_of_range) idx[0] = n;
    /* elements of dt's size, filled through ds_store */
    size_t es = ds_dtype_size(dt);
    std::vector<unsigned char> dst(outer * n * inner * es), src(outer * m * inner * es);
    for (size_t e = 0; e < dst.size() / es; e++) ds_store(dt, dst.data(), (int64_t)e, normal(rng));
    for (size_t e = 0; e < src.size() / es; e++) ds_store(dt, src.data(), (int64_t)e, normal(rng));
    std::vector<unsigned char> want = dst;
    /* the keys and the stable sort row_keys_kernel and the radix sort give */
    std::vector<unsigned> keys((size_t)m), pos((size_t)m);
    for (int64_t j = 0; j < m; j++) {
        keys[j] = (unsigned)(idx[j] >= 0 && idx[j] < n ? idx[j] : n);
        pos[j] = (unsigned)j;
    }
    std::stable_sort(pos.begin(), pos.end(), [&](unsigned a, unsigned b) { return keys[a] < keys[b]; });
    std::vector<unsigned> sorted((size_t)m);
    for (int64_t j = 0; j < m; j++) sorted[j] = keys[pos[j]];
    /* the expected rows: each run summed in double in position order */
    for (int64_t o = 0; o < outer; o++)
        for (int64_t r = 0; r < m; r++) {
            if (sorted[r] >= n || (r > 0 && sorted[r - 1] == sorted[r])) continue;
            for (int64_t c = 0; c < inner; c++) {
                int64_t d = (o * n + sorted[r]) * inner + c;
                double sum = ds_load(dt, want.data(), d);
                for (int64_t j = r; j < m && sorted[j] == sorted[r]; j++)
                    sum += ds_load(dt, src.data(), (o * m + pos[j]) * inner + c);
                ds_store(dt, want.data(), d, sum);
            }
        }
    ds_kview dv = flat(dst.data(), dt, (int64_t)(dst.size() / es)), sv = flat(src.data(), dt, (int64_t)(src.size() / es));
    emu::launch("index_add_runs_kernel", (unsigned)(outer * m), INDEX_RUNS_THREADS, 0,
                [&] { index_add_runs_kernel(dv, sv, sorted.data(), pos.data(), m, n, inner); });
    int64_t wrong = 0, changed = 0;
    for (size_t e = 0; e < dst.size() / es; e++) wrong += memcmp(&dst[e * es], &want[e * es], es) != 0;
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i = 0; i < n; i++) changed += std::count(idx.begin(), idx.end(), i) > 0;
    const char *name = dt == DS_BF16 ? "bf16" : dt == DS_F16 ? "f16" : dt == DS_F32 ? "f32" : "f64";
    check(wrong == 0, "%s outer=%lld n=%lld inner=%lld m=%lld: %lld of %zu elements differ from the sums", name, (long long)outer, (long long)n, (long long)inner, (long long)m,
          (long long)wrong, dst.size() / es);
    if (m > 1)
        check(changed > 1 && changed < outer * n, "the case leaves some rows alone and adds into several (%lld)",
              (long long)changed);
}

} /* namespace */

int main() {
    std::mt19937 rng(11);
    run_case(DS_BF16, 1, 40, 300, 64, true, rng);     /* a row of 300: threads stride over it */
    run_case(DS_BF16, 1, 40, 300, 64, false, rng);
    run_case(DS_F16, 3, 17, 5, 41, true, rng);
    run_case(DS_F16, 2, 17, 5, 41, false, rng);
    run_case(DS_BF16, 2, 9, 128, 1, true, rng);       /* one index, out of range */
    run_case(DS_F32, 1, 30, 70, 50, true, rng);
    run_case(DS_F64, 2, 30, 70, 50, false, rng);
    return check_summary("test_index_rows");
}
