/* Autograd nodes whose backward is a Lua function: how ds.checkpoint
 * recomputes a block in backward.
 *
 *   function_node(out, backward, x1, ..., xn) -> y
 *
 * y is a view of `out` (made with autograd off) recorded as computed from
 * the tensors x1..xn (at most DS_NODE_MAX_INPUTS). The node saves the x's
 * (aliases without history, as any op saves its inputs) and frees them
 * after backward like any node. Backward calls backward(grad_y, x1, ..., xn)
 * on the Lua state running backward; it returns one gradient (or nil) per
 * x. function_node_bare(out, backward, x1, ..., xn) saves none of the x's
 * (backward(grad_y) alone): a backward that reads only what it keeps
 * itself (the fp8 linear's codes) lets the inputs go after forward. The
 * function is held through a registry reference that the node drops
 * when it is freed; since a node may be freed where no Lua call is safe (a
 * tensor's __gc), dropped references are queued and released by the next
 * function_node call. */
#include "lua_tensor.h"
#include "ds_error.h"

#include <stdlib.h>
#include <string.h>

static int *dead_refs;
static size_t n_dead, cap_dead;

static void function_free(ds_node *n) {
    if (n_dead == cap_dead) {
        size_t cap = cap_dead ? cap_dead * 2 : 64;
        int *grown = realloc(dead_refs, cap * sizeof *grown);
        if (!grown) return;     /* out of memory: the function leaks, nothing worse */
        dead_refs = grown;
        cap_dead = cap;
    }
    dead_refs[n_dead++] = (int)n->i[0];
}

static void release_dead(lua_State *L) {
    for (size_t k = 0; k < n_dead; k++) luaL_unref(L, LUA_REGISTRYINDEX, dead_refs[k]);
    n_dead = 0;
}

static int function_backward(ds_node *n, ds_tensor *g, ds_tensor **gin) {
    lua_State *L = dsL_fetching_state();
    if (!L) return ds_fail(DS_ERR_STATE, "its backward is a Lua function and backward was not run from Lua"), -1;
    int top = lua_gettop(L);
    if (!lua_checkstack(L, n->n_inputs + 2)) return ds_fail(DS_ERR_NOMEM, "Lua stack overflow"), -1;
    lua_rawgeti(L, LUA_REGISTRYINDEX, (int)n->i[0]);
    ds_tensor_retain(g);
    dsL_pushtensor(L, g);
    for (int k = 0; k < n->n_inputs; k++) {
        if (!n->saved[k]) {
            lua_pushnil(L);
            continue;
        }
        ds_tensor_retain(n->saved[k]);
        dsL_pushtensor(L, n->saved[k]);
    }
    if (lua_pcall(L, 1 + n->n_inputs, n->n_inputs, 0)) {
        const char *msg = lua_tostring(L, -1);
        ds_fail(DS_ERR_STATE, "%s", msg ? msg : "(error object is not a string)");
        lua_settop(L, top);
        return -1;
    }
    for (int k = 0; k < n->n_inputs; k++) {
        int idx = top + 1 + k;
        if (lua_isnil(L, idx)) continue;
        ds_tensor *t = dsL_totensor(L, idx);
        if (!t) {
            for (int j = 0; j < k; j++) { ds_tensor_release(gin[j]); gin[j] = NULL; }
            ds_fail(DS_ERR_STATE, "the Lua backward returned a %s for input %d, expected a tensor or nil",
                    luaL_typename(L, idx), k + 1);
            lua_settop(L, top);
            return -1;
        }
        ds_tensor_retain(t);
        gin[k] = t;
    }
    lua_settop(L, top);
    return 0;
}

static int function_node(lua_State *L, bool save) {
    release_dead(L);
    ds_tensor *out = dsL_checktensor(L, 1);
    luaL_checktype(L, 2, LUA_TFUNCTION);
    int n = lua_gettop(L) - 2;
    if (n > DS_NODE_MAX_INPUTS)
        return luaL_error(L, "function_node: %d inputs needing grad, at most %d", n, DS_NODE_MAX_INPUTS);
    ds_tensor *in[DS_NODE_MAX_INPUTS] = {0};
    for (int k = 0; k < n; k++) in[k] = dsL_checktensor(L, 3 + k);
    if (out->grad_fn)
        return luaL_error(L, "function_node: the output already has a history (%s made it); "
                          "compute it with autograd off", out->grad_fn->name);
    ds_tensor *y = ds_tensor_view_of(out, out->ndim, out->shape, out->stride, out->offset);
    if (!y) return dsL_error(L);
    /* the output is what the node keeps alive: count it as an activation */
    if (out->storage->category == DS_MEM_OTHER) ds_tensor_set_category(out, DS_MEM_ACT);
    ds_node *node = ds_autograd_record("checkpoint", function_backward, n, in, y);
    if (node) {
        for (int k = 0; k < n && save; k++)
            if (ds_node_save(node, k, in[k])) {
                ds_tensor_release(y);
                return dsL_error(L);
            }
        lua_pushvalue(L, 2);
        node->i[0] = luaL_ref(L, LUA_REGISTRYINDEX);
        node->on_free = function_free;
    }
    return dsL_pushtensor(L, y);
}

static int l_function_node(lua_State *L) { return function_node(L, true); }
static int l_function_node_bare(lua_State *L) { return function_node(L, false); }

static const luaL_Reg fns[] = {
    {"function_node", l_function_node}, {"function_node_bare", l_function_node_bare},
    {NULL, NULL}
};

void dsL_open_function(lua_State *L) { dsL_register(L, fns, false); }
