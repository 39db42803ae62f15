/* The interactive prompt: libedit for line editing, history and
 * completion; evaluation and printing live in lua/dslua/repl.lua. */
#ifndef LUA_REPL_H
#define LUA_REPL_H

#include <lua.h>

/* lua_pcall with a traceback handler; 0 or the error on the stack. */
int dsL_pcall(lua_State *L, int nargs, int nresults);
void dsL_repl(lua_State *L);

#endif
