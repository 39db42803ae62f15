/* What live reload needs from C (dslua/live/reload.lua) besides the SHA-256
 * that names a version (core.ckpt.sha256): a cheap look at a file's
 * metadata for the per-step check, and strings as u8 tensors so
 * collectives can carry them.
 *
 *   core._reload.stat(path)     -> signature string (mtime, size, inode) or nil, why
 *   core._reload.to_bytes(s)    -> u8 tensor of s's bytes
 *   core._reload.from_bytes(t)  -> the string of a contiguous CPU u8 tensor
 *   core._reload.sleep(seconds)
 *   core._reload.pcall_budget(seconds, fn, ...) -> pcall(fn, ...), stopped
 *       with an error once seconds of wall-clock time have passed
 */
#include "lua_tensor.h"
#include "ds_error.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

/* Modification time to the nanosecond, size and inode: an edit in place
 * changes the first two, an editor's write-and-rename the inode. */
static int l_stat(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    struct stat st;
    if (stat(path, &st) != 0) {
        lua_pushnil(L);
        lua_pushstring(L, strerror(errno));
        return 2;
    }
    char sig[96];
    snprintf(sig, sizeof sig, "%lld.%09ld %lld %llu", (long long)st.st_mtim.tv_sec, (long)st.st_mtim.tv_nsec,
             (long long)st.st_size, (unsigned long long)st.st_ino);
    lua_pushstring(L, sig);
    return 1;
}

static int l_to_bytes(lua_State *L) {
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    int64_t shape[1] = { (int64_t)n };
    ds_tensor *t = ds_tensor_new(1, shape, DS_U8, DS_CPU_DEVICE);
    if (!t) return dsL_error(L);
    if (n) memcpy(ds_tensor_data(t), s, n);
    return dsL_pushtensor(L, t);
}

static int l_from_bytes(lua_State *L) {
    ds_tensor *t = dsL_checktensor(L, 1);
    if (t->dtype != DS_U8 || ds_tensor_device(t).type != DS_DEV_CPU || !ds_tensor_is_contiguous(t))
        return luaL_error(L, "from_bytes: expected a contiguous CPU u8 tensor, got %s on %s", ds_dtype_name(t->dtype),
                          ds_tensor_device(t).type == DS_DEV_CPU ? "the CPU" : "a GPU");
    int64_t n = ds_tensor_numel(t);
    lua_pushlstring(L, n ? (const char *)ds_tensor_data(t) : "", (size_t)n);
    return 1;
}

static int l_sleep(lua_State *L) {
    lua_Number s = luaL_checknumber(L, 1);
    if (!(s >= 0 && s <= 3600)) return luaL_error(L, "sleep: seconds must be in [0, 3600], got %f", s);
    struct timespec ts = { (time_t)s, (long)((s - (lua_Number)(time_t)s) * 1e9) };
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
    return 0;
}

/* The budget of the user code running now: a count hook compares the
 * clock with the deadline (it runs in the interpreter only: the loader of
 * user code turns the JIT off for it). Past the deadline it raises at
 * every instruction, naming where it first stopped the code (code that
 * catches the error meets it again, wherever it goes on). Nested calls
 * keep the earlier deadline; the hook in place before (the REPL's Ctrl-C)
 * comes back after. */
static double budget_deadline, budget_seconds;
static bool budget_passed;
static char budget_where[160];        /* where the code was when the deadline passed */

static double monotonic(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void budget_hook(lua_State *L, lua_Debug *ar) {
    (void)ar;
    if (monotonic() < budget_deadline) return;
    if (!budget_passed) {
        lua_Debug at;
        budget_passed = true;
        budget_where[0] = '\0';
        if (lua_getstack(L, 0, &at) && lua_getinfo(L, "Sl", &at) && at.currentline > 0)
            snprintf(budget_where, sizeof budget_where, ", stopped at %s:%d", at.short_src, at.currentline);
        lua_sethook(L, budget_hook, LUA_MASKCOUNT, 1);
    }
    /* the place is in the message: no luaL_error prefix (its caller's line) */
    lua_pushfstring(L, "ran past its time budget of %f s (reload.budget)%s", budget_seconds, budget_where);
    lua_error(L);
}

static int l_pcall_budget(lua_State *L) {
    lua_Number s = luaL_checknumber(L, 1);
    if (!(s > 0 && s <= 86400)) return luaL_error(L, "pcall_budget: seconds must be in (0, 86400], got %f", s);
    luaL_checktype(L, 2, LUA_TFUNCTION);
    lua_Hook old_hook = lua_gethook(L);
    int old_mask = lua_gethookmask(L), old_count = lua_gethookcount(L);
    double old_deadline = budget_deadline, old_seconds = budget_seconds, deadline = monotonic() + s;
    if (!(old_deadline > 0 && old_deadline < deadline)) budget_deadline = deadline, budget_seconds = s;
    lua_sethook(L, budget_hook, LUA_MASKCOUNT, 1000);
    int rc = lua_pcall(L, lua_gettop(L) - 2, LUA_MULTRET, 0);
    lua_sethook(L, old_hook, old_mask, old_count);
    budget_deadline = old_deadline, budget_seconds = old_seconds;
    if (!old_deadline) budget_passed = false;
    lua_pushboolean(L, rc == 0);
    lua_replace(L, 1);
    return lua_gettop(L);
}

void dsL_open_reload(lua_State *L) {
    static const luaL_Reg fns[] = {
        {"stat", l_stat}, {"to_bytes", l_to_bytes}, {"from_bytes", l_from_bytes},
        {"sleep", l_sleep}, {"pcall_budget", l_pcall_budget}, {NULL, NULL}
    };
    dsL_setfuncs(L, "_reload", fns);
}
