/* The Lua library as the dslua binary embeds it, for the targets that
 * drive Lua code: a state with ds installed, and a Lua function called on
 * each input, where any error it raises past its own checks is a finding. */
#ifndef FUZZ_LUA_H
#define FUZZ_LUA_H

#include <lua.h>
#include <stddef.h>
#include <stdint.h>

/* libFuzzer's entry points, which these targets define */
int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Runs the chunk code, named name ("=fuzz_x"): the function it returns is
 * the one fuzz_lua_call calls. Aborts when the chunk raises. */
lua_State *fuzz_lua_new(const char *name, const char *code);
/* Calls that function on the input as a string (nil when data is NULL);
 * aborts, saying what raised, when it raises. */
void fuzz_lua_call(lua_State *L, const uint8_t *data, size_t size, const char *what);

#endif
