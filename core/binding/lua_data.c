/* Lua binding of the dataset readers, the batch gatherer and the prefetch
 * loader: the primitives under lua/dslua/io/data.lua, as core.data_core.
 *
 * Sample indices: a Lua table holds 1-based indices, a tensor or an order
 * 0-based ones (index values in tensors are 0-based everywhere). */
#include "lua_tensor.h"
#include "ds_data.h"
#include "ds_error.h"
#include "ds_loader.h"
#include "ds_order.h"

#include <glob.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define DATASET_MT "dslua.Dataset"
#define LOADER_MT "dslua.Loader"
#define ORDER_MT "dslua.Order"

static ds_dataset *check_dataset(lua_State *L, int idx) {
    return *(ds_dataset **)luaL_checkudata(L, idx, DATASET_MT);
}

static ds_loader *check_loader(lua_State *L, int idx) {
    ds_loader *l = *(ds_loader **)luaL_checkudata(L, idx, LOADER_MT);
    if (!l) luaL_error(L, "loader: already closed");
    return l;
}

static int push_dataset(lua_State *L, ds_dataset *d) {
    if (!d) return dsL_error(L);
    ds_dataset **p = dsL_newhandle(L, DATASET_MT);
    *p = d;
    return 1;
}

DSL_HANDLE_GC(dataset_gc, ds_dataset, DATASET_MT, ds_dataset_release)

DSL_HANDLE_GC(loader_gc, ds_loader, LOADER_MT, ds_loader_free)

/* A list of strings at idx, borrowed, in a buffer the Lua GC owns. */
static const char **check_strings(lua_State *L, int idx, const char *what, int *n) {
    luaL_checktype(L, idx, LUA_TTABLE);
    *n = (int)lua_objlen(L, idx);
    if (*n == 0) luaL_error(L, "%s: expected a non-empty list of file names", what);
    const char **s = lua_newuserdata(L, sizeof *s * (size_t)*n);
    for (int k = 0; k < *n; k++) {
        lua_rawgeti(L, idx, k + 1);
        if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "%s: entry %d is a %s, expected a string", what, k + 1, luaL_typename(L, -1));
        s[k] = lua_tostring(L, -1);
        lua_pop(L, 1);          /* still referenced by the table */
    }
    return s;
}

/* The sample indices at idx as 0-based int64 in a GC-owned buffer: a table
 * of 1-based indices, an integer tensor of 0-based ones (positions
 * [start, start + count) of it when start is given), or nil for the run
 * start, start + 1, ... of count indices. */
static int64_t *check_indices(lua_State *L, int idx, const ds_dataset *d, int64_t *n) {
    int64_t len = ds_dataset_len(d);
    if (lua_istable(L, idx)) {
        *n = (int64_t)lua_objlen(L, idx);
        int64_t *v = lua_newuserdata(L, sizeof *v * (size_t)(*n ? *n : 1));
        for (int64_t b = 0; b < *n; b++) {
            lua_rawgeti(L, idx, (int)b + 1);
            lua_Number x = lua_tonumber(L, -1);
            if (!lua_isnumber(L, -1) || x != floor(x) || x < 1 || x > (lua_Number)len)
                luaL_error(L, "dataset: index %s at position %d is outside [1, %f] (Lua lists of indices are 1-based)",
                           lua_isnumber(L, -1) ? lua_tostring(L, -1) : luaL_typename(L, -1), (int)b + 1, (lua_Number)len);
            v[b] = (int64_t)x - 1;
            lua_pop(L, 1);
        }
        return v;
    }
    lua_Integer start = luaL_optinteger(L, idx + 1, 0), count = luaL_optinteger(L, idx + 2, -1);
    if (lua_isnoneornil(L, idx)) {
        luaL_argcheck(L, start >= 0 && count >= 0, idx + 1, "a run of indices needs a start and a count");
        *n = count;
        int64_t *v = lua_newuserdata(L, sizeof *v * (size_t)(count ? count : 1));
        for (int64_t b = 0; b < count; b++) v[b] = start + b;
        return v;
    }
    const ds_order *o = luaL_testudata(L, idx, ORDER_MT);
    if (o) {
        if (count < 0) count = o->len - start;
        if (start < 0 || count < 0 || start + count > o->len)
            luaL_error(L, "dataset: positions [%f, %f) are outside the order of %f", (lua_Number)start,
                       (lua_Number)(start + count), (lua_Number)o->len);
        *n = count;
        int64_t *v = lua_newuserdata(L, sizeof *v * (size_t)(count ? count : 1));
        ds_order_fill(o, start, count, v);
        return v;
    }
    ds_tensor *t = dsL_totensor(L, idx);
    if (!t) luaL_typerror(L, idx, "list of indices, tensor of indices or order");
    char s[96];
    if (t->ndim != 1 || ds_dtype_is_float(t->dtype) || t->dtype == DS_BOOL || ds_tensor_device(t).type != DS_DEV_CPU)
        luaL_error(L, "dataset: indices must be a 1-D integer CPU tensor, got %s %s", ds_dtype_name(t->dtype),
                   ds_shape_str(t, s, sizeof s));
    if (count < 0) count = t->shape[0] - start;
    if (start < 0 || count < 0 || start + count > t->shape[0])
        luaL_error(L, "dataset: positions [%f, %f) are outside the %f indices", (lua_Number)start,
                   (lua_Number)(start + count), (lua_Number)t->shape[0]);
    *n = count;
    int64_t *v = lua_newuserdata(L, sizeof *v * (size_t)(count ? count : 1));
    if (t->dtype == DS_I64 && ds_tensor_is_contiguous(t))
        memcpy(v, (const int64_t *)ds_tensor_data(t) + start, sizeof *v * (size_t)count);
    else
        for (int64_t b = 0; b < count; b++) v[b] = (int64_t)ds_tensor_get(t, start + b);
    return v;     /* the gatherer checks the range */
}

/* {name = tensor, ...}, taking over out's references; drop_lead views each
 * without its leading dim of one (a single sample). */
static int push_batch(lua_State *L, const ds_dataset *d, ds_tensor **out, bool drop_lead) {
    int nf = ds_dataset_nfields(d);
    lua_createtable(L, 0, nf);
    for (int k = 0; k < nf; k++) {
        ds_tensor *t = out[k];
        if (drop_lead) {
            t = ds_tensor_view_of(out[k], out[k]->ndim - 1, out[k]->shape + 1, out[k]->stride + 1, out[k]->offset);
            ds_tensor_release(out[k]);
        }
        out[k] = NULL;
        if (!t)
            for (int j = k + 1; j < nf; j++) ds_tensor_release(out[j]);
        dsL_pushtensor(L, t);
        lua_setfield(L, -2, ds_dataset_field_name(d, k));
    }
    return 1;
}

/* read_idx(path, ndim, first (0-based), count (-1: to the end)) -> u8 tensor, items in the file */
static int l_read_idx(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    int ndim = (int)luaL_checkinteger(L, 2);
    int64_t total = 0;
    dsL_pushtensor(L, ds_data_read_idx(path, ndim, luaL_optinteger(L, 3, 0), luaL_optinteger(L, 4, -1), &total));
    lua_pushnumber(L, (lua_Number)total);
    return 2;
}

/* idx_items(path, ndim) -> the items its header declares */
static int l_idx_items(lua_State *L) {
    int64_t items;
    if (ds_data_idx_items(luaL_checkstring(L, 1), (int)luaL_checkinteger(L, 2), &items)) return dsL_error(L);
    lua_pushnumber(L, (lua_Number)items);
    return 1;
}

/* read_cifar10({paths}) -> x u8 [N,3,32,32], y i64 [N] */
static int l_read_cifar10(lua_State *L) {
    int n;
    lua_settop(L, 1);
    const char **paths = check_strings(L, 1, "cifar10", &n);
    ds_tensor *x, *y;
    if (ds_data_read_cifar10(n, paths, &x, &y)) return dsL_error(L);
    dsL_pushtensor(L, x);
    dsL_pushtensor(L, y);
    return 2;
}

/* shards({paths}, block, stride, vocab) -> dataset, {token count per shard} */
static int l_shards(lua_State *L) {
    int n;
    lua_settop(L, 4);
    const char **paths = check_strings(L, 1, "shards", &n);
    int64_t block = dsL_checkint(L, 2, 1, INT64_MAX, "shards: block_size");
    int64_t stride = dsL_checkint(L, 3, 1, INT64_MAX, "shards: stride");
    int64_t vocab = dsL_checkint(L, 4, 0, INT64_MAX, "shards: vocab_size");
    int64_t *lengths = lua_newuserdata(L, sizeof *lengths * (size_t)n);
    push_dataset(L, ds_dataset_shards(n, paths, block, stride, vocab, lengths));
    lua_createtable(L, n, 0);
    for (int k = 0; k < n; k++) {
        lua_pushnumber(L, (lua_Number)lengths[k]);
        lua_rawseti(L, -2, k + 1);
    }
    return 2;
}

/* char_tokens(text) -> tokens i64, vocabulary (its bytes as a string) */
static int l_char_tokens(lua_State *L) {
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    unsigned char vocab[256];
    int nv;
    dsL_pushtensor(L, ds_data_char_tokens((const unsigned char *)s, n, vocab, &nv));
    lua_pushlstring(L, (const char *)vocab, (size_t)nv);
    return 2;
}

/* encode(text, vocab) -> tokens i64 */
static int l_encode(lua_State *L) {
    size_t n, nv;
    const char *s = luaL_checklstring(L, 1, &n), *vocab = luaL_checklstring(L, 2, &nv);
    return dsL_pushtensor(L, ds_data_encode((const unsigned char *)s, n, (const unsigned char *)vocab, (int)nv));
}

/* decode(ids tensor, vocab) -> string */
static int l_decode(lua_State *L) {
    ds_tensor *ids = dsL_checktensor(L, 1);
    size_t nv;
    const char *vocab = luaL_checklstring(L, 2, &nv);
    int64_t n = ds_tensor_numel(ids);
    unsigned char *buf = lua_newuserdata(L, (size_t)(n ? n : 1));
    if (ds_data_decode(ids, (const unsigned char *)vocab, (int)nv, buf)) return dsL_error(L);
    lua_pushlstring(L, (const char *)buf, (size_t)n);
    return 1;
}

/* glob(pattern) -> sorted list of matching paths (empty when none) */
static int l_glob(lua_State *L) {
    const char *pattern = luaL_checkstring(L, 1);
    glob_t g;
    int rc = glob(pattern, 0, NULL, &g);
    if (rc != 0 && rc != GLOB_NOMATCH) {
        if (rc != GLOB_ABORTED) globfree(&g);
        return luaL_error(L, "glob: cannot read the folders of '%s'", pattern);
    }
    lua_createtable(L, rc ? 0 : (int)g.gl_pathc, 0);
    for (size_t k = 0; rc == 0 && k < g.gl_pathc; k++) {
        lua_pushstring(L, g.gl_pathv[k]);
        lua_rawseti(L, -2, (int)k + 1);
    }
    if (rc == 0) globfree(&g);
    return 1;
}

/* read_file(path) -> its bytes (gunzipped when gzip), refusing what is
 * not a regular file (a FIFO would block forever) */
static int l_read_file(lua_State *L) {
    size_t n;
    unsigned char *b = ds_data_read_all(luaL_checkstring(L, 1), &n);
    if (!b) return dsL_error(L);
    lua_pushlstring(L, (const char *)b, n);
    free(b);
    return 1;
}

/* is_dir(path) -> boolean */
static int l_is_dir(lua_State *L) {
    struct stat st;
    lua_pushboolean(L, stat(luaL_checkstring(L, 1), &st) == 0 && S_ISDIR(st.st_mode));
    return 1;
}

/* rows({names}, {tensors}) -> dataset */
static int l_rows(lua_State *L) {
    luaL_checktype(L, 1, LUA_TTABLE);
    luaL_checktype(L, 2, LUA_TTABLE);
    int n = (int)lua_objlen(L, 1);
    if (n < 1 || n > DS_DATASET_MAX_FIELDS || (int)lua_objlen(L, 2) != n)
        return luaL_error(L, "dataset: %d names and %d tensors, expected 1 to %d of each", n, (int)lua_objlen(L, 2),
                          DS_DATASET_MAX_FIELDS);
    const char *names[DS_DATASET_MAX_FIELDS];
    ds_tensor *fields[DS_DATASET_MAX_FIELDS];
    for (int k = 0; k < n; k++) {
        lua_rawgeti(L, 1, k + 1);
        names[k] = luaL_checkstring(L, -1);
        lua_rawgeti(L, 2, k + 1);
        fields[k] = dsL_totensor(L, -1);
        if (!fields[k]) return luaL_error(L, "dataset: field '%s' is a %s, expected a tensor", names[k], luaL_typename(L, -1));
        lua_pop(L, 2);
    }
    return push_dataset(L, ds_dataset_rows(n, names, fields));
}

/* windows(tokens, {segment lengths}, block, stride) -> dataset */
static int l_windows(lua_State *L) {
    ds_tensor *tokens = dsL_checktensor(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    int nseg = (int)lua_objlen(L, 2);
    int64_t *seg = lua_newuserdata(L, sizeof *seg * (size_t)(nseg ? nseg : 1));
    for (int k = 0; k < nseg; k++) {
        lua_rawgeti(L, 2, k + 1);
        seg[k] = dsL_checkint(L, -1, 0, INT64_MAX, "windows: a segment length");
        lua_pop(L, 1);
    }
    int64_t block = dsL_checkint(L, 3, 1, INT64_MAX, "windows: block_size");
    int64_t stride = dsL_checkint(L, 4, 1, INT64_MAX, "windows: stride");
    return push_dataset(L, ds_dataset_windows(tokens, nseg, seg, block, stride));
}

static int l_len(lua_State *L) {
    lua_pushnumber(L, (lua_Number)ds_dataset_len(check_dataset(L, 1)));
    return 1;
}

/* gather(dataset, indices [, start, count]) -> {name = tensor with a leading batch dim} */
static int l_gather(lua_State *L) {
    ds_dataset *d = check_dataset(L, 1);
    lua_settop(L, 4);
    int64_t n;
    int64_t *idx = check_indices(L, 2, d, &n);
    ds_tensor *out[DS_DATASET_MAX_FIELDS];
    if (ds_dataset_gather(d, idx, n, DS_CPU_DEVICE, out)) return dsL_error(L);
    return push_batch(L, d, out, false);
}

/* get(dataset, i) -> one sample (i 1-based) */
static int l_get(lua_State *L) {
    ds_dataset *d = check_dataset(L, 1);
    lua_Number i = luaL_checknumber(L, 2);
    int64_t len = ds_dataset_len(d);
    if (i != floor(i) || i < 1 || i > (lua_Number)len)
        return luaL_error(L, "dataset:get: index %s is outside [1, %f]", lua_tostring(L, 2), (lua_Number)len);
    int64_t at = (int64_t)i - 1;
    ds_tensor *out[DS_DATASET_MAX_FIELDS];
    if (ds_dataset_gather(d, &at, 1, DS_CPU_DEVICE, out)) return dsL_error(L);
    return push_batch(L, d, out, true);
}

/* permutation(n, seed) -> i64 tensor, a permutation of [0, n) */
static int l_permutation(lua_State *L) {
    lua_Number n = luaL_checknumber(L, 1), seed = luaL_checknumber(L, 2);
    luaL_argcheck(L, n >= 0 && n == floor(n) && n < 0x1p53, 1, "size must be a non-negative integer");
    luaL_argcheck(L, seed >= 0 && seed == floor(seed) && seed < 0x1p64, 2, "seed must be a non-negative integer below 2^64");
    return dsL_pushtensor(L, ds_dataset_permutation((int64_t)n, (uint64_t)seed));
}

static lua_Integer check_count(lua_State *L, int idx, const char *what) {
    lua_Number x = luaL_checknumber(L, idx);
    if (x != floor(x) || x < 0 || x >= 0x1p53)
        luaL_error(L, "order: %s must be an integer in [0, 2^53), got %s", what, lua_tostring(L, idx));
    return (lua_Integer)x;
}

/* A new order over the window [first, first + span) of [0, n), shuffled by
 * seed when shuffle, of the runs in the list at idx ({{start, stride, block,
 * count}, ...}). */
static int push_order(lua_State *L, int64_t n, int64_t first, int64_t span, bool shuffle, uint64_t seed, int idx) {
    luaL_checktype(L, idx, LUA_TTABLE);
    int nruns = (int)lua_objlen(L, idx);
    ds_order *o = lua_newuserdata(L, ds_order_size(nruns));
    ds_order_run *runs = lua_newuserdata(L, sizeof *runs * (size_t)(nruns ? nruns : 1));
    static const char *const fields[] = { "start", "stride", "block", "count" };
    for (int k = 0; k < nruns; k++) {
        lua_rawgeti(L, idx, k + 1);
        if (!lua_istable(L, -1))
            luaL_error(L, "order: run %d is a %s, expected {start, stride, block, count}", k + 1, luaL_typename(L, -1));
        int64_t v[4];
        for (int f = 0; f < 4; f++) {
            lua_rawgeti(L, -1, f + 1);
            v[f] = check_count(L, lua_gettop(L), fields[f]);
            lua_pop(L, 1);
        }
        runs[k] = (ds_order_run){ v[0], v[1], v[2], v[3] };
        lua_pop(L, 1);
    }
    if (ds_order_init(o, n, first, span, shuffle, seed, nruns, runs)) return dsL_error(L);
    lua_pop(L, 1);
    luaL_getmetatable(L, ORDER_MT);
    lua_setmetatable(L, -2);
    return 1;
}

/* order(n, seed or false, runs [, first, span]) -> an order: the runs'
 * positions (mod span, plus first; the window defaults to [0, n)) through
 * ds_shuffle(n, seed) when a seed is given */
static int l_order(lua_State *L) {
    int64_t n = check_count(L, 1, "the dataset length");
    bool shuffle = lua_toboolean(L, 2);
    uint64_t seed = shuffle ? (uint64_t)check_count(L, 2, "seed") : 0;
    int64_t first = lua_isnoneornil(L, 4) ? 0 : check_count(L, 4, "the window's first position");
    int64_t span = lua_isnoneornil(L, 5) ? n - first : check_count(L, 5, "the window's span");
    return push_order(L, n, first, span, shuffle, seed, 3);
}

static const ds_order *check_order(lua_State *L, int idx) { return luaL_checkudata(L, idx, ORDER_MT); }

static int order_len(lua_State *L) {
    lua_pushnumber(L, (lua_Number)check_order(L, 1)->len);
    return 1;
}

/* a == b: the same description (so the same indices) */
static int order_eq(lua_State *L) {
    const ds_order *a = check_order(L, 1), *b = check_order(L, 2);
    lua_pushboolean(L, a->n == b->n && a->first == b->first && a->span == b->span && a->shuffle == b->shuffle &&
                           a->seed == b->seed && a->nruns == b->nruns &&
                           !memcmp(a->runs, b->runs, sizeof *a->runs * (size_t)a->nruns));
    return 1;
}

/* order:at(k) -> the index at position k (0-based) */
static int order_at(lua_State *L) {
    const ds_order *o = check_order(L, 1);
    lua_Number k = luaL_checknumber(L, 2);
    if (k != floor(k) || k < 0 || k >= (lua_Number)o->len)
        return luaL_error(L, "order:at: position %s is outside [0, %f)", lua_tostring(L, 2), (lua_Number)o->len);
    int64_t v;
    ds_order_fill(o, (int64_t)k, 1, &v);
    lua_pushnumber(L, (lua_Number)v);
    return 1;
}

/* order:cut(runs) -> the same permutation of [0, n) over other runs (a
 * rank's share of the epoch's order) */
static int order_cut(lua_State *L) {
    const ds_order *o = check_order(L, 1);
    return push_order(L, o->n, o->first, o->span, o->shuffle, o->seed, 2);
}

/* order:describe() -> {n =, seed = (when shuffled), runs =, window = {first,
 * span}}: what ds.data.order takes to make the same order again */
static int order_describe(lua_State *L) {
    const ds_order *o = check_order(L, 1);
    lua_createtable(L, 0, 4);
    lua_pushnumber(L, (lua_Number)o->n);
    lua_setfield(L, -2, "n");
    if (o->shuffle) {
        lua_pushnumber(L, (lua_Number)o->seed);
        lua_setfield(L, -2, "seed");
    }
    lua_createtable(L, o->nruns, 0);
    for (int k = 0; k < o->nruns; k++) {
        const int64_t v[4] = { o->runs[k].start, o->runs[k].stride, o->runs[k].block, o->runs[k].count };
        lua_createtable(L, 4, 0);
        for (int f = 0; f < 4; f++) {
            lua_pushnumber(L, (lua_Number)v[f]);
            lua_rawseti(L, -2, f + 1);
        }
        lua_rawseti(L, -2, k + 1);
    }
    lua_setfield(L, -2, "runs");
    lua_createtable(L, 2, 0);
    lua_pushnumber(L, (lua_Number)o->first);
    lua_rawseti(L, -2, 1);
    lua_pushnumber(L, (lua_Number)o->span);
    lua_rawseti(L, -2, 2);
    lua_setfield(L, -2, "window");
    return 1;
}

/* order:domain() -> n: the indices are in [0, n) */
static int order_domain(lua_State *L) {
    lua_pushnumber(L, (lua_Number)check_order(L, 1)->n);
    return 1;
}

/* order:totable() -> the indices as a Lua list (0-based values) */
static int order_totable(lua_State *L) {
    const ds_order *o = check_order(L, 1);
    if (o->len > INT32_MAX) return luaL_error(L, "order:totable: %f indices do not fit a Lua list", (lua_Number)o->len);
    lua_createtable(L, (int)o->len, 0);
    for (int64_t k = 0; k < o->len; k++) {
        int64_t v;
        ds_order_fill(o, k, 1, &v);
        lua_pushnumber(L, (lua_Number)v);
        lua_rawseti(L, -2, (int)k + 1);
    }
    return 1;
}

/* order:tensor() -> the indices as an i64 tensor */
static int order_tensor(lua_State *L) {
    const ds_order *o = check_order(L, 1);
    int64_t len = o->len;
    ds_tensor *t = ds_tensor_new(1, &len, DS_I64, DS_CPU_DEVICE);
    if (t) ds_order_fill(o, 0, len, ds_tensor_data(t));
    return dsL_pushtensor(L, t);
}

/* device(name) -> the device's name ('cuda' is 'cuda:0'), when it is
 * available here; else an error saying why */
static int l_device(lua_State *L) {
    ds_device dev;
    if (ds_device_parse(luaL_checkstring(L, 1), &dev) || ds_device_check("device", dev)) return dsL_error(L);
    char name[16];
    ds_device_name(dev, name, sizeof name);
    lua_pushstring(L, name);
    return 1;
}

/* loader(dataset, num_workers, depth [, device]) -> loader whose batches
 * are on device (default 'cpu') */
static int l_loader(lua_State *L) {
    ds_dataset *d = check_dataset(L, 1);
    int workers = (int)luaL_checkinteger(L, 2), depth = (int)luaL_checkinteger(L, 3);
    ds_device dev = DS_CPU_DEVICE;
    if (!lua_isnoneornil(L, 4) && ds_device_parse(luaL_checkstring(L, 4), &dev)) return dsL_error(L);
    ds_loader **p = dsL_newhandle(L, LOADER_MT);
    *p = ds_loader_new(d, workers, depth, dev);
    if (!*p) return dsL_error(L);
    return 1;
}

/* submit(loader, dataset, indices [, start, count]) */
static int l_submit(lua_State *L) {
    ds_loader *l = check_loader(L, 1);
    ds_dataset *d = check_dataset(L, 2);
    lua_settop(L, 5);
    int64_t n;
    int64_t *idx = check_indices(L, 3, d, &n);
    if (ds_loader_submit(l, idx, n)) return dsL_error(L);
    return 0;
}

/* next(loader, dataset) -> the oldest submitted batch */
static int l_next(lua_State *L) {
    ds_loader *l = check_loader(L, 1);
    ds_dataset *d = check_dataset(L, 2);
    ds_tensor *out[DS_DATASET_MAX_FIELDS];
    if (ds_loader_next(l, out)) return dsL_error(L);
    return push_batch(L, d, out, false);
}

static int l_queued(lua_State *L) {
    lua_pushinteger(L, ds_loader_queued(check_loader(L, 1)));
    return 1;
}

static int l_depth(lua_State *L) {
    lua_pushinteger(L, ds_loader_depth(check_loader(L, 1)));
    return 1;
}

static int l_drain(lua_State *L) {
    ds_loader_drain(check_loader(L, 1));
    return 0;
}

/* close(loader): joins the threads now rather than at collection */
static int l_close(lua_State *L) {
    luaL_checkudata(L, 1, LOADER_MT);
    return loader_gc(L);
}

static const luaL_Reg data_functions[] = {
    {"read_idx", l_read_idx}, {"idx_items", l_idx_items}, {"read_cifar10", l_read_cifar10}, {"shards", l_shards},
    {"char_tokens", l_char_tokens}, {"encode", l_encode}, {"decode", l_decode},
    {"glob", l_glob}, {"is_dir", l_is_dir}, {"read_file", l_read_file},
    {"rows", l_rows}, {"windows", l_windows}, {"len", l_len}, {"gather", l_gather}, {"get", l_get},
    {"permutation", l_permutation}, {"order", l_order}, {"device", l_device},
    {"loader", l_loader}, {"submit", l_submit}, {"next", l_next}, {"queued", l_queued}, {"depth", l_depth},
    {"drain", l_drain}, {"close", l_close},
    {NULL, NULL}
};

void dsL_open_data(lua_State *L) {
    luaL_newmetatable(L, DATASET_MT);
    lua_pushcfunction(L, dataset_gc);
    lua_setfield(L, -2, "__gc");
    lua_pop(L, 1);
    luaL_newmetatable(L, LOADER_MT);
    lua_pushcfunction(L, loader_gc);
    lua_setfield(L, -2, "__gc");
    lua_pop(L, 1);
    static const luaL_Reg order_methods[] = {
        {"at", order_at}, {"cut", order_cut}, {"domain", order_domain}, {"totable", order_totable},
        {"tensor", order_tensor}, {"describe", order_describe}, {NULL, NULL}
    };
    luaL_newmetatable(L, ORDER_MT);
    lua_pushcfunction(L, order_len);
    lua_setfield(L, -2, "__len");
    lua_pushcfunction(L, order_eq);
    lua_setfield(L, -2, "__eq");
    dsL_setfuncs(L, "__index", order_methods);
    lua_pop(L, 1);
    dsL_setfuncs(L, "data_core", data_functions);
}
