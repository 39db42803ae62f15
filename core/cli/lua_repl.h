/* The interactive prompt: libedit for line editing, history and
 * completion; evaluation and printing live in lua/dslua/live/repl.lua. */
#ifndef LUA_REPL_H
#define LUA_REPL_H

#include <lua.h>

/* The REPL of dslua: the banner, then dsL_repl_loop over dslua.live.repl. */
void dsL_repl(lua_State *L);
/* dslua.live.repl.init(): the globals the REPL and -e code have (`ds`, help);
 * nonzero with the error on the stack. */
int dsL_repl_init(lua_State *L);
/* Reads inputs with prompt until Ctrl-D; module.step(input) runs each one
 * (true: incomplete, read another line), module.complete(text) completes. */
void dsL_repl_loop(lua_State *L, const char *module, const char *prompt);

#endif
