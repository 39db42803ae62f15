/* Lua bindings of the fp8 ops (ds_op_fp8.h) and of the scalar conversions
 * and scale rule they use (kernels/ds_fp8.h), formats named 'e4m3' and
 * 'e5m2'. The fp8 linear layer is lua/dslua/nn/fp8.lua. */
#include "lua_tensor.h"
#include "ds_error.h"

#include <string.h>

static ds_fp8_format check_format(lua_State *L, int idx) {
    const char *f = luaL_checkstring(L, idx);
    if (strcmp(f, "e4m3") == 0) return DS_FP8_E4M3;
    if (strcmp(f, "e5m2") == 0) return DS_FP8_E5M2;
    return (ds_fp8_format)luaL_error(L, "fp8: format must be 'e4m3' or 'e5m2', got '%s'", f);
}

static int check_margin(lua_State *L, int idx) {
    lua_Number m = luaL_optnumber(L, idx, 0);
    if (!(m >= 0 && m <= 64) || m != (int)m) return luaL_error(L, "fp8: margin must be an integer in [0, 64]");
    return (int)m;
}

/* fp8_cast(x, meta, format [, current [, margin [, amax]]]) -> u8 codes */
static int l_fp8_cast(lua_State *L) {
    ds_tensor *x = dsL_checktensor(L, 1), *meta = dsL_checktensor(L, 2);
    ds_fp8_format f = check_format(L, 3);
    int margin = check_margin(L, 5);
    ds_tensor *amax = lua_isnoneornil(L, 6) ? NULL : dsL_checktensor(L, 6);
    return dsL_pushtensor(L, ds_fp8_cast(x, meta, f, lua_toboolean(L, 4), margin, amax));
}

/* fp8_cast_transpose(x [m, k], meta, format [, current [, margin [, amax]]])
 * -> u8 codes [m, k] and the same codes transposed [k, m], in one pass */
static int l_fp8_cast_transpose(lua_State *L) {
    ds_tensor *x = dsL_checktensor(L, 1), *meta = dsL_checktensor(L, 2), *q, *qt;
    ds_fp8_format f = check_format(L, 3);
    int margin = check_margin(L, 5);
    ds_tensor *amax = lua_isnoneornil(L, 6) ? NULL : dsL_checktensor(L, 6);
    if (ds_fp8_cast_transpose(x, meta, f, lua_toboolean(L, 4), margin, amax, &q, &qt)) return dsL_error(L);
    dsL_pushtensor(L, q);
    dsL_pushtensor(L, qt);
    return 2;
}

/* fp8_amax(x) -> max |x|, f32 [1] */
static int l_fp8_amax(lua_State *L) { return dsL_pushtensor(L, ds_fp8_amax(dsL_checktensor(L, 1))); }

/* fp8_uncast(q, meta, format [, dtype = 'f32']) */
static int l_fp8_uncast(lua_State *L) {
    ds_tensor *q = dsL_checktensor(L, 1), *meta = dsL_checktensor(L, 2);
    ds_fp8_format f = check_format(L, 3);
    return dsL_pushtensor(L, ds_fp8_uncast(q, meta, f, dsL_checkdtype(L, 4, DS_F32)));
}

/* fp8_gemm(a, a_meta, a_format, b, b_meta, b_format [, bias [, dtype = 'f32']]) -> a @ b^T (+ bias) */
static int l_fp8_gemm(lua_State *L) {
    ds_tensor *a = dsL_checktensor(L, 1), *am = dsL_checktensor(L, 2);
    ds_fp8_format af = check_format(L, 3);
    ds_tensor *b = dsL_checktensor(L, 4), *bm = dsL_checktensor(L, 5);
    ds_fp8_format bf = check_format(L, 6);
    ds_tensor *bias = lua_isnoneornil(L, 7) ? NULL : dsL_checktensor(L, 7);
    return dsL_pushtensor(L, ds_fp8_gemm(a, am, af, b, bm, bf, bias, dsL_checkdtype(L, 8, DS_F32)));
}

/* fp8_encode(value, format) -> code; fp8_decode(code, format) -> value */
static int l_fp8_encode(lua_State *L) {
    lua_pushinteger(L, ds_f32_to_fp8((float)luaL_checknumber(L, 1), check_format(L, 2)));
    return 1;
}

static int l_fp8_decode(lua_State *L) {
    lua_Integer c = luaL_checkinteger(L, 1);
    if (c < 0 || c > 255) return luaL_error(L, "fp8_decode: code must be in [0, 255], got %d", (int)c);
    lua_pushnumber(L, ds_fp8_to_f32((uint8_t)c, check_format(L, 2)));
    return 1;
}

/* fp8_scale(amax, format [, margin [, prev = 1]]) -> the scale and its
 * inverse as f32 holds them (what a current cast writes into its meta) */
static int l_fp8_scale(lua_State *L) {
    float amax = (float)luaL_checknumber(L, 1);
    ds_fp8_format f = check_format(L, 2);
    float s = ds_fp8_scale(amax, f, check_margin(L, 3), (float)luaL_optnumber(L, 4, 1));
    lua_pushnumber(L, s);
    lua_pushnumber(L, 1.0f / s);
    return 2;
}

static const luaL_Reg fns[] = {
    {"fp8_cast", l_fp8_cast}, {"fp8_cast_transpose", l_fp8_cast_transpose}, {"fp8_amax", l_fp8_amax},
    {"fp8_uncast", l_fp8_uncast}, {"fp8_gemm", l_fp8_gemm},
    {"fp8_encode", l_fp8_encode}, {"fp8_decode", l_fp8_decode}, {"fp8_scale", l_fp8_scale},
    {NULL, NULL}
};

void dsL_open_fp8(lua_State *L) { dsL_register(L, fns, false); }
