/* What ZeRO (lua/dslua/zero.lua) needs below Lua, as ds.core._zero:
 *
 *   _zero.set_fetch(fn)        fn(t) must make a released tensor whole; it is
 *                              called when an op or a backward node reads one
 *   _zero.release_data(t)      t (a leaf) keeps its shape, loses its data
 *   _zero.set_data(t, src)     t becomes a view of src's data (no copy)
 *   _zero.is_released(t)
 *   _zero.retype(t, dtype)     t (a leaf) converted in place
 *   _zero.drop(t, ...)         the handles let go of their tensors now
 *   _zero.take_grad(p, rows)   p's gradient moved into [P, s] rows
 *   _zero.key(t)               a value that names the tensor itself (every
 *                              Lua handle of one tensor gives the same key)
 *   _zero.backward(loss, params, on_ready)
 *                              loss's backward; on_ready(i) runs as soon as
 *                              params[i]'s gradient is complete
 *
 * Errors inside fn or on_ready fail the op or the backward with their
 * message. */
#include "lua_tensor.h"
#include "ds_autograd.h"
#include "ds_error.h"

#include <stdlib.h>

static int fetch_ref = LUA_NOREF;
static lua_State *backward_L;       /* the state running a backward, for fetches inside it */

static int call_fetch(lua_State *L, ds_tensor *t) {
    if (fetch_ref == LUA_NOREF) return 0;
    lua_rawgeti(L, LUA_REGISTRYINDEX, fetch_ref);
    ds_tensor_retain(t);
    dsL_pushtensor(L, t);
    if (lua_pcall(L, 1, 0, 0) == 0) return 0;
    const char *msg = lua_tostring(L, -1);
    ds_fail(DS_ERR_STATE, "fetching a partitioned parameter: %s", msg ? msg : "(error object is not a string)");
    lua_pop(L, 1);
    return -1;
}

void dsL_fetch(lua_State *L, int idx, ds_tensor *t) {
    char s[96];
    if (call_fetch(L, t)) dsL_error(L);
    if (ds_tensor_is_released(t))
        luaL_error(L, "argument %d: %s %s has no data: a partitioned parameter (ZeRO stage 3) used where "
                   "nothing gathers it", idx, ds_dtype_name(t->dtype), ds_shape_str(t, s, sizeof s));
}

static int fetch_in_backward(ds_tensor *t, void *ud) {
    (void)ud;
    return backward_L ? call_fetch(backward_L, t) : 0;
}

int dsL_backward(lua_State *L, ds_tensor *root, ds_tensor *grad, bool retain_graph) {
    lua_State *outer = backward_L;
    backward_L = L;
    int rc = ds_backward(root, grad, retain_graph);
    backward_L = outer;
    return rc;
}

static int l_set_fetch(lua_State *L) {
    if (!lua_isnil(L, 1)) luaL_checktype(L, 1, LUA_TFUNCTION);
    luaL_unref(L, LUA_REGISTRYINDEX, fetch_ref);
    lua_settop(L, 1);
    fetch_ref = lua_isnil(L, 1) ? LUA_NOREF : luaL_ref(L, LUA_REGISTRYINDEX);
    ds_autograd_set_fetch(fetch_ref == LUA_NOREF ? NULL : fetch_in_backward, NULL);
    return 0;
}

static int l_release_data(lua_State *L) {
    if (ds_tensor_release_data(dsL_checkmeta(L, 1))) return dsL_error(L);
    return 0;
}

static int l_set_data(lua_State *L) {
    if (ds_tensor_set_data(dsL_checkmeta(L, 1), dsL_checktensor(L, 2))) return dsL_error(L);
    return 0;
}

/* retype(t, dtype): t (a leaf) converted in place, so every list holding
 * it sees the new dtype; its gradient is dropped. */
static int l_retype(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    int dt = ds_dtype_parse(luaL_checkstring(L, 2));
    if (dt < 0 || !ds_dtype_is_float((ds_dtype)dt))
        return luaL_argerror(L, 2, lua_pushfstring(L, "expected a float dtype, got '%s'", lua_tostring(L, 2)));
    if (t->grad_fn) return luaL_error(L, "retype: only a leaf can change dtype in place");
    bool prev = ds_set_grad_enabled(false);
    ds_tensor *c = ds_to_dtype(t, (ds_dtype)dt);
    ds_set_grad_enabled(prev);
    if (!c) return dsL_error(L);
    ds_mem_category cat = t->storage->category;
    t->dtype = (ds_dtype)dt;
    int rc = ds_tensor_set_data(t, c);
    ds_tensor_release(c);
    if (rc) return dsL_error(L);
    ds_tensor_set_category(t, cat);
    ds_tensor_release(t->grad);
    t->grad = NULL;
    return 0;
}

/* drop(t, ...): each handle lets go of its tensor now, not at the next
 * garbage collection (Lua cannot see how many bytes a handle holds). A
 * dropped handle raises when used. */
static int l_drop(lua_State *L) {
    for (int i = 1; i <= lua_gettop(L); i++) {
        ds_tensor **p = luaL_testudata(L, i, DSL_TENSOR_MT);
        if (!p) continue;
        ds_tensor_release(*p);
        *p = NULL;
    }
    return 0;
}

/* take_grad(p, rows): p's gradient, flattened and cut into rows of rows'
 * width (rows: [P, s] with P * s >= numel, already zero), copied in and
 * dropped from p. false when p has no gradient. */
static int l_take_grad(lua_State *L) {
    ds_tensor *p = dsL_checkmeta(L, 1), *rows = dsL_checktensor(L, 2);
    ds_tensor *g = p->grad;
    if (!g) { lua_pushboolean(L, 0); return 1; }
    int64_t n = ds_tensor_numel(g), s = rows->ndim == 2 ? rows->shape[1] : 0;
    char s1[96], s2[96];
    if (s <= 0 || rows->shape[0] * s < n || !ds_tensor_is_contiguous(g))
        return luaL_error(L, "take_grad: a gradient %s does not fit rows %s", ds_shape_str(g, s1, sizeof s1),
                          ds_shape_str(rows, s2, sizeof s2));
    int64_t full = n / s, rem = n % s;
    int rc = 0;
    if (full > 0) {
        int64_t shape[2] = { full, s }, stride[2] = { s, 1 };
        ds_tensor *src = ds_tensor_view_of(g, 2, shape, stride, g->offset);
        ds_tensor *dst = ds_tensor_view_of(rows, 2, shape, rows->stride, rows->offset);
        rc = !src || !dst || ds_copy_(dst, src);
        ds_tensor_release(src);
        ds_tensor_release(dst);
    }
    if (rc == 0 && rem > 0) {
        int64_t shape[1] = { rem }, one[1] = { 1 }, stride[1] = { rows->stride[1] };
        ds_tensor *src = ds_tensor_view_of(g, 1, shape, one, g->offset + full * s);
        ds_tensor *dst = ds_tensor_view_of(rows, 1, shape, stride, rows->offset + full * rows->stride[0]);
        rc = !src || !dst || ds_copy_(dst, src);
        ds_tensor_release(src);
        ds_tensor_release(dst);
    }
    if (rc) return dsL_error(L);
    p->grad = NULL;
    ds_tensor_release(g);
    lua_pushboolean(L, 1);
    return 1;
}

static int l_is_released(lua_State *L) {
    lua_pushboolean(L, ds_tensor_is_released(dsL_checkmeta(L, 1)));
    return 1;
}

static int l_key(lua_State *L) {
    lua_pushlightuserdata(L, dsL_checkmeta(L, 1));
    return 1;
}

/* One backward's hooks: on_ready sits at stack slot 3. */
typedef struct { lua_State *L; ds_tensor **params; int n; } hooked;

static int ready_cb(ds_tensor *leaf, void *ud) {
    hooked *h = ud;
    int i = 0;
    while (i < h->n && h->params[i] != leaf) i++;
    lua_State *L = h->L;
    lua_pushvalue(L, 3);
    lua_pushinteger(L, i + 1);
    if (lua_pcall(L, 1, 0, 0) == 0) return 0;
    const char *msg = lua_tostring(L, -1);
    ds_fail(DS_ERR_STATE, "gradient ready hook: %s", msg ? msg : "(error object is not a string)");
    lua_pop(L, 1);
    return -1;
}

static int l_backward(lua_State *L) {
    ds_tensor *loss = dsL_checktensor(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    luaL_checktype(L, 3, LUA_TFUNCTION);
    lua_settop(L, 3);
    int n = (int)lua_objlen(L, 2);
    hooked h = { L, malloc((size_t)(n ? n : 1) * sizeof(ds_tensor *)), n };
    if (!h.params) return luaL_error(L, "backward: out of memory");
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, 2, i + 1);
        h.params[i] = dsL_totensor(L, -1);
        lua_pop(L, 1);
        if (!h.params[i]) {
            free(h.params);
            return luaL_error(L, "backward: params[%d] is not a tensor", i + 1);
        }
    }
    int rc = 0, set = 0;
    for (; set < n && rc == 0; set++) rc = ds_autograd_set_leaf_hook(h.params[set], ready_cb, &h);
    if (rc == 0) rc = dsL_backward(L, loss, NULL, false);
    for (int i = 0; i < set; i++) ds_autograd_set_leaf_hook(h.params[i], NULL, &h);
    free(h.params);
    if (rc) return dsL_error(L);
    return 0;
}

static const luaL_Reg zero_functions[] = {
    {"set_fetch", l_set_fetch}, {"release_data", l_release_data}, {"set_data", l_set_data},
    {"is_released", l_is_released}, {"retype", l_retype}, {"drop", l_drop}, {"take_grad", l_take_grad}, {"key", l_key}, {"backward", l_backward},
    {NULL, NULL}
};

void dsL_open_zero(lua_State *L) {
    lua_newtable(L);
    luaL_register(L, NULL, zero_functions);
    lua_setfield(L, -2, "_zero");
}
