/* The optimizer handle's C side, for other bindings: the ZeRO engine steps
 * an optimizer that Lua built (ds.optim) over its master weights. */
#ifndef LUA_OPTIM_H
#define LUA_OPTIM_H

#include "ds_optim.h"

#include <lua.h>

/* The ds_optim of a Lua optimizer (the table ds.optim builds, whose _h
 * field is the handle) or of the handle itself at idx; raises if neither. */
ds_optim *dsL_checkoptim(lua_State *L, int idx);
/* Every group's hyperparameters from the param_groups list at idx (as
 * h:step reads them, checked with ds_optim_check_hparams); h has
 * o->n_groups entries. Raises naming the group and key on a bad value. */
void dsL_optim_hparams(lua_State *L, int idx, const ds_optim *o, ds_optim_hparams *h);

#endif
