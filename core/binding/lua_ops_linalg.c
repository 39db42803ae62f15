/* Lua bindings of the matrix products, convolution and pooling. Options
 * come as a table; sizes are a number for both spatial dims or {h, w}. */
#include "lua_tensor.h"
#include "ds_error.h"

#include <string.h>

static int l_matmul(lua_State *L) {
    return dsL_pushtensor(L, ds_matmul(dsL_checktensor(L, 1), dsL_checktensor(L, 2)));
}

static int l_mm(lua_State *L) { return dsL_pushtensor(L, ds_mm(dsL_checktensor(L, 1), dsL_checktensor(L, 2))); }
static int l_bmm(lua_State *L) { return dsL_pushtensor(L, ds_bmm(dsL_checktensor(L, 1), dsL_checktensor(L, 2))); }

/* linear(x, weight [, bias]) */
static int l_linear(lua_State *L) {
    ds_tensor *x = dsL_checktensor(L, 1), *w = dsL_checktensor(L, 2);
    ds_tensor *b = lua_isnoneornil(L, 3) ? NULL : dsL_checktensor(L, 3);
    return dsL_pushtensor(L, ds_linear(x, w, b));
}

/* Raises on keys of the options table at idx that are not in `known`. */
static void check_keys(lua_State *L, int idx, const char *op, const char *const *known) {
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        bool ok = false;
        if (lua_type(L, -1) == LUA_TSTRING)
            for (int i = 0; known[i]; i++) ok = ok || strcmp(known[i], lua_tostring(L, -1)) == 0;
        if (ok) continue;
        const char *key = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : luaL_typename(L, -1);
        luaL_Buffer b;
        luaL_buffinit(L, &b);
        for (int i = 0; known[i]; i++) {
            if (i) luaL_addstring(&b, ", ");
            luaL_addstring(&b, known[i]);
        }
        luaL_pushresult(&b);
        luaL_error(L, "%s: unknown option '%s' (expected %s)", op, key, lua_tostring(L, -1));
    }
}

static int64_t check_int(lua_State *L, int idx, const char *op, const char *what) {
    lua_Number v = lua_tonumber(L, idx);
    /* range first: casting a huge double to an integer is undefined */
    if (lua_type(L, idx) != LUA_TNUMBER || !(v > -2147483648.0 && v < 2147483648.0) || v != (lua_Number)(int64_t)v)
        luaL_error(L, "%s: %s must be an integer, got %s", op, what,
                   lua_type(L, idx) == LUA_TNUMBER ? lua_tostring(L, idx) : luaL_typename(L, idx));
    return (int64_t)v;
}

/* A size for both spatial dims from the value at idx: n or {h, w}; def when nil. */
static void check_size2(lua_State *L, int idx, const char *op, const char *what, const int64_t *def, int64_t *out) {
    if (lua_isnoneornil(L, idx)) { out[0] = def[0]; out[1] = def[1]; return; }
    if (!lua_istable(L, idx)) { out[0] = out[1] = check_int(L, idx, op, what); return; }
    if (lua_objlen(L, idx) != 2) luaL_error(L, "%s: %s must be an integer or {h, w}", op, what);
    for (int i = 0; i < 2; i++) {
        lua_rawgeti(L, idx, i + 1);
        out[i] = check_int(L, lua_gettop(L), op, what);
        lua_pop(L, 1);
    }
}

static void opt_pair(lua_State *L, int opts, const char *op, const char *key, const int64_t *def, int64_t *out) {
    if (opts) lua_getfield(L, opts, key); else lua_pushnil(L);
    check_size2(L, lua_gettop(L), op, key, def, out);
    lua_pop(L, 1);
}

/* conv2d(x, w [, bias [, opts]]) with opts {stride, padding, dilation, groups};
 * opts may also come third when there is no bias. */
static int l_conv2d(lua_State *L) {
    static const char *const known[] = { "stride", "padding", "dilation", "groups", NULL };
    ds_tensor *x = dsL_checktensor(L, 1), *w = dsL_checktensor(L, 2), *b = NULL;
    int opts = 0;
    if (lua_istable(L, 3)) opts = 3;
    else {
        if (!lua_isnoneornil(L, 3)) b = dsL_checktensor(L, 3);
        if (lua_istable(L, 4)) opts = 4;
        else if (!lua_isnoneornil(L, 4)) return luaL_argerror(L, 4, "expected an options table");
    }
    if (opts) check_keys(L, opts, "conv2d", known);
    static const int64_t one[2] = { 1, 1 }, zero[2] = { 0, 0 };
    ds_conv2d_params p;
    opt_pair(L, opts, "conv2d", "stride", one, p.stride);
    opt_pair(L, opts, "conv2d", "padding", zero, p.padding);
    opt_pair(L, opts, "conv2d", "dilation", one, p.dilation);
    p.groups = 1;
    if (opts) {
        lua_getfield(L, opts, "groups");
        if (!lua_isnil(L, -1)) p.groups = check_int(L, lua_gettop(L), "conv2d", "groups");
        lua_pop(L, 1);
    }
    return dsL_pushtensor(L, ds_conv2d(x, w, b, &p));
}

/* The shared arguments of the pools: (x, kernel [, opts]); stride defaults
 * to the kernel. */
static ds_tensor *pool_args(lua_State *L, const char *op, ds_pool2d_params *p) {
    static const char *const known_max[] = { "stride", "padding", NULL };
    static const char *const known_avg[] = { "stride", "padding", "count_include_pad", NULL };
    static const int64_t zero[2] = { 0, 0 };
    ds_tensor *x = dsL_checktensor(L, 1);
    if (lua_isnoneornil(L, 2)) luaL_error(L, "%s: expected a kernel size (an integer or {h, w})", op);
    check_size2(L, 2, op, "kernel", zero, p->kernel);
    int opts = 0;
    if (lua_istable(L, 3)) opts = 3;
    else if (!lua_isnoneornil(L, 3)) luaL_argerror(L, 3, "expected an options table");
    bool avg = strcmp(op, "avg_pool2d") == 0;
    if (opts) check_keys(L, opts, op, avg ? known_avg : known_max);
    opt_pair(L, opts, op, "stride", p->kernel, p->stride);
    opt_pair(L, opts, op, "padding", zero, p->padding);
    p->count_include_pad = 1;
    if (opts && avg) {
        lua_getfield(L, opts, "count_include_pad");
        if (!lua_isnil(L, -1)) {
            if (!lua_isboolean(L, -1)) luaL_error(L, "%s: count_include_pad must be a boolean", op);
            p->count_include_pad = lua_toboolean(L, -1);
        }
        lua_pop(L, 1);
    }
    return x;
}

/* gelu_mlp(x, w1, b1, w2, b2 [, {approximate = 'none'|'tanh'}]), b1 and b2 may be nil */
static int l_gelu_mlp(lua_State *L) {
    static const char *const known[] = { "approximate", NULL };
    ds_tensor *x = dsL_checktensor(L, 1), *w1 = dsL_checktensor(L, 2), *w2 = dsL_checktensor(L, 4);
    ds_tensor *b1 = lua_isnoneornil(L, 3) ? NULL : dsL_checktensor(L, 3);
    ds_tensor *b2 = lua_isnoneornil(L, 5) ? NULL : dsL_checktensor(L, 5);
    const char *how = "none";
    if (lua_istable(L, 6)) {
        check_keys(L, 6, "gelu_mlp", known);
        lua_getfield(L, 6, "approximate");
        if (!lua_isnil(L, -1)) how = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : luaL_typename(L, -1);
    } else if (!lua_isnoneornil(L, 6)) {
        return luaL_argerror(L, 6, "expected an options table");
    }
    if (strcmp(how, "tanh") != 0 && strcmp(how, "none") != 0)
        return luaL_error(L, "gelu_mlp: approximate must be 'none' or 'tanh', got %s", how);
    return dsL_pushtensor(L, ds_gelu_mlp(x, w1, b1, w2, b2, strcmp(how, "tanh") == 0));
}

/* max_pool2d(x, kernel [, {stride=kernel, padding=0}]) */
static int l_max_pool2d(lua_State *L) {
    ds_pool2d_params p;
    ds_tensor *x = pool_args(L, "max_pool2d", &p);
    return dsL_pushtensor(L, ds_max_pool2d(x, &p));
}

/* avg_pool2d(x, kernel [, {stride=kernel, padding=0, count_include_pad=true}]) */
static int l_avg_pool2d(lua_State *L) {
    ds_pool2d_params p;
    ds_tensor *x = pool_args(L, "avg_pool2d", &p);
    return dsL_pushtensor(L, ds_avg_pool2d(x, &p));
}

static const luaL_Reg linalg_fns[] = {
    {"matmul", l_matmul}, {"mm", l_mm}, {"bmm", l_bmm}, {"linear", l_linear},
    {"gelu_mlp", l_gelu_mlp},
    {"conv2d", l_conv2d}, {"max_pool2d", l_max_pool2d}, {"avg_pool2d", l_avg_pool2d},
    {NULL, NULL}
};

void dsL_open_linalg(lua_State *L) {
    dsL_register(L, linalg_fns, true);
}
