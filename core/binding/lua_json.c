/* ds.json decoding, over Debian's cJSON (encoding is in lua/dslua/base/json.lua).
 *
 * DeepSpeed reads its config with hjson, so config files in the wild carry
 * comments (#, // and block comments) and trailing commas. A first pass
 * blanks those with spaces, keeping every offset, so a syntax error still
 * points at the right line and column. cJSON keeps duplicate keys; they are
 * errors naming their key path, as DeepSpeed's
 * dict_raise_error_on_duplicate_keys makes them. Objects become tables,
 * arrays tables with the json array metatable (so they encode back as arrays
 * even when empty), null the json.null sentinel (a NULL light userdata). */
#include "lua_tensor.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>

#define JSON_ARRAY_MT "dslua.json.array"

/* The offset just past the string that opens at s[i]. */
static size_t skip_string(const char *s, size_t n, size_t i) {
    for (i++; i < n && s[i] != '"'; i++)
        if (s[i] == '\\') i++;
    return i < n ? i + 1 : n;
}

/* Blanks comments and trailing commas in s[0..n) in place. Returns the
 * offset of an unterminated block comment, or n when all is well. */
static size_t blank_extensions(char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (s[i] == '"') {
            i = skip_string(s, n, i);
        } else if (s[i] == '#' || (s[i] == '/' && i + 1 < n && s[i + 1] == '/')) {
            while (i < n && s[i] != '\n') s[i++] = ' ';
        } else if (s[i] == '/' && i + 1 < n && s[i + 1] == '*') {
            size_t start = i;
            s[i++] = ' ';
            s[i++] = ' ';
            while (i < n && !(s[i] == '*' && i + 1 < n && s[i + 1] == '/')) {
                if (s[i] != '\n') s[i] = ' ';
                i++;
            }
            if (i >= n) return start;
            s[i++] = ' ';
            s[i++] = ' ';
        } else {
            i++;
        }
    }
    /* comments are gone, so the next non-blank after a comma is plain */
    for (i = 0; i < n;) {
        if (s[i] == '"') { i = skip_string(s, n, i); continue; }
        if (s[i] == ',') {
            size_t j = i + 1;
            while (j < n && (unsigned char)s[j] <= ' ') j++;
            if (j < n && (s[j] == '}' || s[j] == ']')) s[i] = ' ';
        }
        i++;
    }
    return n;
}

/* The offset of a \u0000 escape inside a string of s[0..n), or n: cJSON
 * keeps strings as C strings, so "a\u0000b" would silently become "a". */
static size_t find_nul_escape(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '"') continue;
        size_t end = skip_string(s, n, i);
        for (size_t k = i + 1; k + 5 < end; k++) {
            if (s[k] != '\\') continue;
            if (s[k + 1] == 'u' && strncmp(s + k + 2, "0000", 4) == 0) return k;
            k++;                        /* the escaped character */
        }
        i = end - 1;
    }
    return n;
}

/* "source:line:col: what" for the byte at offset pos of text. */
static int syntax_error(lua_State *L, const char *source, const char *text, size_t n,
                        size_t pos, const char *what) {
    int line = 1, col = 1;
    for (size_t k = 0; k < pos && k < n; k++) {
        if (text[k] == '\n') { line++; col = 1; } else col++;
    }
    if (pos >= n)
        return luaL_error(L, "%s:%d:%d: %s: unexpected end of text", source, line, col, what);
    char near[24];
    size_t k = 0;
    while (k < sizeof near - 1 && pos + k < n && text[pos + k] != '\n' && text[pos + k] != '\r') {
        near[k] = text[pos + k];
        k++;
    }
    near[k] = '\0';
    return luaL_error(L, "%s:%d:%d: %s near '%s'", source, line, col, what, near);
}

typedef struct {
    int dups;                                  /* stack index of the duplicate list */
    int depth;
    struct { const char *key; int index; } path[CJSON_NESTING_LIMIT + 2];
} decoder;

/* Appends "a.b[2].c: duplicate key" to the duplicate list. */
static void note_duplicate(lua_State *L, decoder *d, const char *key) {
    char buf[1024];
    size_t len = 0;
    for (int k = 0; k <= d->depth && len < sizeof buf; k++) {
        const char *seg = k < d->depth ? d->path[k].key : key;
        int w = seg ? snprintf(buf + len, sizeof buf - len, "%s%s", len ? "." : "", seg)
                    : snprintf(buf + len, sizeof buf - len, "[%d]", d->path[k].index);
        if (w > 0) len += (size_t)w;
    }
    lua_pushfstring(L, "%s: duplicate key", buf);
    lua_rawseti(L, d->dups, (int)lua_objlen(L, d->dups) + 1);
}

static void push_value(lua_State *L, decoder *d, const cJSON *item) {
    luaL_checkstack(L, 4, "json: nesting too deep");
    if (cJSON_IsNull(item)) {
        lua_pushlightuserdata(L, NULL);
    } else if (cJSON_IsBool(item)) {
        lua_pushboolean(L, cJSON_IsTrue(item));
    } else if (cJSON_IsNumber(item)) {
        lua_pushnumber(L, item->valuedouble);
    } else if (cJSON_IsString(item)) {
        lua_pushstring(L, item->valuestring);
    } else if (cJSON_IsArray(item)) {
        lua_createtable(L, cJSON_GetArraySize(item), 0);
        int i = 0;
        for (const cJSON *c = item->child; c; c = c->next, i++) {
            d->path[d->depth].key = NULL;
            d->path[d->depth].index = i;
            d->depth++;
            push_value(L, d, c);
            d->depth--;
            lua_rawseti(L, -2, i + 1);
        }
        luaL_getmetatable(L, JSON_ARRAY_MT);
        lua_setmetatable(L, -2);
    } else {
        lua_createtable(L, 0, cJSON_GetArraySize(item));
        for (const cJSON *c = item->child; c; c = c->next) {
            lua_pushstring(L, c->string);
            lua_rawget(L, -2);
            if (!lua_isnil(L, -1)) note_duplicate(L, d, c->string);
            lua_pop(L, 1);
            lua_pushstring(L, c->string);
            d->path[d->depth].key = c->string;
            d->depth++;
            push_value(L, d, c);
            d->depth--;
            lua_rawset(L, -3);          /* the later value wins, as in Python */
        }
    }
}

/* Under pcall: (root, decoder) -> value, duplicate list. */
static int build(lua_State *L) {
    const cJSON *root = lua_touserdata(L, 1);
    decoder *d = lua_touserdata(L, 2);
    lua_newtable(L);
    d->dups = lua_gettop(L);
    d->depth = 0;
    push_value(L, d, root);
    lua_pushvalue(L, d->dups);
    return 2;
}

/* decode(text [, source [, keep_duplicates]]) -> value
 * With keep_duplicates, duplicate keys are not raised but returned as a
 * second value: a list of "key.path: duplicate key" lines. */
static int l_decode(lua_State *L) {
    size_t n;
    const char *text = luaL_checklstring(L, 1, &n);
    const char *source = luaL_optstring(L, 2, "json");
    bool keep = lua_toboolean(L, 3);
    size_t skip = n >= 3 && memcmp(text, "\xEF\xBB\xBF", 3) == 0 ? 3 : 0;   /* a UTF-8 BOM */
    char *buf = lua_newuserdata(L, n + 1);
    memcpy(buf, text, n);
    memset(buf, ' ', skip);
    buf[n] = '\0';
    size_t bad = blank_extensions(buf, n);
    if (bad < n) return syntax_error(L, source, text, n, bad, "unterminated /* comment");
    if ((bad = find_nul_escape(buf, n)) < n)
        return syntax_error(L, source, text, n, bad, "a string holds \\u0000 (NUL), which dslua cannot keep in a key or value");
    size_t start = 0;
    while (start < n && (unsigned char)buf[start] <= ' ') start++;
    if (start == n) return luaL_error(L, "%s: no JSON value in the text", source);

    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(buf, n + 1, &end, 1);
    if (!root) return syntax_error(L, source, text, n, end ? (size_t)(end - buf) : 0, "invalid JSON");
    if ((size_t)(end - buf) != n) {     /* a NUL inside the text ended the parse */
        cJSON_Delete(root);
        return syntax_error(L, source, text, n, (size_t)(end - buf), "invalid JSON");
    }
    decoder *d = lua_newuserdata(L, sizeof *d);
    lua_pushcfunction(L, build);
    lua_pushlightuserdata(L, root);
    lua_pushlightuserdata(L, d);
    int rc = lua_pcall(L, 2, 2, 0);
    cJSON_Delete(root);
    if (rc != 0) return dsL_raw_error(L);
    if (keep) return 2;
    int ndup = (int)lua_objlen(L, -1);
    if (ndup == 0) { lua_pop(L, 1); return 1; }
    int list = lua_gettop(L);
    lua_pushliteral(L, "");
    for (int k = 1; k <= ndup; k++) {
        lua_pushfstring(L, "%s%s: ", k > 1 ? "\n" : "", source);
        lua_rawgeti(L, list, k);
        lua_concat(L, 3);
    }
    return dsL_raw_error(L);
}

/* array(t) -> t, marked to encode as a JSON array even when empty */
static int l_array(lua_State *L) {
    if (lua_isnoneornil(L, 1)) {
        lua_settop(L, 0);
        lua_newtable(L);
    }
    luaL_checktype(L, 1, LUA_TTABLE);
    lua_settop(L, 1);
    luaL_getmetatable(L, JSON_ARRAY_MT);
    lua_setmetatable(L, 1);
    return 1;
}

/* is_array(v) -> whether v carries the array mark */
static int l_is_array(lua_State *L) {
    bool yes = false;
    if (lua_type(L, 1) == LUA_TTABLE && lua_getmetatable(L, 1)) {
        luaL_getmetatable(L, JSON_ARRAY_MT);
        yes = lua_rawequal(L, -1, -2);
    }
    lua_pushboolean(L, yes);
    return 1;
}

void dsL_open_json(lua_State *L) {
    static const luaL_Reg fns[] = {
        {"decode", l_decode}, {"array", l_array}, {"is_array", l_is_array}, {NULL, NULL},
    };
    luaL_newmetatable(L, JSON_ARRAY_MT);
    lua_pop(L, 1);
    lua_newtable(L);
    luaL_register(L, NULL, fns);
    lua_pushlightuserdata(L, NULL);
    lua_setfield(L, -2, "null");
    lua_setfield(L, -2, "json");
}
