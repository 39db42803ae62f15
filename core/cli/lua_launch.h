/* `dslua [launcher options] script [args]`: runs the script on ranks
 * through mpirun and waits for it. */
#ifndef LUA_LAUNCH_H
#define LUA_LAUNCH_H

#include <lua.h>

/* args: dslua's arguments from the first launcher option on. Returns
 * mpirun's exit status (or ends this process with mpirun's signal). */
int dsL_launch(lua_State *L, char **args, int nargs);

#endif
