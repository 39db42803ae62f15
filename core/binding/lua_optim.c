/* The optimizer core in Lua: a handle over ds_optim that lua/dslua/optim/init.lua
 * drives. Hyperparameters are read from the Lua param_groups tables at
 * every step, so a schedule that edits them takes effect at once. */
#include "lua_optim.h"
#include "lua_tensor.h"
#include "ds_error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DSL_OPTIM_MT "dslua.Optim"

ds_optim *dsL_checkoptim(lua_State *L, int idx) {
    ds_optim **p = luaL_testudata(L, idx, DSL_OPTIM_MT);
    if (!p && lua_istable(L, idx)) {
        lua_getfield(L, idx, "_h");
        p = luaL_testudata(L, -1, DSL_OPTIM_MT);
        lua_pop(L, 1);      /* the table keeps the handle alive */
    }
    if (!p) luaL_error(L, "optim: expected an optimizer (ds.optim) or its handle, got %s", luaL_typename(L, idx));
    if (!*p) luaL_error(L, "optim: optimizer already freed");
    return *p;
}

/* A 1-based group index, checked. */
static int checkgroup(lua_State *L, int idx, const ds_optim *o) {
    lua_Integer g = luaL_checkinteger(L, idx);
    if (g < 1 || g > o->n_groups)
        luaL_error(L, "optim.%s: group %d out of range (%d groups)", ds_optim_name(o->kind), (int)g, o->n_groups);
    return (int)g - 1;
}

/* "optim.AdamW: group 2" for messages; "optim.AdamW: apply" when g < 0 */
static const char *where(char *buf, size_t n, ds_optim_kind k, int g) {
    if (g < 0) snprintf(buf, n, "optim.%s: apply", ds_optim_name(k));
    else snprintf(buf, n, "optim.%s: group %d", ds_optim_name(k), g + 1);
    return buf;
}

static double num_field(lua_State *L, int t, const char *key, ds_optim_kind k, int g) {
    lua_getfield(L, t, key);
    if (lua_type(L, -1) != LUA_TNUMBER) {
        char w[64];
        luaL_error(L, "%s: %s must be a number, got %s", where(w, sizeof w, k, g), key, luaL_typename(L, -1));
    }
    double v = lua_tonumber(L, -1);
    lua_pop(L, 1);
    return v;
}

static bool bool_field(lua_State *L, int t, const char *key, bool def, ds_optim_kind k, int g) {
    lua_getfield(L, t, key);
    bool v = def;
    if (lua_isboolean(L, -1)) v = lua_toboolean(L, -1);
    else if (!lua_isnil(L, -1)) {
        char w[64];
        luaL_error(L, "%s: %s must be a boolean, got %s", where(w, sizeof w, k, g), key, luaL_typename(L, -1));
    }
    lua_pop(L, 1);
    return v;
}

static void betas_field(lua_State *L, int t, ds_optim_hparams *h, ds_optim_kind k, int g) {
    lua_getfield(L, t, "betas");
    bool ok = lua_istable(L, -1) && lua_objlen(L, -1) == 2;
    for (int i = 1; ok && i <= 2; i++) {
        lua_rawgeti(L, -1, i);
        ok = lua_type(L, -1) == LUA_TNUMBER;
        if (ok) *(i == 1 ? &h->beta1 : &h->beta2) = lua_tonumber(L, -1);
        lua_pop(L, 1);
    }
    if (!ok) {
        char w[64];
        luaL_error(L, "%s: betas must be a table of two numbers", where(w, sizeof w, k, g));
    }
    lua_pop(L, 1);
}

/* The hyperparameters kind k reads, from the group table at t (group g,
 * 0-based, or -1 for apply). */
static ds_optim_hparams read_hparams(lua_State *L, int t, ds_optim_kind k, int g) {
    ds_optim_hparams h;
    memset(&h, 0, sizeof h);
    h.lr = num_field(L, t, "lr", k, g);
    h.weight_decay = num_field(L, t, "weight_decay", k, g);
    switch (k) {
    case DS_OPTIM_SGD:
        h.momentum = num_field(L, t, "momentum", k, g);
        h.dampening = num_field(L, t, "dampening", k, g);
        h.nesterov = bool_field(L, t, "nesterov", false, k, g);
        break;
    case DS_OPTIM_ADAGRAD:
        h.eps = num_field(L, t, "eps", k, g);
        h.lr_decay = num_field(L, t, "lr_decay", k, g);
        h.initial_accumulator_value = num_field(L, t, "initial_accumulator_value", k, g);
        break;
    case DS_OPTIM_LION:
        betas_field(L, t, &h, k, g);
        break;
    default:      /* Adam, AdamW, Lamb */
        betas_field(L, t, &h, k, g);
        h.eps = num_field(L, t, "eps", k, g);
        h.bias_correction = bool_field(L, t, "bias_correction", true, k, g);
        break;
    }
    if (k == DS_OPTIM_LAMB) {
        h.max_coeff = num_field(L, t, "max_coeff", k, g);
        h.min_coeff = num_field(L, t, "min_coeff", k, g);
        h.eps_inside_sqrt = bool_field(L, t, "eps_inside_sqrt", false, k, g);
    }
    return h;
}

static ds_optim_kind checkkind(lua_State *L, int idx) {
    const char *name = luaL_checkstring(L, idx);
    int kind = ds_optim_parse(name);
    if (kind < 0) luaL_error(L, "optim: unknown optimizer '%s' (SGD, Adam, AdamW, Adagrad, Lamb, Lion)", name);
    return (ds_optim_kind)kind;
}

/* optim_apply(name, group, t, p, g, {state...} [, first [, grad_scale]]):
 * one stateless update of the 1-D f32 views p (in place) and the state
 * views, listed in the kind's slot order (optim_state_names); group holds
 * the hyperparameters, read as param_groups are at step; t is the 1-based
 * step; first starts SGD's momentum buffer (default t == 1); the kernel
 * takes g times grad_scale (default 1) without changing g. */
static int l_optim_apply(lua_State *L) {
    ds_optim_kind k = checkkind(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    char what[64];
    snprintf(what, sizeof what, "optim.%s: apply: step", ds_optim_name(k));
    int64_t t = dsL_checkint(L, 3, 1, INT64_MAX, what);
    ds_tensor *p = dsL_checktensor(L, 4), *g = dsL_checktensor(L, 5);
    ds_tensor *s[DS_OPTIM_MAX_STATE] = { NULL, NULL };
    if (!lua_isnoneornil(L, 6)) {
        luaL_checktype(L, 6, LUA_TTABLE);
        int n = (int)lua_objlen(L, 6);
        if (n > ds_optim_n_state(k))
            return luaL_error(L, "optim.%s: apply: %d state tensors, the kind has %d", ds_optim_name(k), n,
                              ds_optim_n_state(k));
        for (int i = 0; i < n; i++) {
            lua_rawgeti(L, 6, i + 1);
            if (!(s[i] = dsL_totensor(L, -1)))
                return luaL_error(L, "optim.%s: apply: state %d (%s) is a %s, not a tensor", ds_optim_name(k), i + 1,
                                  ds_optim_state_name(k, i), luaL_typename(L, -1));
            lua_pop(L, 1);
        }
    }
    bool first = lua_isnoneornil(L, 7) ? t == 1 : lua_toboolean(L, 7);
    double grad_scale = luaL_optnumber(L, 8, 1);
    ds_optim_hparams h = read_hparams(L, 2, k, -1);
    if (ds_optim_apply(k, &h, (int64_t)t, first, p, g, s[0], s[1], grad_scale, NULL)) return dsL_error(L);
    return 0;
}

/* optim_check_group(name, group): raises what optim_apply would about the
 * hyperparameters, so a caller can check every group before it steps any. */
static int l_optim_check_group(lua_State *L) {
    ds_optim_kind k = checkkind(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    ds_optim_hparams h = read_hparams(L, 2, k, -1);
    if (ds_optim_check_hparams(k, &h, -1)) return dsL_error(L);
    return 0;
}

/* optim_state_names(name) -> the kind's state slots, in order */
static int l_optim_state_names(lua_State *L) {
    ds_optim_kind k = checkkind(L, 1);
    lua_newtable(L);
    for (int s = 0; s < ds_optim_n_state(k); s++) {
        lua_pushstring(L, ds_optim_state_name(k, s));
        lua_rawseti(L, -2, s + 1);
    }
    return 1;
}

/* optim_new(kind) -> handle */
static int l_optim_new(lua_State *L) {
    ds_optim_kind kind = checkkind(L, 1);
    ds_optim **p = dsL_newhandle(L, DSL_OPTIM_MT);
    if (!(*p = ds_optim_new(kind))) return dsL_error(L);
    return 1;
}

DSL_HANDLE_GC(l_gc, ds_optim, DSL_OPTIM_MT, ds_optim_free)

/* h:add_group(group): group.params is a list of tensors; the other fields
 * are the hyperparameters. */
static int l_add_group(lua_State *L) {
    ds_optim *o = dsL_checkoptim(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    int g = o->n_groups;
    ds_optim_hparams h = read_hparams(L, 2, o->kind, g);
    lua_getfield(L, 2, "params");
    if (!lua_istable(L, -1))
        return luaL_error(L, "optim.%s: group %d: params must be a list of tensors", ds_optim_name(o->kind), g + 1);
    int n = (int)lua_objlen(L, -1);
    ds_tensor **params = lua_newuserdata(L, sizeof *params * (size_t)(n + 1));   /* freed by the GC */
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, -2, i + 1);
        if (!(params[i] = dsL_totensor(L, -1)))
            return luaL_error(L, "optim.%s: parameter %d of group %d is a %s, not a tensor", ds_optim_name(o->kind),
                              i + 1, g + 1, luaL_typename(L, -1));
        lua_pop(L, 1);
    }
    if (ds_optim_add_group(o, n, params, &h)) return dsL_error(L);
    return 0;
}

/* The Lua group's params list must be the one the group was built from. */
static void check_params(lua_State *L, int t, const ds_optim *o, int g) {
    const ds_optim_group *gr = &o->groups[g];
    lua_getfield(L, t, "params");
    bool same = lua_istable(L, -1) && (int)lua_objlen(L, -1) == gr->n_params;
    for (int i = 0; same && i < gr->n_params; i++) {
        lua_rawgeti(L, -1, i + 1);
        same = dsL_totensor(L, -1) == gr->params[i];
        lua_pop(L, 1);
    }
    if (!same)
        luaL_error(L, "optim.%s: group %d: params differ from the %d the group was built with (use add_param_group "
                   "for new ones)", ds_optim_name(o->kind), g + 1, gr->n_params);
    lua_pop(L, 1);
}

void dsL_optim_hparams(lua_State *L, int idx, const ds_optim *o, ds_optim_hparams *h) {
    if (idx < 0 && idx > LUA_REGISTRYINDEX) idx = lua_gettop(L) + idx + 1;
    if (!lua_istable(L, idx))
        luaL_error(L, "optim.%s: param_groups must be a table, got %s", ds_optim_name(o->kind), luaL_typename(L, idx));
    if ((int)lua_objlen(L, idx) != o->n_groups)
        luaL_error(L, "optim.%s: %d param_groups, the optimizer has %d", ds_optim_name(o->kind),
                   (int)lua_objlen(L, idx), o->n_groups);
    for (int g = 0; g < o->n_groups; g++) {
        lua_rawgeti(L, idx, g + 1);
        if (!lua_istable(L, -1)) luaL_error(L, "optim.%s: group %d is not a table", ds_optim_name(o->kind), g + 1);
        int t = lua_gettop(L);
        check_params(L, t, o, g);
        h[g] = read_hparams(L, t, o->kind, g);
        if (ds_optim_check_hparams(o->kind, &h[g], g)) dsL_error(L);
        lua_pop(L, 1);
    }
}

/* h:step(param_groups): every group, hyperparameters read now */
static int l_step(lua_State *L) {
    ds_optim *o = dsL_checkoptim(L, 1);
    lua_settop(L, 2);       /* the list stays at 2, below h */
    /* every group checked before any steps, so a bad value changes nothing */
    ds_optim_hparams *h = lua_newuserdata(L, sizeof *h * (size_t)(o->n_groups + 1));
    dsL_optim_hparams(L, 2, o, h);
    for (int g = 0; g < o->n_groups; g++)
        if (ds_optim_step(o, g, &h[g])) return dsL_error(L);
    return 0;
}

static int l_zero_grad(lua_State *L) {
    if (ds_optim_zero_grad(dsL_checkoptim(L, 1))) return dsL_error(L);
    return 0;
}

/* h:flat(g, 'params' | 'grads' | state name) -> the flat 1-D buffer, or nil */
static int l_flat(lua_State *L) {
    ds_optim *o = dsL_checkoptim(L, 1);
    ds_optim_group *gr = &o->groups[checkgroup(L, 2, o)];
    const char *which = luaL_checkstring(L, 3);
    ds_tensor *t;
    if (strcmp(which, "params") == 0) t = gr->flat_params;
    else if (strcmp(which, "grads") == 0) t = gr->flat_grads;
    else {
        int slot = ds_optim_state_slot(o->kind, which);
        if (slot < 0) return luaL_error(L, "optim.%s: no buffer '%s'", ds_optim_name(o->kind), which);
        t = gr->state[slot];
    }
    if (!t) return 0;
    ds_tensor_retain(t);
    return dsL_pushtensor(L, t);
}

/* h:param_state(g, i) -> {name = clone, ...} of the slots that hold state */
static int l_param_state(lua_State *L) {
    ds_optim *o = dsL_checkoptim(L, 1);
    int g = checkgroup(L, 2, o);
    lua_Integer i = luaL_checkinteger(L, 3);
    luaL_argcheck(L, i >= 1 && i <= o->groups[g].n_params, 3, "parameter index out of range");
    lua_newtable(L);
    for (int s = 0; s < ds_optim_n_state(o->kind); s++) {
        ds_tensor *view = ds_optim_state_view(o, g, (int)i - 1, s);
        if (!view) continue;
        ds_tensor *copy = ds_clone(view);
        ds_tensor_release(view);
        dsL_pushtensor(L, copy);
        lua_setfield(L, -2, ds_optim_state_name(o->kind, s));
    }
    return 1;
}

/* h:load_state(g, i, name, tensor) */
static int l_load_state(lua_State *L) {
    ds_optim *o = dsL_checkoptim(L, 1);
    int g = checkgroup(L, 2, o);
    lua_Integer i = luaL_checkinteger(L, 3);
    luaL_argcheck(L, i >= 1 && i <= o->groups[g].n_params, 3, "parameter index out of range");
    const char *name = luaL_checkstring(L, 4);
    int slot = ds_optim_state_slot(o->kind, name);
    if (slot < 0) return luaL_error(L, "optim.%s: load_state_dict: unknown state '%s'", ds_optim_name(o->kind), name);
    if (ds_optim_load_state(o, g, (int)i - 1, slot, dsL_checktensor(L, 5))) return dsL_error(L);
    return 0;
}

/* h:reset_state(g, group): step 0 and fresh buffers */
static int l_reset_state(lua_State *L) {
    ds_optim *o = dsL_checkoptim(L, 1);
    int g = checkgroup(L, 2, o);
    luaL_checktype(L, 3, LUA_TTABLE);
    ds_optim_hparams h = read_hparams(L, 3, o->kind, g);
    if (ds_optim_reset_state(o, g, &h)) return dsL_error(L);
    return 0;
}

/* h:steps(g [, n]) -> the group's step count, set to n when given */
static int l_steps(lua_State *L) {
    ds_optim *o = dsL_checkoptim(L, 1);
    int g = checkgroup(L, 2, o);
    if (!lua_isnoneornil(L, 3)) {
        o->groups[g].step = dsL_checkint(L, 3, 0, INT64_MAX, "steps: step");
    }
    lua_pushnumber(L, (lua_Number)o->groups[g].step);
    return 1;
}

/* h:has_state(g, name) -> whether the slot holds state: allocated, and for
 * SGD's momentum once a step has started it (what state_dict saves) */
static int l_has_state(lua_State *L) {
    ds_optim *o = dsL_checkoptim(L, 1);
    ds_optim_group *gr = &o->groups[checkgroup(L, 2, o)];
    const char *name = luaL_checkstring(L, 3);
    int slot = ds_optim_state_slot(o->kind, name);
    if (slot < 0) return luaL_error(L, "optim.%s: no buffer '%s'", ds_optim_name(o->kind), name);
    lua_pushboolean(L, gr->state[slot] && (o->kind != DS_OPTIM_SGD || gr->momentum_started));
    return 1;
}

/* h:lamb_coeffs(g) -> each piece's trust ratio at the last step (the
 * parameters', unless ds_optim_set_segments cut the group otherwise) */
static int l_lamb_coeffs(lua_State *L) {
    ds_optim *o = dsL_checkoptim(L, 1);
    ds_optim_group *gr = &o->groups[checkgroup(L, 2, o)];
    lua_createtable(L, gr->n_seg, 0);
    for (int i = 0; i < gr->n_seg; i++) {
        lua_pushnumber(L, gr->lamb_coeffs[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

/* h:state_names() -> the state slots of this kind, in order */
static int l_state_names(lua_State *L) {
    ds_optim *o = dsL_checkoptim(L, 1);
    lua_newtable(L);
    for (int s = 0; s < ds_optim_n_state(o->kind); s++) {
        lua_pushstring(L, ds_optim_state_name(o->kind, s));
        lua_rawseti(L, -2, s + 1);
    }
    return 1;
}

static const luaL_Reg optim_methods[] = {
    {"add_group", l_add_group}, {"step", l_step}, {"zero_grad", l_zero_grad}, {"flat", l_flat},
    {"param_state", l_param_state}, {"load_state", l_load_state}, {"reset_state", l_reset_state},
    {"steps", l_steps}, {"has_state", l_has_state}, {"lamb_coeffs", l_lamb_coeffs}, {"state_names", l_state_names},
    {NULL, NULL}
};

static const luaL_Reg optim_functions[] = {
    {"optim_new", l_optim_new}, {"optim_apply", l_optim_apply}, {"optim_check_group", l_optim_check_group},
    {"optim_state_names", l_optim_state_names}, {NULL, NULL}
};

void dsL_open_optim(lua_State *L) {
    dsL_newtype(L, DSL_OPTIM_MT, optim_methods, l_gc);
    lua_pop(L, 1);
    luaL_register(L, NULL, optim_functions);
}
