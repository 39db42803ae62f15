/* The attach socket from Lua (core/io/ds_attach.h): the job's server, whose
 * queue dslua/live/attach.lua drains at each step boundary, and the client that
 * `dslua attach` talks through.
 *
 *   local A = require('dslua.core')._attach
 *   A.check_dir(dir [, create])      -> true, or nil and why
 *   local s = A.listen(path [, {uid = n}])   -- uid: the peer uid accepted
 *                                            -- (default: this process's)
 *   s:next([timeout])   -> client, text (client 0: the server's notice; no
 *                          text: that client hung up), or nil
 *   s:reply(client, text) -> true, or false when that client has gone
 *   s:close()
 *   local c = A.dial(path)
 *   c:send(text); c:recv([timeout]) -> text, or nil when the time ran out
 *   c:close()
 *   A.uid() -> the effective uid; A.pid() -> this process's id
 *   A.alive(pid) -> false when no process has that id (a dead job's socket)
 */
#include "lua_tensor.h"
#include "ds_attach.h"
#include "ds_error.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#define DSL_ATTACH_SERVER_MT "dslua.AttachServer"
#define DSL_ATTACH_CONN_MT "dslua.AttachConn"

static ds_attach_server *checkserver(lua_State *L) {
    return dsL_checkhandle(L, 1, DSL_ATTACH_SERVER_MT, "attach: the server is closed");
}

static ds_attach_conn *checkconn(lua_State *L) {
    return dsL_checkhandle(L, 1, DSL_ATTACH_CONN_MT, "attach: the connection is closed");
}

static double opt_timeout(lua_State *L, int idx, double def) {
    lua_Number t = luaL_optnumber(L, idx, def);
    if (!(t == t) || t > 86400) return luaL_error(L, "attach: timeout must be a number of seconds up to 86400, got %f", t);
    return t;
}

static int l_check_dir(lua_State *L) {
    const char *dir = luaL_checkstring(L, 1);
    if (ds_attach_check_dir(dir, lua_toboolean(L, 2))) {
        lua_pushnil(L);
        lua_pushstring(L, ds_error_message());
        return 2;
    }
    lua_pushboolean(L, 1);
    return 1;
}

static int l_listen(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    uid_t uid = geteuid();
    if (!lua_isnoneornil(L, 2)) {
        luaL_checktype(L, 2, LUA_TTABLE);
        lua_getfield(L, 2, "uid");
        if (!lua_isnil(L, -1)) {
            lua_Number u = luaL_checknumber(L, -1);
            if (!(u >= 0 && u < 4294967295.0 && u == (lua_Number)(uid_t)u))
                return luaL_error(L, "attach.listen: uid must be a user id, got %f", u);
            uid = (uid_t)u;
        }
        lua_pop(L, 1);
    }
    ds_attach_server **p = dsL_newhandle(L, DSL_ATTACH_SERVER_MT);
    if (!(*p = ds_attach_listen(path, uid))) return dsL_error(L);
    return 1;
}

static int l_next(lua_State *L) {
    ds_attach_server *s = checkserver(L);
    double timeout = opt_timeout(L, 2, 0);
    uint64_t client;
    char *data;
    size_t len;
    if (!ds_attach_next(s, timeout, &client, &data, &len)) return 0;
    lua_pushnumber(L, (lua_Number)client);
    if (!data) return 1;                       /* the client hung up */
    lua_pushlstring(L, data, len);
    free(data);
    return 2;
}

static int l_reply(lua_State *L) {
    ds_attach_server *s = checkserver(L);
    lua_Number id = luaL_checknumber(L, 2);
    size_t len;
    const char *text = luaL_checklstring(L, 3, &len);
    if (!(id >= 1 && id == (lua_Number)(uint64_t)id)) return luaL_error(L, "attach: reply: bad client id %f", id);
    int rc = ds_attach_reply(s, (uint64_t)id, text, len);
    if (rc < 0) return dsL_error(L);
    lua_pushboolean(L, rc == 0);
    return 1;
}

DSL_HANDLE_GC(l_server_gc, ds_attach_server, DSL_ATTACH_SERVER_MT, ds_attach_close)

static int l_dial(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    ds_attach_conn **p = dsL_newhandle(L, DSL_ATTACH_CONN_MT);
    if (!(*p = ds_attach_dial(path))) return dsL_error(L);
    return 1;
}

static int l_send(lua_State *L) {
    ds_attach_conn *c = checkconn(L);
    size_t len;
    const char *text = luaL_checklstring(L, 2, &len);
    if (ds_attach_send(c, text, len)) return dsL_error(L);
    return 0;
}

static int l_recv(lua_State *L) {
    ds_attach_conn *c = checkconn(L);
    double timeout = opt_timeout(L, 2, -1);
    char *data;
    size_t len;
    int rc = ds_attach_recv(c, timeout, &data, &len);
    if (rc < 0) return dsL_error(L);
    if (rc == 0) return 0;
    lua_pushlstring(L, data, len);
    free(data);
    return 1;
}

DSL_HANDLE_GC(l_conn_gc, ds_attach_conn, DSL_ATTACH_CONN_MT, ds_attach_hangup)

static int l_uid(lua_State *L) {
    lua_pushnumber(L, (lua_Number)geteuid());
    return 1;
}

static int l_pid(lua_State *L) {
    lua_pushnumber(L, (lua_Number)getpid());
    return 1;
}

static int l_alive(lua_State *L) {
    lua_Number pid = luaL_checknumber(L, 1);
    if (!(pid >= 1 && pid <= 4194304 && pid == (lua_Number)(pid_t)pid)) return luaL_error(L, "attach.alive: bad pid %f", pid);
    lua_pushboolean(L, kill((pid_t)pid, 0) == 0 || errno != ESRCH);
    return 1;
}

void dsL_open_attach(lua_State *L) {
    static const luaL_Reg server_methods[] = {
        {"next", l_next}, {"reply", l_reply}, {"close", l_server_gc}, {NULL, NULL}
    };
    static const luaL_Reg conn_methods[] = {
        {"send", l_send}, {"recv", l_recv}, {"close", l_conn_gc}, {NULL, NULL}
    };
    static const luaL_Reg fns[] = {
        {"check_dir", l_check_dir}, {"listen", l_listen}, {"dial", l_dial}, {"uid", l_uid}, {"pid", l_pid}, {"alive", l_alive},
        {NULL, NULL}
    };
    dsL_newtype(L, DSL_ATTACH_SERVER_MT, server_methods, l_server_gc);
    lua_pop(L, 1);
    dsL_newtype(L, DSL_ATTACH_CONN_MT, conn_methods, l_conn_gc);
    lua_pop(L, 1);
    dsL_setfuncs(L, "_attach", fns);
}
