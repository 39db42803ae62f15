/* Lua bindings of the LR schedule formulas (ds_lr.h), one parameter
 * group's value at DeepSpeed's last_batch_iteration:
 *   lr_range_test(iteration, params [, who]) -> lr
 *   one_cycle(iteration, params [, who])     -> lr, momentum (nil without cycle_momentum)
 *   warmup_lr(iteration, params [, who])     -> lr
 *   warmup_decay_lr(iteration, params [, who]) -> lr
 *   warmup_cosine_lr(iteration, params [, who]) -> base_lr * ratio (base_lr defaults to 1)
 * params use DeepSpeed's names and defaults; unknown names, wrong types and
 * out-of-range values raise an error prefixed with who (default the
 * function's name). Registered as core.lr_formulas; lua/dslua/optim/lr.lua builds
 * the scheduler objects on them. */
#include "lua_tensor.h"
#include "ds_error.h"
#include "ds_lr.h"

#include <math.h>
#include <string.h>

/* Every key of the params table at idx must be one of names; the Lua
 * scheduler objects suggest the nearest, here the list is short enough. */
static void check_keys(lua_State *L, int idx, const char *who, const char *const *names) {
    luaL_checktype(L, idx, LUA_TTABLE);
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        if (lua_type(L, -1) != LUA_TSTRING)
            luaL_error(L, "%s: params keys must be names, got a %s key", who, luaL_typename(L, -1));
        const char *key = lua_tostring(L, -1);
        const char *const *n = names;
        while (*n && strcmp(*n, key) != 0) n++;
        if (*n) continue;
        luaL_Buffer b;
        luaL_buffinit(L, &b);
        for (n = names; *n; n++) {
            if (n != names) luaL_addstring(&b, ", ");
            luaL_addstring(&b, *n);
        }
        luaL_pushresult(&b);
        luaL_error(L, "%s: unknown param '%s' (valid: %s)", who, key, lua_tostring(L, -1));
    }
}

static double param_number(lua_State *L, int idx, const char *who, const char *key, double def, bool required) {
    lua_getfield(L, idx, key);
    int t = lua_type(L, -1);
    if (t == LUA_TNIL && required) luaL_error(L, "%s: params.%s is required", who, key);
    if (t != LUA_TNIL && t != LUA_TNUMBER)
        luaL_error(L, "%s: params.%s must be a number, got %s", who, key, luaL_typename(L, -1));
    double v = t == LUA_TNIL ? def : lua_tonumber(L, -1);
    lua_pop(L, 1);
    return v;
}

static bool param_flag(lua_State *L, int idx, const char *who, const char *key, bool def) {
    lua_getfield(L, idx, key);
    int t = lua_type(L, -1);
    if (t != LUA_TNIL && t != LUA_TBOOLEAN)
        luaL_error(L, "%s: params.%s must be a boolean, got %s", who, key, luaL_typename(L, -1));
    bool v = t == LUA_TNIL ? def : lua_toboolean(L, -1);
    lua_pop(L, 1);
    return v;
}

static ds_warmup_type param_warmup_type(lua_State *L, int idx, const char *who) {
    lua_getfield(L, idx, "warmup_type");
    ds_warmup_type type = DS_WARMUP_LOG;
    if (!lua_isnil(L, -1)) {
        const char *s = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        if (s && strcmp(s, "log") == 0) type = DS_WARMUP_LOG;
        else if (s && strcmp(s, "linear") == 0) type = DS_WARMUP_LINEAR;
        else
            luaL_error(L, "%s: params.warmup_type must be 'log' or 'linear', got %s%s%s", who, s ? "'" : "a ",
                       s ? s : luaL_typename(L, -1), s ? "'" : "");
    }
    lua_pop(L, 1);
    return type;
}

static int64_t check_iteration(lua_State *L, const char *who) {
    char what[96];
    snprintf(what, sizeof what, "%s: iteration", who);
    return dsL_checkint(L, 1, INT64_MIN, INT64_MAX, what);
}

static void checked(lua_State *L, int rc, const char *who) {
    if (rc) luaL_error(L, "%s: params.%s", who, ds_error_message());
}

static const char *const RANGE_TEST_NAMES[] = {
    "lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate", "lr_range_test_staircase", NULL};

static int l_lr_range_test(lua_State *L) {
    const char *who = luaL_optstring(L, 3, "lr_range_test");
    int64_t it = check_iteration(L, who);
    check_keys(L, 2, who, RANGE_TEST_NAMES);
    ds_lr_range_test p = {
        .min_lr = param_number(L, 2, who, "lr_range_test_min_lr", 1e-3, false),
        .step_size = param_number(L, 2, who, "lr_range_test_step_size", 2000, false),
        .step_rate = param_number(L, 2, who, "lr_range_test_step_rate", 1.0, false),
        .staircase = param_flag(L, 2, who, "lr_range_test_staircase", false),
    };
    checked(L, ds_lr_range_test_check(&p), who);
    lua_pushnumber(L, ds_lr_range_test_lr(&p, it));
    return 1;
}

static const char *const ONE_CYCLE_NAMES[] = {
    "cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
    "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
    "cycle_min_mom", "cycle_max_mom", "decay_mom_rate", NULL};

static int l_one_cycle(lua_State *L) {
    const char *who = luaL_optstring(L, 3, "one_cycle");
    int64_t it = check_iteration(L, who);
    check_keys(L, 2, who, ONE_CYCLE_NAMES);
    ds_lr_one_cycle p = {
        .min_lr = param_number(L, 2, who, "cycle_min_lr", 0, true),
        .max_lr = param_number(L, 2, who, "cycle_max_lr", 0, true),
        .decay_lr_rate = param_number(L, 2, who, "decay_lr_rate", 0, false),
        .first_step_size = param_number(L, 2, who, "cycle_first_step_size", 2000, false),
        .first_stair_count = param_number(L, 2, who, "cycle_first_stair_count", 0, false),
        .decay_step_size = param_number(L, 2, who, "decay_step_size", 0, false),
        .min_mom = param_number(L, 2, who, "cycle_min_mom", 0.8, false),
        .max_mom = param_number(L, 2, who, "cycle_max_mom", 0.9, false),
        .decay_mom_rate = param_number(L, 2, who, "decay_mom_rate", 0, false),
    };
    /* DeepSpeed's None defaults: the second half mirrors the first */
    p.second_step_size = param_number(L, 2, who, "cycle_second_step_size", p.first_step_size, false);
    p.second_stair_count = param_number(L, 2, who, "cycle_second_stair_count", p.first_stair_count, false);
    bool cycle_momentum = param_flag(L, 2, who, "cycle_momentum", true);
    checked(L, ds_lr_one_cycle_check(&p), who);
    double lr, mom;
    ds_lr_one_cycle_at(&p, it, &lr, &mom);
    lua_pushnumber(L, lr);
    if (!cycle_momentum) return 1;
    lua_pushnumber(L, mom);
    return 2;
}

static const char *const WARMUP_NAMES[] = {
    "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", NULL};
static const char *const WARMUP_DECAY_NAMES[] = {
    "total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", NULL};

static ds_lr_warmup check_warmup(lua_State *L, const char *who, bool with_decay) {
    check_keys(L, 2, who, with_decay ? WARMUP_DECAY_NAMES : WARMUP_NAMES);
    ds_lr_warmup p = {
        .min_lr = param_number(L, 2, who, "warmup_min_lr", 0, false),
        .max_lr = param_number(L, 2, who, "warmup_max_lr", 0.001, false),
        .num_steps = param_number(L, 2, who, "warmup_num_steps", 1000, false),
        .type = param_warmup_type(L, 2, who),
        .total_num_steps = with_decay ? param_number(L, 2, who, "total_num_steps", 0, true) : 0,
    };
    checked(L, ds_lr_warmup_check(&p, with_decay), who);
    return p;
}

static int l_warmup_lr(lua_State *L) {
    const char *who = luaL_optstring(L, 3, "warmup_lr");
    int64_t it = check_iteration(L, who);
    ds_lr_warmup p = check_warmup(L, who, false);
    lua_pushnumber(L, ds_lr_warmup_lr(&p, it));
    return 1;
}

static int l_warmup_decay_lr(lua_State *L) {
    const char *who = luaL_optstring(L, 3, "warmup_decay_lr");
    int64_t it = check_iteration(L, who);
    ds_lr_warmup p = check_warmup(L, who, true);
    lua_pushnumber(L, ds_lr_warmup_decay_lr(&p, it));
    return 1;
}

static const char *const WARMUP_COSINE_NAMES[] = {
    "total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type", "base_lr", NULL};

static int l_warmup_cosine_lr(lua_State *L) {
    const char *who = luaL_optstring(L, 3, "warmup_cosine_lr");
    int64_t it = check_iteration(L, who);
    check_keys(L, 2, who, WARMUP_COSINE_NAMES);
    ds_lr_warmup_cosine p = {
        .total_num_steps = param_number(L, 2, who, "total_num_steps", 0, true),
        .warmup_min_ratio = param_number(L, 2, who, "warmup_min_ratio", 0.0, false),
        .warmup_num_steps = param_number(L, 2, who, "warmup_num_steps", 1000, false),
        .cos_min_ratio = param_number(L, 2, who, "cos_min_ratio", 0.0001, false),
        .type = param_warmup_type(L, 2, who),
    };
    double base_lr = param_number(L, 2, who, "base_lr", 1.0, false);
    checked(L, ds_lr_warmup_cosine_check(&p), who);
    if (!isfinite(base_lr) || base_lr < 0)
        luaL_error(L, "%s: params.base_lr must be a finite number >= 0, got %f", who, base_lr);
    lua_pushnumber(L, base_lr * ds_lr_warmup_cosine_ratio(&p, it));
    return 1;
}

void dsL_open_lr(lua_State *L) {
    static const luaL_Reg fns[] = {
        {"lr_range_test", l_lr_range_test},
        {"one_cycle", l_one_cycle},
        {"warmup_lr", l_warmup_lr},
        {"warmup_decay_lr", l_warmup_decay_lr},
        {"warmup_cosine_lr", l_warmup_cosine_lr},
        {NULL, NULL},
    };
    dsL_setfuncs(L, "lr_formulas", fns);
}
