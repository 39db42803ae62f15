/* Lua binding of attention:
 * ds.scaled_dot_product_attention(q, k, v [, {causal = true, scale = 1/sqrt(D), backend = 'auto'}])
 * ds.qkv_attention(qkv, n_head [, {causal = true, scale = 1/sqrt(D), backend = 'auto'}])
 * backend: 'auto', 'fused' or 'math' (ds_op_attention.h). */
#include "lua_tensor.h"

#include <math.h>
#include <string.h>

/* The options table at idx: unknown keys are errors, so a misspelt
 * `causal` cannot silently turn the mask off. */
static void check_options(lua_State *L, int idx, const char *op, bool *causal, double *scale,
                          ds_attention_backend *backend) {
    static const char *const backends[] = { "auto", "fused", "math", NULL };    /* ds_attention_backend order */
    *causal = true;
    *scale = NAN;
    *backend = DS_ATTN_AUTO;
    if (lua_isnoneornil(L, idx)) return;
    luaL_checktype(L, idx, LUA_TTABLE);
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        const char *key = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
        if (key && strcmp(key, "causal") == 0) {
            if (!lua_isboolean(L, -1)) luaL_error(L, "%s: causal must be a boolean, got %s", op, luaL_typename(L, -1));
            *causal = lua_toboolean(L, -1);
        } else if (key && strcmp(key, "scale") == 0) {
            if (lua_type(L, -1) != LUA_TNUMBER || !isfinite(lua_tonumber(L, -1)))
                luaL_error(L, "%s: scale must be a finite number, got %s", op, luaL_typename(L, -1));
            *scale = lua_tonumber(L, -1);
        } else if (key && strcmp(key, "backend") == 0) {
            int b = 0;
            const char *name = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
            while (name && backends[b] && strcmp(name, backends[b]) != 0) b++;
            if (!name || !backends[b])
                luaL_error(L, "%s: backend must be 'auto', 'fused' or 'math', got %s", op,
                           name ? lua_pushfstring(L, "'%s'", name) : luaL_typename(L, -1));
            *backend = (ds_attention_backend)b;
        } else {
            luaL_error(L, "%s: unknown option %s (expected causal, scale, backend)", op,
                       key ? lua_pushfstring(L, "'%s'", key) : luaL_typename(L, -2));
        }
        lua_pop(L, 1);
    }
}

static int l_scaled_dot_product_attention(lua_State *L) {
    ds_tensor *q = dsL_checktensor(L, 1), *k = dsL_checktensor(L, 2), *v = dsL_checktensor(L, 3);
    bool causal;
    double scale;
    ds_attention_backend backend;
    check_options(L, 4, "scaled_dot_product_attention", &causal, &scale, &backend);
    return dsL_pushtensor(L, ds_scaled_dot_product_attention(q, k, v, causal, scale, backend));
}

static int l_qkv_attention(lua_State *L) {
    ds_tensor *qkv = dsL_checktensor(L, 1);
    lua_Integer n_head = luaL_checkinteger(L, 2);
    bool causal;
    double scale;
    ds_attention_backend backend;
    check_options(L, 3, "qkv_attention", &causal, &scale, &backend);
    return dsL_pushtensor(L, ds_qkv_attention(qkv, (int64_t)n_head, causal, scale, backend));
}

static const luaL_Reg attention_functions[] = {
    {"scaled_dot_product_attention", l_scaled_dot_product_attention}, {"qkv_attention", l_qkv_attention},
    {NULL, NULL}
};

void dsL_open_attention(lua_State *L) { dsL_register(L, attention_functions, false); }
