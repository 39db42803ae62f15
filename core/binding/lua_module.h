/* Installing dslua into a lua_State: the C module `dslua.core` and the
 * searcher that finds the embedded Lua library. */
#ifndef LUA_MODULE_H
#define LUA_MODULE_H

#include <lua.h>

#define DSLUA_VERSION "0.1.0"

int luaopen_dslua_core(lua_State *L);
void dsL_install(lua_State *L);
/* lua_pcall with a traceback handler; 0 or the error on the stack. */
int dsL_pcall(lua_State *L, int nargs, int nresults);

#endif
