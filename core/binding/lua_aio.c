/* ds.aio: asynchronous file I/O of tensor bytes (core/ds_aio.h).
 *
 *   local f = ds.aio.open(path, nbytes)      -- a new file, mode 0600 (ds_aio.h: how)
 *   local r = f:write(t, byte_offset)        -- or f:read(t, byte_offset)
 *   ... compute ...
 *   r:wait()                                 -- raises naming file, offset, bytes
 *   f:close()
 *
 * A request keeps its tensor and its file alive; collecting a request or a
 * file finishes what is pending first. */
#include "lua_tensor.h"
#include "ds_aio.h"
#include "ds_error.h"
#include "ds_file.h"

#include <stdio.h>

#define DSL_AIOFILE_MT "dslua.AioFile"
#define DSL_AIOREQ_MT "dslua.AioRequest"

static ds_aio_file *checkfile(lua_State *L, int idx) {
    ds_aio_file **p = luaL_checkudata(L, idx, DSL_AIOFILE_MT);
    if (!*p) luaL_error(L, "aio: the file is closed");
    return *p;
}

static ds_aio_req *checkreq(lua_State *L, int idx) {
    return *(ds_aio_req **)luaL_checkudata(L, idx, DSL_AIOREQ_MT);
}

/* aio.open(path, nbytes) -> file */
static int l_open(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    char what[512];
    snprintf(what, sizeof what, "aio.open: '%s': size", path);
    int64_t n = dsL_checkint(L, 2, 0, INT64_MAX, what);
    ds_aio_file **p = dsL_newhandle(L, DSL_AIOFILE_MT);
    if (!(*p = ds_aio_open(path, n))) return dsL_error(L);
    return 1;
}

static int l_file_gc(lua_State *L) {
    ds_aio_file **p = luaL_checkudata(L, 1, DSL_AIOFILE_MT);
    if (*p) ds_aio_close(*p);      /* nowhere to raise from a finalizer */
    *p = NULL;
    return 0;
}

/* f:close(): finishes pending requests; raises if one of them failed */
static int l_close(lua_State *L) {
    ds_aio_file **p = luaL_checkudata(L, 1, DSL_AIOFILE_MT);
    if (!*p) return 0;
    int rc = ds_aio_close(*p);
    *p = NULL;
    if (rc) return dsL_error(L);
    return 0;
}

static int start(lua_State *L, bool write) {
    ds_aio_file *f = checkfile(L, 1);
    ds_tensor *t = dsL_checktensor(L, 2);
    char what[512];
    snprintf(what, sizeof what, "aio.%s: '%s': byte offset", write ? "write" : "read", ds_aio_path(f));
    int64_t off = lua_isnoneornil(L, 3) ? 0 : dsL_checkint(L, 3, 0, INT64_MAX, what);
    ds_aio_req **p = dsL_newhandle(L, DSL_AIOREQ_MT);
    *p = write ? ds_aio_write(f, t, off) : ds_aio_read(f, t, off);
    if (!*p) return dsL_error(L);
    return 1;
}

/* f:write(t [, byte_offset]) / f:read(t [, byte_offset]) -> request */
static int l_write(lua_State *L) { return start(L, true); }
static int l_read(lua_State *L) { return start(L, false); }

static int l_path(lua_State *L) {
    lua_pushstring(L, ds_aio_path(checkfile(L, 1)));
    return 1;
}

static int l_size(lua_State *L) {
    lua_pushnumber(L, (lua_Number)ds_aio_size(checkfile(L, 1)));
    return 1;
}

static int l_file_tostring(lua_State *L) {
    ds_aio_file **p = luaL_checkudata(L, 1, DSL_AIOFILE_MT);
    if (*p) lua_pushfstring(L, "aio file '%s' (%f bytes)", ds_aio_path(*p), (lua_Number)ds_aio_size(*p));
    else lua_pushstring(L, "aio file (closed)");
    return 1;
}

/* r:wait() -> bytes moved; raises naming the file, offset, bytes and why */
static int l_wait(lua_State *L) {
    ds_aio_req *r = checkreq(L, 1);
    if (ds_aio_wait(r)) return dsL_error(L);
    lua_pushnumber(L, (lua_Number)ds_aio_req_bytes(r));
    return 1;
}

/* r:done() -> whether the request is complete (errors come from wait) */
static int l_done(lua_State *L) {
    lua_pushboolean(L, ds_aio_done(checkreq(L, 1)));
    return 1;
}

DSL_HANDLE_GC(l_req_gc, ds_aio_req, DSL_AIOREQ_MT, ds_aio_req_free)

/* aio.mkdir(path) -> true, or nil and why: path and its missing parents,
 * mode 0700, walked as the guarded open walks (ds_file.h) */
static int l_mkdir(lua_State *L) {
    if (ds_file_mkdirs(luaL_checkstring(L, 1), 0700)) {
        lua_pushnil(L);
        lua_pushstring(L, ds_error_message());
        return 2;
    }
    lua_pushboolean(L, 1);
    return 1;
}

static const luaL_Reg file_methods[] = {
    {"write", l_write}, {"read", l_read}, {"close", l_close}, {"path", l_path}, {"size", l_size}, {NULL, NULL}
};
static const luaL_Reg req_methods[] = { {"wait", l_wait}, {"done", l_done}, {NULL, NULL} };

void dsL_open_aio(lua_State *L) {
    dsL_newtype(L, DSL_AIOFILE_MT, file_methods, l_file_gc);
    lua_pushcfunction(L, l_file_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pop(L, 1);
    dsL_newtype(L, DSL_AIOREQ_MT, req_methods, l_req_gc);
    lua_pop(L, 1);
    lua_newtable(L);
    lua_pushcfunction(L, l_open);
    lua_setfield(L, -2, "open");
    lua_pushcfunction(L, l_mkdir);
    lua_setfield(L, -2, "mkdir");
    lua_setfield(L, -2, "aio");
}
