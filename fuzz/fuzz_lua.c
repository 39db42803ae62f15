#include "fuzz_lua.h"
#include "lua_module.h"

#include <lauxlib.h>
#include <lualib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fn_ref = LUA_NOREF;
static const char *chunk;

lua_State *fuzz_lua_new(const char *name, const char *code) {
    lua_State *L = luaL_newstate();
    luaL_openlibs(L);
    dsL_install(L);
    chunk = name + 1;
    if (luaL_loadbuffer(L, code, strlen(code), name) || lua_pcall(L, 0, 1, 0)) {
        fprintf(stderr, "%s: %s\n", chunk, lua_tostring(L, -1));
        abort();
    }
    fn_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    return L;
}

void fuzz_lua_call(lua_State *L, const uint8_t *data, size_t size, const char *what) {
    lua_rawgeti(L, LUA_REGISTRYINDEX, fn_ref);
    if (data) lua_pushlstring(L, (const char *)data, size);
    else lua_pushnil(L);
    if (lua_pcall(L, 1, 0, 0) != 0) {
        fprintf(stderr, "%s: %s raised: %s\n", chunk, what, lua_tostring(L, -1));
        abort();
    }
}
