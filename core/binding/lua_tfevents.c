/* TensorBoard event files (core/io/ds_tfevents.h), as ds.core.tfevents:
 *
 *   tfevents.open(dir) -> w     a new events.out.tfevents.* file in dir
 *     w:scalar(tag, value, step [, wall_time]) (default: now, seconds since the epoch)   w:flush()   w:path()   w:close()
 *   tfevents.read(path) -> {{wall_time, step, tag, value} or
 *                           {wall_time, step, file_version}...}, CRCs checked [, note]: a
 *                           file that ends inside its last record is read up to it, the
 *                           note saying so
 *   tfevents.crc32c(string) -> the unmasked CRC-32C
 *
 * Every failure raises with the core's message, which names the file. */
#include "lua_tensor.h"
#include "ds_tfevents.h"

#include <time.h>

#define DSL_TFEVENTS_MT "dslua.TfEvents"

static ds_tfevents *checkwriter(lua_State *L) {
    return dsL_checkhandle(L, 1, DSL_TFEVENTS_MT, "tfevents: the writer is closed");
}

static int l_open(lua_State *L) {
    const char *dir = luaL_checkstring(L, 1);
    ds_tfevents **p = dsL_newhandle(L, DSL_TFEVENTS_MT);
    *p = ds_tfevents_open(dir);
    if (!*p) return dsL_error(L);
    return 1;
}

static int l_scalar(lua_State *L) {
    ds_tfevents *w = checkwriter(L);
    const char *tag = luaL_checkstring(L, 2);
    double value = luaL_checknumber(L, 3), step = luaL_checknumber(L, 4), wall;
    if (lua_isnoneornil(L, 5)) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        wall = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
    } else {
        wall = luaL_checknumber(L, 5);
    }
    if (ds_tfevents_scalar(w, tag, (float)value, (int64_t)step, wall)) return dsL_error(L);
    return 0;
}

static int l_flush(lua_State *L) {
    if (ds_tfevents_flush(checkwriter(L))) return dsL_error(L);
    return 0;
}

static int l_path(lua_State *L) {
    lua_pushstring(L, ds_tfevents_path(checkwriter(L)));
    return 1;
}

/* __gc: a write error here has no one to tell (close() reports it) */
DSL_HANDLE_GC(l_gc, ds_tfevents, DSL_TFEVENTS_MT, ds_tfevents_close)

/* a second close is a no-op */
static int l_close(lua_State *L) {
    ds_tfevents **p = luaL_checkudata(L, 1, DSL_TFEVENTS_MT);
    ds_tfevents *w = *p;
    *p = NULL;
    if (ds_tfevents_close(w)) return dsL_error(L);
    return 0;
}

/* each event appended to the list at stack index 2 */
static int push_event(const ds_tfevent *e, void *ctx) {
    lua_State *L = ctx;
    lua_createtable(L, 0, 4);
    dsL_setnumber(L, "wall_time", e->wall_time);
    dsL_setnumber(L, "step", (lua_Number)e->step);
    if (e->file_version) {
        lua_pushstring(L, e->file_version);
        lua_setfield(L, -2, "file_version");
    } else {
        lua_pushstring(L, e->tag);
        lua_setfield(L, -2, "tag");
        dsL_setnumber(L, "value", e->value);
    }
    lua_rawseti(L, 2, (int)lua_objlen(L, 2) + 1);
    return 0;
}

static int l_read(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    lua_settop(L, 1);
    lua_newtable(L);
    long torn;
    if (ds_tfevents_read(path, push_event, L, &torn)) return dsL_error(L);
    if (torn < 0) return 1;
    lua_pushfstring(L, "tfevents: %s: the file ends inside the record at byte %f (its writer stopped mid-write): "
                    "read up to it", path, (lua_Number)torn);
    return 2;
}

static int l_crc32c(lua_State *L) {
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    lua_pushnumber(L, ds_tfevents_crc32c(s, n));
    return 1;
}

static const luaL_Reg writer_methods[] = {
    {"scalar", l_scalar}, {"flush", l_flush}, {"path", l_path}, {"close", l_close}, {NULL, NULL}
};

static const luaL_Reg tfevents_fns[] = {
    {"open", l_open}, {"read", l_read}, {"crc32c", l_crc32c}, {NULL, NULL}
};

void dsL_open_tfevents(lua_State *L) {
    dsL_newtype(L, DSL_TFEVENTS_MT, writer_methods, l_gc);
    lua_pop(L, 1);
    dsL_setfuncs(L, "tfevents", tfevents_fns);
}
