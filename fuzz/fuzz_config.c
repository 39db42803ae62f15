/* libFuzzer target: ds.json's decoder (core/binding/lua_json.c) and
 * ds.config's checker (lua/dslua/config.lua) on any text, through the Lua
 * library as the dslua binary embeds it. Invalid JSON and invalid configs
 * are errors, reported as values; anything raised past them (a Lua error
 * in the checker itself) or a crash is a finding. */
#include "lua_module.h"

#include <lauxlib.h>
#include <lualib.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static lua_State *L;
static int check_ref;

static const char checker[] =
    "local json, config = require 'dslua.json', require 'dslua.config'\n"
    "return function(text)\n"
    "  local ok, v = pcall(json.decode, text, 'fuzz')\n"
    "  if not ok then return end\n"
    "  config.check(v, { world_size = 2 })\n"
    "end\n";

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    L = luaL_newstate();
    luaL_openlibs(L);
    dsL_install(L);
    if (luaL_loadbuffer(L, checker, sizeof checker - 1, "=fuzz_config") || lua_pcall(L, 0, 1, 0)) {
        fprintf(stderr, "fuzz_config: %s\n", lua_tostring(L, -1));
        abort();
    }
    check_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    lua_rawgeti(L, LUA_REGISTRYINDEX, check_ref);
    lua_pushlstring(L, (const char *)data, size);
    if (lua_pcall(L, 1, 0, 0) != 0) {
        fprintf(stderr, "fuzz_config: the checker raised: %s\n", lua_tostring(L, -1));
        abort();
    }
    static unsigned runs;
    if (++runs % 256 == 0) lua_gc(L, LUA_GCCOLLECT, 0);   /* the state stays small however long the run */
    return 0;
}
