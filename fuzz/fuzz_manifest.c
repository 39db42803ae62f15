/* libFuzzer target: a checkpoint's manifest.json (lua/dslua/io/checkpoint/manifest.lua)
 * on any text, through the Lua library as the dslua binary embeds it. The
 * text is the manifest of a folder that also holds a real rank file (a
 * 2x2 linear layer, its Adam state and a module buffer: the seed corpus's
 * model), and ds.checkpoint.read_full reads the checkpoint whole. Refusing
 * the manifest is fine; a value of it used unchecked (a Lua error such as
 * indexing nil or comparing a string, a C function's bad argument) or a
 * crash is a finding. Called with nil, the checker removes the folder. */
#include "fuzz_lua.h"

#include <stdint.h>
#include <stdlib.h>

static lua_State *L;

static const char checker[] =
    "local ds, json = require 'dslua', require 'dslua.base.json'\n"
    "local C = require('dslua.core').ckpt\n"
    "local root = os.tmpname()\n"
    "os.remove(root)\n"
    "C.mkdirs(root .. '/ck')\n"
    "local function vec(n) return ds.arange(n):to('f32') end\n"
    "C.save(root .. '/ck/rank_00000.safetensors', {\n"
    "  { 'fp32/fc.weight', vec(4) }, { 'exp_avg/fc.weight', vec(4) }, { 'exp_avg_sq/fc.weight', vec(4) },\n"
    "  { 'fp32/fc.bias', vec(2) }, { 'exp_avg/fc.bias', vec(2) }, { 'exp_avg_sq/fc.bias', vec(2) },\n"
    "  { 'client/t', vec(2) }, { 'module/fc.weight', vec(4) } },\n"
    "  { format = 'pt', dslua = json.encode { rank = 0, world_size = 1, global_steps = 1 } })\n"
    "local function finding(err)\n"
    "  if type(err) ~= 'string' then return true end\n"
    "  for _, s in ipairs { 'attempt to ', 'bad argument', 'stack overflow', 'table index is' } do\n"
    "    if err:match('^[^ ]-:%d+: ' .. s) then return true end\n"
    "  end\n"
    "end\n"
    "return function(text)\n"
    "  if not text then return C.remove_tree(root) end\n"
    "  local f = assert(io.open(root .. '/ck/manifest.json', 'wb'))\n"
    "  f:write(text)\n"
    "  f:close()\n"
    "  local ok, err = pcall(ds.checkpoint.read_full, root, 'ck', true)\n"
    "  if not ok and finding(err) then error(err, 0) end\n"
    "end\n";

static void clean(void) { fuzz_lua_call(L, NULL, 0, "removing the folder"); }

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    L = fuzz_lua_new("=fuzz_manifest", checker);
    atexit(clean);
    lua_gc(L, LUA_GCCOLLECT, 0);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_lua_call(L, data, size, "reading the checkpoint");
    /* the tensors the read made are freed now: LuaJIT's own heap, where
     * their handles live, is hidden from the leak checker */
    lua_gc(L, LUA_GCCOLLECT, 0);
    return 0;
}
