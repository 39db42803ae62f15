#include "lua_module.h"
#include "lua_tensor.h"
#include "ds_threads.h"

#include <lauxlib.h>
#include <omp.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct { const char *name, *chunk, *src; size_t len; } embedded_module;
extern const embedded_module dsL_embedded[];

static int l_num_threads(lua_State *L) {
    if (!lua_isnoneornil(L, 1)) {
        lua_Number n = luaL_checknumber(L, 1);
        /* more threads than a few per core only thrashes, and libgomp aborts
         * the process when it cannot create them */
        int most = 4 * omp_get_num_procs();
        if (!(n >= 1 && n <= most))
            return luaL_error(L, "num_threads: thread count must be in [1, %d], got %f", most, n);
        ds_set_num_threads((int)n);
    }
    lua_pushinteger(L, ds_get_num_threads());
    return 1;
}

/* cpu_optim_isa([name]): the CPU optimizer loops' instruction set, read or
 * picked ("avx512", "avx2", "sse2"); each writes the same bits */
static int l_cpu_optim_isa(lua_State *L) {
    if (!lua_isnoneornil(L, 1) && ds_cpu_optim_use(luaL_checkstring(L, 1)))
        return luaL_error(L, "cpu_optim_isa: %s", ds_kernel_error());
    lua_pushstring(L, ds_cpu_optim_isa());
    return 1;
}

/* isatty(fd): progress output draws a bar on a terminal, plain lines in a pipe */
static int l_isatty(lua_State *L) {
    lua_pushboolean(L, isatty((int)luaL_optinteger(L, 1, 1)));
    return 1;
}

/* wall_time(): monotonic seconds, for rates and timers */
static int l_wall_time(lua_State *L) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    lua_pushnumber(L, (lua_Number)ts.tv_sec + (lua_Number)ts.tv_nsec * 1e-9);
    return 1;
}

/* embedded_source(): the text of the Lua library this binary carries, a
 * corpus that ships with dslua (the quickstart trains on it);
 * embedded_source(chunk): one module's ("@lua/dslua/nn/init.lua"), or nil, for
 * the REPL's help to read its comments. */
static int l_embedded_source(lua_State *L) {
    if (!lua_isnoneornil(L, 1)) {
        const char *chunk = luaL_checkstring(L, 1);
        for (const embedded_module *m = dsL_embedded; m->name; m++)
            if (strcmp(m->chunk, chunk) == 0) { lua_pushlstring(L, m->src, m->len); return 1; }
        return 0;
    }
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    for (const embedded_module *m = dsL_embedded; m->name; m++) luaL_addlstring(&b, m->src, m->len);
    luaL_pushresult(&b);
    return 1;
}

/* ------------------------------------------------ errors naming their function */

static _Thread_local bool raw_error;      /* set by dsL_raw_error until named_call sees it */

int dsL_raw_error(lua_State *L) {
    raw_error = true;
    return lua_error(L);
}

/* The error at -1 raised by the function named at upvalue 2, as Lua would
 * have put it had it known the name: Lua names a C function from the
 * bytecode that called it, so one called through pcall, a tail call or
 * from C is '?' ("bad argument #1 to '?'"). With the caller's position,
 * which the function's own message lacks (its caller is named_call),
 * unless it was raised raw. */
static void name_error(lua_State *L) {
    const char *msg = lua_tostring(L, -1), *name = lua_tostring(L, lua_upvalueindex(2));
    int arg = 0, at = 0;
    if (raw_error) lua_pushliteral(L, "");
    else luaL_where(L, 1);
    raw_error = false;
    if (sscanf(msg, "bad argument #%d to '?' (%n", &arg, &at) == 1 && at > 0) {
        lua_Debug ar;
        bool method = lua_getstack(L, 0, &ar) && lua_getinfo(L, "n", &ar) && ar.namewhat &&
                      strcmp(ar.namewhat, "method") == 0;
        if (method && arg == 1) lua_pushfstring(L, "calling '%s' on bad self (%s", name, msg + at);
        else lua_pushfstring(L, "bad argument #%d to '%s' (%s", method ? arg - 1 : arg, name, msg + at);
    } else {
        lua_pushvalue(L, -2);
    }
    lua_concat(L, 2);
    lua_replace(L, -2);
}

/* Calls upvalue 1 with this call's arguments; its error named by name_error. */
static int named_call(lua_State *L) {
    int n = lua_gettop(L);
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    if (lua_pcall(L, n, LUA_MULTRET, 0) == 0) return lua_gettop(L);
    if (lua_type(L, -1) == LUA_TSTRING) name_error(L);
    raw_error = false;
    return lua_error(L);
}

/* Every C function in the table at idx (and the tables inside it, not
 * metamethods) replaced by a named_call of it, under its key. done, at
 * the top, maps each table seen and each function to its replacement, so
 * a function under two keys stays one function. */
static void name_functions(lua_State *L, int idx) {
    int done = lua_gettop(L);
    lua_pushvalue(L, idx);
    lua_rawget(L, done);
    bool seen = !lua_isnil(L, -1);
    lua_pop(L, 1);
    if (seen) return;
    lua_pushvalue(L, idx);
    lua_pushboolean(L, 1);
    lua_rawset(L, done);
    for (lua_pushnil(L); lua_next(L, idx); lua_pop(L, 1)) {
        if (lua_type(L, -2) != LUA_TSTRING || strncmp(lua_tostring(L, -2), "__", 2) == 0) continue;
        if (lua_istable(L, -1)) {
            lua_pushvalue(L, done);
            name_functions(L, lua_gettop(L) - 1);
            lua_pop(L, 1);
        } else if (lua_iscfunction(L, -1)) {
            lua_pushvalue(L, -1);
            lua_rawget(L, done);
            if (lua_isnil(L, -1)) {
                lua_pop(L, 1);
                lua_pushvalue(L, -1);
                lua_pushvalue(L, -3);
                lua_pushcclosure(L, named_call, 2);
                lua_pushvalue(L, -2);
                lua_pushvalue(L, -2);
                lua_rawset(L, done);
            }
            lua_pushvalue(L, -3);
            lua_insert(L, -2);
            lua_rawset(L, idx);         /* an existing key: lua_next goes on */
        }
    }
}

/* The module table at -1, its functions and the methods of the object
 * types it made (their metatables' __index tables) named. */
static void name_all(lua_State *L) {
    int module = lua_gettop(L);
    lua_newtable(L);
    name_functions(L, module);
    for (lua_pushnil(L); lua_next(L, LUA_REGISTRYINDEX); lua_pop(L, 1)) {
        if (lua_type(L, -2) != LUA_TSTRING || strncmp(lua_tostring(L, -2), "dslua.", 6) != 0 || !lua_istable(L, -1))
            continue;
        lua_getfield(L, -1, "__index");
        if (lua_istable(L, -1)) {
            lua_pushvalue(L, module + 1);
            name_functions(L, lua_gettop(L) - 1);
            lua_pop(L, 1);
        }
        lua_pop(L, 1);
    }
    lua_settop(L, module);
}

static const luaL_Reg core_functions[] = {
    {"embedded_source", l_embedded_source}, {"wall_time", l_wall_time}, {"isatty", l_isatty},
    {"num_threads", l_num_threads}, {"cpu_optim_isa", l_cpu_optim_isa}, {NULL, NULL}
};

int luaopen_dslua_core(lua_State *L) {
    lua_newtable(L);
    dsL_open_tensor(L);
    dsL_open_ops(L);
    dsL_open_linalg(L);
    dsL_open_nn(L);
    dsL_open_index(L);
    dsL_open_attention(L);
    dsL_open_optim(L);
    dsL_open_data(L);
    dsL_open_json(L);
    dsL_open_lr(L);
    dsL_open_comm(L);
    dsL_open_aio(L);
    dsL_open_ckpt(L);
    dsL_open_zero(L);
    dsL_open_onebit(L);
    dsL_open_cuda(L);
    dsL_open_reload(L);
    dsL_open_attach(L);
    dsL_open_function(L);
    dsL_open_fp8(L);
    dsL_open_tfevents(L);
    dsL_open_plot(L);
    dsL_open_file(L);
    luaL_register(L, NULL, core_functions);
    lua_pushstring(L, DSLUA_VERSION);
    lua_setfield(L, -2, "version");
    name_all(L);
    return 1;
}

/* package.loaders entry: embedded modules, looked up before the file
 * system so the library always matches the binary. */
static int search_embedded(lua_State *L) {
    const char *name = luaL_checkstring(L, 1);
    for (const embedded_module *m = dsL_embedded; m->name; m++) {
        if (strcmp(m->name, name) != 0) continue;
        if (luaL_loadbuffer(L, m->src, m->len, m->chunk) != 0) return lua_error(L);
        return 1;
    }
    lua_pushfstring(L, "\n\tno embedded module '%s'", name);
    return 1;
}

void dsL_install(lua_State *L) {
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "preload");
    lua_pushcfunction(L, luaopen_dslua_core);
    lua_setfield(L, -2, "dslua.core");
    lua_pop(L, 1);
    lua_getfield(L, -1, "loaders");
    int n = (int)lua_objlen(L, -1);
    for (int i = n; i >= 2; i--) {         /* shift to make room after preload */
        lua_rawgeti(L, -1, i);
        lua_rawseti(L, -2, i + 1);
    }
    lua_pushcfunction(L, search_embedded);
    lua_rawseti(L, -2, 2);
    lua_pop(L, 2);
}

static int traceback(lua_State *L) {
    const char *msg = lua_tostring(L, 1);
    if (!msg) {
        if (luaL_callmeta(L, 1, "__tostring") && lua_isstring(L, -1)) return 1;
        msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    }
    luaL_traceback(L, L, msg, 1);
    return 1;
}

int dsL_pcall(lua_State *L, int nargs, int nresults) {
    int base = lua_gettop(L) - nargs;
    lua_pushcfunction(L, traceback);
    lua_insert(L, base);
    int rc = lua_pcall(L, nargs, nresults, base);
    lua_remove(L, base);
    return rc;
}
