/* Training curves as a PNG (core/io/ds_plot.h), as ds.core.plot:
 *
 *   plot.png(path, xlabel, {{name = s, x = {...}, y = {...} [, label = s]}...} [, width, height])
 *
 * Consecutive entries of the same name are curves of one panel, each in
 * its colour, their labels in a legend.
 * Every failure raises with the core's message, which names the file. */
#include "lua_tensor.h"
#include "ds_plot.h"

/* t[key] (a list of numbers) into a new userdata buffer left on the stack */
static double *numbers(lua_State *L, int t, const char *key, size_t *n) {
    lua_getfield(L, t, key);
    if (!lua_istable(L, -1)) luaL_error(L, "plot: panel.%s must be a list of numbers", key);
    int list = lua_gettop(L);
    *n = lua_objlen(L, list);
    double *v = lua_newuserdata(L, sizeof *v * (*n ? *n : 1));
    for (size_t i = 0; i < *n; i++) {
        lua_rawgeti(L, list, (int)i + 1);
        if (!lua_isnumber(L, -1)) luaL_error(L, "plot: panel.%s[%d] is not a number", key, (int)i + 1);
        v[i] = lua_tonumber(L, -1);
        lua_pop(L, 1);
    }
    return v;
}

static int l_png(lua_State *L) {
    const char *path = luaL_checkstring(L, 1), *xlabel = luaL_checkstring(L, 2);
    luaL_checktype(L, 3, LUA_TTABLE);
    int width = (int)luaL_optinteger(L, 4, 900), height = (int)luaL_optinteger(L, 5, 640);
    int np = (int)lua_objlen(L, 3);
    lua_settop(L, 5);
    /* the buffers stay on the stack (Lua owns them) until ds_plot_png returns */
    ds_plot_series *panels = lua_newuserdata(L, sizeof *panels * (size_t)(np ? np : 1));
    for (int i = 0; i < np; i++) {
        lua_rawgeti(L, 3, i + 1);
        if (!lua_istable(L, -1)) return luaL_error(L, "plot: panel %d must be a table", i + 1);
        int t = lua_gettop(L);
        lua_getfield(L, t, "name");
        panels[i].name = luaL_checkstring(L, -1);
        lua_getfield(L, t, "label");
        panels[i].label = lua_isnil(L, -1) ? NULL : luaL_checkstring(L, -1);
        size_t nx, ny;
        panels[i].x = numbers(L, t, "x", &nx);
        panels[i].y = numbers(L, t, "y", &ny);
        if (nx != ny) return luaL_error(L, "plot: panel %d has %d x and %d y values", i + 1, (int)nx, (int)ny);
        panels[i].n = nx;
    }
    if (ds_plot_png(path, xlabel, panels, np, width, height)) return dsL_error(L);
    return 0;
}

static const luaL_Reg plot_fns[] = {{"png", l_png}, {NULL, NULL}};

void dsL_open_plot(lua_State *L) {
    dsL_setfuncs(L, "plot", plot_fns);
}
