/* The 1-bit optimizers (core/train/ds_onebit.h) as ds.core._onebit:
 *
 *   _onebit.new(engine, optimizer, {kind = "OneBitAdam" | "ZeroOneAdam" |
 *               "OneBitLamb", freeze_step, var_freeze_step, var_update_scaler,
 *               local_step_scaler, local_step_clipper, coeff_beta, factor_max,
 *               factor_min, factor_threshold}) -> b
 *                        the engine (a flat _zero.engine over optimizer, an
 *                        AdamW or for OneBitLamb a Lamb, without bias
 *                        correction) then steps through b
 *   b:reduces() -> whether the next step takes all-reduced gradients
 *   b:stats() -> {steps, compressed, bytes} (the last step's)
 *   b:allreduce(g, x)    x: the compressed average over the ranks, parameter by
 *                        parameter (group g's errors; OneBitAdam, ZeroOneAdam)
 *   b:lamb_state(g) -> fresh_v, pieces        OneBitLamb's own state of group g (copies)
 *   b:load_lamb_state(g, step, fresh_v, pieces)   set back, as saved at optimizer step `step`
 *   b:close()            the engine steps with its optimizer again
 *
 * b keeps the engine and the optimizer handles alive. */
#include "lua_tensor.h"
#include "lua_optim.h"
#include "ds_error.h"
#include "ds_onebit.h"
#include "ds_zero.h"

#include <string.h>

#define DSL_ONEBIT_MT "dslua.OneBit"

typedef struct {
    ds_onebit *b;
} onebit_ud;

static onebit_ud *check_onebit(lua_State *L) {
    onebit_ud *u = luaL_checkudata(L, 1, DSL_ONEBIT_MT);
    if (!u->b) luaL_error(L, "1-bit optimizer: used after close()");
    return u;
}

/* The engine b steps, from b's environment, while it is open: lua_zero.c's
 * handle holds the ds_zero pointer, NULL once closed (its memory outlives
 * the finalizers of the cycle that collects it). */
static ds_zero *open_engine(lua_State *L) {
    lua_getfenv(L, 1);
    lua_rawgeti(L, -1, 1);
    ds_zero **z = lua_touserdata(L, -1);
    lua_pop(L, 2);
    return z ? *z : NULL;
}

static double field(lua_State *L, int t, const char *key, double def) {
    lua_getfield(L, t, key);
    double v = lua_isnil(L, -1) ? def : luaL_checknumber(L, -1);
    lua_pop(L, 1);
    return v;
}

static int step_fn(void *ud, const ds_optim_hparams *h) { return ds_onebit_step(ud, h); }

static int l_new(lua_State *L) {
    ds_zero *z = dsL_checkzero(L, 1);
    ds_optim *o = dsL_checkoptim(L, 2);
    luaL_checktype(L, 3, LUA_TTABLE);
    lua_getfield(L, 3, "kind");
    const char *kind = luaL_checkstring(L, -1);
    /* DeepSpeed's defaults */
    ds_onebit_config c = {
        .kind = strcmp(kind, "ZeroOneAdam") == 0 ? DS_ZERO_ONE_ADAM
              : strcmp(kind, "OneBitLamb") == 0 ? DS_ONEBIT_LAMB : DS_ONEBIT_ADAM,
        .freeze_step = (int64_t)field(L, 3, "freeze_step", 100000),
        .coeff_beta = field(L, 3, "coeff_beta", 0.9),
        .factor_max = field(L, 3, "factor_max", 4.0),
        .factor_min = field(L, 3, "factor_min", 0.5),
        .factor_threshold = field(L, 3, "factor_threshold", 0.1),
        .var_freeze_step = (int64_t)field(L, 3, "var_freeze_step", 100000),
        .var_update_scaler = (int64_t)field(L, 3, "var_update_scaler", 16),
        .local_step_scaler = (int64_t)field(L, 3, "local_step_scaler", 32678),
        .local_step_clipper = (int64_t)field(L, 3, "local_step_clipper", 16),
    };
    if (strcmp(kind, "ZeroOneAdam") != 0 && strcmp(kind, "OneBitAdam") != 0 && strcmp(kind, "OneBitLamb") != 0)
        return luaL_error(L, "1-bit optimizer: unknown kind '%s' (OneBitAdam, ZeroOneAdam, OneBitLamb)", kind);
    onebit_ud *u = lua_newuserdata(L, sizeof *u);
    u->b = NULL;
    luaL_getmetatable(L, DSL_ONEBIT_MT);
    lua_setmetatable(L, -2);
    /* the engine and the optimizer live as long as b */
    lua_createtable(L, 2, 0);
    lua_pushvalue(L, 1);
    lua_rawseti(L, -2, 1);
    lua_pushvalue(L, 2);
    lua_rawseti(L, -2, 2);
    lua_setfenv(L, -2);
    if (!(u->b = ds_onebit_new(&c, o))) return dsL_error(L);
    if (ds_zero_set_step_fn(z, step_fn, u->b)) return dsL_error(L);
    return 1;
}

static int l_reduces(lua_State *L) {
    lua_pushboolean(L, ds_onebit_reduces(check_onebit(L)->b));
    return 1;
}

static int l_stats(lua_State *L) {
    ds_onebit_stats s;
    ds_onebit_stats_get(check_onebit(L)->b, &s);
    lua_createtable(L, 0, 3);
    dsL_setnumber(L, "steps", (lua_Number)s.steps);
    lua_pushboolean(L, s.compressed);
    lua_setfield(L, -2, "compressed");
    dsL_setnumber(L, "bytes", (lua_Number)s.bytes);
    return 1;
}

static int l_allreduce(lua_State *L) {
    onebit_ud *u = check_onebit(L);
    if (ds_onebit_allreduce(u->b, (int)luaL_checkinteger(L, 2) - 1, dsL_checktensor(L, 3))) return dsL_error(L);
    return 0;
}

static int l_lamb_state(lua_State *L) {
    onebit_ud *u = check_onebit(L);
    ds_tensor *fresh_v, *pieces;
    if (ds_onebit_lamb_state(u->b, (int)luaL_checkinteger(L, 2) - 1, &fresh_v, &pieces)) return dsL_error(L);
    dsL_pushtensor(L, fresh_v);
    dsL_pushtensor(L, pieces);
    return 2;
}

static int l_load_lamb_state(lua_State *L) {
    onebit_ud *u = check_onebit(L);
    if (ds_onebit_lamb_load(u->b, (int)luaL_checkinteger(L, 2) - 1, (int64_t)luaL_checknumber(L, 3),
                            dsL_checktensor(L, 4), dsL_checktensor(L, 5)))
        return dsL_error(L);
    return 0;
}

/* close() and __gc: the engine, if still open, steps with its optimizer again */
static int l_close(lua_State *L) {
    onebit_ud *u = luaL_checkudata(L, 1, DSL_ONEBIT_MT);
    ds_zero *z = u->b ? open_engine(L) : NULL;
    if (z) ds_zero_set_step_fn(z, NULL, NULL);
    ds_onebit_free(u->b);
    u->b = NULL;
    return 0;
}

static const luaL_Reg onebit_methods[] = {
    {"reduces", l_reduces}, {"stats", l_stats}, {"allreduce", l_allreduce}, {"lamb_state", l_lamb_state},
    {"load_lamb_state", l_load_lamb_state}, {"close", l_close},
    {NULL, NULL}
};

void dsL_open_onebit(lua_State *L) {
    dsL_newtype(L, DSL_ONEBIT_MT, onebit_methods, l_close);
    lua_pop(L, 1);
    lua_newtable(L);
    lua_pushcfunction(L, l_new);
    lua_setfield(L, -2, "new");
    lua_setfield(L, -2, "_onebit");
}
