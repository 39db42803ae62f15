/* Lua bindings of indexing and joining: embedding, index_select, gather,
 * scatter_add, cat, stack, repeat_interleave, split, chunk. Dims are 1-based (negative from
 * the end); index values inside tensors are 0-based, as PyTorch data. */
#include "lua_tensor.h"
#include "ds_error.h"

static int l_embedding(lua_State *L) {
    ds_tensor *w = dsL_checktensor(L, 1), *ids = dsL_checktensor(L, 2);
    return dsL_pushtensor(L, ds_embedding(w, ids));
}

static int l_index_select(lua_State *L) {
    ds_tensor *x = dsL_checktensor(L, 1);
    int64_t d = dsL_checkdim(L, 2, x);
    return dsL_pushtensor(L, ds_index_select(x, d, dsL_checktensor(L, 3)));
}

static int l_gather(lua_State *L) {
    ds_tensor *x = dsL_checktensor(L, 1);
    int64_t d = dsL_checkdim(L, 2, x);
    return dsL_pushtensor(L, ds_gather(x, d, dsL_checktensor(L, 3)));
}

static int l_scatter_add(lua_State *L) {
    ds_tensor *x = dsL_checktensor(L, 1);
    int64_t d = dsL_checkdim(L, 2, x);
    ds_tensor *idx = dsL_checktensor(L, 3), *src = dsL_checktensor(L, 4);
    return dsL_pushtensor(L, ds_scatter_add(x, d, idx, src));
}

/* The tensors of the list at idx, borrowed from it, in a buffer the Lua GC
 * owns so that an error raised halfway leaks nothing. */
static ds_tensor **check_list(lua_State *L, int idx, const char *op, int *n) {
    luaL_checktype(L, idx, LUA_TTABLE);
    *n = (int)lua_objlen(L, idx);
    if (*n == 0) luaL_error(L, "%s: expected a non-empty list of tensors", op);
    ds_tensor **ts = lua_newuserdata(L, sizeof *ts * (size_t)*n);
    for (int k = 0; k < *n; k++) {
        lua_rawgeti(L, idx, k + 1);
        ts[k] = dsL_totensor(L, -1);
        if (!ts[k]) luaL_error(L, "%s: element %d of the list is a %s, expected a tensor", op, k + 1, luaL_typename(L, -1));
        lua_pop(L, 1);
    }
    return ts;
}

/* cat({a, b, ...} [, dim=1]) */
static int l_cat(lua_State *L) {
    int n;
    lua_settop(L, 2);     /* the list's buffer goes above the arguments */
    ds_tensor **ts = check_list(L, 1, "cat", &n);
    int64_t d = lua_isnoneornil(L, 2) ? 0 : dsL_checkdim(L, 2, ts[0]);
    return dsL_pushtensor(L, ds_cat(n, ts, d));
}

/* stack({a, b, ...} [, dim=1]): dim counts the result's dims, so it runs
 * to one past the inputs' */
static int l_stack(lua_State *L) {
    int n;
    lua_settop(L, 2);
    ds_tensor **ts = check_list(L, 1, "stack", &n);
    lua_Integer d = luaL_optinteger(L, 2, 1);
    int nd = ts[0]->ndim + 1;
    if (d == 0 || d > nd || d < -nd)
        luaL_argerror(L, 2, lua_pushfstring(L, "dim %d out of range for a %d-dim result (dims are 1-based; -1 is the last)",
                                            (int)d, nd));
    return dsL_pushtensor(L, ds_stack(n, ts, d > 0 ? d - 1 : d));
}

/* repeat_interleave(x, repeats, dim) */
static int l_repeat_interleave(lua_State *L) {
    ds_tensor *x = dsL_checktensor(L, 1);
    int64_t rep = dsL_checkint(L, 2, 1, INT64_MAX, "repeats");
    return dsL_pushtensor(L, ds_repeat_interleave(x, rep, dsL_checkdim(L, 3, x)));
}

/* The pieces of t along d as a Lua list. The list is made before the
 * split, so no allocation can fail between making the pieces and handing
 * them to Lua. */
static int push_pieces(lua_State *L, ds_tensor *t, int64_t d, int64_t n, const int64_t *sizes) {
    ds_tensor **pieces = lua_newuserdata(L, sizeof *pieces * (size_t)(n ? n : 1));
    lua_createtable(L, (int)n, 0);
    if (ds_split(t, d, n, sizes, pieces)) return dsL_error(L);
    for (int64_t k = 0; k < n; k++) {
        dsL_pushtensor(L, pieces[k]);
        lua_rawseti(L, -2, (int)k + 1);
    }
    return 1;
}

/* Pieces become Lua table entries; more than a Lua table can index is an
 * error before any buffer is sized from the count. */
static void check_pieces(lua_State *L, const char *op, int64_t n) {
    if (n > (1 << 26)) luaL_error(L, "%s: %f pieces is too many", op, (double)n);
}

/* split(size_or_sizes [, dim=1]): pieces of `size` (the last may be
 * smaller), or of the listed sizes, which must add up to the dim's size */
static int l_split(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    int64_t d = lua_isnoneornil(L, 3) ? 0 : dsL_checkdim(L, 3, t);
    int64_t n, *sizes;
    if (lua_istable(L, 2)) {
        n = (int64_t)lua_objlen(L, 2);
        sizes = lua_newuserdata(L, sizeof *sizes * (size_t)(n ? n : 1));
        for (int64_t k = 0; k < n; k++) {
            lua_rawgeti(L, 2, (int)k + 1);
            if (!lua_isnumber(L, -1)) luaL_argerror(L, 2, "split sizes must be integers");
            sizes[k] = (int64_t)lua_tointeger(L, -1);
            lua_pop(L, 1);
        }
    } else {
        int64_t size = luaL_checkinteger(L, 2);
        n = ds_split_sizes(t, d, size, NULL);
        if (n < 0) return dsL_error(L);
        check_pieces(L, "split", n);
        sizes = lua_newuserdata(L, sizeof *sizes * (size_t)n);
        ds_split_sizes(t, d, size, sizes);
    }
    return push_pieces(L, t, d, n, sizes);
}

/* chunk(n [, dim=1]): n pieces of ceil(size / n) (fewer when they run out) */
static int l_chunk(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    int64_t chunks = luaL_checkinteger(L, 2);
    int64_t d = lua_isnoneornil(L, 3) ? 0 : dsL_checkdim(L, 3, t);
    int64_t n = ds_chunk_sizes(t, d, chunks, NULL);
    if (n < 0) return dsL_error(L);
    check_pieces(L, "chunk", n);
    int64_t *sizes = lua_newuserdata(L, sizeof *sizes * (size_t)n);
    ds_chunk_sizes(t, d, chunks, sizes);
    return push_pieces(L, t, d, n, sizes);
}

static const luaL_Reg methods[] = {
    {"index_select", l_index_select}, {"gather", l_gather}, {"scatter_add", l_scatter_add},
    {"split", l_split}, {"chunk", l_chunk}, {"repeat_interleave", l_repeat_interleave},
    {NULL, NULL}
};

static const luaL_Reg functions[] = {
    {"embedding", l_embedding}, {"cat", l_cat}, {"stack", l_stack},
    {NULL, NULL}
};

void dsL_open_index(lua_State *L) {
    dsL_register(L, methods, true);
    dsL_register(L, functions, false);
}
