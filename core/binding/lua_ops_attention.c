/* Lua binding of fused attention:
 * ds.scaled_dot_product_attention(q, k, v [, {causal = true, scale = 1/sqrt(D)}]) */
#include "lua_tensor.h"

#include <math.h>
#include <string.h>

#define OP "scaled_dot_product_attention"

/* Unknown option keys are errors: a misspelt `causal` must not silently
 * turn the mask off. */
static int l_scaled_dot_product_attention(lua_State *L) {
    ds_tensor *q = dsL_checktensor(L, 1), *k = dsL_checktensor(L, 2), *v = dsL_checktensor(L, 3);
    bool causal = true;
    double scale = NAN;
    if (!lua_isnoneornil(L, 4)) {
        luaL_checktype(L, 4, LUA_TTABLE);
        lua_pushnil(L);
        while (lua_next(L, 4)) {
            const char *key = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
            if (key && strcmp(key, "causal") == 0) {
                if (!lua_isboolean(L, -1))
                    return luaL_error(L, OP ": causal must be a boolean, got %s", luaL_typename(L, -1));
                causal = lua_toboolean(L, -1);
            } else if (key && strcmp(key, "scale") == 0) {
                if (lua_type(L, -1) != LUA_TNUMBER || !isfinite(lua_tonumber(L, -1)))
                    return luaL_error(L, OP ": scale must be a finite number, got %s", luaL_typename(L, -1));
                scale = lua_tonumber(L, -1);
            } else {
                return luaL_error(L, OP ": unknown option %s (expected causal, scale)",
                                  key ? lua_pushfstring(L, "'%s'", key) : luaL_typename(L, -2));
            }
            lua_pop(L, 1);
        }
    }
    return dsL_pushtensor(L, ds_scaled_dot_product_attention(q, k, v, causal, scale));
}

static const luaL_Reg attention_functions[] = {
    {"scaled_dot_product_attention", l_scaled_dot_product_attention},
    {NULL, NULL}
};

void dsL_open_attention(lua_State *L) { dsL_register(L, attention_functions, false); }
