#include "lua_repl.h"
#include "lua_module.h"

#include <editline/readline.h>
#include <lauxlib.h>
#include <luajit.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static lua_State *repl_state;
static const char *repl_module;     /* the Lua module that runs each input */
static volatile sig_atomic_t prompt_interrupted;

/* Ctrl-C at the prompt drops the line being typed, as shells do. */
static void on_prompt_sigint(int sig) {
    (void)sig;
    prompt_interrupted = 1;
}

/* Ctrl-C while code runs: a hook raises an error at the next call or
 * instruction count, so a runaway loop stops and the prompt comes back.
 * JIT-compiled loops run no hooks, so a second Ctrl-C quits for good. */
static void stop_hook(lua_State *L, lua_Debug *ar) {
    (void)ar;
    lua_sethook(L, NULL, 0, 0);
    luaL_error(L, "interrupted");
}

static void on_sigint(int sig) {
    static const char hint[] = "\n(interrupting; Ctrl-C again quits)\n";
    signal(sig, SIG_DFL);
    if (write(STDERR_FILENO, hint, sizeof hint - 1) < 0) return;
    lua_sethook(repl_state, stop_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
}

/* Calls <repl_module>.<fn>(arg) and leaves its results on the stack. */
static int call_repl(lua_State *L, const char *fn, const char *arg, int nresults) {
    lua_getglobal(L, "require");
    lua_pushstring(L, repl_module);
    if (dsL_pcall(L, 1, 1) != 0) return -1;
    lua_getfield(L, -1, fn);
    lua_remove(L, -2);
    lua_pushstring(L, arg);
    return dsL_pcall(L, 1, nresults);
}

/* libedit asks for matches of `text`; dslua.live.repl.complete finds them. */
static char **complete(const char *text, int start, int end) {
    (void)start; (void)end;
    lua_State *L = repl_state;
    int top = lua_gettop(L);
    rl_attempted_completion_over = 1;
    if (call_repl(L, "complete", text, 1) != 0 || !lua_istable(L, -1)) { lua_settop(L, top); return NULL; }
    int n = (int)lua_objlen(L, -1);
    if (n == 0) { lua_settop(L, top); return NULL; }
    char **m = calloc((size_t)n + 2, sizeof *m);
    if (!m) { lua_settop(L, top); return NULL; }
    /* m[0] is the longest common prefix, which libedit inserts */
    for (int i = 1; i <= n; i++) {
        lua_rawgeti(L, -1, i);
        m[i] = strdup(lua_tostring(L, -1) ? lua_tostring(L, -1) : "");
        lua_pop(L, 1);
    }
    size_t len = strlen(m[1]);
    for (int i = 2; i <= n; i++) {
        size_t k = 0;
        while (k < len && m[i][k] == m[1][k]) k++;
        len = k;
    }
    m[0] = strndup(m[1], len);
    if (n == 1) { free(m[1]); m[1] = NULL; }
    lua_settop(L, top);
    return m;
}

static char *history_path(void) {
    const char *p = getenv("DSLUA_HISTORY");
    if (p && *p) return strdup(p);
    const char *home = getenv("HOME");
    if (!home) return NULL;
    size_t n = strlen(home) + 32;
    char *s = malloc(n);
    if (s) snprintf(s, n, "%s/.dslua_history", home);
    return s;
}

int dsL_repl_init(lua_State *L) {
    repl_module = "dslua.live.repl";
    return call_repl(L, "init", "", 0);
}

void dsL_repl(lua_State *L) {
    printf("dslua %s (%s) -- `ds` is loaded; Ctrl-D exits\n", DSLUA_VERSION, LUAJIT_VERSION);
    if (dsL_repl_init(L) != 0) {
        fprintf(stderr, "%s\n", lua_tostring(L, -1));
        lua_pop(L, 1);
    }
    dsL_repl_loop(L, "dslua.live.repl", "ds> ");
}

void dsL_repl_loop(lua_State *L, const char *module, const char *prompt) {
    repl_state = L;
    repl_module = module;
    char *hist = history_path();
    using_history();
    stifle_history(1000);
    if (hist) read_history(hist);
    rl_attempted_completion_function = complete;
    rl_basic_word_break_characters = " \t\n\"'`@$><=;|&{(,+-*/%^~#";
    rl_completion_append_character = '\0';

    char *buffer = NULL;
    struct sigaction at_prompt = {0};
    at_prompt.sa_handler = on_prompt_sigint;
    for (;;) {
        sigaction(SIGINT, &at_prompt, NULL);
        prompt_interrupted = 0;
        char *line = readline(buffer ? ".. " : prompt);
        if (prompt_interrupted) {
            free(line);
            free(buffer);
            buffer = NULL;
            putchar('\n');
            continue;
        }
        if (!line) break;
        size_t old = buffer ? strlen(buffer) : 0;
        char *joined = realloc(buffer, old + strlen(line) + 2);
        if (!joined) { free(line); break; }
        if (old) joined[old++] = '\n';
        strcpy(joined + old, line);
        buffer = joined;
        free(line);

        struct sigaction sa = {0}, prev;
        sa.sa_handler = on_sigint;
        sigaction(SIGINT, &sa, &prev);
        int rc = call_repl(L, "step", buffer, 1);
        sigaction(SIGINT, &prev, NULL);
        lua_sethook(L, NULL, 0, 0);
        bool incomplete = rc == 0 && lua_toboolean(L, -1);
        if (rc != 0) fprintf(stderr, "%s\n", lua_tostring(L, -1));
        lua_pop(L, 1);
        if (incomplete) continue;
        if (strspn(buffer, " \t\n") < strlen(buffer)) {
            add_history(buffer);
            if (hist) write_history(hist);
        }
        free(buffer);
        buffer = NULL;
    }
    free(buffer);
    free(hist);
    putchar('\n');
}
