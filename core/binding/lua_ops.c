/* Lua bindings of the elementwise, shape and reduction ops. Each checks its
 * arguments, calls the core op and pushes the result or raises its error. */
#include "lua_tensor.h"
#include "ds_error.h"

#include <math.h>
#include <string.h>

/* The operands at idx and idx + 1 into t: either may be a number, which
 * takes the other side's dtype (own: made here, release_operands frees
 * it). False where neither is a tensor. */
static bool check_operands(lua_State *L, int idx, ds_tensor *t[2], bool own[2]) {
    t[0] = dsL_totensor(L, idx);
    t[1] = dsL_totensor(L, idx + 1);
    if (!t[0] && !t[1]) return false;
    t[0] = dsL_checkoperand(L, idx, t[1] ? t[1] : t[0], &own[0]);
    t[1] = dsL_checkoperand(L, idx + 1, t[0], &own[1]);
    return true;
}

static void release_operands(ds_tensor *t[2], const bool own[2]) {
    if (own[0]) ds_tensor_release(t[0]);
    if (own[1]) ds_tensor_release(t[1]);
}

static int push_binary(lua_State *L, ds_binary_op op) {
    ds_tensor *t[2];
    bool own[2];
    if (!check_operands(L, 1, t, own))
        return luaL_error(L, "expected a tensor operand, got %s and %s", luaL_typename(L, 1), luaL_typename(L, 2));
    ds_tensor *out = ds_binary(op, t[0], t[1]);
    release_operands(t, own);
    return dsL_pushtensor(L, out);
}

#define BINARY(name, op) static int l_##name(lua_State *L) { return push_binary(L, op); }
BINARY(add, DS_BIN_ADD) BINARY(sub, DS_BIN_SUB) BINARY(mul, DS_BIN_MUL) BINARY(div, DS_BIN_DIV)
BINARY(maximum, DS_BIN_MAX) BINARY(minimum, DS_BIN_MIN)
BINARY(eq, DS_BIN_EQ) BINARY(ne, DS_BIN_NE) BINARY(lt, DS_BIN_LT) BINARY(le, DS_BIN_LE)
BINARY(gt, DS_BIN_GT) BINARY(ge, DS_BIN_GE)

/* pow: a tensor to a number uses the scalar kernel (and its gradient) */
static int l_pow(lua_State *L) {
    ds_tensor *a = dsL_totensor(L, 1);
    if (a && lua_type(L, 2) == LUA_TNUMBER)
        return dsL_pushtensor(L, ds_unary(DS_UN_POW_SCALAR, a, lua_tonumber(L, 2)));
    return push_binary(L, DS_BIN_POW);
}

static int push_unary(lua_State *L, ds_unary_op op) {
    return dsL_pushtensor(L, ds_unary(op, dsL_checktensor(L, 1), 0));
}

#define UNARY(name, op) static int l_##name(lua_State *L) { return push_unary(L, op); }
UNARY(neg, DS_UN_NEG) UNARY(exp, DS_UN_EXP) UNARY(log, DS_UN_LOG) UNARY(sqrt, DS_UN_SQRT)
UNARY(rsqrt, DS_UN_RSQRT) UNARY(tanh, DS_UN_TANH) UNARY(sigmoid, DS_UN_SIGMOID)
UNARY(abs, DS_UN_ABS) UNARY(relu, DS_UN_RELU) UNARY(silu, DS_UN_SILU)

/* gelu(x [, approximate]) with approximate 'tanh' or 'none' (erf), as PyTorch */
static int l_gelu(lua_State *L) {
    ds_tensor *x = dsL_checktensor(L, 1);
    const char *how = luaL_optstring(L, 2, "none");
    ds_unary_op op;
    if (strcmp(how, "tanh") == 0) op = DS_UN_GELU_TANH;
    else if (strcmp(how, "none") == 0 || strcmp(how, "erf") == 0) op = DS_UN_GELU_ERF;
    else return luaL_argerror(L, 2, "approximate must be 'none' or 'tanh'");
    return dsL_pushtensor(L, ds_unary(op, x, 0));
}

static int l_where(lua_State *L) {
    ds_tensor *cond = dsL_checktensor(L, 1);
    ds_tensor *t[2];
    bool own[2];
    if (!check_operands(L, 2, t, own)) return luaL_error(L, "where: expected a tensor for one of the values");
    ds_tensor *out = ds_where(cond, t[0], t[1]);
    release_operands(t, own);
    return dsL_pushtensor(L, out);
}

/* ---- shapes ---- */

static int l_view(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    int64_t shape[DS_MAX_DIMS];
    int nd = dsL_checkshape(L, 2, shape);
    return dsL_pushtensor(L, ds_view(t, nd, shape));
}

static int l_reshape(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    int64_t shape[DS_MAX_DIMS];
    int nd = dsL_checkshape(L, 2, shape);
    return dsL_pushtensor(L, ds_reshape(t, nd, shape));
}

static int l_transpose(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    int64_t a = lua_isnoneornil(L, 2) ? 0 : dsL_checkdim(L, 2, t);
    int64_t b = lua_isnoneornil(L, 3) ? 1 : dsL_checkdim(L, 3, t);
    if (t->ndim < 2 && lua_isnoneornil(L, 2)) { ds_tensor_retain(t); return dsL_pushtensor(L, t); }
    return dsL_pushtensor(L, ds_transpose(t, a, b));
}

static int l_permute(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    int64_t perm[DS_MAX_DIMS];
    int n = lua_istable(L, 2) ? (int)lua_objlen(L, 2) : lua_gettop(L) - 1;
    if (n != t->ndim) return luaL_error(L, "permute: expected %d dims, got %d", t->ndim, n);
    for (int i = 0; i < n; i++) {
        if (lua_istable(L, 2)) {
            lua_rawgeti(L, 2, i + 1);
            perm[i] = dsL_checkdim(L, lua_gettop(L), t);
            lua_pop(L, 1);
        } else perm[i] = dsL_checkdim(L, i + 2, t);
    }
    return dsL_pushtensor(L, ds_permute(t, perm));
}

/* narrow(dim, start, length) with a 1-based start, as Lua indexes */
static int l_narrow(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    int64_t d = dsL_checkdim(L, 2, t);
    lua_Integer start = luaL_checkinteger(L, 3), len = luaL_checkinteger(L, 4);
    luaL_argcheck(L, start != 0, 3, "start is 1-based (or negative from the end)");
    return dsL_pushtensor(L, ds_narrow(t, d, start > 0 ? start - 1 : start, len));
}

static int l_squeeze(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    if (!lua_isnoneornil(L, 2)) return dsL_pushtensor(L, ds_squeeze(t, dsL_checkdim(L, 2, t)));
    int64_t shape[DS_MAX_DIMS];
    int nd = 0;
    for (int i = 0; i < t->ndim; i++) if (t->shape[i] != 1) shape[nd++] = t->shape[i];
    return dsL_pushtensor(L, ds_reshape(t, nd, shape));
}

static int l_unsqueeze(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    lua_Integer d = luaL_checkinteger(L, 2);
    if (d == 0 || d > t->ndim + 1 || d < -(t->ndim + 1))
        luaL_argerror(L, 2, lua_pushfstring(L, "dim %d out of range for unsqueezing a %d-dim tensor (dims are 1-based; -1 is the last)",
                                            (int)d, t->ndim));
    return dsL_pushtensor(L, ds_unsqueeze(t, d > 0 ? d - 1 : d));
}

static int l_contiguous(lua_State *L) { return dsL_pushtensor(L, ds_contiguous(dsL_checktensor(L, 1))); }
static int l_clone(lua_State *L) { return dsL_pushtensor(L, ds_clone(dsL_checktensor(L, 1))); }
static int l_detach(lua_State *L) { return dsL_pushtensor(L, ds_detach(dsL_checktensor(L, 1))); }

/* to('bf16'), to('cpu'), to('cuda:0') */
static int l_to(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    const char *what = luaL_checkstring(L, 2);
    int dt = ds_dtype_parse(what);
    if (dt >= 0) return dsL_pushtensor(L, ds_to_dtype(t, (ds_dtype)dt));
    ds_device dev;
    if (ds_device_parse(what, &dev))
        return luaL_argerror(L, 2, lua_pushfstring(L, "'%s' is neither a dtype nor a device", what));
    return dsL_pushtensor(L, ds_to_device(t, dev));
}

/* In-place ops record no history: on a tensor that requires grad they
 * would change what backward computes without telling it. */
static ds_tensor *check_inplace(lua_State *L, const char *op) {
    ds_tensor *t = dsL_checktensor(L, 1);
    if (t->requires_grad && ds_grad_enabled()) {
        char s[96];
        luaL_error(L, "%s: in-place op on a %s %s tensor that requires grad (%s%s); wrap it in ds.no_grad, or use "
                   "the out-of-place op", op, ds_dtype_name(t->dtype), ds_shape_str(t, s, sizeof s),
                   t->grad_fn ? "made by " : "a leaf", t->grad_fn ? t->grad_fn->name : "");
    }
    return t;
}

static int l_copy_(lua_State *L) {
    ds_tensor *dst = check_inplace(L, "copy_");
    bool own;
    ds_tensor *src = dsL_checkoperand(L, 2, dst, &own);
    int rc = ds_copy_(dst, src);
    if (own) ds_tensor_release(src);
    if (rc) return dsL_error(L);
    lua_settop(L, 1);
    return 1;
}

static int l_fill_(lua_State *L) {
    ds_tensor *t = check_inplace(L, "fill_");
    if (ds_fill_(t, dsL_checkvalue(L, "fill_", luaL_checknumber(L, 2), t->dtype))) return dsL_error(L);
    lua_settop(L, 1);
    return 1;
}

/* in-place arithmetic for optimizers: add_(src [, alpha]) etc., no autograd */
static int inplace(lua_State *L, ds_binary_op op, const char *name) {
    ds_tensor *dst = check_inplace(L, name);
    bool own;
    ds_tensor *src = dsL_checkoperand(L, 2, dst, &own);
    int rc = ds_binary_(op, dst, src);
    if (own) ds_tensor_release(src);
    if (rc) return dsL_error(L);
    lua_settop(L, 1);
    return 1;
}

static int l_add_(lua_State *L) { return inplace(L, DS_BIN_ADD, "add_"); }
static int l_sub_(lua_State *L) { return inplace(L, DS_BIN_SUB, "sub_"); }
static int l_mul_(lua_State *L) { return inplace(L, DS_BIN_MUL, "mul_"); }
static int l_div_(lua_State *L) { return inplace(L, DS_BIN_DIV, "div_"); }

/* ---- reductions: t:sum([dims [, keepdim]]) ---- */

static int push_reduce(lua_State *L, ds_reduce_op op) {
    ds_tensor *t = dsL_checktensor(L, 1);
    int64_t dims[DS_MAX_DIMS];
    int nd = dsL_checkdims(L, 2, t, dims);
    return dsL_pushtensor(L, ds_reduce(op, t, nd, dims, lua_toboolean(L, 3), 0));
}

static int l_sum(lua_State *L) { return push_reduce(L, DS_RED_SUM); }
static int l_mean(lua_State *L) { return push_reduce(L, DS_RED_MEAN); }
static int l_amax(lua_State *L) { return push_reduce(L, DS_RED_MAX); }
static int l_amin(lua_State *L) { return push_reduce(L, DS_RED_MIN); }

/* argmax([dim [, keepdim]]): 0-based indices, as data; no dim flattens */
static int push_arg(lua_State *L, ds_reduce_op op) {
    ds_tensor *t = dsL_checktensor(L, 1);
    if (lua_isnoneornil(L, 2)) {
        int64_t all = -1;
        ds_tensor *flat = ds_reshape(t, 1, &all);
        if (!flat) return dsL_error(L);
        int64_t d0 = 0;
        ds_tensor *r = ds_reduce(op, flat, 1, &d0, false, 0);
        ds_tensor_release(flat);
        return dsL_pushtensor(L, r);
    }
    int64_t d = dsL_checkdim(L, 2, t);
    return dsL_pushtensor(L, ds_reduce(op, t, 1, &d, lua_toboolean(L, 3), 0));
}

static int l_argmax(lua_State *L) { return push_arg(L, DS_RED_ARGMAX); }
static int l_argmin(lua_State *L) { return push_arg(L, DS_RED_ARGMIN); }

/* var([dims [, correction=1 [, keepdim]]]) */
static int l_var(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    int64_t dims[DS_MAX_DIMS];
    int nd = dsL_checkdims(L, 2, t, dims);
    return dsL_pushtensor(L, ds_var(t, nd, dims, luaL_optnumber(L, 3, 1), lua_toboolean(L, 4)));
}

/* norm([p=2 [, dims [, keepdim]]]); p may be math.huge */
static int l_norm(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    double p = luaL_optnumber(L, 2, 2);
    luaL_argcheck(L, p >= 0, 2, "p must be >= 0");
    int64_t dims[DS_MAX_DIMS];
    int nd = dsL_checkdims(L, 3, t, dims);
    return dsL_pushtensor(L, ds_norm(t, p, nd, dims, lua_toboolean(L, 4)));
}

static const luaL_Reg ops[] = {
    {"add", l_add}, {"sub", l_sub}, {"mul", l_mul}, {"div", l_div}, {"pow", l_pow},
    {"maximum", l_maximum}, {"minimum", l_minimum},
    {"eq", l_eq}, {"ne", l_ne}, {"lt", l_lt}, {"le", l_le}, {"gt", l_gt}, {"ge", l_ge},
    {"neg", l_neg}, {"exp", l_exp}, {"log", l_log}, {"sqrt", l_sqrt}, {"rsqrt", l_rsqrt},
    {"tanh", l_tanh}, {"sigmoid", l_sigmoid}, {"abs", l_abs}, {"relu", l_relu},
    {"silu", l_silu}, {"gelu", l_gelu}, {"where", l_where},
    {"view", l_view}, {"reshape", l_reshape}, {"transpose", l_transpose}, {"permute", l_permute},
    {"narrow", l_narrow}, {"squeeze", l_squeeze}, {"unsqueeze", l_unsqueeze},
    {"contiguous", l_contiguous}, {"clone", l_clone}, {"detach", l_detach}, {"to", l_to},
    {"copy_", l_copy_}, {"fill_", l_fill_},
    {"add_", l_add_}, {"sub_", l_sub_}, {"mul_", l_mul_}, {"div_", l_div_},
    {"sum", l_sum}, {"mean", l_mean}, {"amax", l_amax}, {"amin", l_amin},
    {"argmax", l_argmax}, {"argmin", l_argmin}, {"var", l_var}, {"norm", l_norm},
    {NULL, NULL}
};

void dsL_open_ops(lua_State *L) {
    dsL_register(L, ops, true);
}
