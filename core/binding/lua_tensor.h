/* The binding layer's tensor helpers: how a ds_tensor lives in Lua.
 *
 * A Lua tensor is a full userdata holding one reference to a ds_tensor;
 * __gc drops it. Every bound function checks its arguments with these
 * helpers and raises a Lua error (never crashes) when they are wrong. */
#ifndef LUA_TENSOR_H
#define LUA_TENSOR_H

#include "ds_ops.h"

#include <lua.h>
#include <lauxlib.h>

#define DSL_TENSOR_MT "dslua.Tensor"
#define DSL_GROUP_MT "dslua.CommGroup"     /* ds.comm.new_group's groups (lua_comm.c) */

/* A tensor argument whose data an op will read: a released partitioned
 * parameter is fetched first (the autograd fetch function). */
ds_tensor *dsL_checktensor(lua_State *L, int idx);
/* A tensor argument whose shape, dtype or autograd fields alone are read. */
ds_tensor *dsL_checkmeta(lua_State *L, int idx);
/* Fetches t (at idx) through the fetch function when its data is released;
 * raises naming t when that leaves it released. */
void dsL_fetch(lua_State *L, int idx, ds_tensor *t);
/* ds_backward from Lua: fetches during backward call back into L. */
int dsL_backward(lua_State *L, ds_tensor *root, ds_tensor *grad, bool retain_graph);
/* The state of the binding call now fetching or running backward (where a
 * fetch function written in Lua runs), NULL outside one. */
lua_State *dsL_fetching_state(void);
/* Sets that state around a core call that runs backward or fetches (the
 * step engine's backward); returns the one it replaces, to put back. */
lua_State *dsL_set_fetching_state(lua_State *L);
ds_tensor *dsL_totensor(lua_State *L, int idx);          /* NULL if not a tensor */
/* A tensor argument, or a number turned into a 0-dim tensor like `like`.
 * *owned is set when the caller must release the result. */
ds_tensor *dsL_checkoperand(lua_State *L, int idx, const ds_tensor *like, bool *owned);
/* Pushes t, taking over the caller's reference. A NULL t raises the core
 * error instead, prefixed with nothing: core messages already name the op. */
int dsL_pushtensor(lua_State *L, ds_tensor *t);
/* Raises the pending core error as a Lua error. */
int dsL_error(lua_State *L);
/* Raises the string at -1 as it is: without the caller's position, which
 * every other error of a binding function carries (for messages that say
 * where themselves, or that come from deep inside the library). */
int dsL_raw_error(lua_State *L);
/* The integer at idx in [lo, hi], checked as a number before the cast (a
 * float cast out of range is undefined); raises "what must be an integer
 * ..." otherwise. */
int64_t dsL_checkint(lua_State *L, int idx, int64_t lo, int64_t hi, const char *what);
/* A 1-based (or negative) Lua dim, returned 0-based for t; raises on 0. */
int64_t dsL_checkdim(lua_State *L, int idx, const ds_tensor *t);
/* A shape from a table {2,3} or from the integers at idx.. (varargs);
 * returns ndim. */
int dsL_checkshape(lua_State *L, int idx, int64_t *shape);
/* dims from nil (all: returns -1), an integer, or a table of integers. */
int dsL_checkdims(lua_State *L, int idx, const ds_tensor *t, int64_t *dims);
ds_dtype dsL_checkdtype(lua_State *L, int idx, ds_dtype def);
/* v, for a tensor of dtype t that op fills: an integer dtype refuses NaN,
 * infinities and values outside its range (a cast would wrap them or be
 * undefined), naming the value and the dtype; a fraction truncates. */
double dsL_checkvalue(lua_State *L, const char *op, double v, ds_dtype t);

/* A userdata type: metatable `name` (left on the stack) with methods as
 * __index and gc as __gc. */
void dsL_newtype(lua_State *L, const char *name, const luaL_Reg *methods, lua_CFunction gc);

/* A handle: a new userdata of metatable mt (pushed) holding one object
 * pointer, NULL until the caller stores the object there. Made before
 * the object, so that a memory error making it cannot leak the object. */
void *dsL_newhandle(lua_State *L, const char *mt);
/* The object of the handle of metatable mt at idx; raises `closed` (the
 * whole message) when it was closed. */
void *dsL_checkhandle(lua_State *L, int idx, const char *mt, const char *closed);

/* A handle's __gc (and close, where closing cannot fail): releases the
 * object, NULL included, and clears the handle, so that a second call is
 * harmless. */
#define DSL_HANDLE_GC(name, type, mt, release)   \
    static int name(lua_State *L) {              \
        type **p = luaL_checkudata(L, 1, mt);    \
        release(*p);                             \
        *p = NULL;                               \
        return 0;                                \
    }

/* Sets key of the table at -1 to a new table of fns. */
void dsL_setfuncs(lua_State *L, const char *key, const luaL_Reg *fns);

/* Sets key of the table at -1 to the number v. */
void dsL_setnumber(lua_State *L, const char *key, double v);

/* Registers fns into the module table at -1 and, with as_methods, into
 * the tensor method table as well. */
void dsL_register(lua_State *L, const luaL_Reg *fns, bool as_methods);

/* Opens the tensor type and every op family into the table at -1. */
void dsL_open_tensor(lua_State *L);
void dsL_open_ops(lua_State *L);
void dsL_open_linalg(lua_State *L);
void dsL_open_nn(lua_State *L);
void dsL_open_index(lua_State *L);
void dsL_open_attention(lua_State *L);
void dsL_open_optim(lua_State *L);
void dsL_open_data(lua_State *L);
void dsL_open_json(lua_State *L);
void dsL_open_lr(lua_State *L);
void dsL_open_comm(lua_State *L);
void dsL_open_aio(lua_State *L);
void dsL_open_ckpt(lua_State *L);
void dsL_open_zero(lua_State *L);
/* The step engine (ds_zero.h) of the handle at idx; raises if closed. */
struct ds_zero *dsL_checkzero(lua_State *L, int idx);
void dsL_open_onebit(lua_State *L);
void dsL_open_cuda(lua_State *L);
void dsL_open_reload(lua_State *L);
void dsL_open_attach(lua_State *L);
void dsL_open_function(lua_State *L);
void dsL_open_fp8(lua_State *L);
void dsL_open_tfevents(lua_State *L);
void dsL_open_plot(lua_State *L);
void dsL_open_file(lua_State *L);

#endif
