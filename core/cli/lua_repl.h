/* The interactive prompt: libedit for line editing, history and
 * completion; evaluation and printing live in lua/dslua/repl.lua. */
#ifndef LUA_REPL_H
#define LUA_REPL_H

#include <lua.h>

void dsL_repl(lua_State *L);

#endif
