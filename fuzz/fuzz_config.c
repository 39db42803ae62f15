/* libFuzzer target: ds.json's decoder (core/binding/lua_json.c) and
 * ds.config's checker (lua/dslua/config/init.lua) on any text, through the Lua
 * library as the dslua binary embeds it. Invalid JSON and invalid configs
 * are errors, reported as values; anything raised past them (a Lua error
 * in the checker itself) or a crash is a finding. */
#include "fuzz_lua.h"

#include <stdint.h>

static lua_State *L;

static const char checker[] =
    "local json, config = require 'dslua.base.json', require 'dslua.config'\n"
    "return function(text)\n"
    "  local ok, v = pcall(json.decode, text, 'fuzz')\n"
    "  if not ok then return end\n"
    "  config.check(v, { world_size = 2 })\n"
    "end\n";

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    L = fuzz_lua_new("=fuzz_config", checker);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_lua_call(L, data, size, "the checker");
    static unsigned runs;
    if (++runs % 256 == 0) lua_gc(L, LUA_GCCOLLECT, 0);   /* the state stays small however long the run */
    return 0;
}
