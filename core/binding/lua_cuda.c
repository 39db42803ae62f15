/* Devices from Lua: t:cuda(), t:cpu(), t:is_cuda(), ds.device() (this
 * rank's device) and ds.cuda.* (availability, synchronisation, the caching
 * allocator, TF32, the attention kernel). The same in a CPU-only build, where there are no GPUs. */
#include "lua_tensor.h"
#include "ds_cuda.h"
#include "ds_rank_device.h"

/* t:cuda([device]): device is an index (0-based, as in 'cuda:0') or a
 * name 'cuda:N'; by default this rank's GPU. */
static int l_cuda(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    ds_device dev = { DS_DEV_CUDA, 0 };
    if (lua_type(L, 2) == LUA_TSTRING) {
        if (ds_device_parse(lua_tostring(L, 2), &dev)) return dsL_error(L);
        if (dev.type != DS_DEV_CUDA) return luaL_error(L, "cuda: '%s' is not a CUDA device", lua_tostring(L, 2));
    } else if (!lua_isnoneornil(L, 2)) {
        lua_Integer i = luaL_checkinteger(L, 2);
        if (i < 0 || i > 1 << 20) return luaL_error(L, "cuda: device index %d is out of range", (int)i);
        dev.index = (int)i;
    } else {
        dev.index = ds_rank_device_index(ds_cuda_device_count());
    }
    if (ds_cuda_check_device("cuda", dev.index)) return dsL_error(L);
    return dsL_pushtensor(L, ds_to_device(t, dev));
}

static int l_cpu(lua_State *L) { return dsL_pushtensor(L, ds_to_device(dsL_checktensor(L, 1), DS_CPU_DEVICE)); }

static int l_is_cuda(lua_State *L) {
    lua_pushboolean(L, ds_tensor_device(dsL_checkmeta(L, 1)).type == DS_DEV_CUDA);
    return 1;
}

/* ds.device(): this rank's device (core/cuda/ds_rank_device.h: the
 * --device flag, DSLUA_DEVICE, else its GPU when the process sees one,
 * else 'cpu'), said once per process on stderr. ds.device(name) chooses
 * as `--device name` does (dslua/init.lua passes ds.args.device);
 * ds.device(t) is t:device(). */
static int l_device(lua_State *L) {
    ds_tensor *t = dsL_totensor(L, 1);
    ds_device d;
    if (t) d = ds_tensor_device(t);
    else if (ds_rank_device(luaL_optstring(L, 1, NULL), &d)) return dsL_error(L);
    char name[16];
    ds_device_name(d, name, sizeof name);
    lua_pushstring(L, name);
    return 1;
}

/* ds.cuda.is_built(): whether this binary has the CUDA backend at all */
static int l_is_built(lua_State *L) {
    lua_pushboolean(L, ds_cuda_built());
    return 1;
}

static int l_is_available(lua_State *L) {
    lua_pushboolean(L, ds_cuda_device_count() > 0);
    return 1;
}

static int l_device_count(lua_State *L) {
    lua_pushinteger(L, ds_cuda_device_count());
    return 1;
}

/* ds.cuda.unavailable_reason(): why there is no GPU ("" when there is) */
static int l_unavailable_reason(lua_State *L) {
    lua_pushstring(L, ds_cuda_device_count() > 0 ? "" : ds_cuda_unavailable_reason());
    return 1;
}

static int l_synchronize(lua_State *L) {
    if (ds_cuda_synchronize()) return dsL_error(L);
    return 0;
}

/* ds.cuda.memory_info([index]): the caching allocator of cuda:index
 * (default this rank's): allocated bytes and their peak, cached bytes, cudaMalloc calls,
 * cache hits; and the page-locked host memory of every device's uploads:
 * pinned bytes held, cudaHostAlloc calls. */
static int l_memory_info(lua_State *L) {
    int index = lua_isnoneornil(L, 1) ? ds_rank_device_index(ds_cuda_device_count()) : (int)luaL_checkinteger(L, 1);
    ds_cuda_mem_info m;
    if (ds_cuda_memory_info(index, &m)) return dsL_error(L);
    lua_createtable(L, 0, 7);
    dsL_setnumber(L, "allocated", (lua_Number)m.allocated);
    dsL_setnumber(L, "peak", (lua_Number)m.peak);
    dsL_setnumber(L, "cached", (lua_Number)m.cached);
    dsL_setnumber(L, "device_allocs", (lua_Number)m.device_allocs);
    dsL_setnumber(L, "cache_hits", (lua_Number)m.cache_hits);
    dsL_setnumber(L, "pinned", (lua_Number)m.pinned);
    dsL_setnumber(L, "pinned_allocs", (lua_Number)m.pinned_allocs);
    return 1;
}

/* ds.cuda.shared(): {gpu, first, last} when this host has more ranks than
 * GPUs (this rank's GPU, the world ranks first to last on it), else nil */
static int l_shared(lua_State *L) {
    int first, last, gpu;
    if (!ds_rank_device_shared(&first, &last, &gpu)) return 0;
    lua_createtable(L, 0, 3);
    lua_pushinteger(L, gpu);
    lua_setfield(L, -2, "gpu");
    lua_pushinteger(L, first);
    lua_setfield(L, -2, "first");
    lua_pushinteger(L, last);
    lua_setfield(L, -2, "last");
    return 1;
}

/* ds.cuda.reset_peak([index]): memory_info's peak starts again from now */
static int l_reset_peak(lua_State *L) {
    int index = lua_isnoneornil(L, 1) ? ds_rank_device_index(ds_cuda_device_count()) : (int)luaL_checkinteger(L, 1);
    if (ds_cuda_reset_peak(index)) return dsL_error(L);
    return 0;
}

static int l_empty_cache(lua_State *L) {
    (void)L;
    ds_cuda_empty_cache();
    return 0;
}

/* ds.cuda.allow_tf32([on [, use]]): sets (with a boolean) and returns the
 * switch of use 'matmul' (f32 GEMMs) or 'cudnn'
 * (convolutions); without use, sets both and returns matmul's. */
static int l_allow_tf32(lua_State *L) {
    static const char *const uses[] = { "matmul", "cudnn", NULL };
    bool both = lua_isnoneornil(L, 2);
    int on = -1, use = both ? 0 : luaL_checkoption(L, 2, NULL, uses);
    if (!lua_isnoneornil(L, 1)) {
        luaL_checktype(L, 1, LUA_TBOOLEAN);
        on = lua_toboolean(L, 1);
    }
    if (both) ds_cuda_allow_tf32(true, on);
    lua_pushboolean(L, ds_cuda_allow_tf32(use == 1, on));
    return 1;
}

/* ds.cuda.allow_wgmma([on]): sets (with a boolean) and returns whether bf16
 * and f16 attention forwards and backwards may run on Hopper's wgmma
 * kernels. */
static int l_allow_wgmma(lua_State *L) {
    int on = -1;
    if (!lua_isnoneornil(L, 1)) {
        luaL_checktype(L, 1, LUA_TBOOLEAN);
        on = lua_toboolean(L, 1);
    }
    lua_pushboolean(L, ds_cuda_allow_wgmma(on));
    return 1;
}

/* ds.cuda.attention_kernel(dtype, head_dim[, pass]): 'wgmma-tma', 'wgmma'
 * or 'mma.sync', the kernel such an attention forward (pass 'forward', the
 * default) or backward ('backward') runs on this rank's GPU, and why not
 * the pass's first choice (its kernels fed by TMA) where it is not. */
static int l_attention_kernel(lua_State *L) {
    static const char *const passes[] = { "forward", "backward", NULL };
    ds_dtype dt = dsL_checkdtype(L, 1, DS_BF16);
    int D = (int)luaL_checkinteger(L, 2), backward = luaL_checkoption(L, 3, "forward", passes);
    const char *why = "";
    const char *k = ds_cuda_attention_kernel(dt, D, backward == 1, &why);
    if (!k) return dsL_error(L);
    lua_pushstring(L, k);
    if (!*why) return 1;
    lua_pushstring(L, why);
    return 2;
}

static const luaL_Reg tensor_methods[] = {
    {"cuda", l_cuda}, {"cpu", l_cpu}, {"is_cuda", l_is_cuda}, {NULL, NULL}
};

static const luaL_Reg cuda_functions[] = {
    {"is_built", l_is_built}, {"is_available", l_is_available}, {"device_count", l_device_count},
    {"unavailable_reason", l_unavailable_reason}, {"synchronize", l_synchronize},
    {"memory_info", l_memory_info}, {"reset_peak", l_reset_peak}, {"empty_cache", l_empty_cache}, {"allow_tf32", l_allow_tf32},
    {"shared", l_shared}, {"allow_wgmma", l_allow_wgmma}, {"attention_kernel", l_attention_kernel}, {NULL, NULL}
};

void dsL_open_cuda(lua_State *L) {
    luaL_getmetatable(L, DSL_TENSOR_MT);
    lua_getfield(L, -1, "methods");
    luaL_register(L, NULL, tensor_methods);
    lua_pop(L, 2);
    lua_pushcfunction(L, l_device);
    lua_setfield(L, -2, "device");
    dsL_setfuncs(L, "cuda", cuda_functions);
}
