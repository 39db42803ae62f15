/* The comm runtime: starting and ending MPI, groups, waiting with a
 * deadline, the signature check, and the works in flight. The primitives
 * are in ds_comm_ops.c, the MPI payload backend in ds_comm_mpi.c.
 *
 * Ending: a rank leaving first tells every other rank (an exit notice on
 * a communicator of its own) its status and how far it got: how many
 * collectives it called on each group, how many sends and receives it
 * started with that rank. With status 0 it then waits until every rank
 * has said the same, and finalizes; with another status (or after a failed
 * wait) it leaves at once and mpirun ends the job. A rank waiting for a
 * call that a rank which has left never made fails at once instead of at
 * the timeout; a call the leaver did make still completes. */
#include "ds_comm_impl.h"
#include "ds_error.h"
#include "ds_ops.h"

#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { TAG_EXIT = 1 };

static struct {
    bool initialized, finalized, broken;
    int check;                      /* -1: DSLUA_COMM_CHECK not read yet */
    double timeout;                 /* 0: DSLUA_COMM_TIMEOUT not read yet */
    int rank, size;
    MPI_Comm exitc;                 /* exit notices only */
    int64_t **exits;                /* per world rank: its notice, NULL while it runs */
    int n_exited;
    int64_t *sent, *received;       /* sends and receives started, per world rank */
    int ngroups;                    /* groups made, the world included */
    ds_comm_work *inflight;
    ds_comm_group *groups;          /* from new_group, kept until exit */
    const ds_comm_backend *backends[DS_NDEVICE_TYPES];
} S = { .check = -1, .size = 1, .backends = {
    [DS_DEV_CPU] = &ds_comm_mpi_backend,
#ifdef DSLUA_CUDA
    [DS_DEV_CUDA] = &ds_comm_nccl_backend,
#endif
} };

static int world_ranks0[1] = { 0 };
static ds_comm_group world = { .rank = 0, .size = 1, .ranks = world_ranks0, .name = "world" };

/* An exit notice: int64 words */
enum { N_STATUS, N_SENT_TO_YOU, N_RECEIVED_FROM_YOU, N_GROUPS, N_SEQ };

static const char *op_names[DS_COMM_NOPS] = { "sum", "avg", "max", "min", "prod" };

int ds_comm_op_parse(const char *name) {
    for (int i = 0; i < DS_COMM_NOPS; i++)
        if (strcmp(name, op_names[i]) == 0) return i;
    return -1;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int env_int(const char *name, int def) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) : def;
}

bool ds_comm_launched(void) { return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK"); }
bool ds_comm_is_initialized(void) { return S.initialized && !S.finalized; }

int ds_comm_rank(const ds_comm_group *g) {
    if (g) return g->rank;
    if (S.initialized) return S.rank;
    return ds_comm_launched() ? env_int("OMPI_COMM_WORLD_RANK", env_int("PMIX_RANK", 0)) : 0;
}

int ds_comm_size(const ds_comm_group *g) {
    if (g) return g->size;
    if (S.initialized || !ds_comm_launched()) return S.size;
    if (getenv("OMPI_COMM_WORLD_SIZE")) return env_int("OMPI_COMM_WORLD_SIZE", 1);
    return ds_comm_init() ? 1 : S.size;
}

int ds_comm_local_rank(void) { return env_int("OMPI_COMM_WORLD_LOCAL_RANK", env_int("LOCAL_RANK", 0)); }
int ds_comm_local_size(void) { return env_int("OMPI_COMM_WORLD_LOCAL_SIZE", env_int("LOCAL_SIZE", 1)); }

double ds_comm_timeout(void) {
    if (S.timeout <= 0) {
        const char *v = getenv("DSLUA_COMM_TIMEOUT");
        double t = v ? atof(v) : 0;
        S.timeout = t > 0 ? t : 300;
    }
    return S.timeout;
}

void ds_comm_set_timeout(double seconds) { S.timeout = seconds; }

bool ds_comm_check_enabled(void) {
    if (S.check < 0) {
        const char *v = getenv("DSLUA_COMM_CHECK");
        S.check = v && *v && strcmp(v, "0") != 0;
    }
    return S.check;
}

void ds_comm_set_check(bool on) { S.check = on; }


const ds_comm_backend *ds_comm_backend_of(const ds_tensor *t, const char *op) {
    ds_device d = ds_tensor_device(t);
    if (S.backends[d.type]) return S.backends[d.type];
    char name[32];
    ds_device_name(d, name, sizeof name);
    return ds_fail(DS_ERR_ARG, "%s: no comm backend for %s tensors in this build", op, name);
}

_Noreturn void ds_comm_abort(int code) {
    fflush(stdout);
    fflush(stderr);
    if (S.initialized && !S.finalized) MPI_Abort(MPI_COMM_WORLD, code ? code : 1);
    exit(code);
}

/* ---- waiting ---- */

/* Records the exit notices that have arrived. */
static void poll_exits(void) {
    while (S.initialized && !S.finalized) {
        int flag = 0, n = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_EXIT, S.exitc, &flag, &st) != MPI_SUCCESS || !flag) return;
        MPI_Get_count(&st, MPI_INT64_T, &n);
        int64_t *msg = calloc((size_t)(n > N_SEQ ? n : N_SEQ), sizeof *msg);
        if (!msg) return;
        MPI_Recv(msg, n, MPI_INT64_T, st.MPI_SOURCE, TAG_EXIT, S.exitc, MPI_STATUS_IGNORE);
        if (S.exits[st.MPI_SOURCE]) free(S.exits[st.MPI_SOURCE]);
        else S.n_exited++;
        S.exits[st.MPI_SOURCE] = msg;
    }
}

enum { ANY_MEMBER = -1, IGNORE_EXITS = -2 };

/* What a wait needs from other ranks. */
typedef struct {
    const ds_comm_group *g;
    int who;                /* a peer's world rank, ANY_MEMBER of g, or IGNORE_EXITS */
    bool sending;           /* to the peer, else from it */
    int64_t ordinal;        /* the call: g's collective number, or the n-th send/recv with the peer */
} need;

/* A rank the wait needs that has left without making the call, or -1. */
static int gone(const need *n) {
    if (!S.n_exited || n->who == IGNORE_EXITS) return -1;
    int count = n->who >= 0 ? 1 : n->g->size;
    for (int i = 0; i < count; i++) {
        int m = n->who >= 0 ? n->who : n->g->ranks[i];
        const int64_t *e = S.exits[m];
        if (!e) continue;
        if (e[N_STATUS] != 0) return m;
        int64_t made = n->who >= 0 ? e[n->sending ? N_RECEIVED_FROM_YOU : N_SENT_TO_YOU]
                                   : n->g->index < e[N_GROUPS] ? e[N_SEQ + n->g->index] : 0;
        if (made < n->ordinal) return m;
    }
    return -1;
}

/* Spin briefly (small messages finish in microseconds), then yield the
 * core (ranks may outnumber cores), then sleep: a long wait costs little. */
static void backoff(double waited) {
    if (waited < 1e-4) return;
    if (waited < 0.01) { sched_yield(); return; }
    struct timespec ts = { 0, waited < 1.0 ? 50000 : 1000000 };
    nanosleep(&ts, NULL);
}

typedef int (*test_fn)(void *ctx, bool *done);

static int test_mpi(void *ctx, bool *done) {
    int flag = 0;
    if (ds_comm_mpi_check(MPI_Test(ctx, &flag, MPI_STATUS_IGNORE), "comm")) return -1;
    *done = flag != 0;
    return 0;
}

static int test_work(void *ctx, bool *done) {
    ds_comm_work *w = ctx;
    return w->be->test(w->req, done);
}

/* Polls test until done, the deadline, or a needed rank leaving. A failed
 * wait leaves something in flight that may still write: the layer is
 * broken from then on. */
static int wait_for(test_fn test, void *ctx, const need *nd, const char *what, double limit) {
    double t0 = now();
    for (;;) {
        bool done = false;
        if (test(ctx, &done)) { S.broken = true; return -1; }
        if (done) return 0;
        poll_exits();
        double waited = now() - t0;
        int r = gone(nd);
        if (r >= 0) {
            S.broken = true;
            return ds_fail(DS_ERR_STATE, "%s cannot complete on rank %d: rank %d exited (status %lld) without joining "
                           "it (waited %.1f s)", what, S.rank, r, (long long)S.exits[r][N_STATUS], waited), -1;
        }
        if (waited > limit) {
            S.broken = true;
            if (nd->who >= 0)
                return ds_fail(DS_ERR_STATE, "%s timed out on rank %d after %.1f s: rank %d never joined (timeout %g s: "
                               "ds.comm.set_timeout, DSLUA_COMM_TIMEOUT)", what, S.rank, waited, nd->who, limit), -1;
            return ds_fail(DS_ERR_STATE, "%s timed out on rank %d of %d after %.1f s: not every rank of %s joined "
                           "(timeout %g s: ds.comm.set_timeout, DSLUA_COMM_TIMEOUT)", what, S.rank, S.size, waited,
                           nd->g->name, limit), -1;
        }
        backoff(waited);
    }
}

/* a control exchange within g's current collective */
static int wait_ctl(MPI_Request *r, const ds_comm_group *g, const char *what) {
    need nd = { g, ANY_MEMBER, false, g->seq };
    return wait_for(test_mpi, r, &nd, what, ds_comm_timeout());
}

static int wait_work(ds_comm_work *w) {
    need nd = { w->g, w->peer >= 0 ? w->peer : ANY_MEMBER, w->sending, w->ordinal };
    return wait_for(test_work, w, &nd, w->what, ds_comm_timeout());
}

int ds_comm_ctl_allgather(ds_comm_group *g, const void *mine, void *all, int bytes, const char *what) {
    MPI_Request r;
    if (ds_comm_mpi_check(MPI_Iallgather(mine, bytes, MPI_BYTE, all, bytes, MPI_BYTE, g->ctl, &r), what)) return -1;
    return wait_ctl(&r, g, what);
}

int ds_comm_ctl_bcast(ds_comm_group *g, void *buf, int bytes, int root, const char *what) {
    MPI_Request r;
    if (ds_comm_mpi_check(MPI_Ibcast(buf, bytes, MPI_BYTE, root, g->ctl, &r), what)) return -1;
    return wait_ctl(&r, g, what);
}

int64_t ds_comm_p2p_count(int peer, bool sending) {
    if (!S.initialized) return 0;
    return sending ? ++S.sent[peer] : ++S.received[peer];
}

/* ---- starting and ending ---- */

static int finalize(void);

/* Sends every other rank this rank's exit notice; the requests. */
static MPI_Request *notify_exit(int status) {
    static int64_t *msgs;           /* read by MPI until the sends complete */
    int len = N_SEQ + S.ngroups;
    msgs = malloc((size_t)S.size * (size_t)len * sizeof *msgs);
    MPI_Request *sends = msgs ? malloc((size_t)S.size * sizeof *sends) : NULL;
    for (int r = 0; sends && r < S.size; r++) {
        int64_t *m = msgs + (size_t)r * (size_t)len;
        sends[r] = MPI_REQUEST_NULL;
        if (r == S.rank) continue;
        m[N_STATUS] = status;
        m[N_SENT_TO_YOU] = S.sent[r];
        m[N_RECEIVED_FROM_YOU] = S.received[r];
        m[N_GROUPS] = S.ngroups;
        m[N_SEQ] = world.seq;
        for (ds_comm_group *g = S.groups; g; g = g->next) m[N_SEQ + g->index] = g->seq;
        MPI_Isend(m, len, MPI_INT64_T, r, TAG_EXIT, S.exitc, &sends[r]);
    }
    return sends;
}

static void at_exit(int status, void *arg) {
    (void)arg;
    if (!S.initialized || S.finalized) return;
    fflush(stdout);
    fflush(stderr);
    if (status != 0 || S.broken) {
        /* leaving without MPI_Finalize: mpirun ends every other rank, and
         * those waiting on this one hear it first from the notice */
        fprintf(stderr, "[rank %d] exited with status %d%s\n", S.rank, status,
                S.broken ? " after a failed collective" : "");
        MPI_Request *sends = notify_exit(status ? status : 1);
        for (double t0 = now(); sends && now() - t0 < 0.2; backoff(now() - t0)) {
            int flag = 0;
            MPI_Testall(S.size, sends, &flag, MPI_STATUSES_IGNORE);
            if (flag) break;
        }
        free(sends);
        return;
    }
    if (finalize()) {
        fprintf(stderr, "[rank %d] error: %s\n", S.rank, ds_error_message());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
}

int ds_comm_init(void) {
    if (S.initialized || S.finalized || !ds_comm_launched()) return 0;
    int flag = 0, provided;
    MPI_Initialized(&flag);
    if (!flag && ds_comm_mpi_check(MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided), "comm: MPI_Init"))
        return -1;
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &S.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &S.size);
    S.exits = calloc((size_t)S.size, sizeof *S.exits);
    S.sent = calloc((size_t)S.size, sizeof *S.sent);
    S.received = calloc((size_t)S.size, sizeof *S.received);
    world.ranks = malloc((size_t)S.size * sizeof(int));
    if (!S.exits || !S.sent || !S.received || !world.ranks) return ds_fail(DS_ERR_NOMEM, "comm: out of memory"), -1;
    for (int i = 0; i < S.size; i++) world.ranks[i] = i;
    S.ngroups = 1;
    world.rank = S.rank;
    world.size = S.size;
    if (ds_comm_mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &world.comm), "comm: MPI_Comm_dup") ||
        ds_comm_mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &world.ctl), "comm: MPI_Comm_dup") ||
        ds_comm_mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &S.exitc), "comm: MPI_Comm_dup"))
        return -1;
    S.initialized = true;
    /* lines reach mpirun as they are printed, not lost in a buffer when the job aborts */
    fflush(stdout);
    setvbuf(stdout, NULL, _IOLBF, 0);
    on_exit(at_exit, NULL);
    return 0;
}

static ds_comm_group *world_group(void) { return &world; }

static void unlink_work(ds_comm_work *w) {
    for (ds_comm_work **p = &S.inflight; *p; p = &(*p)->next)
        if (*p == w) { *p = w->next; return; }
}

/* Every work still in flight, then the exit handshake, then MPI_Finalize. */
static int finalize(void) {
    while (S.inflight) {
        ds_comm_work *w = S.inflight;
        bool done;
        if (wait_work(w) || ds_comm_work_test(w, &done)) return -1;
    }
    MPI_Request *sends = notify_exit(0), barrier;
    if (!sends) return ds_fail(DS_ERR_NOMEM, "comm: out of memory"), -1;
    char what[64];
    snprintf(what, sizeof what, "exit of rank %d", S.rank);
    /* no deadline: a rank still running either ends, fails (and aborts the
     * job), or waits on this one and fails at once on its notice */
    int rc = ds_comm_mpi_check(MPI_Ibarrier(S.exitc, &barrier), what);
    need nd = { &world, IGNORE_EXITS, false, 0 };
    if (!rc) rc = wait_for(test_mpi, &barrier, &nd, what, INFINITY);
    /* every notice was sent before its sender reached the barrier */
    for (double t0 = now(); !rc && S.n_exited < S.size - 1; backoff(now() - t0)) {
        poll_exits();
        if (now() - t0 > ds_comm_timeout()) rc = (ds_fail(DS_ERR_STATE, "%s: exit notices missing", what), -1);
    }
    if (rc) { free(sends); return -1; }
    MPI_Waitall(S.size, sends, MPI_STATUSES_IGNORE);
    free(sends);
    S.finalized = true;
    MPI_Finalize();
    return 0;
}

/* ---- groups ---- */

int ds_comm_group_world_rank(const ds_comm_group *g, int i) {
    if (!g) g = world_group();
    return i >= 0 && i < g->size ? g->ranks[i] : -1;
}

const char *ds_comm_group_name(const ds_comm_group *g) { return g ? g->name : world.name; }

/* FNV-1a over the rank list: ranks agree on a group cheaply. */
static int64_t ranks_hash(const int *ranks, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) h = (h ^ (uint64_t)(uint32_t)ranks[i]) * 1099511628211ull;
    return (int64_t)(h >> 1);
}

static void group_free(ds_comm_group *g) {
    free(g->ranks);
    free(g);
}

ds_comm_group *ds_comm_new_group(const int *ranks, int n) {
    if (ds_comm_init()) return NULL;
    int size = S.size;
    if (n < 1) return ds_fail(DS_ERR_ARG, "new_group: needs at least one rank");
    ds_comm_group *g = calloc(1, sizeof *g);
    if (!g || !(g->ranks = malloc((size_t)n * sizeof(int)))) {
        free(g);
        return ds_fail(DS_ERR_NOMEM, "new_group: out of memory");
    }
    g->rank = -1;
    g->size = n;
    g->index = S.ngroups;
    g->comm = g->ctl = MPI_COMM_NULL;
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        if (ranks[i] < 0 || ranks[i] >= size) {
            group_free(g);
            return ds_fail(DS_ERR_ARG, "new_group: rank %d out of range for a world of %d rank%s", ranks[i], size,
                           size == 1 ? "" : "s");
        }
        for (int j = 0; j < i; j++)
            if (ranks[j] == ranks[i]) {
                group_free(g);
                return ds_fail(DS_ERR_ARG, "new_group: rank %d listed twice", ranks[i]);
            }
        g->ranks[i] = ranks[i];
        if (ranks[i] == ds_comm_rank(NULL)) g->rank = i;
        if (len < sizeof g->name - 16)
            len += (size_t)snprintf(g->name + len, sizeof g->name - len, "%s%d", i ? "," : "[", ranks[i]);
    }
    snprintf(g->name + len, sizeof g->name - len, "%s]", len >= sizeof g->name - 16 ? ",..." : "");
    if (S.initialized) {
        ds_comm_group *w = NULL;
        char what[160];
        if (ds_comm_begin(&w, "new_group", -1, n, -1, true, false, what, sizeof what)) { group_free(g); return NULL; }
        int64_t mine[2] = { n, ranks_hash(ranks, n) }, *all = malloc((size_t)S.size * sizeof mine);
        int rc = all ? ds_comm_ctl_allgather(w, mine, all, sizeof mine, what) : -1;
        for (int r = 0; rc == 0 && r < S.size; r++)
            if (all[2 * r] != mine[0] || all[2 * r + 1] != mine[1]) {
                S.broken = true;
                rc = (ds_fail(DS_ERR_ARG, "new_group: rank %d passed other ranks (%lld) than rank %d (%s): every rank "
                             "calls new_group with the same list", r, (long long)all[2 * r], S.rank, g->name), -1);
            }
        free(all);
        if (rc == 0 && g->rank >= 0) {
            MPI_Group wg, sub;
            MPI_Comm_group(MPI_COMM_WORLD, &wg);
            MPI_Group_incl(wg, n, g->ranks, &sub);
            rc = ds_comm_mpi_check(MPI_Comm_create_group(MPI_COMM_WORLD, sub, (int)(w->seq & 0x7fff), &g->comm),
                                   "new_group");
            if (!rc) rc = ds_comm_mpi_check(MPI_Comm_dup(g->comm, &g->ctl), "new_group");
            MPI_Group_free(&sub);
            MPI_Group_free(&wg);
        }
        if (rc) { group_free(g); return NULL; }
    }
    g->next = S.groups;
    S.groups = g;
    S.ngroups++;
    return g;
}

/* ---- the check ---- */

typedef struct {
    char op[16];
    int32_t dtype, root;
    int64_t count, seq;
    int32_t strict, pad;
} signature;

/* "all_reduce(f32, 10 elements) #7": count -1 and root -1 left out, seq 0
 * (send/recv, which are not numbered) too */
static void describe(char *buf, size_t n, const char *op, int dtype, int64_t count, int root, int64_t seq) {
    char dt[24] = "?", cnt[48] = "", rt[24] = "", sq[32] = "";
    if (dtype >= 0) snprintf(dt, sizeof dt, "%s", ds_dtype_name((ds_dtype)dtype));
    if (count >= 0) snprintf(cnt, sizeof cnt, ", %lld element%s", (long long)count, count == 1 ? "" : "s");
    if (root >= 0) snprintf(rt, sizeof rt, ", root %d", root);
    if (seq > 0) snprintf(sq, sizeof sq, " #%lld", (long long)seq);
    if (strcmp(op, "barrier") == 0) snprintf(buf, n, "barrier()%s", sq);
    else snprintf(buf, n, "%s(%s%s%s)%s", op, dt, cnt, rt, sq);
}

static bool same_call(const signature *a, const signature *b) {
    if (strcmp(a->op, b->op) != 0 || a->seq != b->seq || a->root != b->root) return false;
    if (a->dtype >= 0 && b->dtype >= 0 && a->dtype != b->dtype) return false;
    return !(a->strict && b->strict && a->count != b->count);
}

static int check_signatures(ds_comm_group *g, const signature *mine, const char *what) {
    signature *all = malloc((size_t)g->size * sizeof *all);
    if (!all) return ds_fail(DS_ERR_NOMEM, "comm check: out of memory"), -1;
    char w[200];
    snprintf(w, sizeof w, "%s (comm check)", what);
    int rc = ds_comm_ctl_allgather(g, mine, all, sizeof *mine, w);
    for (int r = 1; rc == 0 && r < g->size; r++) {
        if (same_call(&all[r], &all[0])) continue;
        char a[96], b[96];
        describe(a, sizeof a, all[r].op, all[r].dtype, all[r].count, all[r].root, all[r].seq);
        describe(b, sizeof b, all[0].op, all[0].dtype, all[0].count, all[0].root, all[0].seq);
        S.broken = true;
        rc = (ds_fail(DS_ERR_STATE, "comm check: rank %d called %s while rank %d called %s", g->ranks[r], a,
                     g->ranks[0], b), -1);
    }
    free(all);
    return rc;
}

int ds_comm_begin(ds_comm_group **gp, const char *op, int dtype, int64_t count, int root, bool strict, bool p2p,
                  char *what, size_t n) {
    if (ds_comm_init()) return -1;
    if (S.broken) return ds_fail(DS_ERR_STATE, "%s: an earlier collective failed on rank %d; the job cannot go on", op,
                                 S.rank), -1;
    ds_comm_group *g = *gp ? *gp : world_group();
    if (g->rank < 0)
        return ds_fail(DS_ERR_ARG, "%s: rank %d is not a member of group %s", op, ds_comm_rank(NULL), g->name), -1;
    *gp = g;
    ds_comm_progress();
    if (p2p) {
        describe(what, n, op, dtype, count, -1, 0);
        return 0;
    }
    g->seq++;
    describe(what, n, op, dtype, count, root, g->seq);
    if (!ds_comm_check_enabled() || g->size == 1 || !S.initialized) return 0;
    signature mine;
    memset(&mine, 0, sizeof mine);
    snprintf(mine.op, sizeof mine.op, "%s", op);
    mine.dtype = dtype;
    mine.root = root;
    mine.count = count;
    mine.seq = g->seq;
    mine.strict = strict;
    return check_signatures(g, &mine, what);
}

/* ---- works ---- */

int ds_comm_copy(ds_tensor *dst, ds_tensor *src, const char *op) {
    if (ds_tensor_kernels(dst)->core->copy(ds_tensor_kview(dst), ds_tensor_kview(src)))
        return ds_fail(DS_ERR_STATE, "%s: %s", op, ds_kernel_error()), -1;
    return 0;
}

ds_comm_work *ds_comm_work_new(ds_comm_group *g, const char *what, int peer, int nresults) {
    ds_comm_work *w = calloc(1, sizeof *w);
    if (w && nresults) w->results = calloc((size_t)nresults, sizeof *w->results);
    if (!w || (nresults && !w->results)) {
        free(w);
        return ds_fail(DS_ERR_NOMEM, "%s: out of memory", what);
    }
    w->g = g;
    w->peer = peer;
    w->ordinal = g->seq;
    w->nresults = nresults;
    snprintf(w->what, sizeof w->what, "%s", what);
    return w;
}

static void drop(ds_tensor **t) {
    if (*t) ds_tensor_release(*t);
    *t = NULL;
}

void ds_comm_work_free(ds_comm_work *w) {
    if (!w) return;
    drop(&w->target);
    drop(&w->buf);
    drop(&w->keep);
    for (int i = 0; i < w->nresults; i++) drop(&w->results[i]);
    free(w->results);
    free(w);
}

/* avg: the sum divided by the rank count, in the wire dtype (f32 or f64) */
static void divide_(ds_tensor *t, double d) {
    if (ds_tensor_device(t).type != DS_DEV_CPU) {      /* GPU buffers: the device's division kernel */
        ds_tensor *s = ds_scalar_like(t, d), *q = s ? ds_div(t, s) : NULL;
        if (q) ds_copy_(t, q);
        ds_tensor_release(s);
        ds_tensor_release(q);
        return;
    }
    int64_t n = ds_tensor_numel(t);
    if (t->dtype == DS_F64) {
        double *p = ds_tensor_data(t);
        for (int64_t i = 0; i < n; i++) p[i] /= d;
    } else {
        float *p = ds_tensor_data(t);
        for (int64_t i = 0; i < n; i++) p[i] = (float)(p[i] / d);
    }
}

static int finish(ds_comm_work *w) {
    int rc = 0;
    if (w->divide > 0 && w->buf) divide_(w->buf, w->divide);
    if (w->target && w->buf) rc = ds_comm_copy(w->target, w->buf, w->what);
    drop(&w->target);
    drop(&w->buf);
    drop(&w->keep);
    w->state = rc ? -1 : 1;
    return rc;
}

ds_comm_work *ds_comm_work_launch(ds_comm_work *w, const ds_comm_backend *be, int rc, void *req) {
    if (rc) { ds_comm_work_free(w); return NULL; }
    w->be = be;
    w->req = req;
    w->next = S.inflight;
    S.inflight = w;
    return w;
}

ds_comm_work *ds_comm_work_local(ds_comm_work *w) {
    if (finish(w)) { ds_comm_work_free(w); return NULL; }
    return w;
}

/* The backend says w is done: out of the list, results ready. */
static void complete(ds_comm_work *w) {
    w->be->free_req(w->req);
    w->req = NULL;
    unlink_work(w);
    finish(w);
    if (w->orphan) ds_comm_work_free(w);
}

int ds_comm_work_test(ds_comm_work *w, bool *done) {
    *done = false;
    if (w->req && w->state == 0) {
        bool d = false;
        if (test_work(w, &d)) { w->state = -1; S.broken = true; return -1; }
        if (!d) return 0;
        complete(w);
    }
    *done = true;
    if (w->state < 0) return ds_fail(DS_ERR_STATE, "%s failed", w->what), -1;
    return 0;
}

int ds_comm_work_wait(ds_comm_work *w) {
    if (w->req && w->state == 0) {
        if (wait_work(w)) {
            w->state = -1;
            return -1;
        }
        complete(w);
    }
    if (w->state < 0) return ds_fail(DS_ERR_STATE, "%s failed", w->what), -1;
    return 0;
}

int ds_comm_work_nresults(const ds_comm_work *w) { return w->nresults; }

ds_tensor *ds_comm_work_result(ds_comm_work *w, int i) {
    if (i < 0 || i >= w->nresults || !w->results[i]) return ds_fail(DS_ERR_ARG, "%s: no result %d", w->what, i);
    ds_tensor_retain(w->results[i]);
    return w->results[i];
}

/* In flight (or failed with a request that may still write): the list
 * keeps it, and complete() frees it. */
void ds_comm_work_release(ds_comm_work *w) {
    if (!w) return;
    if (w->req) w->orphan = true;
    else ds_comm_work_free(w);
}

void ds_comm_progress(void) {
    if (!S.initialized || S.finalized || S.broken) return;
    poll_exits();
    for (ds_comm_work *w = S.inflight, *next; w; w = next) {
        next = w->next;
        bool done = false;
        if (w->state == 0 && w->be->test(w->req, &done) == 0 && done) complete(w);
    }
}
