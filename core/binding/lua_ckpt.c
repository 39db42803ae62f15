/* What checkpoints need from C (core/io: ds_safetensors.h, ds_sha256.h,
 * ds_file.h), as ds.core.ckpt:
 *
 *   ckpt.save(path, {{name, tensor}...} [, {key = 'string'...} [, {crc32 =
 *             bool, kill_after = bytes}]]) -> bytes, sha256 [, {crc32...}]
 *   ckpt.open(path) -> f      f:entries() -> {{name, dtype, shape, numel}...}
 *     f:entry(name) -> that table or nil      f:metadata() -> {key = 'string'}
 *     f:read(name, lo, n) -> 1-D CPU tensor of elements [lo, lo + n) (0-based)
 *     f:read_into(name, lo, n, dst, at): the same into contiguous dst from its element at
 *     f:crc32(name) -> CRC-32 of the tensor's bytes    f:path()    f:close()
 *   ckpt.sha256(string) -> hex      ckpt.sha256_file(path) -> hex
 *   ckpt.mkdirs(path)   ckpt.exists(path)   ckpt.fsync_dir(path)
 *   ckpt.replace_dir(src, dst)   ckpt.remove_tree(path)
 *   ckpt.kill_self()   the test hook's SIGKILL, as a crash would end a rank
 *
 * Every failure raises with the core's message, which names the file. */
#include "lua_tensor.h"
#include "ds_error.h"
#include "ds_file.h"
#include "ds_safetensors.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>

#define DSL_STFILE_MT "dslua.SafetensorsFile"

static ds_safetensors_file *checkfile(lua_State *L, int idx) {
    ds_safetensors_file **p = luaL_checkudata(L, idx, DSL_STFILE_MT);
    if (!*p) luaL_error(L, "safetensors: the file is closed");
    return *p;
}

static int entry_index(lua_State *L, ds_safetensors_file *f, int idx) {
    const char *name = luaL_checkstring(L, idx);
    int i = ds_safetensors_find(f, name);
    if (i < 0) return luaL_error(L, "'%s' has no tensor '%s'", ds_safetensors_path(f), name);
    return i;
}

/* save(path, entries [, meta [, opts]]) */
static int l_save(lua_State *L) {
    lua_settop(L, 4);               /* the buffers below go above the arguments */
    const char *path = luaL_checkstring(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    int n = (int)lua_objlen(L, 2);
    bool crcs = false;
    int64_t kill_after = -1;
    if (!lua_isnoneornil(L, 4)) {
        luaL_checktype(L, 4, LUA_TTABLE);
        lua_getfield(L, 4, "crc32");
        crcs = lua_toboolean(L, -1);
        lua_getfield(L, 4, "kill_after");
        if (!lua_isnil(L, -1)) kill_after = (int64_t)luaL_checknumber(L, -1);
        lua_pop(L, 2);
    }
    /* Lua owns the strings and tensors while they sit in these tables */
    const char **names = lua_newuserdata(L, sizeof *names * (size_t)(n + 1));
    ds_tensor **tensors = lua_newuserdata(L, sizeof *tensors * (size_t)(n + 1));
    uint32_t *sums = lua_newuserdata(L, sizeof *sums * (size_t)(n + 1));
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, 2, i + 1);
        if (!lua_istable(L, -1)) return luaL_error(L, "safetensors.save: '%s': entry %d is not {name, tensor}", path, i + 1);
        lua_rawgeti(L, -1, 1);
        names[i] = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        lua_rawgeti(L, -2, 2);
        tensors[i] = dsL_totensor(L, -1);
        if (!names[i] || !tensors[i])
            return luaL_error(L, "safetensors.save: '%s': entry %d is not {name, tensor}", path, i + 1);
        lua_pop(L, 3);
    }
    int n_meta = 0;
    const char **keys = NULL, **values = NULL;
    if (!lua_isnoneornil(L, 3)) {
        luaL_checktype(L, 3, LUA_TTABLE);
        for (lua_pushnil(L); lua_next(L, 3); lua_pop(L, 1)) n_meta++;
        keys = lua_newuserdata(L, sizeof *keys * (size_t)(n_meta + 1));
        values = lua_newuserdata(L, sizeof *values * (size_t)(n_meta + 1));
        int k = 0;
        for (lua_pushnil(L); lua_next(L, 3); lua_pop(L, 1)) {
            if (lua_type(L, -2) != LUA_TSTRING || lua_type(L, -1) != LUA_TSTRING)
                return luaL_error(L, "safetensors.save: '%s': metadata keys and values must be strings", path);
            keys[k] = lua_tostring(L, -2);
            values[k++] = lua_tostring(L, -1);
        }
    }
    ds_safetensors_saved out;
    if (ds_safetensors_save(path, n, names, tensors, n_meta, keys, values, crcs ? sums : NULL, kill_after, &out))
        return dsL_error(L);
    lua_pushnumber(L, (lua_Number)out.bytes);
    lua_pushstring(L, out.sha256);
    if (!crcs) return 2;
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_pushnumber(L, sums[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 3;
}

static int l_open(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    ds_safetensors_file **p = dsL_newhandle(L, DSL_STFILE_MT);
    if (!(*p = ds_safetensors_open(path))) return dsL_error(L);
    return 1;
}

DSL_HANDLE_GC(l_gc, ds_safetensors_file, DSL_STFILE_MT, ds_safetensors_close)

static void push_entry(lua_State *L, const ds_safetensors_entry *e) {
    lua_createtable(L, 0, 4);
    lua_pushstring(L, e->name);
    lua_setfield(L, -2, "name");
    lua_pushstring(L, ds_dtype_name(e->dtype));
    lua_setfield(L, -2, "dtype");
    lua_createtable(L, e->ndim, 0);
    for (int d = 0; d < e->ndim; d++) {
        lua_pushnumber(L, (lua_Number)e->shape[d]);
        lua_rawseti(L, -2, d + 1);
    }
    lua_setfield(L, -2, "shape");
    dsL_setnumber(L, "numel", (lua_Number)e->numel);
}

static int l_entries(lua_State *L) {
    ds_safetensors_file *f = checkfile(L, 1);
    int n = ds_safetensors_count(f);
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        push_entry(L, ds_safetensors_entry_at(f, i));
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int l_entry(lua_State *L) {
    ds_safetensors_file *f = checkfile(L, 1);
    int i = ds_safetensors_find(f, luaL_checkstring(L, 2));
    if (i < 0) return 0;
    push_entry(L, ds_safetensors_entry_at(f, i));
    return 1;
}

static int l_metadata(lua_State *L) {
    ds_safetensors_file *f = checkfile(L, 1);
    lua_newtable(L);
    for (int i = 0; i < ds_safetensors_n_metadata(f); i++) {
        const char *k, *v;
        ds_safetensors_metadata_at(f, i, &k, &v);
        lua_pushstring(L, v);
        lua_setfield(L, -2, k);
    }
    return 1;
}

static int64_t checkcount(lua_State *L, int idx) {
    lua_Number v = luaL_checknumber(L, idx);
    luaL_argcheck(L, v >= 0 && v < 0x1p63 && v == (lua_Number)(int64_t)v, idx, "expected a non-negative integer");
    return (int64_t)v;
}

static int l_read(lua_State *L) {
    ds_safetensors_file *f = checkfile(L, 1);
    int i = entry_index(L, f, 2);
    const ds_safetensors_entry *e = ds_safetensors_entry_at(f, i);
    int64_t lo = lua_isnoneornil(L, 3) ? 0 : checkcount(L, 3);
    int64_t n = lua_isnoneornil(L, 4) ? e->numel - lo : checkcount(L, 4);
    return dsL_pushtensor(L, ds_safetensors_read(f, i, lo, n));
}

static int l_read_into(lua_State *L) {
    ds_safetensors_file *f = checkfile(L, 1);
    int i = entry_index(L, f, 2);
    if (ds_safetensors_read_into(f, i, checkcount(L, 3), checkcount(L, 4), dsL_checktensor(L, 5), checkcount(L, 6)))
        return dsL_error(L);
    return 0;
}

static int l_crc32_entry(lua_State *L) {
    ds_safetensors_file *f = checkfile(L, 1);
    uint32_t crc;
    if (ds_safetensors_entry_crc32(f, entry_index(L, f, 2), &crc)) return dsL_error(L);
    lua_pushnumber(L, crc);
    return 1;
}

static int l_path(lua_State *L) {
    lua_pushstring(L, ds_safetensors_path(checkfile(L, 1)));
    return 1;
}

static int l_sha256(lua_State *L) {
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    char hex[DS_SHA256_HEX];
    if (ds_sha256_bytes(s, n, hex)) return dsL_error(L);
    lua_pushstring(L, hex);
    return 1;
}

static int l_sha256_file(lua_State *L) {
    char hex[DS_SHA256_HEX];
    if (ds_sha256_file(luaL_checkstring(L, 1), hex)) return dsL_error(L);
    lua_pushstring(L, hex);
    return 1;
}

static int l_mkdirs(lua_State *L) {
    if (ds_file_mkdirs(luaL_checkstring(L, 1), 0755)) return dsL_error(L);
    return 0;
}

static int l_exists(lua_State *L) {
    lua_pushboolean(L, ds_file_exists(luaL_checkstring(L, 1)));
    return 1;
}

static int l_fsync_dir(lua_State *L) {
    if (ds_file_fsync_dir(luaL_checkstring(L, 1))) return dsL_error(L);
    return 0;
}

static int l_replace_dir(lua_State *L) {
    if (ds_file_replace_dir(luaL_checkstring(L, 1), luaL_checkstring(L, 2))) return dsL_error(L);
    return 0;
}

static int l_remove_tree(lua_State *L) {
    if (ds_file_remove_tree(luaL_checkstring(L, 1))) return dsL_error(L);
    return 0;
}

static int l_kill_self(lua_State *L) {
    (void)L;
    raise(SIGKILL);
    return 0;
}

static const luaL_Reg file_methods[] = {
    {"entries", l_entries}, {"entry", l_entry}, {"metadata", l_metadata}, {"read", l_read}, {"read_into", l_read_into},
    {"crc32", l_crc32_entry}, {"path", l_path}, {"close", l_gc}, {NULL, NULL}
};

static const luaL_Reg ckpt_fns[] = {
    {"save", l_save}, {"open", l_open}, {"sha256", l_sha256}, {"sha256_file", l_sha256_file},
    {"mkdirs", l_mkdirs}, {"exists", l_exists}, {"fsync_dir", l_fsync_dir},
    {"replace_dir", l_replace_dir}, {"remove_tree", l_remove_tree}, {"kill_self", l_kill_self}, {NULL, NULL}
};

void dsL_open_ckpt(lua_State *L) {
    dsL_newtype(L, DSL_STFILE_MT, file_methods, l_gc);
    lua_pop(L, 1);
    dsL_setfuncs(L, "ckpt", ckpt_fns);
}
