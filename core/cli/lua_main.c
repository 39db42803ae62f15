/* The dslua executable: `dslua [options] [script [args]]`, behaving like
 * the `lua` interpreter (arg table, varargs, -e, -l, -i) with dslua built
 * in, and a REPL when started alone on a terminal. */
#include "lua_launch.h"
#include "lua_module.h"
#include "lua_repl.h"
#include "ds_threads.h"
#include "ds_comm.h"
#include "ds_env.h"
#include "ds_rankenv.h"
#include "ds_report.h"
#include "ds_attach.h"

#include <lauxlib.h>
#include <lualib.h>
#include <luajit.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char usage[] =
    "usage: dslua [options] [script [args...]]\n"
    "  -e code        run the Lua code, with `ds` and help loaded as in the REPL\n"
    "  -l name        require library 'name' (as a global of that name)\n"
    "  -i             enter the REPL after running the script\n"
    "  -v, --version  print the version\n"
    "  -h, --help     print this help\n"
    "  --report       print the libraries and versions, the GPUs and the features on\n"
    "  --check-config FILE [--world-size N]\n"
    "                 print FILE's DeepSpeed config resolved (every default filled\n"
    "                 in, the batch sizes for N ranks, default 1) or its errors,\n"
    "                 and exit non-zero on errors\n"
    "  --             stop handling options\n"
    "dslua attach [JOB] [--rank R] [-e CODE] [--list]\n"
    "                 a REPL inside a running job (rank 0, or R): read its loss, lr,\n"
    "                 memory and step time, set the lr or schedule, request a\n"
    "                 checkpoint, pause and resume, run code on every rank;\n"
    "                 -e runs CODE and exits; --list shows the running jobs\n"
    "dslua plot <csv file or event dir> [-o curves.png]\n"
    "                 loss and lr against steps as a PNG, from what csv_monitor or\n"
    "                 tensorboard wrote\n"
    "  -              run standard input as a script\n"
    "Launching ranks with mpirun, options before the script as the deepspeed launcher\n"
    "takes them (`dslua -n 2 train.lua --config ds.json`):\n"
    "  -n, --num_gpus, --nproc_per_node N   ranks per host (default: the hostfile's\n"
    "                 slots, else 1)\n"
    "  --hostfile F   the hosts, one `host slots=N` line each (DeepSpeed's format)\n"
    "  --include S, --exclude S   hosts and slots of the hostfile: host1:0,2@host2\n"
    "  --num_nodes N  the first N hosts of the hostfile\n"
    "  --master_addr A, --master_port P   exported to the ranks (default 29500)\n"
    "Under mpirun (this launcher or plain `mpirun -np N dslua script`) each rank sees\n"
    "RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, MASTER_ADDR,\n"
    "MASTER_PORT, and the script gets --local_rank=N after its own arguments.\n"
    "With no script on a terminal, dslua starts a REPL with `ds` loaded.\n"
    "Environment: DSLUA_NUM_THREADS (else OMP_NUM_THREADS) sets CPU threads (default:\n"
    "every core, a rank its share of them); OMP_WAIT_POLICY=ACTIVE lets idle OpenMP\n"
    "threads spin (default PASSIVE: they sleep, leaving the cores to other work);\n"
    "DSLUA_DEVICE (cpu, cuda or cuda:N; a script's --device wins) sets the device\n"
    "ds.device() and the engine use (default: the GPU LOCAL_RANK picks, else cpu);\n"
    "DSLUA_HISTORY names the REPL history file (default ~/.dslua_history).\n";

/* ------------------------------------------------------------ stop signals */

/* What a stop signal's handler needs, made before any comes (the handler
 * uses no stdio): a rank's "[rank N] " (empty: not under mpirun) and the
 * /proc stat file of the launcher that started the job (empty: none). */
static char stop_prefix[32], launcher_stat[40];

static void put(char *b, size_t n, size_t *at, const char *s) {
    while (*s && *at + 1 < n) b[(*at)++] = *s++;
}

/* Whether the launcher has ended (gone, or a zombie its parent has not
 * reaped yet), with async-signal-safe calls only. */
static bool launcher_ended(void) {
    char buf[256];
    int fd = open(launcher_stat, O_RDONLY);
    if (fd < 0) return true;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return true;
    buf[n] = '\0';
    const char *paren = strrchr(buf, ')');
    return paren && paren[1] == ' ' && paren[2] == 'Z';
}

/* SIGTERM or SIGHUP: the attach sockets go, a rank says who stopped it
 * (mpirun passes on what ended it: its own signal, or the launcher's
 * death), and the signal ends the process. */
static void on_stop(int sig, siginfo_t *info, void *ctx) {
    (void)ctx;
    ds_attach_unlink_all();
    if (stop_prefix[0]) {
        char msg[256], pid[16];
        size_t at = 0, k = sizeof pid - 1;
        pid[k] = '\0';
        long v = info->si_pid > 0 ? info->si_pid : 0;
        do pid[--k] = (char)('0' + v % 10); while ((v /= 10) && k > 0);
        put(msg, sizeof msg, &at, stop_prefix);
        put(msg, sizeof msg, &at, sig == SIGTERM ? "stopped by SIGTERM from pid " : "stopped by SIGHUP from pid ");
        put(msg, sizeof msg, &at, pid + k);
        if (info->si_pid == getppid()) put(msg, sizeof msg, &at, " (mpirun)");
        if (launcher_stat[0] && launcher_ended()) put(msg, sizeof msg, &at, ": the launcher that started the job has ended");
        put(msg, sizeof msg, &at, "\n");
        if (write(STDERR_FILENO, msg, at) < 0) { /* stderr gone: nothing to tell */ }
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

static void catch_stop_signals(void) {
    const char *rank = getenv("OMPI_COMM_WORLD_RANK"), *launcher = getenv("DSLUA_LAUNCHER_PID");
    if (rank) snprintf(stop_prefix, sizeof stop_prefix, "[rank %d] ", atoi(rank));
    if (rank && launcher && atoi(launcher) > 0) snprintf(launcher_stat, sizeof launcher_stat, "/proc/%d/stat", atoi(launcher));
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_stop;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
}

/* A progress bar drawn on the terminal (dslua.io.progress, when loaded) has
 * its line erased, so that the error starts on a line of its own. */
static void clear_progress(lua_State *L) {
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "loaded");
    lua_getfield(L, -1, "dslua.io.progress");
    if (lua_istable(L, -1)) {
        lua_getfield(L, -1, "clear");
        if (lua_pcall(L, 0, 0, 0) != 0) lua_pop(L, 1);
    }
    lua_pop(L, 3);
}

static int report(lua_State *L, int rc) {
    if (rc != 0) clear_progress(L);
    if (rc != 0 && ds_comm_launched()) {
        /* one rank failing ends every rank at once, naming itself */
        fprintf(stderr, "[rank %d] error: %s\n", ds_comm_rank(NULL), lua_tostring(L, -1) ? lua_tostring(L, -1) : "(error)");
        ds_comm_abort(1);
    }
    if (rc != 0) {
        fprintf(stderr, "dslua: %s\n", lua_tostring(L, -1) ? lua_tostring(L, -1) : "(error)");
        lua_pop(L, 1);
    }
    return rc;
}

/* The stack holds the loaded chunk (or its load error) and nargs arguments. */
static int run_chunk(lua_State *L, int loadrc, int nargs) {
    if (loadrc != 0) return report(L, loadrc);
    return report(L, dsL_pcall(L, nargs, 0));
}

/* The global `arg`: arg[0] is the script, arg[1..] its arguments, and the
 * interpreter and options at negative indices, as `lua` sets it. */
static void set_arg_table(lua_State *L, char **argv, int argc, int script) {
    lua_createtable(L, argc - script, script + 1);
    for (int i = 0; i < argc; i++) {
        lua_pushstring(L, argv[i]);
        lua_rawseti(L, -2, i - script);
    }
    lua_setglobal(L, "arg");
}

/* Files next to the script are found by require, before package.path. */
static void add_script_dir(lua_State *L, const char *script) {
    const char *slash = strrchr(script, '/');
    if (!slash) return;
    lua_getglobal(L, "package");
    lua_pushlstring(L, script, (size_t)(slash - script));
    lua_pushvalue(L, -1);
    lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;", lua_tostring(L, -2), lua_tostring(L, -1));
    lua_getfield(L, -4, "path");
    lua_concat(L, 2);
    lua_setfield(L, -4, "path");
    lua_pop(L, 3);
}

static int run_script(lua_State *L, char **argv, int argc, int script) {
    const char *fname = argv[script];
    bool from_stdin = strcmp(fname, "-") == 0;
    set_arg_table(L, argv, argc, script);
    if (!from_stdin) add_script_dir(L, fname);
    if (luaL_loadfile(L, from_stdin ? NULL : fname) != 0) return report(L, 1);
    int nargs = argc - script - 1;
    luaL_checkstack(L, nargs + 3, "too many arguments");
    for (int i = script + 1; i < argc; i++) lua_pushstring(L, argv[i]);
    return run_chunk(L, 0, nargs);
}

/* Under mpirun the script gets --local_rank=N, as DeepSpeed's launcher
 * passes it, unless it has one already: after its own arguments (so
 * positional ones keep their places), before a `--` that ends its options. */
static int run_rank_script(lua_State *L, char **argv, int argc, int script) {
    int at = script + 1;
    for (; at < argc && strcmp(argv[at], "--") != 0; at++) {
        const char *a = argv[at];
        if (strncmp(a, "--local_rank", 12) == 0 || strncmp(a, "--local-rank", 12) == 0)
            if (a[12] == '\0' || a[12] == '=') return run_script(L, argv, argc, script);
    }
    char flag[32];
    snprintf(flag, sizeof flag, "--local_rank=%d", ds_env_local_rank());
    char **v = malloc((size_t)(argc + 1) * sizeof *v);
    if (!v) { fprintf(stderr, "dslua: out of memory\n"); return 1; }
    memcpy(v, argv, (size_t)at * sizeof *v);
    v[at] = flag;
    memcpy(v + at + 1, argv + at, (size_t)(argc - at) * sizeof *v);
    int rc = run_script(L, v, argc + 1, script);
    free(v);
    return rc;
}

/* `--name value` or `--name=value`: true when a is the option, with *value
 * set to its inline value or NULL. */
static bool valued_option(const char *a, const char *name, const char **value) {
    size_t n = strlen(name);
    if (strncmp(a, name, n) != 0 || (a[n] != '\0' && a[n] != '=')) return false;
    *value = a[n] == '=' ? a + n + 1 : NULL;
    return true;
}

/* The deepspeed launcher's options; dslua.parallel.launcher parses them. */
static bool launcher_option(const char *a) {
    static const char *const names[] = { "-n", "--num_gpus", "--num_accelerators", "--nproc_per_node",
                                         "--hostfile", "--include", "--exclude", "--num_nodes",
                                         "--master_addr", "--master_port" };
    const char *value;
    for (size_t k = 0; k < sizeof names / sizeof *names; k++)
        if (valued_option(a, names[k], &value)) return true;
    return false;
}

/* require('dslua.config').check_cli(path, world_size): 0 when valid. */
static int check_config(lua_State *L, const char *path, const char *world_size) {
    lua_getglobal(L, "require");
    lua_pushliteral(L, "dslua.config");
    if (report(L, dsL_pcall(L, 1, 1))) return 1;
    lua_getfield(L, -1, "check_cli");
    lua_pushstring(L, path);
    if (world_size) lua_pushstring(L, world_size); else lua_pushnil(L);
    if (report(L, dsL_pcall(L, 2, 1))) return 1;
    return lua_toboolean(L, -1) ? 0 : 1;
}

/* A subcommand: require(module).main(args), its result on the stack above
 * the module. Nonzero when it raised (reported). */
static int run_subcommand(lua_State *L, const char *module, char **args, int nargs) {
    lua_getglobal(L, "require");
    lua_pushstring(L, module);
    if (report(L, dsL_pcall(L, 1, 1))) return 1;
    lua_getfield(L, -1, "main");
    lua_createtable(L, nargs, 0);
    for (int i = 0; i < nargs; i++) {
        lua_pushstring(L, args[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return report(L, dsL_pcall(L, 1, 1));
}

/* `dslua attach ...`: dslua.live.attach_cli.main(args) returns an exit status,
 * or the prompt of a REPL whose inputs run in the job; leaving it detaches. */
static int attach(lua_State *L, char **args, int nargs) {
    if (run_subcommand(L, "dslua.live.attach_cli", args, nargs)) return 1;
    if (!lua_isstring(L, -1) || lua_isnumber(L, -1)) return (int)lua_tointeger(L, -1);
    char *prompt = strdup(lua_tostring(L, -1));
    if (!prompt) { fprintf(stderr, "dslua: out of memory\n"); return 1; }
    lua_pop(L, 1);
    dsL_repl_loop(L, "dslua.live.attach_cli", prompt);
    free(prompt);
    lua_getfield(L, -1, "detach");
    return report(L, dsL_pcall(L, 0, 0));
}

/* `dslua plot ...`: dslua.io.plot.main(args) returns an exit status. */
static int plot(lua_State *L, char **args, int nargs) {
    if (run_subcommand(L, "dslua.io.plot", args, nargs)) return 1;
    return (int)lua_tointeger(L, -1);
}

static int require_global(lua_State *L, const char *name) {
    lua_getglobal(L, "require");
    lua_pushstring(L, name);
    int rc = report(L, dsL_pcall(L, 1, 1));
    if (rc == 0) lua_setglobal(L, name);
    return rc;
}

int main(int argc, char **argv) {
    ds_threads_exec_env(argv);
    ds_rankenv_init();
    ds_threads_init();
    catch_stop_signals();
    lua_State *L = luaL_newstate();
    if (!L) { fprintf(stderr, "dslua: cannot create a Lua state\n"); return 1; }
    luaL_openlibs(L);
    dsL_install(L);

    if (argc >= 2 && strcmp(argv[1], "attach") == 0) {
        int rc = attach(L, argv + 2, argc - 2);
        lua_close(L);
        return rc;
    }
    if (argc >= 2 && strcmp(argv[1], "plot") == 0) {
        int rc = plot(L, argv + 2, argc - 2);
        lua_close(L);
        return rc;
    }
    bool interactive = false, ran = false;
    const char *check_path = NULL, *world_size = NULL, *value = NULL;
    int i = 1, rc = 0;
    for (; i < argc && rc == 0; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-v") == 0 || strcmp(a, "--version") == 0) {
            printf("dslua %s (%s)\n", DSLUA_VERSION, LUAJIT_VERSION);
            ran = true;
        } else if (strcmp(a, "--report") == 0) {
            ds_report(stdout, LUAJIT_VERSION);
            lua_close(L);
            return 0;
        } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            fputs(usage, stdout);
            lua_close(L);
            return 0;
        } else if (strcmp(a, "-i") == 0) {
            interactive = true;
        } else if (strcmp(a, "-e") == 0 || strcmp(a, "-l") == 0) {
            if (i + 1 >= argc) { fprintf(stderr, "dslua: '%s' needs an argument\n%s", a, usage); return 1; }
            const char *v = argv[++i];
            if (a[1] == 'e') {
                set_arg_table(L, argv, argc, i + 1 < argc ? i + 1 : argc - 1);
                rc = report(L, dsL_repl_init(L));
                if (rc == 0) rc = run_chunk(L, luaL_loadbuffer(L, v, strlen(v), "=(command line)"), 0);
            } else {
                rc = require_global(L, v);
            }
            ran = true;
        } else if (valued_option(a, "--check-config", &value) || valued_option(a, "--world-size", &value)) {
            if (!value && i + 1 >= argc) { fprintf(stderr, "dslua: '%s' needs an argument\n%s", a, usage); return 1; }
            if (!value) value = argv[++i];
            if (a[2] == 'c') check_path = value; else world_size = value;
        } else if (strcmp(a, "--") == 0) {
            i++;
            break;
        } else if (launcher_option(a)) {
            if (ran || interactive || check_path || world_size) {
                fprintf(stderr, "dslua: '%s' launches a script on ranks; it goes with no -e, -l, -i or --check-config\n%s", a, usage);
                rc = 1;
            } else {
                rc = dsL_launch(L, argv + i, argc - i);
            }
            lua_close(L);
            return rc;
        } else if (a[0] == '-' && a[1]) {
            fprintf(stderr, "dslua: unknown option '%s'\n%s", a, usage);
            lua_close(L);
            return 1;
        } else {
            break;
        }
    }
    if (rc == 0 && (check_path || world_size)) {
        if (!check_path || i < argc) {
            fprintf(stderr, "dslua: %s\n%s", check_path ? "--check-config takes no script"
                                                        : "--world-size goes with --check-config", usage);
            rc = 1;
        } else {
            rc = check_config(L, check_path, world_size);
        }
        lua_close(L);
        return rc;
    }
    if (rc == 0 && i < argc) {
        rc = ds_comm_launched() ? run_rank_script(L, argv, argc, i) : run_script(L, argv, argc, i);
        ran = true;
    }
    if (rc == 0 && (interactive || !ran)) {
        if (interactive || isatty(STDIN_FILENO)) {
            set_arg_table(L, argv, argc, 0);
            dsL_repl(L);
        } else {
            set_arg_table(L, argv, argc, 0);
            rc = run_chunk(L, luaL_loadfile(L, NULL), 0);
        }
    }
    lua_close(L);
    return rc ? 1 : 0;
}
