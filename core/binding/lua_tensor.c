/* The tensor type in Lua: construction, fields, conversions, memory. */
#include "lua_tensor.h"
#include "ds_error.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static lua_State *main_state;
static _Thread_local bool on_lua_thread;    /* the thread that owns main_state */
static int64_t gc_threshold = 64 << 20;

/* The Lua GC sees only the small userdata, not the native bytes behind
 * it, so once live native memory has grown by a quarter (at least a floor)
 * since the last collection we collect: garbage tensors cannot pile up
 * between Lua's own cycles. A quarter, not a doubling: in training most
 * live bytes are parameters and optimizer state that never become garbage,
 * and activations that wait for a collection cannot be reused by the next
 * step's allocations (each fresh page costs a fault). The floor is 64 MiB
 * on the CPU. With tensors on a GPU it is 512 MiB: a full collection
 * takes about 0.16 ms of host time with GPT-2's modules loaded, and at 64
 * MiB it came every call or two of an op with a 12-50 MB output, the
 * likely reason such calls ran at a fraction of PyTorch's speed (a bf16
 * GELU of 8192x3072: 0.20 ms against 0.04 ms), while garbage waiting there
 * costs only device memory, and an allocation that finds none left
 * collects first. */
static void gc_pressure(lua_State *L) {
    int64_t live = ds_mem_live_bytes();
    if (live <= gc_threshold) return;
    lua_gc(L, LUA_GCCOLLECT, 0);
    live = ds_mem_live_bytes();
    int64_t floor = ds_mem_device_live_bytes() > 0 ? (int64_t)512 << 20 : (int64_t)64 << 20;
    gc_threshold = live + (live / 4 > floor ? live / 4 : floor);
}

/* Only the Lua thread may collect: a loader or OpenMP thread that runs
 * out of memory just fails its allocation. */
static void collect_on_oom(void *ud) {
    (void)ud;
    if (main_state && on_lua_thread) lua_gc(main_state, LUA_GCCOLLECT, 0);
}

int dsL_error(lua_State *L) {
    return luaL_error(L, "%s", ds_error_message());
}

ds_tensor *dsL_totensor(lua_State *L, int idx) {
    ds_tensor **p = luaL_testudata(L, idx, DSL_TENSOR_MT);
    return p ? *p : NULL;
}

ds_tensor *dsL_checkmeta(lua_State *L, int idx) {
    ds_tensor **p = luaL_testudata(L, idx, DSL_TENSOR_MT);
    if (!p) luaL_typerror(L, idx, "tensor");
    if (!*p) luaL_error(L, "bad argument #%d (a tensor handle that was dropped)", idx);
    return *p;
}

static lua_State *fetching_L;

lua_State *dsL_fetching_state(void) { return fetching_L; }

lua_State *dsL_set_fetching_state(lua_State *L) {
    lua_State *outer = fetching_L;
    fetching_L = L;
    return outer;
}

void dsL_fetch(lua_State *L, int idx, ds_tensor *t) {
    char s[96];
    lua_State *outer = fetching_L;
    fetching_L = L;
    int rc = ds_autograd_fetch(t);
    fetching_L = outer;
    if (rc) dsL_error(L);
    if (ds_tensor_is_released(t))
        luaL_error(L, "argument %d: %s %s has no data: a partitioned parameter (ZeRO stage 3) used where "
                   "nothing gathers it", idx, ds_dtype_name(t->dtype), ds_shape_str(t, s, sizeof s));
}

int dsL_backward(lua_State *L, ds_tensor *root, ds_tensor *grad, bool retain_graph) {
    lua_State *outer = fetching_L;
    fetching_L = L;
    int rc = ds_backward(root, grad, retain_graph);
    fetching_L = outer;
    return rc;
}

ds_tensor *dsL_checktensor(lua_State *L, int idx) {
    ds_tensor *t = dsL_checkmeta(L, idx);
    if (ds_tensor_is_released(t)) dsL_fetch(L, idx, t);
    return t;
}

ds_tensor *dsL_checkoperand(lua_State *L, int idx, const ds_tensor *like, bool *owned) {
    *owned = false;
    if (lua_type(L, idx) == LUA_TNUMBER || lua_type(L, idx) == LUA_TBOOLEAN) {
        double v = lua_isboolean(L, idx) ? lua_toboolean(L, idx) : lua_tonumber(L, idx);
        ds_tensor *s = ds_scalar_like(like, v);
        if (!s) dsL_error(L);
        *owned = true;
        return s;
    }
    return dsL_checktensor(L, idx);
}

int dsL_pushtensor(lua_State *L, ds_tensor *t) {
    if (!t) return dsL_error(L);
    ds_tensor **p = dsL_newhandle(L, DSL_TENSOR_MT);
    *p = t;
    gc_pressure(L);
    return 1;
}

int64_t dsL_checkint(lua_State *L, int idx, int64_t lo, int64_t hi, const char *what) {
    lua_Number v = lua_tonumber(L, idx);
    /* compared as a double first: casting one outside int64's range is undefined */
    bool ok = lua_type(L, idx) == LUA_TNUMBER && v == floor(v) && v >= -0x1p63 && v < 0x1p63;
    int64_t i = ok ? (int64_t)v : 0;
    if (ok && i >= lo && i <= hi) return i;
    char range[96], got[64];
    if (hi == INT64_MAX && lo == INT64_MIN) snprintf(range, sizeof range, "that fits in 64 bits");
    else if (hi == INT64_MAX) snprintf(range, sizeof range, ">= %lld", (long long)lo);
    else snprintf(range, sizeof range, "in [%lld, %lld]", (long long)lo, (long long)hi);
    if (lua_type(L, idx) == LUA_TNUMBER) snprintf(got, sizeof got, "%.17g", v);
    else snprintf(got, sizeof got, "a %s", luaL_typename(L, idx));
    luaL_error(L, "%s must be an integer %s, got %s", what, range, got);
    return 0;
}

int64_t dsL_checkdim(lua_State *L, int idx, const ds_tensor *t) {
    lua_Integer d = luaL_checkinteger(L, idx);
    int nd = t->ndim ? t->ndim : 1;
    if (d == 0 || d > nd || d < -nd)
        luaL_argerror(L, idx, lua_pushfstring(L, "dim %d out of range for a %d-dim tensor (dims are 1-based; -1 is the last)",
                                               (int)d, t->ndim));
    return d > 0 ? d - 1 : d;
}

int dsL_checkshape(lua_State *L, int idx, int64_t *shape) {
    int nd = 0;
    if (lua_istable(L, idx)) {
        nd = (int)lua_objlen(L, idx);
        if (nd > DS_MAX_DIMS) luaL_argerror(L, idx, "too many dims");
        for (int i = 0; i < nd; i++) {
            lua_rawgeti(L, idx, i + 1);
            if (!lua_isnumber(L, -1)) luaL_argerror(L, idx, "shape entries must be integers");
            shape[i] = dsL_checkint(L, -1, INT64_MIN, INT64_MAX, "a shape entry");
            lua_pop(L, 1);
        }
        return nd;
    }
    int top = lua_gettop(L);
    for (int i = idx; i <= top && lua_isnumber(L, i); i++) {
        if (nd == DS_MAX_DIMS) luaL_argerror(L, i, "too many dims");
        shape[nd++] = dsL_checkint(L, i, INT64_MIN, INT64_MAX, "a shape entry");
    }
    return nd;
}

int dsL_checkdims(lua_State *L, int idx, const ds_tensor *t, int64_t *dims) {
    if (lua_isnoneornil(L, idx)) return -1;
    if (lua_isnumber(L, idx)) { dims[0] = dsL_checkdim(L, idx, t); return 1; }
    luaL_checktype(L, idx, LUA_TTABLE);
    int n = (int)lua_objlen(L, idx);
    if (n > DS_MAX_DIMS) luaL_argerror(L, idx, "too many dims");
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, idx, i + 1);
        dims[i] = dsL_checkdim(L, lua_gettop(L), t);
        lua_pop(L, 1);
    }
    return n;
}

ds_dtype dsL_checkdtype(lua_State *L, int idx, ds_dtype def) {
    if (lua_isnoneornil(L, idx)) return def;
    const char *name = luaL_checkstring(L, idx);
    int t = ds_dtype_parse(name);
    if (t < 0)
        luaL_argerror(L, idx, lua_pushfstring(L, "unknown dtype '%s' (f32, f64, bf16, f16, i32, i64, u8, bool)", name));
    return (ds_dtype)t;
}

double dsL_checkvalue(lua_State *L, const char *op, double v, ds_dtype t) {
    int64_t lo, hi;                 /* trunc(v) must lie in [lo, hi] */
    switch (t) {
    case DS_I32: lo = INT32_MIN, hi = INT32_MAX; break;
    case DS_I64: lo = INT64_MIN, hi = INT64_MAX; break;
    case DS_U8: lo = 0, hi = UINT8_MAX; break;
    default: return v;
    }
    double w = trunc(v);
    if (!(w >= (double)lo && w < (double)hi + 1)) {     /* NaN too; (double)INT64_MAX + 1 is 2^63 */
        char msg[160];
        snprintf(msg, sizeof msg, "%s: %.17g does not fit %s (integers in [%lld, %lld])", op, isnan(v) ? NAN : v,
                 ds_dtype_name(t), (long long)lo, (long long)hi);
        luaL_error(L, "%s", msg);
    }
    return v;
}

static ds_device checkdevice(lua_State *L, int idx) {
    ds_device d = DS_CPU_DEVICE;
    if (!lua_isnoneornil(L, idx) && ds_device_parse(luaL_checkstring(L, idx), &d)) dsL_error(L);
    return d;
}

void dsL_register(lua_State *L, const luaL_Reg *fns, bool as_methods) {
    luaL_getmetatable(L, DSL_TENSOR_MT);
    lua_getfield(L, -1, "methods");
    for (const luaL_Reg *f = fns; f->name; f++) {
        lua_pushcfunction(L, f->func);
        lua_pushvalue(L, -1);
        lua_setfield(L, -5, f->name);
        if (as_methods) lua_setfield(L, -2, f->name);
        else lua_pop(L, 1);
    }
    lua_pop(L, 2);
}

/* ---- construction from nested Lua tables ---- */

static void nested_shape(lua_State *L, int idx, int depth, int *ndim, int64_t *shape) {
    if (!lua_istable(L, idx)) { *ndim = depth; return; }
    if (depth == DS_MAX_DIMS) luaL_error(L, "tensor: nested deeper than %d dims", DS_MAX_DIMS);
    shape[depth] = (int64_t)lua_objlen(L, idx);
    if (shape[depth] == 0) { *ndim = depth + 1; return; }
    lua_rawgeti(L, idx, 1);
    nested_shape(L, lua_gettop(L), depth + 1, ndim, shape);
    lua_pop(L, 1);
}

static void nested_fill(lua_State *L, int idx, int depth, int ndim, const int64_t *shape,
                        ds_tensor *t, int64_t *pos) {
    if (depth == ndim) {
        if (lua_type(L, idx) != LUA_TNUMBER && lua_type(L, idx) != LUA_TBOOLEAN)
            luaL_error(L, "tensor: expected a number at depth %d, got %s", depth, luaL_typename(L, idx));
        double v = lua_isboolean(L, idx) ? lua_toboolean(L, idx) : lua_tonumber(L, idx);
        ds_tensor_set(t, (*pos)++, dsL_checkvalue(L, "tensor", v, t->dtype));
        return;
    }
    if (!lua_istable(L, idx))
        luaL_error(L, "tensor: ragged nested table at depth %d (expected a table of %d elements, got a %s)",
                   depth + 1, (int)shape[depth], luaL_typename(L, idx));
    if ((int64_t)lua_objlen(L, idx) != shape[depth])
        luaL_error(L, "tensor: ragged nested table at depth %d (expected %d elements, got %d)",
                   depth + 1, (int)shape[depth], (int)lua_objlen(L, idx));
    for (int64_t i = 0; i < shape[depth]; i++) {
        lua_rawgeti(L, idx, (int)i + 1);
        nested_fill(L, lua_gettop(L), depth + 1, ndim, shape, t, pos);
        lua_pop(L, 1);
    }
}

/* ds.tensor(data [, dtype]): data is a number or nested tables */
static int l_tensor(lua_State *L) {
    luaL_argcheck(L, lua_istable(L, 1) || lua_isnumber(L, 1) || lua_isboolean(L, 1), 1,
                  "expected a number or a nested table of numbers");
    ds_dtype dt = dsL_checkdtype(L, 2, DS_F32);
    int nd = 0;
    int64_t shape[DS_MAX_DIMS];
    nested_shape(L, 1, 0, &nd, shape);
    ds_tensor *t = ds_tensor_new(nd, shape, dt, DS_CPU_DEVICE);
    if (!t) return dsL_error(L);
    dsL_pushtensor(L, t);     /* owned by Lua first, so an error below cannot leak it */
    int64_t pos = 0;
    nested_fill(L, 1, 0, nd, shape, t, &pos);
    return 1;
}

/* zeros/ones/rand/randn(shape..., [dtype]) where shape is a table or ints */
static int make_filled(lua_State *L, int kind) {
    int64_t shape[DS_MAX_DIMS];
    int nd = dsL_checkshape(L, 1, shape);
    int dt_idx = lua_istable(L, 1) ? 2 : nd + 1;
    ds_dtype dt = dsL_checkdtype(L, dt_idx, DS_F32);
    ds_device dev = checkdevice(L, dt_idx + 1);
    switch (kind) {
    case 0: return dsL_pushtensor(L, ds_tensor_full(nd, shape, dt, dev, 0));
    case 1: return dsL_pushtensor(L, ds_tensor_full(nd, shape, dt, dev, 1));
    case 2: return dsL_pushtensor(L, ds_rand(nd, shape, dt, dev, NULL));
    default: return dsL_pushtensor(L, ds_randn(nd, shape, dt, dev, NULL));
    }
}

static int l_zeros(lua_State *L) { return make_filled(L, 0); }
static int l_ones(lua_State *L) { return make_filled(L, 1); }
static int l_rand(lua_State *L) { return make_filled(L, 2); }
static int l_randn(lua_State *L) { return make_filled(L, 3); }

static int l_full(lua_State *L) {
    int64_t shape[DS_MAX_DIMS];
    luaL_checktype(L, 1, LUA_TTABLE);
    int nd = dsL_checkshape(L, 1, shape);
    ds_dtype dt = dsL_checkdtype(L, 3, DS_F32);
    double v = dsL_checkvalue(L, "full", luaL_checknumber(L, 2), dt);
    return dsL_pushtensor(L, ds_tensor_full(nd, shape, dt, checkdevice(L, 4), v));
}

/* arange(end) or arange(start, end [, step [, dtype]]) */
static int l_arange(lua_State *L) {
    double start = 0, end, step = 1;
    int dt_idx;
    if (lua_isnumber(L, 2)) {
        start = luaL_checknumber(L, 1);
        end = luaL_checknumber(L, 2);
        step = luaL_optnumber(L, 3, 1);
        dt_idx = 4;
    } else {
        end = luaL_checknumber(L, 1);
        dt_idx = 2;
    }
    bool whole = start == floor(start) && end == floor(end) && step == floor(step);
    ds_dtype dt = dsL_checkdtype(L, dt_idx, whole ? DS_I64 : DS_F32);
    return dsL_pushtensor(L, ds_arange(start, end, step, dt, checkdevice(L, dt_idx + 1)));
}

static int l_manual_seed(lua_State *L) {
    lua_Number s = luaL_checknumber(L, 1);
    luaL_argcheck(L, s >= 0 && s == floor(s) && s < 0x1p64, 1, "seed must be a non-negative integer below 2^64");
    ds_manual_seed((uint64_t)s);
    return 0;
}

/* get_rng_state() -> the default generator's seed and counter offset as 32
 * hex digits (both are 64-bit: a Lua number would round them) */
static int l_get_rng_state(lua_State *L) {
    const ds_generator *g = ds_default_generator();
    char s[33];
    snprintf(s, sizeof s, "%016llx%016llx", (unsigned long long)g->seed, (unsigned long long)g->offset);
    lua_pushstring(L, s);
    return 1;
}

/* set_rng_state(s): what get_rng_state returned */
static int l_set_rng_state(lua_State *L) {
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    if (n != 32 || strspn(s, "0123456789abcdef") != 32)
        return luaL_error(L, "set_rng_state: expected 32 hex digits from get_rng_state, got '%s'", s);
    char seed[17], offset[17];
    memcpy(seed, s, 16);
    memcpy(offset, s + 16, 16);
    seed[16] = offset[16] = '\0';
    *ds_default_generator() = (ds_generator){ strtoull(seed, NULL, 16), strtoull(offset, NULL, 16) };
    return 0;
}

/* ---- fields and conversions ---- */

DSL_HANDLE_GC(l_gc, ds_tensor, DSL_TENSOR_MT, ds_tensor_release)

static int l_size(lua_State *L) {
    ds_tensor *t = dsL_checkmeta(L, 1);
    if (!lua_isnoneornil(L, 2)) {
        int64_t d = dsL_checkdim(L, 2, t);
        lua_pushinteger(L, t->ndim ? (lua_Integer)t->shape[d < 0 ? d + t->ndim : d] : 1);
        return 1;
    }
    lua_createtable(L, t->ndim, 0);
    for (int i = 0; i < t->ndim; i++) {
        lua_pushinteger(L, (lua_Integer)t->shape[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int l_stride(lua_State *L) {
    ds_tensor *t = dsL_checkmeta(L, 1);
    lua_createtable(L, t->ndim, 0);
    for (int i = 0; i < t->ndim; i++) {
        lua_pushinteger(L, (lua_Integer)t->stride[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

/* t:version() -> its bytes' storage id and count of in-place writes
 * (PyTorch's _version, shared by every view): equal pairs, equal bytes. */
static int l_version(lua_State *L) {
    ds_tensor *t = dsL_checkmeta(L, 1);
    lua_pushnumber(L, (lua_Number)t->storage->id);
    lua_pushnumber(L, (lua_Number)atomic_load_explicit(&t->storage->version, memory_order_relaxed));
    return 2;
}

static int l_dim(lua_State *L) { lua_pushinteger(L, dsL_checkmeta(L, 1)->ndim); return 1; }
static int l_numel(lua_State *L) { lua_pushnumber(L, (lua_Number)ds_tensor_numel(dsL_checkmeta(L, 1))); return 1; }
static int l_len(lua_State *L) {
    ds_tensor *t = dsL_checkmeta(L, 1);
    lua_pushinteger(L, t->ndim ? (lua_Integer)t->shape[0] : 0);
    return 1;
}
static int l_dtype(lua_State *L) { lua_pushstring(L, ds_dtype_name(dsL_checkmeta(L, 1)->dtype)); return 1; }
static int l_is_contiguous(lua_State *L) { lua_pushboolean(L, ds_tensor_is_contiguous(dsL_checkmeta(L, 1))); return 1; }

static int l_device(lua_State *L) {
    char name[16];
    ds_device_name(ds_tensor_device(dsL_checkmeta(L, 1)), name, sizeof name);
    lua_pushstring(L, name);
    return 1;
}

/* t itself on the CPU; else one copy of it there (pushed, so it lives on
 * the stack), which also reports what the device found since the last
 * synchronisation. */
static ds_tensor *on_host(lua_State *L, ds_tensor *t) {
    if (ds_tensor_device(t).type == DS_DEV_CPU) return t;
    ds_tensor *h = ds_to_device(t, DS_CPU_DEVICE);
    if (!h) dsL_error(L);
    dsL_pushtensor(L, h);
    return h;
}

static int l_item(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    char s[96];
    if (ds_tensor_numel(t) != 1)
        return luaL_error(L, "item: tensor of shape %s has %d elements, not one", ds_shape_str(t, s, sizeof s),
                          (int)ds_tensor_numel(t));
    double v = ds_tensor_get(on_host(L, t), 0);
    if (t->dtype == DS_BOOL) lua_pushboolean(L, v != 0);
    else lua_pushnumber(L, v);
    return 1;
}

static void push_nested(lua_State *L, const ds_tensor *t, int depth, int64_t *pos) {
    if (depth == t->ndim) {
        double v = ds_tensor_get(t, (*pos)++);
        if (t->dtype == DS_BOOL) lua_pushboolean(L, v != 0);
        else lua_pushnumber(L, v);
        return;
    }
    lua_createtable(L, (int)t->shape[depth], 0);
    for (int64_t i = 0; i < t->shape[depth]; i++) {
        push_nested(L, t, depth + 1, pos);
        lua_rawseti(L, -2, (int)i + 1);
    }
}

static int l_totable(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    luaL_argcheck(L, ds_tensor_numel(t) <= (1 << 26), 1, "tensor too large for a Lua table");
    int64_t pos = 0;
    luaL_checkstack(L, t->ndim + 4, "nested tensor");
    push_nested(L, on_host(L, t), 0, &pos);       /* one copy off the GPU, not one per element */
    return 1;
}

static int l_backward(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    ds_tensor *g = lua_isnoneornil(L, 2) ? NULL : dsL_checktensor(L, 2);
    if (dsL_backward(L, t, g, lua_toboolean(L, 3))) return dsL_error(L);
    return 0;
}

static int l_requires_grad_(lua_State *L) {
    ds_tensor *t = dsL_checkmeta(L, 1);
    bool on = lua_isnoneornil(L, 2) ? true : lua_toboolean(L, 2);
    if (on && !ds_dtype_is_float(t->dtype))
        return luaL_error(L, "requires_grad: only floating point tensors can require grad, got %s", ds_dtype_name(t->dtype));
    if (t->grad_fn && !on)
        return luaL_error(L, "requires_grad: cannot turn off on a non-leaf tensor; use detach()");
    t->requires_grad = on;
    lua_settop(L, 1);
    return 1;
}

static int l_set_category(lua_State *L) {
    ds_tensor *t = dsL_checkmeta(L, 1);
    const char *name = luaL_checkstring(L, 2);
    int c = ds_mem_category_parse(name);
    if (c < 0)
        return luaL_argerror(L, 2, lua_pushfstring(L, "unknown memory category '%s' (parameters, gradients, master_weights, optimizer_state, activations, other)", name));
    ds_tensor_set_category(t, (ds_mem_category)c);
    lua_settop(L, 1);
    return 1;
}

/* t[i], as torch's: the view of t at 1-based (or negative) position i of
 * dim 1, with that dim gone. */
static int index_select1(lua_State *L, ds_tensor *t) {
    lua_Number v = lua_tonumber(L, 2);
    int64_t n = t->ndim ? t->shape[0] : 0;
    if (t->ndim == 0) return luaL_error(L, "t[%s]: a 0-dim tensor has no dim to index; use t:item()", lua_tostring(L, 2));
    if (v != floor(v) || v == 0 || v > (lua_Number)n || v < -(lua_Number)n)
        return luaL_error(L, "t[%s]: index out of range for dim 1 of size %f (indices are 1-based; -1 is the last)",
                          lua_tostring(L, 2), (lua_Number)n);
    int64_t i = (int64_t)v;
    ds_tensor *row = ds_narrow(t, 0, i > 0 ? i - 1 : i, 1);
    ds_tensor *out = row ? ds_squeeze(row, 0) : NULL;
    ds_tensor_release(row);
    return dsL_pushtensor(L, out);
}

/* A key that names nothing: the metatable's no_method (the Lua layer's,
 * with a suggestion) words the error, else it is plain. */
static int no_method(lua_State *L, const char *k) {
    luaL_where(L, 1);
    lua_getmetatable(L, 1);
    lua_getfield(L, -1, "no_method");
    if (lua_isfunction(L, -1)) {
        lua_pushstring(L, k);
        lua_call(L, 1, 1);
    } else {
        lua_pushfstring(L, "tensor has no method '%s'", k);
    }
    lua_remove(L, -2);
    lua_concat(L, 2);
    return lua_error(L);
}

/* t[i], then t.grad, t.requires_grad, t.is_leaf, t.grad_fn, then the
 * method table; any other key is an error, as torch's AttributeError. */
static int l_index(lua_State *L) {
    ds_tensor *t = dsL_checkmeta(L, 1);
    if (lua_type(L, 2) == LUA_TNUMBER) return index_select1(L, t);
    lua_getmetatable(L, 1);
    lua_getfield(L, -1, "methods");
    lua_pushvalue(L, 2);
    lua_rawget(L, -2);
    if (!lua_isnil(L, -1)) return 1;
    const char *k = lua_tostring(L, 2);
    if (!k) return 0;
    if (strcmp(k, "grad") == 0) {
        if (!t->grad) return 0;
        ds_tensor_retain(t->grad);
        return dsL_pushtensor(L, t->grad);
    }
    if (strcmp(k, "requires_grad") == 0) { lua_pushboolean(L, t->requires_grad); return 1; }
    if (strcmp(k, "is_leaf") == 0) { lua_pushboolean(L, t->grad_fn == NULL); return 1; }
    if (strcmp(k, "grad_fn") == 0) {
        if (!t->grad_fn) return 0;
        lua_pushstring(L, t->grad_fn->name);
        return 1;
    }
    return no_method(L, k);
}

static int l_newindex(lua_State *L) {
    ds_tensor *t = dsL_checkmeta(L, 1);
    const char *k = luaL_checkstring(L, 2);
    if (strcmp(k, "requires_grad") == 0) {
        lua_settop(L, 3);
        lua_remove(L, 2);
        return l_requires_grad_(L);
    }
    if (strcmp(k, "grad") == 0) {
        ds_tensor *g = lua_isnil(L, 3) ? NULL : dsL_checktensor(L, 3);
        char s1[96], s2[96];
        if (g && (!ds_tensor_same_shape(g, t) || g->dtype != t->dtype))
            return luaL_error(L, "grad: assigned %s %s to a tensor of %s %s", ds_dtype_name(g->dtype),
                              ds_shape_str(g, s1, sizeof s1), ds_dtype_name(t->dtype), ds_shape_str(t, s2, sizeof s2));
        if (g) ds_tensor_retain(g);
        ds_tensor_release(t->grad);
        t->grad = g;
        return 0;
    }
    return luaL_error(L, "tensor has no settable field '%s'", k);
}

static int l_is_tensor(lua_State *L) { lua_pushboolean(L, dsL_totensor(L, 1) != NULL); return 1; }

static int l_set_grad_enabled(lua_State *L) {
    lua_pushboolean(L, ds_set_grad_enabled(lua_toboolean(L, 1)));
    return 1;
}

static int l_is_grad_enabled(lua_State *L) { lua_pushboolean(L, ds_grad_enabled()); return 1; }

static void push_category_table(lua_State *L, const int64_t *v, int64_t total) {
    lua_createtable(L, 0, DS_MEM_NCATEGORIES + 1);
    for (int i = 0; i < DS_MEM_NCATEGORIES; i++) {
        lua_pushnumber(L, (lua_Number)v[i]);
        lua_setfield(L, -2, ds_mem_category_name((ds_mem_category)i));
    }
    dsL_setnumber(L, "total", (lua_Number)total);
}

static int l_memory_stats(lua_State *L) {
    ds_mem_stats s;
    ds_mem_get_stats(&s);
    lua_createtable(L, 0, 2);
    push_category_table(L, s.current, s.total_current);
    lua_setfield(L, -2, "current");
    push_category_table(L, s.peak, s.total_peak);
    lua_setfield(L, -2, "peak");
    dsL_setnumber(L, "cached", (lua_Number)s.cached);
    return 1;
}

static int l_reset_peak_memory(lua_State *L) { (void)L; ds_mem_reset_peak(); return 0; }

static int l_empty_cache(lua_State *L) { (void)L; ds_mem_empty_cache(); return 0; }

static int l_kernel_calls(lua_State *L) {
    lua_pushnumber(L, (lua_Number)ds_kernel_calls());
    return 1;
}

static const luaL_Reg tensor_methods[] = {
    {"size", l_size}, {"stride", l_stride}, {"dim", l_dim}, {"numel", l_numel},
    {"dtype", l_dtype}, {"device", l_device}, {"is_contiguous", l_is_contiguous},
    {"item", l_item}, {"totable", l_totable}, {"backward", l_backward},
    {"requires_grad_", l_requires_grad_}, {"set_category", l_set_category}, {"version", l_version},
    {NULL, NULL}
};

static const luaL_Reg module_functions[] = {
    {"tensor", l_tensor}, {"zeros", l_zeros}, {"ones", l_ones}, {"full", l_full},
    {"rand", l_rand}, {"randn", l_randn}, {"arange", l_arange},
    {"manual_seed", l_manual_seed}, {"get_rng_state", l_get_rng_state}, {"set_rng_state", l_set_rng_state}, {"is_tensor", l_is_tensor},
    {"set_grad_enabled", l_set_grad_enabled}, {"is_grad_enabled", l_is_grad_enabled},
    {"memory_stats", l_memory_stats}, {"reset_peak_memory", l_reset_peak_memory},
    {"empty_cache", l_empty_cache}, {"kernel_calls", l_kernel_calls},
    {NULL, NULL}
};

static const luaL_Reg tensor_metamethods[] = {
    {"__gc", l_gc}, {"__index", l_index}, {"__newindex", l_newindex}, {"__len", l_len}, {NULL, NULL}
};

void dsL_open_tensor(lua_State *L) {
    main_state = L;
    on_lua_thread = true;
    ds_mem_set_oom_handler(collect_on_oom, NULL);
    luaL_newmetatable(L, DSL_TENSOR_MT);
    lua_newtable(L);
    lua_setfield(L, -2, "methods");
    luaL_register(L, NULL, tensor_metamethods);
    lua_pushvalue(L, -1);
    lua_setfield(L, -3, "Tensor");    /* the metatable, for Lua-side methods */
    lua_pop(L, 1);
    dsL_register(L, tensor_methods, true);
    dsL_register(L, module_functions, false);
}

void *dsL_newhandle(lua_State *L, const char *mt) {
    void *ud = lua_newuserdata(L, sizeof(void *));
    memset(ud, 0, sizeof(void *));
    luaL_getmetatable(L, mt);
    lua_setmetatable(L, -2);
    return ud;
}

void *dsL_checkhandle(lua_State *L, int idx, const char *mt, const char *closed) {
    void **p = luaL_checkudata(L, idx, mt);
    if (!*p) luaL_error(L, "%s", closed);
    return *p;
}

void dsL_setfuncs(lua_State *L, const char *key, const luaL_Reg *fns) {
    lua_newtable(L);
    luaL_register(L, NULL, fns);
    lua_setfield(L, -2, key);
}

void dsL_setnumber(lua_State *L, const char *key, double v) {
    lua_pushnumber(L, v);
    lua_setfield(L, -2, key);
}

void dsL_newtype(lua_State *L, const char *name, const luaL_Reg *methods, lua_CFunction gc) {
    luaL_newmetatable(L, name);
    lua_pushcfunction(L, gc);
    lua_setfield(L, -2, "__gc");
    dsL_setfuncs(L, "__index", methods);
}
