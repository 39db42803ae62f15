/* The launcher's process side: dslua.parallel.launcher builds the mpirun command;
 * this process starts mpirun, passes signals on, passes its stderr on
 * without Open MPI's noise after a rank's own error line, waits, and then
 * removes what Open MPI leaves behind when ranks are killed.
 *
 * For a job on this machine the launcher gives Open MPI a scratch folder
 * of the job's own (its session directory and the shared-memory segments,
 * otherwise /tmp/ompi.* and /dev/shm/vader_segment.*), removed whole
 * however mpirun ends, and preloads libdslua_loopback.so into mpirun so
 * that its control port listens on loopback only. */
#define _GNU_SOURCE      /* nftw */
#include "lua_launch.h"
#include "lua_module.h"

#include <lauxlib.h>
#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t child, caught;

/* A signal for the launcher goes on to mpirun, which ends the ranks; one
 * the terminal sent the whole group (Ctrl-C) reached mpirun already. */
static void pass_on(int sig, siginfo_t *info, void *ctx) {
    (void)ctx;
    caught = sig;
    if (child > 0 && info->si_code != SI_KERNEL) kill(child, sig);
}

static const int passed[] = { SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2 };

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)flag; (void)ftw;
    remove(path);
    return 0;
}

/* The scratch folders of launchers that were killed outright (SIGKILL
 * leaves no time to remove them): dslua.<pid>.* in base, of a pid that is
 * gone, a directory of this user. */
static void remove_stale_scratch(const char *base) {
    DIR *d = opendir(base);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        int pid;
        char dot;
        if (sscanf(e->d_name, "dslua.%d%c", &pid, &dot) != 2 || dot != '.' || pid <= 0) continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
        char path[PATH_MAX];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", base, e->d_name);
        if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == geteuid())
            nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    }
    closedir(d);
}

/* A new folder of this user only, dslua.<pid>.XXXXXX: in /dev/shm
 * (shared-memory segments belong on a tmpfs), else $TMPDIR or /tmp. NULL
 * when none can be made. */
static char *make_scratch(char *buf, size_t n) {
    const char *tmp = getenv("TMPDIR");
    const char *bases[] = { "/dev/shm", tmp && *tmp ? tmp : "/tmp" };
    for (size_t i = 0; i < sizeof bases / sizeof *bases; i++) {
        remove_stale_scratch(bases[i]);
        snprintf(buf, n, "%s/dslua.%d.XXXXXX", bases[i], (int)getpid());
        if (mkdtemp(buf)) return buf;
    }
    return NULL;
}

/* <this binary's folder>/libdslua_loopback.so when it is there */
static bool loopback_library(const char *exe, char *buf, size_t n) {
    const char *slash = strrchr(exe, '/');
    snprintf(buf, n, "%.*s/libdslua_loopback.so", slash ? (int)(slash - exe) : 1, slash ? exe : ".");
    return access(buf, R_OK) == 0;
}

/* mpirun's stderr passed on line by line. Once a rank has said why the
 * job failed (dslua's "[rank N] error: ..." or "[rank N] exited with
 * status ..."), Open MPI's own account of it is left out: its help boxes
 * (between lines of dashes) and its ORTE_ERROR_LOG and help-aggregation
 * lines. Without such a line everything passes (a rank killed by a
 * signal is told by Open MPI alone). */
typedef struct {
    bool said, in_box;
    size_t n;
    char line[8192];
} noise_filter;

static bool dslua_said(const char *s) {
    int r, at = 0;
    if (sscanf(s, "[rank %d] %n", &r, &at) != 1 || at == 0) return false;
    return strncmp(s + at, "error: ", 7) == 0 || strncmp(s + at, "exited with status ", 19) == 0;
}

/* Open MPI's show_help frames its boxes with lines of 74 dashes. */
static bool box_edge(const char *s) {
    size_t n = strspn(s, "-");
    return n == 74 && (s[n] == '\n' || s[n] == '\0');
}

static bool orte_noise(const char *s) {
    return strstr(s, "ORTE_ERROR_LOG") || strstr(s, "has sent help message") ||
           strstr(s, "have sent help message") || strstr(s, "orte_base_help_aggregate");
}

/* One line (with its newline, or a piece of a long one) to stderr or not. */
static void filter_line(noise_filter *f, const char *s, size_t n) {
    bool drop = false;
    if (f->said) {
        if (box_edge(s)) drop = true, f->in_box = !f->in_box;
        else drop = f->in_box || orte_noise(s);
    } else if (dslua_said(s)) {
        f->said = true;
    }
    if (!drop && write(STDERR_FILENO, s, n) < 0) { /* stderr gone: nothing to tell */ }
}

static void filter_feed(noise_filter *f, const char *buf, size_t n) {
    for (size_t i = 0; i < n; i++) {
        f->line[f->n++] = buf[i];
        if (buf[i] == '\n' || f->n == sizeof f->line - 1) {
            f->line[f->n] = '\0';
            filter_line(f, f->line, f->n);
            f->n = 0;
        }
    }
}

/* A process of its own passes the pipe on until every writer has closed
 * it: mpirun's last lines (the ranks saying why they stop) still arrive
 * when the launcher itself is killed. It ignores the signals the launcher
 * passes on to mpirun, whose end ends it. Its pid, or -1. */
static pid_t start_filter(int fd, int writer) {
    pid_t pid = fork();
    if (pid != 0) return pid;
    for (size_t i = 0; i < sizeof passed / sizeof *passed; i++) signal(passed[i], SIG_IGN);
    close(writer);
    static noise_filter f;
    char buf[4096];
    for (;;) {
        ssize_t k = read(fd, buf, sizeof buf);
        if (k > 0) filter_feed(&f, buf, (size_t)k);
        else if (k == 0 || errno != EINTR) break;
    }
    if (f.n) filter_line(&f, f.line, f.n);
    _exit(0);
}

/* Waits a moment for the filter to pass mpirun's last lines on (a process
 * mpirun left behind may hold the pipe open: not waited for). */
static void wait_filter(pid_t pid) {
    for (int i = 0; i < 200; i++) {
        pid_t r = waitpid(pid, NULL, WNOHANG);
        if (r == pid || (r < 0 && errno != EINTR)) return;
        usleep(10000);
    }
}

/* Starts cmd with lib preloaded (when given), waits for it: its status.
 * mpirun ends with the launcher (SIGTERM when it dies, SIGKILL included),
 * and a job on this machine (local) tells its ranks the launcher's pid,
 * so they can say that it is gone. */
static int run_mpirun(char **cmd, const char *lib, bool local) {
    struct sigaction sa, old[sizeof passed / sizeof *passed];
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = pass_on;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < sizeof passed / sizeof *passed; i++) sigaction(passed[i], &sa, &old[i]);
    fflush(NULL);
    int err[2];
    pid_t filter = -1;
    if (pipe(err) == 0) filter = start_filter(err[0], err[1]);
    else err[0] = err[1] = -1;
    if (filter < 0 && err[0] >= 0) {             /* no filter: mpirun's stderr is ours, unfiltered */
        close(err[0]);
        close(err[1]);
        err[0] = err[1] = -1;
    }
    pid_t launcher = getpid();
    pid_t pid = fork();
    if (pid == 0) {
        for (size_t i = 0; i < sizeof passed / sizeof *passed; i++) sigaction(passed[i], &old[i], NULL);
        if (err[1] >= 0) {
            dup2(err[1], STDERR_FILENO);
            close(err[0]);
            close(err[1]);
        }
        if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() != launcher) _exit(1);
        if (local) {
            char id[24];
            snprintf(id, sizeof id, "%d", (int)launcher);
            setenv("DSLUA_LAUNCHER_PID", id, 1);
        }
        if (lib) {
            const char *prev = getenv("LD_PRELOAD");
            char *both = malloc(strlen(lib) + (prev ? strlen(prev) : 0) + 2);
            if (both) {
                sprintf(both, "%s%s%s", lib, prev && *prev ? ":" : "", prev && *prev ? prev : "");
                setenv("LD_PRELOAD", both, 1);
            }
        }
        execv(cmd[0], cmd);
        fprintf(stderr, "dslua: cannot run %s: %s\n", cmd[0], strerror(errno));
        _exit(127);
    }
    if (err[0] >= 0) {
        close(err[0]);
        close(err[1]);
    }
    if (pid < 0) {
        fprintf(stderr, "dslua: cannot start %s: %s\n", cmd[0], strerror(errno));
        if (filter > 0) wait_filter(filter);
        return -1;
    }
    child = pid;
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    child = 0;
    if (filter > 0) wait_filter(filter);
    for (size_t i = 0; i < sizeof passed / sizeof *passed; i++) sigaction(passed[i], &old[i], NULL);
    return status;
}

int dsL_launch(lua_State *L, char **args, int nargs) {
    char exe[PATH_MAX], scratch[PATH_MAX], lib[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n < 0) { fprintf(stderr, "dslua: cannot read /proc/self/exe: %s\n", strerror(errno)); return 1; }
    exe[n] = '\0';
    lua_getglobal(L, "require");
    lua_pushliteral(L, "dslua.parallel.launcher");
    if (dsL_pcall(L, 1, 1)) {
        fprintf(stderr, "dslua: %s\n", lua_tostring(L, -1));
        return 1;
    }
    lua_getfield(L, -1, "main");
    lua_createtable(L, nargs, 0);
    for (int i = 0; i < nargs; i++) {
        lua_pushstring(L, args[i]);
        lua_rawseti(L, -2, i + 1);
    }
    lua_pushstring(L, exe);
    char *dir = make_scratch(scratch, sizeof scratch);
    if (dir) lua_pushstring(L, dir);
    else lua_pushnil(L);
    lua_pushboolean(L, loopback_library(exe, lib, sizeof lib));
    if (lua_pcall(L, 4, 2, 0) != 0) {      /* a usage error: the message alone */
        fprintf(stderr, "dslua: %s\n", lua_tostring(L, -1) ? lua_tostring(L, -1) : "(error)");
        if (dir) rmdir(dir);
        return 1;
    }
    bool local = lua_toboolean(L, -1);
    lua_pop(L, 1);
    int ncmd = (int)lua_objlen(L, -1);
    char **cmd = calloc((size_t)ncmd + 1, sizeof *cmd);
    if (!cmd) { fprintf(stderr, "dslua: out of memory\n"); return 1; }
    for (int i = 0; i < ncmd; i++) {
        lua_rawgeti(L, -1, i + 1);
        cmd[i] = (char *)lua_tostring(L, -1);     /* kept alive by the table */
        lua_pop(L, 1);
    }
    int status = run_mpirun(cmd, local && lib[0] && access(lib, R_OK) == 0 ? lib : NULL, local);
    free(cmd);
    if (caught)
        fprintf(stderr, "dslua: the launcher got signal %d (%s): mpirun and the ranks were stopped\n", (int)caught,
                strsignal(caught));
    else if (status >= 0 && WIFSIGNALED(status))
        fprintf(stderr, "dslua: mpirun was killed by signal %d (%s): the job ended there\n", WTERMSIG(status),
                strsignal(WTERMSIG(status)));
    /* whatever ended mpirun: the job's files go (a killed rank removes nothing) */
    if (dir) nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    fflush(NULL);
    int sig = status >= 0 && WIFSIGNALED(status) ? WTERMSIG(status) : caught;
    if (sig) {
        signal(sig, SIG_DFL);
        raise(sig);
    }
    return status < 0 ? 1 : WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
