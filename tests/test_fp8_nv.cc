// kernels/ds_fp8.h's f32 -> fp8 against NVIDIA's own conversion
// (cuda_fp8.h's __nv_cvt_float_to_fp8 with __NV_SATFINITE, its host code,
// which the GPU's cvt.rn.satfinite matches): every 257th f32 bit pattern
// and every f32 within 4 steps of a halfway point, both formats, bit for
// bit but for NaN's sign and payload (ds_fp8.h makes every NaN 0x7f).
// Built against the toolkit's headers where they are; skipped (77)
// without them.
#if __has_include(<cuda_fp8.h>)
#include <cuda_fp8.h>
#define HAVE_CUDA_FP8 1
#endif
#include "ds_fp8.h"

#include <math.h>
#include <stdio.h>

#include "check.h"

#ifdef HAVE_CUDA_FP8
static int nvidia_code(float x, ds_fp8_format f) {
    return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, f == DS_FP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
}

static int bad;

static void compare(float x, ds_fp8_format f) {
    if (isnan(x)) return;
    int ours = ds_f32_to_fp8(x, f), theirs = nvidia_code(x, f);
    if (ours != theirs && bad++ < 10)
        check(0, "%s %.9g: 0x%02x, cuda_fp8.h 0x%02x", f == DS_FP8_E4M3 ? "e4m3" : "e5m2", x, ours, theirs);
}
#endif

int main() {
#ifdef HAVE_CUDA_FP8
    for (int f = 0; f < DS_NFP8; f++) {
        ds_fp8_format fmt = (ds_fp8_format)f;
        for (uint64_t u = 0; u <= 0xffffffffu; u += 257) compare(ds_bits_f32((uint32_t)u), fmt);
        for (int c = 0; c < 0x7b; c++) {
            float mid = (ds_fp8_to_f32((uint8_t)c, fmt) + ds_fp8_to_f32((uint8_t)(c + 1), fmt)) / 2;
            uint32_t m = ds_f32_bits(mid);
            for (uint32_t d = 0; d <= 8; d++) {
                compare(ds_bits_f32(m + d - 4), fmt);
                compare(-ds_bits_f32(m + d - 4), fmt);
            }
        }
        check(ds_f32_to_fp8(INFINITY, fmt) == nvidia_code(INFINITY, fmt), "infinity saturates as cuda_fp8.h does");
    }
    check(bad == 0, "%d values converted otherwise than cuda_fp8.h", bad);
    return check_summary("test_fp8_nv");
#else
    printf("test_fp8_nv: skipped: no cuda_fp8.h on the include path\n");
    return 77;
#endif
}
