/* The step engine (core/train/ds_zero.h) and the partitioning primitives
 * below it, as ds.core._zero:
 *
 *   _zero.engine{stage, masters, comm_dtype, master_device, bucket_size,
 *                prescale, predivide, persistence_threshold,
 *                prefetch_bucket_size, max_live_parameters,
 *                max_reuse_distance, groups = {{p...}...}, optimizer,
 *                group, stages, shards}    (ds.comm.new_group's groups: group, the ranks that
 *                reduce (nil: the world); stages, the model-parallel ranks of this
 *                data index (pipeline stages, tensor group), over which the
 *                gradient norm sums too (nil: none); shards, {[i] = shard} by
 *                global index: stage 3's parameters built partitioned, each
 *                this rank's shard already)
 *                              -> z (optimizer: the flat mode's, else nil)
 *   z:master(g), z:master_grad(g), z:attach(optimizer), z:stream()
 *   z:backward(loss | nil, reduce)   z:scale_grads(f)
 *   z:step(param_groups, loss_scale, clip, check_overflow)
 *                              -> overflow, grad_norm (nil when not known)
 *   z:refresh({master...})     z:sync_params()  (parameters from the masters now)
 *   z:stats() -> table | nil
 *   z:set_logging(on)          z:comm_records() -> {{name, bytes, ms}...}
 *   z:buckets() -> n           z:bucket(b) -> first param, count, elements
 *   z:add_module({i...}) -> id | nil (it holds no partitioned parameter)
 *   z:pre_forward(id)  z:post_forward(id)  z:gather_all()  z:release_all()
 *   z:shard(i)  z:persistent(i)  z:close()
 *   z:exclude_from_norm(param)  (a tied weight a pipeline's earlier stage counts,
 *                              a replicated one tensor rank 0 counts)
 *   z:offload_params(file | nil)  stage 3's shards into host memory, or the file
 *   z:offload_on_host(chunk)   the test hook of CPU ranks: ZeRO-Offload's pipeline with copies
 *                              made on the host when waited for, chunks of chunk elements
 *   z:offload_counts() -> chunks, rows, shards | nil   the pipeline's chunks stepped, reduced
 *                              rows fetched and stage 3's shards loaded ahead so far (nil: no pipeline)
 *   z:take_local_grads()       masters at stage 0: this rank's unreduced gradients into the masters'
 *   z:reduces(boundary) -> bool   does this micro step's backward reduce?
 *   z:holds() -> 'flat' | 'masters' | 'streamed'   what holds the fp32 weights stepped
 *   z:parts() -> P             the shards each parameter is cut into
 *
 *   _zero.set_fetch(fn)        fn(t) must make a released tensor whole; it is
 *                              called when an op or a backward node reads one
 *   _zero.release_data(t)      t (a leaf) keeps its shape, loses its data
 *   _zero.set_data(t, src)     t becomes a view of src's data (no copy)
 *   _zero.is_released(t)
 *   _zero.retype(t, dtype [, bare])  t (a leaf) converted in place; bare: t is released,
 *                              its dtype alone changes
 *   _zero.placeholder(like, shape)  a released leaf of shape, like's dtype and device, no bytes
 *   _zero.draw(normal, total, lo, n, like)  elements lo .. lo + n - 1 (0-based) of ds.rand
 *                              (ds.randn) of total elements, in like's dtype and device
 *   _zero.drop(t, ...)         the handles let go of their tensors now
 *   _zero.key(t)               a value that names the tensor itself (every
 *                              Lua handle of one tensor gives the same key)
 *
 * Indices are 1-based here. Each engine call is one crossing from Lua:
 * nothing calls back into Lua per parameter or per bucket. */
#include "lua_tensor.h"
#include "lua_optim.h"
#include "ds_autograd.h"
#include "ds_error.h"
#include "ds_rng.h"
#include "ds_zero.h"

#include <math.h>
#include <stdlib.h>

#define DSL_ZERO_MT "dslua.StepEngine"

/* ---------------------------------------------------------------- primitives */

static int fetch_ref = LUA_NOREF;

/* A fetch function written in Lua runs on the state whose call is fetching. */
static int lua_fetch(ds_tensor *t, void *ud) {
    (void)ud;
    lua_State *L = dsL_fetching_state();
    if (!L || fetch_ref == LUA_NOREF) return 0;
    lua_rawgeti(L, LUA_REGISTRYINDEX, fetch_ref);
    ds_tensor_retain(t);
    dsL_pushtensor(L, t);
    if (lua_pcall(L, 1, 0, 0) == 0) return 0;
    const char *msg = lua_tostring(L, -1);
    ds_fail(DS_ERR_STATE, "fetching a partitioned parameter: %s", msg ? msg : "(error object is not a string)");
    lua_pop(L, 1);
    return -1;
}

static int l_set_fetch(lua_State *L) {
    if (!lua_isnil(L, 1)) luaL_checktype(L, 1, LUA_TFUNCTION);
    if (fetch_ref != LUA_NOREF) ds_autograd_remove_fetch(lua_fetch, NULL);
    luaL_unref(L, LUA_REGISTRYINDEX, fetch_ref);
    lua_settop(L, 1);
    fetch_ref = lua_isnil(L, 1) ? LUA_NOREF : luaL_ref(L, LUA_REGISTRYINDEX);
    if (fetch_ref != LUA_NOREF && ds_autograd_add_fetch(lua_fetch, NULL)) {
        luaL_unref(L, LUA_REGISTRYINDEX, fetch_ref);
        fetch_ref = LUA_NOREF;
        return dsL_error(L);
    }
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
    /* a parameter built partitioned stays released: its shard is converted apart */
    bool bare = lua_toboolean(L, 3);
    ds_tensor *t = bare ? dsL_checkmeta(L, 1) : dsL_checktensor(L, 1);
    int dt = ds_dtype_parse(luaL_checkstring(L, 2));
    if (dt < 0 || !ds_dtype_is_float((ds_dtype)dt))
        return luaL_argerror(L, 2, lua_pushfstring(L, "expected a float dtype, got '%s'", lua_tostring(L, 2)));
    if (t->grad_fn) return luaL_error(L, "retype: only a leaf can change dtype in place");
    if (bare && !ds_tensor_is_released(t)) return luaL_error(L, "retype: the tensor is not released");
    if (bare) {
        t->dtype = (ds_dtype)dt;
        return 0;
    }
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

static int l_placeholder(lua_State *L) {
    ds_tensor *like = dsL_checktensor(L, 1);
    int64_t shape[DS_MAX_DIMS], one = 1;
    int nd = dsL_checkshape(L, 2, shape);
    ds_tensor *t = ds_tensor_new(1, &one, like->dtype, ds_tensor_device(like));
    if (!t || ds_tensor_release_data(t)) {
        ds_tensor_release(t);
        return dsL_error(L);
    }
    int64_t stride[DS_MAX_DIMS], s = 1;
    for (int d = nd - 1; d >= 0; d--) {
        stride[d] = s;
        s *= shape[d];
    }
    ds_tensor *v = ds_tensor_view_of(t, nd, shape, stride, 0);
    ds_tensor_release(t);
    return dsL_pushtensor(L, v);
}

static int l_draw(lua_State *L) {
    bool normal = lua_toboolean(L, 1);
    int64_t total = dsL_checkint(L, 2, 0, INT64_MAX, "total"), lo = dsL_checkint(L, 3, 0, INT64_MAX, "lo");
    int64_t n = dsL_checkint(L, 4, 0, INT64_MAX, "n");
    ds_tensor *like = dsL_checkmeta(L, 5);
    return dsL_pushtensor(L, ds_rand_range(normal, total, lo, n, like->dtype, ds_tensor_device(like), NULL));
}

static int l_is_released(lua_State *L) {
    lua_pushboolean(L, ds_tensor_is_released(dsL_checkmeta(L, 1)));
    return 1;
}

static int l_key(lua_State *L) {
    lua_pushlightuserdata(L, dsL_checkmeta(L, 1));
    return 1;
}

/* ---------------------------------------------------------------- the engine */

ds_zero *dsL_checkzero(lua_State *L, int idx) {
    ds_zero **z = luaL_checkudata(L, idx, DSL_ZERO_MT);
    if (!*z) luaL_error(L, "step engine: used after close()");
    return *z;
}

static ds_zero *check_engine(lua_State *L) { return dsL_checkzero(L, 1); }

static double opt_number(lua_State *L, int t, const char *key, double def) {
    lua_getfield(L, t, key);
    if (lua_isnil(L, -1)) {
        lua_pop(L, 1);
        return def;
    }
    if (lua_type(L, -1) != LUA_TNUMBER)
        luaL_error(L, "step engine: %s must be a number, got %s", key, luaL_typename(L, -1));
    double v = lua_tonumber(L, -1);
    lua_pop(L, 1);
    return v;
}

static bool opt_bool(lua_State *L, int t, const char *key) {
    lua_getfield(L, t, key);
    bool v = lua_toboolean(L, -1);
    lua_pop(L, 1);
    return v;
}

static int64_t opt_elements(lua_State *L, int t, const char *key, double def) {
    double v = opt_number(L, t, key, def);
    /* clamped before the cast: one past int64's range is undefined */
    return v >= 9.2e18 ? INT64_MAX : v <= -9.2e18 ? INT64_MIN : (int64_t)v;
}

static void read_config(lua_State *L, int t, ds_zero_config *c) {
    double stage = opt_number(L, t, "stage", 0);
    if (!(stage >= 0 && stage <= 3 && stage == (int)stage)) luaL_error(L, "step engine: stage must be 0, 1, 2 or 3");
    c->stage = (int)stage;
    c->masters = opt_bool(L, t, "masters");
    lua_getfield(L, t, "comm_dtype");
    c->comm_dtype = lua_isnil(L, -1) ? DS_F32 : dsL_checkdtype(L, lua_gettop(L), DS_F32);
    lua_pop(L, 1);
    lua_getfield(L, t, "master_device");
    const char *dev = lua_isnil(L, -1) ? "cpu" : luaL_checkstring(L, -1);
    if (ds_device_parse(dev, &c->master_device))
        luaL_error(L, "step engine: master_device: %s", ds_error_message());
    lua_pop(L, 1);
    c->bucket_size = opt_elements(L, t, "bucket_size", 5e8);
    c->prescale = opt_bool(L, t, "prescale");
    c->predivide = opt_number(L, t, "predivide", 1);
    c->persistence_threshold = opt_elements(L, t, "persistence_threshold", 1e5);
    c->prefetch_bucket_size = opt_elements(L, t, "prefetch_bucket_size", 5e7);
    c->max_live_parameters = opt_elements(L, t, "max_live_parameters", 1e9);
    c->max_reuse_distance = opt_elements(L, t, "max_reuse_distance", 1e9);
    lua_getfield(L, t, "group");
    c->group = lua_isnil(L, -1) ? NULL : *(ds_comm_group **)luaL_checkudata(L, -1, DSL_GROUP_MT);
    lua_getfield(L, t, "stages");
    c->stages = lua_isnil(L, -1) ? NULL : *(ds_comm_group **)luaL_checkudata(L, -1, DSL_GROUP_MT);
    lua_pop(L, 2);
}

/* engine{...}: the groups' parameters flattened, counted per group. */
static int l_engine(lua_State *L) {
    luaL_checktype(L, 1, LUA_TTABLE);
    ds_zero_config c = { 0 };
    read_config(L, 1, &c);
    lua_getfield(L, 1, "optimizer");
    ds_optim *flat = lua_isnil(L, -1) ? NULL : dsL_checkoptim(L, lua_gettop(L));
    lua_getfield(L, 1, "groups");
    int gi = lua_gettop(L);
    if (!lua_istable(L, gi)) return luaL_error(L, "step engine: groups must be a list of parameter lists");
    int ng = (int)lua_objlen(L, gi), n = 0;
    for (int g = 1; g <= ng; g++) {
        lua_rawgeti(L, gi, g);
        if (!lua_istable(L, -1)) return luaL_error(L, "step engine: group %d is not a list of tensors", g);
        n += (int)lua_objlen(L, -1);
        lua_pop(L, 1);
    }
    /* scratch owned by the GC, so a raise below leaks nothing */
    int *counts = lua_newuserdata(L, sizeof *counts * (size_t)(ng + 1));
    ds_tensor **params = lua_newuserdata(L, sizeof *params * (size_t)(n + 1));
    for (int g = 1, i = 0; g <= ng; g++) {
        lua_rawgeti(L, gi, g);
        counts[g - 1] = (int)lua_objlen(L, -1);
        for (int k = 1; k <= counts[g - 1]; k++, i++) {
            lua_rawgeti(L, -1, k);
            if (!(params[i] = dsL_totensor(L, -1)))
                return luaL_error(L, "step engine: group %d item %d is a %s, not a tensor", g, k, luaL_typename(L, -1));
            lua_pop(L, 1);
        }
        lua_pop(L, 1);
    }
    lua_getfield(L, 1, "shards");
    if (!lua_isnil(L, -1)) {
        int si = lua_gettop(L);
        c.shards = lua_newuserdata(L, sizeof *c.shards * (size_t)(n + 1));
        for (int i = 0; i < n; i++) {
            lua_rawgeti(L, si, i + 1);
            if (!lua_isnil(L, -1) && !(c.shards[i] = dsL_totensor(L, -1)))
                return luaL_error(L, "step engine: shard of parameter %d is a %s, not a tensor", i + 1,
                                  luaL_typename(L, -1));
            if (lua_isnil(L, -1)) c.shards[i] = NULL;
            lua_pop(L, 1);
        }
    }
    ds_zero **ud = dsL_newhandle(L, DSL_ZERO_MT);
    if (!(*ud = ds_zero_new(&c, ng, counts, params, flat))) return dsL_error(L);
    return 1;
}

static int l_master(lua_State *L) {
    return dsL_pushtensor(L, ds_zero_master(check_engine(L), (int)luaL_checkinteger(L, 2) - 1));
}

static int l_master_grad(lua_State *L) {
    return dsL_pushtensor(L, ds_zero_master_grad(check_engine(L), (int)luaL_checkinteger(L, 2) - 1));
}

static int l_attach(lua_State *L) {
    if (ds_zero_attach(check_engine(L), dsL_checkoptim(L, 2))) return dsL_error(L);
    return 0;
}

/* A method that runs one engine operation and raises its error */
#define ENGINE_OP(name, op)                           \
    static int name(lua_State *L) {                   \
        if (op(check_engine(L))) return dsL_error(L); \
        return 0;                                     \
    }

ENGINE_OP(l_stream, ds_zero_stream)

static int l_backward(lua_State *L) {
    ds_zero *z = check_engine(L);
    ds_tensor *loss = lua_isnil(L, 2) ? NULL : dsL_checktensor(L, 2);
    /* backward nodes written in Lua (ds.checkpoint) and Lua fetches run on L */
    lua_State *outer = dsL_set_fetching_state(L);
    int rc = ds_zero_backward(z, loss, lua_toboolean(L, 3));
    dsL_set_fetching_state(outer);
    if (rc) return dsL_error(L);
    return 0;
}

static int l_scale_grads(lua_State *L) {
    if (ds_zero_scale_grads(check_engine(L), luaL_checknumber(L, 2))) return dsL_error(L);
    return 0;
}

/* step(param_groups | nil, loss_scale, clip, check_overflow) */
static int l_step(lua_State *L) {
    ds_zero *z = check_engine(L);
    ds_optim *o = ds_zero_optimizer(z);
    ds_optim_hparams *h = NULL;
    if (o) {
        h = lua_newuserdata(L, sizeof *h * (size_t)(o->n_groups + 1));
        dsL_optim_hparams(L, 2, o, h);
    }
    ds_zero_result r;
    if (ds_zero_step(z, h, luaL_optnumber(L, 3, 1), luaL_optnumber(L, 4, 0), lua_toboolean(L, 5), &r))
        return dsL_error(L);
    lua_pushboolean(L, r.overflow);
    if (isnan(r.grad_norm)) lua_pushnil(L);
    else lua_pushnumber(L, r.grad_norm);
    return 2;
}

ENGINE_OP(l_sync_params, ds_zero_sync_params)

static int l_refresh(lua_State *L) {
    ds_zero *z = check_engine(L);
    luaL_checktype(L, 2, LUA_TTABLE);
    int n = (int)lua_objlen(L, 2);
    ds_tensor **m = lua_newuserdata(L, sizeof *m * (size_t)(n + 1));
    for (int g = 0; g < n; g++) {
        lua_rawgeti(L, 2, g + 1);
        if (!(m[g] = dsL_totensor(L, -1)))
            return luaL_error(L, "step engine: refresh: master %d is a %s, not a tensor", g + 1, luaL_typename(L, -1));
        lua_pop(L, 1);
    }
    if (ds_zero_refresh(z, n, m)) return dsL_error(L);
    return 0;
}

static int l_stats(lua_State *L) {
    ds_zero_stats s;
    if (!ds_zero_stats_get(check_engine(L), &s)) return 0;
    lua_createtable(L, 0, 7);
    dsL_setnumber(L, "buckets", s.buckets);
    dsL_setnumber(L, "bytes", (double)s.bytes);
    dsL_setnumber(L, "launched_in_backward", s.launched_in_backward);
    dsL_setnumber(L, "leaves_after_first_launch", s.leaves_after_first_launch);
    dsL_setnumber(L, "comm_ms", s.comm_ms);
    dsL_setnumber(L, "hidden_ms", s.hidden_ms);
    dsL_setnumber(L, "wait_ms", s.wait_ms);
    return 1;
}

static int l_set_logging(lua_State *L) {
    ds_zero_set_logging(check_engine(L), lua_toboolean(L, 2));
    return 0;
}

/* comm_records() -> {{name, bytes, ms}...} since the last call */
static int l_comm_records(lua_State *L) {
    int n;
    const ds_zero_comm_record *r = ds_zero_comm_records(check_engine(L), &n);
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_createtable(L, 3, 0);
        lua_pushstring(L, r[i].name);
        lua_rawseti(L, -2, 1);
        lua_pushnumber(L, (double)r[i].bytes);
        lua_rawseti(L, -2, 2);
        lua_pushnumber(L, r[i].ms);
        lua_rawseti(L, -2, 3);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int l_buckets(lua_State *L) {
    lua_pushinteger(L, ds_zero_n_buckets(check_engine(L)));
    return 1;
}

static int l_bucket(lua_State *L) {
    ds_zero *z = check_engine(L);
    int b = (int)luaL_checkinteger(L, 2);
    if (b < 1 || b > ds_zero_n_buckets(z))
        return luaL_error(L, "step engine: bucket %d out of range [1, %d]", b, ds_zero_n_buckets(z));
    int first, count;
    int64_t numel;
    ds_zero_bucket(z, b - 1, &first, &count, &numel);
    lua_pushinteger(L, first + 1);
    lua_pushinteger(L, count);
    lua_pushnumber(L, (double)numel);
    return 3;
}

static int l_add_module(lua_State *L) {
    ds_zero *z = check_engine(L);
    luaL_checktype(L, 2, LUA_TTABLE);
    int n = (int)lua_objlen(L, 2);
    int *idx = lua_newuserdata(L, sizeof *idx * (size_t)(n + 1));
    for (int k = 0; k < n; k++) {
        lua_rawgeti(L, 2, k + 1);
        idx[k] = (int)luaL_checkinteger(L, -1) - 1;
        lua_pop(L, 1);
    }
    int id = ds_zero_add_module(z, n, idx);
    if (id == -1) return dsL_error(L);
    if (id < 0) return 0;
    lua_pushinteger(L, id + 1);
    return 1;
}

static int l_pre_forward(lua_State *L) {
    if (ds_zero_pre_forward(check_engine(L), (int)luaL_checkinteger(L, 2) - 1)) return dsL_error(L);
    return 0;
}

static int l_post_forward(lua_State *L) {
    if (ds_zero_post_forward(check_engine(L), (int)luaL_checkinteger(L, 2) - 1)) return dsL_error(L);
    return 0;
}

ENGINE_OP(l_gather_all, ds_zero_gather_all)

static int l_release_all(lua_State *L) {
    ds_zero_release_all(check_engine(L));
    return 0;
}

static int param_arg(lua_State *L, int n) {
    int i = (int)luaL_checkinteger(L, 2);
    if (i < 1 || i > n) luaL_error(L, "step engine: parameter %d out of range [1, %d]", i, n);
    return i - 1;
}

static int l_shard(lua_State *L) {
    ds_zero *z = check_engine(L);
    lua_pushnumber(L, (double)ds_zero_shard(z, param_arg(L, ds_zero_n_params(z))));
    return 1;
}

static int l_persistent(lua_State *L) {
    ds_zero *z = check_engine(L);
    lua_pushboolean(L, ds_zero_persistent(z, param_arg(L, ds_zero_n_params(z))));
    return 1;
}

static int l_offload_params(lua_State *L) {
    if (ds_zero_offload_params(check_engine(L), luaL_optstring(L, 2, NULL))) return dsL_error(L);
    return 0;
}

static int l_offload_on_host(lua_State *L) {
    lua_Integer chunk = luaL_checkinteger(L, 2);
    if (ds_zero_offload_on_host(check_engine(L), (int64_t)chunk)) return dsL_error(L);
    return 0;
}

static int l_offload_counts(lua_State *L) {
    int64_t chunks, rows, shards;
    if (!ds_zero_offload_counts(check_engine(L), &chunks, &rows, &shards)) return 0;
    lua_pushinteger(L, (lua_Integer)chunks);
    lua_pushinteger(L, (lua_Integer)rows);
    lua_pushinteger(L, (lua_Integer)shards);
    return 3;
}

ENGINE_OP(l_take_local_grads, ds_zero_take_local_grads)

static int l_reduces(lua_State *L) {
    lua_pushboolean(L, ds_zero_reduces(check_engine(L), lua_toboolean(L, 2)));
    return 1;
}

static int l_holds(lua_State *L) {
    static const char *const names[] = { "flat", "masters", "streamed" };
    lua_pushstring(L, names[ds_zero_holds(check_engine(L))]);
    return 1;
}

static int l_parts(lua_State *L) {
    lua_pushinteger(L, ds_zero_parts(check_engine(L)));
    return 1;
}

DSL_HANDLE_GC(l_close, ds_zero, DSL_ZERO_MT, ds_zero_free)

static int l_exclude_from_norm(lua_State *L) {
    if (ds_zero_exclude_from_norm(check_engine(L), dsL_checktensor(L, 2))) return dsL_error(L);
    return 0;
}

static const luaL_Reg engine_methods[] = {
    {"exclude_from_norm", l_exclude_from_norm},
    {"master", l_master}, {"master_grad", l_master_grad}, {"attach", l_attach}, {"stream", l_stream}, {"backward", l_backward},
    {"scale_grads", l_scale_grads}, {"step", l_step}, {"refresh", l_refresh}, {"sync_params", l_sync_params}, {"stats", l_stats},
    {"buckets", l_buckets}, {"bucket", l_bucket}, {"add_module", l_add_module}, {"pre_forward", l_pre_forward},
    {"post_forward", l_post_forward}, {"gather_all", l_gather_all}, {"release_all", l_release_all},
    {"shard", l_shard}, {"persistent", l_persistent}, {"set_logging", l_set_logging},
    {"comm_records", l_comm_records}, {"offload_params", l_offload_params},
    {"offload_on_host", l_offload_on_host}, {"offload_counts", l_offload_counts},
    {"take_local_grads", l_take_local_grads}, {"reduces", l_reduces}, {"holds", l_holds}, {"parts", l_parts},
    {"close", l_close},
    {NULL, NULL}
};

static const luaL_Reg zero_functions[] = {
    {"engine", l_engine}, {"set_fetch", l_set_fetch}, {"release_data", l_release_data}, {"set_data", l_set_data},
    {"is_released", l_is_released}, {"retype", l_retype}, {"placeholder", l_placeholder}, {"draw", l_draw}, {"drop", l_drop}, {"key", l_key},
    {NULL, NULL}
};

void dsL_open_zero(lua_State *L) {
    dsL_newtype(L, DSL_ZERO_MT, engine_methods, l_close);
    lua_pop(L, 1);
    dsL_setfuncs(L, "_zero", zero_functions);
}
