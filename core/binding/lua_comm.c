/* The comm layer in Lua, as ds._comm: the primitives on positional
 * arguments (tensor, rank, op, group, async), works and groups as
 * userdata. lua/dslua/parallel/comm.lua builds ds.comm on top (options tables, the
 * comms logger, rank-prefixed printing). */
#include "lua_tensor.h"
#include "ds_comm.h"
#include "ds_env.h"
#include "ds_error.h"

#include <limits.h>
#include <stdlib.h>

#define DSL_WORK_MT "dslua.CommWork"

enum { RESULT_NONE, RESULT_ONE, RESULT_LIST };

typedef struct {
    ds_comm_work *w;
    int kind;
} work_ud;

/* The pending core error, raised without a position: the core message
 * names the primitive, and the caller is comm.lua's wrapper anyway. */
static int comm_error(lua_State *L) {
    lua_pushstring(L, ds_error_message());
    return dsL_raw_error(L);
}

static ds_comm_group *opt_group(lua_State *L, int idx) {
    if (lua_isnoneornil(L, idx)) return NULL;
    return *(ds_comm_group **)luaL_checkudata(L, idx, DSL_GROUP_MT);
}

static int check_rank(lua_State *L, int idx, const char *what) {
    lua_Number r = luaL_checknumber(L, idx);
    if (!(r >= 0 && r <= INT_MAX && r == (int)r))
        luaL_argerror(L, idx, lua_pushfstring(L, "%s must be a rank >= 0", what));
    return (int)r;
}

static ds_comm_op check_op(lua_State *L, int idx, const char *name) {
    const char *s = luaL_optstring(L, idx, "sum");
    int op = ds_comm_op_parse(s);
    if (op < 0) luaL_error(L, "%s: unknown op '%s' (sum, avg, max, min, prod)", name, s);
    return (ds_comm_op)op;
}

/* A Lua list of tensors as a malloc'd array (borrowed tensors); *n its
 * length. nil gives NULL when allowed. */
static ds_tensor **check_list(lua_State *L, int idx, const char *name, bool nil_ok, int *n) {
    *n = 0;
    if (nil_ok && lua_isnoneornil(L, idx)) return NULL;
    if (!lua_istable(L, idx)) luaL_error(L, "%s: expected a list of tensors, got %s", name, luaL_typename(L, idx));
    int len = (int)lua_objlen(L, idx);
    ds_tensor **list = malloc((size_t)(len ? len : 1) * sizeof *list);
    if (!list) luaL_error(L, "%s: out of memory", name);
    for (int i = 0; i < len; i++) {
        lua_rawgeti(L, idx, i + 1);
        list[i] = dsL_totensor(L, -1);
        lua_pop(L, 1);
        if (!list[i]) {
            free(list);
            luaL_error(L, "%s: list entry %d is not a tensor", name, i + 1);
        }
    }
    *n = len;
    return list;
}

static int push_results(lua_State *L, ds_comm_work *w, int kind) {
    int n = ds_comm_work_nresults(w);
    if (kind == RESULT_NONE) return 0;
    if (kind == RESULT_ONE) return dsL_pushtensor(L, ds_comm_work_result(w, 0));
    if (n == 0) { lua_pushnil(L); return 1; }
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        dsL_pushtensor(L, ds_comm_work_result(w, i));
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

/* Blocking: waits and pushes the results. Async: pushes the work. */
static int finish(lua_State *L, ds_comm_work *w, int kind, bool async) {
    if (!w) return comm_error(L);
    if (async) {
        work_ud *u = lua_newuserdata(L, sizeof *u);
        u->w = w;
        u->kind = kind;
        luaL_getmetatable(L, DSL_WORK_MT);
        lua_setmetatable(L, -2);
        return 1;
    }
    if (ds_comm_work_wait(w)) {
        ds_comm_work_release(w);
        return comm_error(L);
    }
    int n = push_results(L, w, kind);
    ds_comm_work_release(w);
    return n;
}

static work_ud *check_work(lua_State *L) {
    work_ud *u = luaL_checkudata(L, 1, DSL_WORK_MT);
    if (!u->w) luaL_error(L, "comm: work already released");
    return u;
}

static int l_work_wait(lua_State *L) {
    work_ud *u = check_work(L);
    if (ds_comm_work_wait(u->w)) return comm_error(L);
    return push_results(L, u->w, u->kind);
}

static int l_work_is_completed(lua_State *L) {
    work_ud *u = check_work(L);
    bool done = false;
    if (ds_comm_work_test(u->w, &done)) return comm_error(L);
    lua_pushboolean(L, done);
    return 1;
}

static int l_work_gc(lua_State *L) {
    work_ud *u = luaL_checkudata(L, 1, DSL_WORK_MT);
    ds_comm_work_release(u->w);
    u->w = NULL;
    return 0;
}

static int l_group_rank(lua_State *L) {
    lua_pushinteger(L, ds_comm_rank(opt_group(L, 1)));
    return 1;
}

static int l_group_size(lua_State *L) {
    lua_pushinteger(L, ds_comm_size(opt_group(L, 1)));
    return 1;
}

static int l_group_ranks(lua_State *L) {
    ds_comm_group *g = opt_group(L, 1);
    int n = ds_comm_size(g);
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_pushinteger(L, ds_comm_group_world_rank(g, i));
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int l_group_tostring(lua_State *L) {
    lua_pushfstring(L, "group%s", ds_comm_group_name(opt_group(L, 1)));
    return 1;
}

static int l_new_group(lua_State *L) {
    int n = 0;
    luaL_checktype(L, 1, LUA_TTABLE);
    n = (int)lua_objlen(L, 1);
    int *ranks = malloc((size_t)(n ? n : 1) * sizeof *ranks);
    if (!ranks) return luaL_error(L, "new_group: out of memory");
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, 1, i + 1);
        lua_Number v = lua_tonumber(L, -1);
        /* range first: a cast of a number past int's range is undefined */
        bool ok = lua_type(L, -1) == LUA_TNUMBER && v >= INT_MIN && v <= INT_MAX && v == (int)v;
        lua_pop(L, 1);
        if (!ok) {
            free(ranks);
            return luaL_error(L, "new_group: entry %d of the rank list is not an integer", i + 1);
        }
        ranks[i] = (int)v;
    }
    ds_comm_group *g = ds_comm_new_group(ranks, n);
    free(ranks);
    if (!g) return comm_error(L);
    ds_comm_group **p = dsL_newhandle(L, DSL_GROUP_MT);
    *p = g;
    return 1;
}

static int l_is_group(lua_State *L) {
    lua_pushboolean(L, luaL_testudata(L, 1, DSL_GROUP_MT) != NULL);
    return 1;
}

static int l_local_rank(lua_State *L) {
    lua_pushinteger(L, ds_env_local_rank());
    return 1;
}

static int l_local_size(lua_State *L) {
    lua_pushinteger(L, ds_env_local_size());
    return 1;
}

static int l_launched(lua_State *L) {
    lua_pushboolean(L, ds_comm_launched());
    return 1;
}

/* is_initialized(): starts MPI when launched by mpirun, as a distributed
 * script expects the answer to be true there */
static int l_is_initialized(lua_State *L) {
    if (ds_comm_init()) return comm_error(L);
    lua_pushboolean(L, ds_comm_is_initialized());
    return 1;
}

static int l_set_timeout(lua_State *L) {
    lua_Number s = luaL_checknumber(L, 1);
    if (!(s > 0)) return luaL_error(L, "set_timeout: seconds must be > 0, got %f", s);
    ds_comm_set_timeout(s);
    return 0;
}

static int l_timeout(lua_State *L) {
    lua_pushnumber(L, ds_comm_timeout());
    return 1;
}

static int l_set_check(lua_State *L) {
    ds_comm_set_check(lua_toboolean(L, 1));
    return 0;
}

/* backend(): the backend of device tensors, chosen now if not yet;
 * set_backend(name, source): chooses it (source names the setting) */
static int l_backend(lua_State *L) {
    const char *name = ds_comm_device_backend();
    if (!name) return dsL_error(L);
    lua_pushstring(L, name);
    return 1;
}

static int l_set_backend(lua_State *L) {
    if (ds_comm_set_device_backend(luaL_checkstring(L, 1), luaL_optstring(L, 2, "ds.comm.set_backend")))
        return dsL_error(L);
    return 0;
}

static int l_check_enabled(lua_State *L) {
    lua_pushboolean(L, ds_comm_check_enabled());
    return 1;
}

static int l_abort(lua_State *L) {
    ds_comm_abort((int)luaL_optinteger(L, 1, 1));
}

static int l_progress(lua_State *L) {
    ds_comm_progress();
    return 0;
}

/* flight_record() -> this rank's last collectives, oldest first:
 * {what, group, state, age (s since it began), seconds (it took)} */
static int l_flight_record(lua_State *L) {
    int n = ds_comm_flight_count();
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        ds_comm_flight f;
        if (ds_comm_flight_get(i, &f)) break;
        lua_createtable(L, 0, 5);
        lua_pushstring(L, f.what);
        lua_setfield(L, -2, "what");
        lua_pushstring(L, f.group);
        lua_setfield(L, -2, "group");
        lua_pushstring(L, f.state);
        lua_setfield(L, -2, "state");
        dsL_setnumber(L, "age", f.age);
        dsL_setnumber(L, "seconds", f.seconds);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

/* barrier(group, async) */
static int l_barrier(lua_State *L) {
    return finish(L, ds_comm_barrier(opt_group(L, 1)), RESULT_NONE, lua_toboolean(L, 2));
}

/* send(t, dst, tag, group, async) / recv(t, src, tag, group, async):
 * peer_what and tag_what name the arguments in errors */
static int point_to_point(lua_State *L, ds_comm_work *(*op)(ds_tensor *, int, int, ds_comm_group *),
                          const char *peer_what, const char *tag_what) {
    ds_tensor *t = dsL_checktensor(L, 1);
    int peer = check_rank(L, 2, peer_what);
    int tag = lua_isnoneornil(L, 3) ? 0 : (int)dsL_checkint(L, 3, 0, INT_MAX, tag_what);
    return finish(L, op(t, peer, tag, opt_group(L, 4)), RESULT_NONE, lua_toboolean(L, 5));
}

static int l_send(lua_State *L) { return point_to_point(L, ds_comm_send, "send: dst", "send: tag"); }
static int l_recv(lua_State *L) { return point_to_point(L, ds_comm_recv, "recv: src", "recv: tag"); }

/* broadcast(t, src, group, async) */
static int l_broadcast(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    int src = check_rank(L, 2, "broadcast: src");
    return finish(L, ds_comm_broadcast(t, src, opt_group(L, 3)), RESULT_NONE, lua_toboolean(L, 4));
}

/* reduce(t, dst, op, group, async) */
static int l_reduce(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    int dst = check_rank(L, 2, "reduce: dst");
    ds_comm_op op = check_op(L, 3, "reduce");
    return finish(L, ds_comm_reduce(t, dst, op, opt_group(L, 4)), RESULT_NONE, lua_toboolean(L, 5));
}

/* all_reduce(t, op, group, async) */
static int l_all_reduce(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    ds_comm_op op = check_op(L, 2, "all_reduce");
    return finish(L, ds_comm_all_reduce(t, op, opt_group(L, 3)), RESULT_NONE, lua_toboolean(L, 4));
}

/* gather(t, dst, group, async) -> list on dst, nil elsewhere */
static int l_gather(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    int dst = check_rank(L, 2, "gather: dst");
    return finish(L, ds_comm_gather(t, dst, opt_group(L, 3)), RESULT_LIST, lua_toboolean(L, 4));
}

/* all_gather(t, group, async) -> list */
static int l_all_gather(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    return finish(L, ds_comm_all_gather(t, opt_group(L, 2)), RESULT_LIST, lua_toboolean(L, 3));
}

/* scatter(list or nil, src, group, async) -> tensor */
static int l_scatter(lua_State *L) {
    int n;
    int src = check_rank(L, 2, "scatter: src");
    ds_comm_group *g = opt_group(L, 3);
    ds_tensor **list = check_list(L, 1, "scatter", true, &n);
    ds_comm_work *w = ds_comm_scatter(list, n, src, g);
    free(list);
    return finish(L, w, RESULT_ONE, lua_toboolean(L, 4));
}

/* reduce_scatter(list, op, group, async) -> tensor */
static int l_reduce_scatter(lua_State *L) {
    int n;
    ds_comm_op op = check_op(L, 2, "reduce_scatter");
    ds_comm_group *g = opt_group(L, 3);
    ds_tensor **list = check_list(L, 1, "reduce_scatter", false, &n);
    ds_comm_work *w = ds_comm_reduce_scatter(list, n, op, g);
    free(list);
    return finish(L, w, RESULT_ONE, lua_toboolean(L, 4));
}

/* all_to_all(t, group, async) -> tensor */
static int l_all_to_all(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    return finish(L, ds_comm_all_to_all(t, opt_group(L, 2)), RESULT_ONE, lua_toboolean(L, 3));
}

void dsL_open_comm(lua_State *L) {
    static const luaL_Reg work_methods[] = {
        {"wait", l_work_wait}, {"is_completed", l_work_is_completed}, {NULL, NULL},
    };
    static const luaL_Reg group_methods[] = {
        {"rank", l_group_rank}, {"size", l_group_size}, {"ranks", l_group_ranks}, {NULL, NULL},
    };
    static const luaL_Reg fns[] = {
        {"rank", l_group_rank}, {"size", l_group_size}, {"ranks", l_group_ranks},
        {"local_rank", l_local_rank}, {"local_size", l_local_size}, {"launched", l_launched},
        {"is_initialized", l_is_initialized}, {"set_timeout", l_set_timeout}, {"timeout", l_timeout},
        {"set_check", l_set_check}, {"check_enabled", l_check_enabled}, {"abort", l_abort},
        {"backend", l_backend}, {"set_backend", l_set_backend},
        {"progress", l_progress}, {"flight_record", l_flight_record}, {"new_group", l_new_group}, {"is_group", l_is_group},
        {"barrier", l_barrier}, {"send", l_send}, {"recv", l_recv}, {"broadcast", l_broadcast},
        {"reduce", l_reduce}, {"all_reduce", l_all_reduce}, {"gather", l_gather},
        {"all_gather", l_all_gather}, {"scatter", l_scatter}, {"reduce_scatter", l_reduce_scatter},
        {"all_to_all", l_all_to_all}, {NULL, NULL},
    };
    dsL_newtype(L, DSL_WORK_MT, work_methods, l_work_gc);
    lua_pop(L, 1);

    luaL_newmetatable(L, DSL_GROUP_MT);
    dsL_setfuncs(L, "__index", group_methods);
    lua_pushcfunction(L, l_group_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pop(L, 1);

    dsL_setfuncs(L, "_comm", fns);
}
