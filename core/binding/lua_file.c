/* The guarded file operations (core/io/ds_file.h), as ds.core.file:
 *
 *   file.read(path, max_bytes) -> string     a regular file of at most max_bytes
 *   file.append(path, string)                 created 0644 when missing
 *   file.write(path, string)                  atomically: temp, fsync, rename
 *
 * Links another user could have planted are not followed, FIFOs and devices
 * are refused, and so are directories another user may write into (for
 * reads, only those open to every user), naming them. Every failure raises with the core's message. */
#include "lua_tensor.h"
#include "ds_error.h"
#include "ds_file.h"

#include <stdlib.h>

static int l_read(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    int64_t max = dsL_checkint(L, 2, 0, INT64_MAX, "file.read: max_bytes");
    size_t n;
    char *text = ds_file_read(path, max, &n);
    if (!text) return dsL_error(L);
    lua_pushlstring(L, text, n);
    free(text);
    return 1;
}

static int l_append(lua_State *L) {
    size_t n;
    const char *path = luaL_checkstring(L, 1), *s = luaL_checklstring(L, 2, &n);
    if (ds_file_append(path, s, n)) return dsL_error(L);
    return 0;
}

static int l_write(lua_State *L) {
    size_t n;
    const char *path = luaL_checkstring(L, 1), *s = luaL_checklstring(L, 2, &n);
    if (ds_file_write_atomic(path, s, n)) return dsL_error(L);
    return 0;
}

static const luaL_Reg file_fns[] = {
    {"read", l_read}, {"append", l_append}, {"write", l_write}, {NULL, NULL}
};

void dsL_open_file(lua_State *L) {
    dsL_setfuncs(L, "file", file_fns);
}
