/* Data-parallel gradient buckets in Lua, as ds.core._ddp (used by the
 * engine):
 *
 *   local d = _ddp.new(params, bucket_size)
 *   d:buckets() -> n;  d:bucket(b) -> flat gradient view, first param, count   (1-based)
 *   d:backward(loss, launch, poll) -> buckets launched during backward, gradients completed after the first launch
 *   d:close()
 *
 * backward runs loss's backward with the hooks armed: launch(b, flat) for
 * each bucket as it fills, in bucket order; poll() after each completed
 * gradient; the buckets left are launched after backward. An error in a
 * callback fails the backward with its message. */
#include "lua_tensor.h"
#include "ds_autograd.h"
#include "ds_ddp.h"
#include "ds_error.h"

#include <stdlib.h>

#define DSL_DDP_MT "dslua.DDP"

static ds_ddp **check_ddp(lua_State *L) {
    ds_ddp **d = luaL_checkudata(L, 1, DSL_DDP_MT);
    if (!*d) luaL_error(L, "ddp: used after close()");
    return d;
}

/* new(params, bucket_size) */
static int l_new(lua_State *L) {
    luaL_checktype(L, 1, LUA_TTABLE);
    lua_Number size = luaL_checknumber(L, 2);
    if (size < 0) return luaL_error(L, "ddp: bucket size must be >= 0, got %f", size);
    int n = (int)lua_objlen(L, 1);
    ds_tensor **params = malloc((size_t)(n ? n : 1) * sizeof *params);
    if (!params) return luaL_error(L, "ddp: out of memory");
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, 1, i + 1);
        params[i] = dsL_totensor(L, -1);
        lua_pop(L, 1);
        if (!params[i]) {
            free(params);
            return luaL_error(L, "ddp: parameter %d is not a tensor", i + 1);
        }
    }
    ds_ddp **ud = lua_newuserdata(L, sizeof *ud);
    *ud = NULL;
    luaL_getmetatable(L, DSL_DDP_MT);
    lua_setmetatable(L, -2);
    *ud = ds_ddp_new(n, params, (int64_t)size);
    free(params);
    if (!*ud) return dsL_error(L);
    return 1;
}

static int l_buckets(lua_State *L) {
    lua_pushinteger(L, ds_ddp_n_buckets(*check_ddp(L)));
    return 1;
}

static int l_bucket(lua_State *L) {
    ds_ddp *d = *check_ddp(L);
    int b = (int)luaL_checkinteger(L, 2);
    if (b < 1 || b > ds_ddp_n_buckets(d))
        return luaL_error(L, "ddp: bucket %d out of range [1, %d]", b, ds_ddp_n_buckets(d));
    int first, count;
    ds_ddp_bucket_params(d, b - 1, &first, &count);
    dsL_pushtensor(L, ds_ddp_bucket(d, b - 1));
    lua_pushinteger(L, first + 1);
    lua_pushinteger(L, count);
    return 3;
}

/* The Lua callbacks of one backward, at stack slots 3 and 4. */
typedef struct { lua_State *L; } callbacks;

static int call_lua(lua_State *L, int nargs, const char *what) {
    if (lua_pcall(L, nargs, 0, 0) == 0) return 0;
    const char *msg = lua_tostring(L, -1);
    ds_fail(DS_ERR_STATE, "ddp: %s: %s", what, msg ? msg : "(error object is not a string)");
    lua_pop(L, 1);
    return -1;
}

static int launch_cb(int b, ds_tensor *flat, void *ud) {
    lua_State *L = ((callbacks *)ud)->L;
    if (lua_isnil(L, 3)) return 0;
    lua_pushvalue(L, 3);
    lua_pushinteger(L, b + 1);
    ds_tensor_retain(flat);
    dsL_pushtensor(L, flat);
    return call_lua(L, 2, "launch");
}

static int poll_cb(void *ud) {
    lua_State *L = ((callbacks *)ud)->L;
    if (lua_isnil(L, 4)) return 0;
    lua_pushvalue(L, 4);
    return call_lua(L, 0, "poll");
}

static int l_backward(lua_State *L) {
    ds_ddp *d = *check_ddp(L);
    ds_tensor *loss = dsL_checktensor(L, 2);
    lua_settop(L, 4);
    if (!lua_isnil(L, 3)) luaL_checktype(L, 3, LUA_TFUNCTION);
    if (!lua_isnil(L, 4)) luaL_checktype(L, 4, LUA_TFUNCTION);
    callbacks cb = { L };
    if (ds_ddp_arm(d, launch_cb, poll_cb, &cb)) return dsL_error(L);
    if (dsL_backward(L, loss, NULL, false)) {
        ds_ddp_disarm(d);
        return dsL_error(L);
    }
    ds_ddp_counts counts;
    if (ds_ddp_flush(d, &counts)) return dsL_error(L);
    lua_pushinteger(L, counts.launched_in_backward);
    lua_pushinteger(L, counts.leaves_after_first_launch);
    return 2;
}

static int l_close(lua_State *L) {
    ds_ddp **d = luaL_checkudata(L, 1, DSL_DDP_MT);
    ds_ddp_free(*d);
    *d = NULL;
    return 0;
}

static const luaL_Reg ddp_methods[] = {
    {"buckets", l_buckets}, {"bucket", l_bucket}, {"backward", l_backward}, {"close", l_close},
    {NULL, NULL}
};

void dsL_open_ddp(lua_State *L) {
    luaL_newmetatable(L, DSL_DDP_MT);
    lua_newtable(L);
    luaL_register(L, NULL, ddp_methods);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, l_close);
    lua_setfield(L, -2, "__gc");
    lua_pop(L, 1);
    lua_newtable(L);
    lua_pushcfunction(L, l_new);
    lua_setfield(L, -2, "new");
    lua_setfield(L, -2, "_ddp");
}
