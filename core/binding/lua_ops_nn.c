/* Lua bindings of the nn row ops:
 *   ds.softmax(x [, dim=-1]), x:softmax(dim), ds.log_softmax, x:log_softmax
 *   ds.cross_entropy(logits, target [, {ignore_index=-100, label_smoothing=0, reduction='mean', classes=all}])
 *   ds.mse_loss(input, target [, reduction='mean'])
 *   ds.layer_norm(x, weight|nil, bias|nil [, eps=1e-5])
 *   ds.layer_norm(x, normalized_shape, weight|nil, bias|nil [, eps])    (torch form)
 *   ds.add_layer_norm(x, res, [normalized_shape,] weight|nil, bias|nil [, eps]) -> normed x + res, x + res
 *   ds.rms_norm(x, weight|nil [, eps=machine epsilon])
 *   ds.rms_norm(x, normalized_shape, weight|nil [, eps])                (torch form)
 *   ds.add_rms_norm(x, res, [normalized_shape,] weight|nil [, eps]) -> normed x + res, x + res
 *   ds.rope(x, cos, sin)                                              rotate_half form
 *   ds.swiglu(gate, up)                                               silu(gate) * up
 *   ds.dropout(x, p [, training=true])
 * Dims are 1-based; class ids in targets are 0-based, as in PyTorch data. */
#include "lua_tensor.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static ds_nn_reduction check_reduction(lua_State *L, const char *op, const char *name) {
    int r = ds_nn_reduction_parse(name);
    if (r < 0) luaL_error(L, "%s: reduction must be 'mean', 'sum' or 'none', got '%s'", op, name);
    return (ds_nn_reduction)r;
}

static int push_softmax(lua_State *L, bool as_log) {
    ds_tensor *x = dsL_checktensor(L, 1);
    int64_t d = lua_isnoneornil(L, 2) ? -1 : dsL_checkdim(L, 2, x);
    return dsL_pushtensor(L, as_log ? ds_log_softmax(x, d) : ds_softmax(x, d));
}

static int l_softmax(lua_State *L) { return push_softmax(L, false); }
static int l_log_softmax(lua_State *L) { return push_softmax(L, true); }

/* the number under key at the top of the stack, or an error naming it */
static double option_number(lua_State *L, const char *key) {
    if (lua_type(L, -1) != LUA_TNUMBER)
        luaL_error(L, "cross_entropy: option %s must be a number, got %s", key, luaL_typename(L, -1));
    return lua_tonumber(L, -1);
}

static int l_cross_entropy(lua_State *L) {
    ds_tensor *logits = dsL_checktensor(L, 1), *target = dsL_checktensor(L, 2);
    double ignore = -100, smoothing = 0, classes = 0;
    const char *red = "mean";
    if (!lua_isnoneornil(L, 3)) {
        luaL_checktype(L, 3, LUA_TTABLE);
        lua_pushnil(L);
        while (lua_next(L, 3)) {
            const char *key = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "?";
            if (strcmp(key, "ignore_index") == 0) {
                ignore = option_number(L, key);
                if (ignore != floor(ignore) || fabs(ignore) > 9.0e15)
                    return luaL_error(L, "cross_entropy: ignore_index must be an integer, got %f", ignore);
            } else if (strcmp(key, "label_smoothing") == 0) {
                smoothing = option_number(L, key);
            } else if (strcmp(key, "classes") == 0) {
                classes = option_number(L, key);
                if (classes != floor(classes) || classes < 1 || classes > 9.0e15)
                    return luaL_error(L, "cross_entropy: classes must be a positive integer, got %f", classes);
            } else if (strcmp(key, "reduction") == 0) {
                if (lua_type(L, -1) != LUA_TSTRING)
                    return luaL_error(L, "cross_entropy: option reduction must be a string, got %s", luaL_typename(L, -1));
                red = lua_tostring(L, -1);
            } else {
                return luaL_error(L, "cross_entropy: unknown option '%s' (ignore_index, label_smoothing, reduction, classes)", key);
            }
            lua_pop(L, 1);
        }
    }
    ds_nn_reduction r = check_reduction(L, "cross_entropy", red);
    return dsL_pushtensor(L, ds_cross_entropy(logits, target, (int64_t)ignore, smoothing, (int64_t)classes, r));
}

static int l_mse_loss(lua_State *L) {
    ds_tensor *input = dsL_checktensor(L, 1), *target = dsL_checktensor(L, 2);
    ds_nn_reduction r = check_reduction(L, "mse_loss", luaL_optstring(L, 3, "mean"));
    return dsL_pushtensor(L, ds_mse_loss(input, target, r));
}

static ds_tensor *opt_tensor(lua_State *L, int idx) {
    return lua_isnoneornil(L, idx) ? NULL : dsL_checktensor(L, idx);
}

/* The torch.nn.functional form passes normalized_shape (a number or a
 * table) after the inputs, at idx: returns how many trailing dims of x it
 * names, after checking them, or 0 when argument idx is not a shape. */
static int normalized_shape(lua_State *L, int idx, const char *op, const ds_tensor *x) {
    int64_t shape[DS_MAX_DIMS];
    int nd;
    if (lua_type(L, idx) == LUA_TNUMBER) { shape[0] = (int64_t)lua_tointeger(L, idx); nd = 1; }
    else if (lua_istable(L, idx)) nd = dsL_checkshape(L, idx, shape);
    else return 0;
    bool ok = nd >= 1 && nd <= x->ndim;
    for (int i = 0; ok && i < nd; i++) ok = shape[i] == x->shape[x->ndim - nd + i];
    if (!ok) {
        char want[160], have[96];
        int used = snprintf(want, sizeof want, "[");
        for (int i = 0; i < nd && used < (int)sizeof want; i++)
            used += snprintf(want + used, sizeof want - (size_t)used, i ? ",%lld" : "%lld", (long long)shape[i]);
        if (used < (int)sizeof want) snprintf(want + used, sizeof want - (size_t)used, "]");
        luaL_error(L, "%s: normalized_shape %s does not match the last dims of input %s", op, want,
                   ds_shape_str(x, have, sizeof have));
    }
    return nd;
}

/* layer_norm(x, weight, bias [, eps]) normalises the dims of weight (else
 * bias, else the last dim); layer_norm(x, normalized_shape, weight, bias
 * [, eps]) as torch.nn.functional. */
static int l_layer_norm(lua_State *L) {
    ds_tensor *x = dsL_checktensor(L, 1);
    int nd = normalized_shape(L, 2, "layer_norm", x), a = nd ? 3 : 2;
    ds_tensor *w = opt_tensor(L, a), *b = opt_tensor(L, a + 1);
    double eps = luaL_optnumber(L, a + 2, 1e-5);
    if (!nd) nd = w ? w->ndim : b ? b->ndim : 1;
    return dsL_pushtensor(L, ds_layer_norm(x, nd, w, b, eps));
}

/* A residual norm's two results, the norm y and *sum (an error when y is
 * NULL); *sum is read after y's call has set it. */
static int push_norm_sum(lua_State *L, ds_tensor *y, ds_tensor **sum) {
    dsL_pushtensor(L, y);
    return 1 + dsL_pushtensor(L, *sum);
}

/* add_layer_norm(x, res, weight, bias [, eps]) or add_layer_norm(x, res,
 * normalized_shape, weight, bias [, eps]) -> layer_norm(x + res), x + res */
static int l_add_layer_norm(lua_State *L) {
    ds_tensor *x = dsL_checktensor(L, 1), *res = dsL_checktensor(L, 2), *sum;
    int nd = normalized_shape(L, 3, "add_layer_norm", x), a = nd ? 4 : 3;
    ds_tensor *w = opt_tensor(L, a), *b = opt_tensor(L, a + 1);
    double eps = luaL_optnumber(L, a + 2, 1e-5);
    if (!nd) nd = w ? w->ndim : b ? b->ndim : 1;
    return push_norm_sum(L, ds_add_layer_norm(x, res, nd, w, b, eps, &sum), &sum);
}

/* rms_norm(x, weight [, eps]) or rms_norm(x, normalized_shape, weight [, eps]) */
static int l_rms_norm(lua_State *L) {
    ds_tensor *x = dsL_checktensor(L, 1);
    int nd = normalized_shape(L, 2, "rms_norm", x), a = nd ? 3 : 2;
    ds_tensor *w = opt_tensor(L, a);
    double eps = lua_isnoneornil(L, a + 1) ? NAN : luaL_checknumber(L, a + 1);
    if (!nd) nd = w ? w->ndim : 1;
    return dsL_pushtensor(L, ds_rms_norm(x, nd, w, eps));
}

/* add_rms_norm(x, res, weight [, eps]) or add_rms_norm(x, res,
 * normalized_shape, weight [, eps]) -> rms_norm(x + res), x + res */
static int l_add_rms_norm(lua_State *L) {
    ds_tensor *x = dsL_checktensor(L, 1), *res = dsL_checktensor(L, 2), *sum;
    int nd = normalized_shape(L, 3, "add_rms_norm", x), a = nd ? 4 : 3;
    ds_tensor *w = opt_tensor(L, a);
    double eps = lua_isnoneornil(L, a + 1) ? NAN : luaL_checknumber(L, a + 1);
    if (!nd) nd = w ? w->ndim : 1;
    return push_norm_sum(L, ds_add_rms_norm(x, res, nd, w, eps, &sum), &sum);
}

static int l_rope(lua_State *L) {
    return dsL_pushtensor(L, ds_rope(dsL_checktensor(L, 1), dsL_checktensor(L, 2), dsL_checktensor(L, 3)));
}

static int l_swiglu(lua_State *L) {
    return dsL_pushtensor(L, ds_swiglu(dsL_checktensor(L, 1), dsL_checktensor(L, 2)));
}

static int l_dropout(lua_State *L) {
    ds_tensor *x = dsL_checktensor(L, 1);
    double p = luaL_checknumber(L, 2);
    bool training = lua_isnoneornil(L, 3) ? true : lua_toboolean(L, 3);
    return dsL_pushtensor(L, ds_dropout(x, p, training, NULL));
}

static const luaL_Reg methods[] = {
    {"softmax", l_softmax}, {"log_softmax", l_log_softmax},
    {NULL, NULL}
};

static const luaL_Reg functions[] = {
    {"cross_entropy", l_cross_entropy}, {"mse_loss", l_mse_loss}, {"layer_norm", l_layer_norm},
    {"add_layer_norm", l_add_layer_norm},
    {"rms_norm", l_rms_norm}, {"add_rms_norm", l_add_rms_norm}, {"rope", l_rope},
    {"swiglu", l_swiglu}, {"dropout", l_dropout},
    {NULL, NULL}
};

void dsL_open_nn(lua_State *L) {
    dsL_register(L, methods, true);
    dsL_register(L, functions, false);
}
