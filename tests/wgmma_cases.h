/* What the emulated Hopper attention tests share: a case's shape and the
 * 16-bit element of a float. Include after warp_emulator.h. */
#ifndef WGMMA_CASES_H
#define WGMMA_CASES_H

#include <stdint.h>
#include <type_traits>

namespace wgmma_cases {

/* KV: k and v's heads, each read by H / KV query heads (0: H) */
struct shape {
    int64_t B, H, Tq, Tk; bool causal; int64_t KV = 0;
    int64_t kv() const { return KV ? KV : H; }
};

template <typename T> T elem(float x) {
    return T{ std::is_same<T, __nv_bfloat16>::value ? ds_f32_to_bf16(x) : ds_f32_to_f16(x) };
}

}  // namespace wgmma_cases

#endif
