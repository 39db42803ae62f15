/* The comm runtime: starting and ending MPI, groups, waiting with a
 * deadline, the signature check, and the works in flight. The primitives
 * are in ds_comm_ops.c, the MPI payload backend in ds_comm_mpi.c, the choice
 * of a tensor's backend in ds_comm_backend.c.
 *
 * Ending: a rank leaving first tells every other rank (an exit notice on
 * a communicator of its own) its status and how far it got: how many
 * collectives it called on each group, how many sends and receives it
 * started with that rank. With status 0 it then waits until every rank
 * has said the same, and finalizes; with another status (or after a failed
 * wait) it leaves at once and mpirun ends the job. A rank waiting for a
 * call that a rank which has left never made fails at once instead of at
 * the timeout; a call the leaver did make still completes. The exit wait
 * has the collectives' deadline too.
 *
 * Every collective starts with the ranks agreeing on what it is (the
 * signature: primitive, dtype, count, root, reduce op, its number), so a
 * mismatch fails on every rank before any byte moves. Each rank keeps its
 * last collectives (the flight recorder); a rank that times out asks the
 * others where they are and names those that did not arrive.
 *
 * One file of ~900 lines on purpose: ending, waiting, groups, the check
 * and the works all read and write the job's comm state (S) and the
 * flight recorder, which stay static here rather than behind an API. */
#include "ds_comm_impl.h"
#include "ds_env.h"
#include "ds_error.h"
#include "ds_ops.h"

#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { TAG_EXIT = 1, TAG_ASK, TAG_ANSWER };

enum { FLIGHT = 16 };           /* collectives the flight recorder keeps */
typedef enum { F_AGREE, F_FLIGHT, F_DONE, F_FAILED } flight_state;
typedef struct {
    int64_t id;                 /* 0: empty */
    char what[160];
    const char *group;          /* its name; groups live until exit */
    double begun, ended;
    flight_state state;
} flight_entry;

/* A timed-out rank's question (group -1: the exit) and the answers. */
typedef struct { int32_t group, pad; int64_t seq; } ask_msg;
typedef struct { int64_t seq; int32_t at_exit, pad; char where[200]; } answer_msg;

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
    flight_entry flight[FLIGHT];
    int64_t flights;                /* entries recorded so far */
    const char *waiting;            /* what the current wait is for, NULL outside waits */
    double wait_since;
    bool exiting;                   /* in the exit handshake */
    answer_msg *answers;            /* per world rank: the answer being sent to it */
    MPI_Request *answer_reqs;
} S = { .check = -1, .size = 1 };

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

bool ds_comm_launched(void) { return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK"); }
bool ds_comm_is_initialized(void) { return S.initialized && !S.finalized; }

int ds_comm_rank(const ds_comm_group *g) {
    if (g) return g->rank;
    if (S.initialized) return S.rank;
    return ds_comm_launched() ? ds_env_int("OMPI_COMM_WORLD_RANK", ds_env_int("PMIX_RANK", 0)) : 0;
}

int ds_comm_size(const ds_comm_group *g) {
    if (g) return g->size;
    if (S.initialized || !ds_comm_launched()) return S.size;
    if (getenv("OMPI_COMM_WORLD_SIZE")) return ds_env_int("OMPI_COMM_WORLD_SIZE", 1);
    return ds_comm_init() ? 1 : S.size;
}

double ds_comm_timeout(void) {
    if (S.timeout <= 0) {
        const char *v = getenv("DSLUA_COMM_TIMEOUT");
        double t = v ? atof(v) : 0;
        S.timeout = t > 0 ? t : 300;
    }
    return S.timeout;
}

void ds_comm_set_timeout(double seconds) { S.timeout = seconds; }

/* on unless DSLUA_COMM_CHECK=0: without it, ranks that disagree on a
 * count write past each other's buffers */
bool ds_comm_check_enabled(void) {
    if (S.check < 0) {
        const char *v = getenv("DSLUA_COMM_CHECK");
        S.check = !(v && strcmp(v, "0") == 0);
    }
    return S.check;
}

void ds_comm_set_check(bool on) { S.check = on; }


_Noreturn void ds_comm_abort(int code) {
    fflush(stdout);
    fflush(stderr);
    if (S.initialized && !S.finalized) MPI_Abort(MPI_COMM_WORLD, code ? code : 1);
    exit(code);
}

/* ---- the flight recorder ---- */

static flight_entry *flight_find(int64_t id) {
    flight_entry *e = &S.flight[id % FLIGHT];
    return id > 0 && e->id == id ? e : NULL;
}

static int64_t flight_record(const char *what, const ds_comm_group *g) {
    int64_t id = ++S.flights;
    flight_entry *e = &S.flight[id % FLIGHT];
    e->id = id;
    snprintf(e->what, sizeof e->what, "%s", what);
    e->group = g->name;
    e->begun = now();
    e->ended = 0;
    e->state = F_AGREE;
    return id;
}

static void flight_mark(int64_t id, flight_state st) {
    flight_entry *e = flight_find(id);
    if (!e || e->state >= F_DONE) return;
    e->state = st;
    if (st >= F_DONE) e->ended = now();
}

static const char *flight_state_name(flight_state st) {
    static const char *names[] = { "agreeing", "in flight", "done", "failed" };
    return names[st];
}

int ds_comm_flight_count(void) { return (int)(S.flights < FLIGHT ? S.flights : FLIGHT); }

/* Entry i, 0 the oldest kept. */
int ds_comm_flight_get(int i, ds_comm_flight *out) {
    int n = ds_comm_flight_count();
    if (i < 0 || i >= n) return -1;
    const flight_entry *e = &S.flight[(S.flights - n + 1 + i) % FLIGHT];
    out->what = e->what;
    out->group = e->group;
    out->state = flight_state_name(e->state);
    out->age = now() - e->begun;
    out->seconds = (e->ended > 0 ? e->ended : now()) - e->begun;
    return 0;
}

/* Where this rank is, for another rank that timed out. */
static void where_now(char *buf, size_t n) {
    size_t len = 0;
    if (S.waiting) len = (size_t)snprintf(buf, n, "waiting %.1f s in %s", now() - S.wait_since, S.waiting);
    else len = (size_t)snprintf(buf, n, "in ds.comm, not waiting");
    for (int64_t id = S.flights; len < n && id > 0 && id > S.flights - FLIGHT; id--) {
        const flight_entry *e = flight_find(id);
        if (!e || e->state != F_DONE) continue;
        snprintf(buf + len, n - len, "; last done %s on %s, %.1f s ago", e->what, e->group, now() - e->ended);
        break;
    }
}

/* ---- waiting ---- */

static ds_comm_group *group_by_index(int index);

/* Answers a timed-out rank's question: how far this rank got on the group
 * it asks about, and where it is. */
static void answer(int src) {
    ask_msg q;
    MPI_Recv(&q, sizeof q, MPI_BYTE, src, TAG_ASK, S.exitc, MPI_STATUS_IGNORE);
    int flag = 1;
    if (S.answer_reqs[src] != MPI_REQUEST_NULL) MPI_Test(&S.answer_reqs[src], &flag, MPI_STATUS_IGNORE);
    if (!flag) return;              /* still sending the last answer to it */
    answer_msg *a = &S.answers[src];
    memset(a, 0, sizeof *a);
    const ds_comm_group *g = q.group >= 0 ? group_by_index(q.group) : NULL;
    a->seq = g ? g->seq : 0;
    a->at_exit = S.exiting;
    where_now(a->where, sizeof a->where);
    MPI_Isend(a, sizeof *a, MPI_BYTE, src, TAG_ANSWER, S.exitc, &S.answer_reqs[src]);
}

/* Records the exit notices that have arrived, and answers questions. */
static void poll_exits(void) {
    while (S.initialized && !S.finalized) {
        int flag = 0, n = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_ASK, S.exitc, &flag, &st) == MPI_SUCCESS && flag) {
            answer(st.MPI_SOURCE);
            continue;
        }
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
    int who;                /* a peer's world rank, ANY_MEMBER of g, or IGNORE_EXITS (the exit) */
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

enum { ASK_SECONDS = 1 };       /* how long a timed-out rank waits for answers */

/* After a timeout: asks the ranks the wait needs where they are, gives
 * them a second to answer, and writes who did not arrive and where each
 * rank was into buf. */
static void ask_around(const need *nd, char *buf, size_t n) {
    const ds_comm_group *g = nd->g;
    int count = nd->who >= 0 ? 1 : g->size;
    static ask_msg q;               /* read by MPI until the sends complete */
    q.group = nd->who == IGNORE_EXITS ? -1 : g->index;
    q.seq = nd->ordinal;
    answer_msg *got = calloc((size_t)S.size, sizeof *got);
    bool *answered = calloc((size_t)S.size, sizeof *answered), *arrived = calloc((size_t)S.size, sizeof *arrived);
    if (!got || !answered || !arrived) {
        free(got);
        free(answered);
        free(arrived);
        snprintf(buf, n, "(out of memory asking the other ranks)");
        return;
    }
    char mine[200];                 /* before the asking adds its second */
    where_now(mine, sizeof mine);
    int waiting_for = 0;
    for (int i = 0; i < count; i++) {
        int m = nd->who >= 0 ? nd->who : g->ranks[i];
        if (m == S.rank || S.exits[m]) continue;
        MPI_Request r;
        if (MPI_Isend(&q, sizeof q, MPI_BYTE, m, TAG_ASK, S.exitc, &r) == MPI_SUCCESS) {
            MPI_Request_free(&r);
            waiting_for++;
        }
    }
    for (double t0 = now(); waiting_for > 0 && now() - t0 < ASK_SECONDS; backoff(now() - t0)) {
        poll_exits();               /* answers the others' questions meanwhile */
        int flag = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_ANSWER, S.exitc, &flag, &st) != MPI_SUCCESS || !flag) continue;
        int src = st.MPI_SOURCE;
        MPI_Recv(&got[src], sizeof got[src], MPI_BYTE, src, TAG_ANSWER, S.exitc, MPI_STATUS_IGNORE);
        got[src].where[sizeof got[src].where - 1] = 0;
        if (!answered[src]) waiting_for--;
        answered[src] = true;
    }
    /* who did not arrive: answered with less progress, or not at all */
    size_t len;
    int missing = 0;
    for (int i = 0; i < count; i++) {
        int m = nd->who >= 0 ? nd->who : g->ranks[i];
        arrived[m] = nd->who < 0 && (m == S.rank || (q.group < 0 && S.exits[m]) ||
                                     (answered[m] && (q.group < 0 ? got[m].at_exit : got[m].seq >= q.seq)));
        missing += !arrived[m];
    }
    if (nd->who >= 0) {
        len = (size_t)snprintf(buf, n, "rank %d never joined", nd->who);
    } else if (missing) {
        len = (size_t)snprintf(buf, n, "rank%s", missing > 1 ? "s" : "");
        for (int i = 0, k = 0; i < count && len < n; i++)
            if (!arrived[g->ranks[i]]) len += (size_t)snprintf(buf + len, n - len, "%s %d", k++ ? "," : "", g->ranks[i]);
        if (len < n)
            len += (size_t)snprintf(buf + len, n - len, " did not %s", q.group < 0 ? "reach the exit" : "arrive");
    } else {
        len = (size_t)snprintf(buf, n, "every rank of %s arrived", g->name);
    }
    /* where each rank was: all of a small group, else this one and the missing */
    if (len < n) len += (size_t)snprintf(buf + len, n - len, ". Where each rank was:");
    for (int i = 0; i < count + (nd->who >= 0) && len < n; i++) {
        int m = nd->who >= 0 ? (i == 0 ? S.rank : nd->who) : g->ranks[i];
        if (m != S.rank && count > 8 && arrived[m]) continue;
        if (m == S.rank) len += (size_t)snprintf(buf + len, n - len, " rank %d %s;", m, mine);
        else if (S.exits[m] && q.group < 0 && S.exits[m][N_STATUS] == 0)
            len += (size_t)snprintf(buf + len, n - len, " rank %d at the exit;", m);
        else if (S.exits[m])
            len += (size_t)snprintf(buf + len, n - len, " rank %d exited (status %lld);", m,
                                    (long long)S.exits[m][N_STATUS]);
        else if (answered[m]) len += (size_t)snprintf(buf + len, n - len, " rank %d %s;", m, got[m].where);
        else
            len += (size_t)snprintf(buf + len, n - len, " rank %d no answer in %d s (stopped, or busy outside "
                                    "ds.comm);", m, ASK_SECONDS);
    }
    if (len > 0 && len < n && buf[len - 1] == ';') buf[len - 1] = 0;
    free(got);
    free(answered);
    free(arrived);
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
    const char *outer = S.waiting;
    double outer_since = S.wait_since;
    S.waiting = what;
    S.wait_since = t0;
    int rc = 0;
    for (;;) {
        bool done = false;
        if (test(ctx, &done)) { S.broken = true; rc = -1; break; }
        if (done) break;
        poll_exits();
        ds_comm_staged_pump();      /* a staged call another rank waits for starts meanwhile */
        double waited = now() - t0;
        int r = gone(nd);
        if (r >= 0) {
            S.broken = true;
            rc = (ds_fail(DS_ERR_STATE, "%s cannot complete on rank %d: rank %d exited (status %lld) without joining "
                          "it (waited %.1f s)", what, S.rank, r, (long long)S.exits[r][N_STATUS], waited), -1);
            break;
        }
        if (waited > limit) {
            S.broken = true;
            char who[700];
            ask_around(nd, who, sizeof who);
            rc = (ds_fail(DS_ERR_STATE, "%s timed out on rank %d of %d after %.1f s (timeout %g s: "
                          "ds.comm.set_timeout, DSLUA_COMM_TIMEOUT): %s", what, S.rank, S.size, waited, limit, who),
                  -1);
            break;
        }
        backoff(waited);
    }
    S.waiting = outer;
    S.wait_since = outer_since;
    return rc;
}

/* a control exchange within g's current collective */
static int wait_ctl(MPI_Request *r, const ds_comm_group *g, const char *what) {
    need nd = { g, ANY_MEMBER, false, g->seq };
    return wait_for(test_mpi, r, &nd, what, ds_comm_timeout());
}

static int wait_work(ds_comm_work *w) {
    need nd = { w->g, w->peer >= 0 ? w->peer : ANY_MEMBER, w->sending, w->ordinal };
    int rc = wait_for(test_work, w, &nd, w->what, ds_comm_timeout());
    if (rc) flight_mark(w->flight, F_FAILED);
    return rc;
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
    S.answers = calloc((size_t)S.size, sizeof *S.answers);
    S.answer_reqs = malloc((size_t)S.size * sizeof *S.answer_reqs);
    world.ranks = malloc((size_t)S.size * sizeof(int));
    if (!S.exits || !S.sent || !S.received || !S.answers || !S.answer_reqs || !world.ranks)
        return ds_fail(DS_ERR_NOMEM, "comm: out of memory"), -1;
    for (int i = 0; i < S.size; i++) {
        world.ranks[i] = i;
        S.answer_reqs[i] = MPI_REQUEST_NULL;
    }
    S.ngroups = 1;
    world.rank = S.rank;
    world.size = S.size;
    if (ds_comm_mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &world.comm), "comm: MPI_Comm_dup") ||
        ds_comm_mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &world.ctl), "comm: MPI_Comm_dup") ||
        ds_comm_mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &world.staged), "comm: MPI_Comm_dup") ||
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

static ds_comm_group *group_by_index(int index) {
    if (index == 0) return &world;
    for (ds_comm_group *g = S.groups; g; g = g->next)
        if (g->index == index) return g;
    return NULL;
}

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
    /* the collectives' deadline: a rank stuck after its last collective
     * (a loop, a stopped process) is named instead of hanging the job */
    S.exiting = true;
    int rc = ds_comm_mpi_check(MPI_Ibarrier(S.exitc, &barrier), what);
    need nd = { &world, IGNORE_EXITS, false, 0 };
    if (!rc) rc = wait_for(test_mpi, &barrier, &nd, what, ds_comm_timeout());
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
    g->comm = g->ctl = g->staged = MPI_COMM_NULL;
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
        ds_comm_sig sig = ds_comm_sig_of("new_group", -1, n, -1, true);
        if (ds_comm_begin(&w, &sig, false, NULL, what, sizeof what)) { group_free(g); return NULL; }
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
            if (!rc) rc = ds_comm_mpi_check(MPI_Comm_dup(g->comm, &g->staged), "new_group");
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

ds_comm_sig ds_comm_sig_of(const char *op, int dtype, int64_t count, int root, bool strict) {
    ds_comm_sig s;
    memset(&s, 0, sizeof s);
    snprintf(s.op, sizeof s.op, "%s", op);
    s.dtype = dtype;
    s.root = root;
    s.rop = -1;
    s.strict = strict;
    s.count = count;
    return s;
}

/* "all_reduce(f32, 10 elements) #7": count -1 and root -1 left out, seq 0
 * (send/recv, which are not numbered) too; the reduce op with rop */
static void describe(char *buf, size_t n, const ds_comm_sig *s, bool rop) {
    char dt[24] = "?", cnt[48] = "", rt[24] = "", ro[16] = "", sq[32] = "";
    if (s->dtype >= 0) snprintf(dt, sizeof dt, "%s", ds_dtype_name((ds_dtype)s->dtype));
    if (s->count >= 0) snprintf(cnt, sizeof cnt, ", %lld element%s", (long long)s->count, s->count == 1 ? "" : "s");
    if (s->root >= 0) snprintf(rt, sizeof rt, ", root %d", s->root);
    if (rop && s->rop >= 0 && s->rop < DS_COMM_NOPS) snprintf(ro, sizeof ro, ", %s", op_names[s->rop]);
    if (s->seq > 0) snprintf(sq, sizeof sq, " #%lld", (long long)s->seq);
    if (strcmp(s->op, "barrier") == 0) snprintf(buf, n, "barrier()%s", sq);
    else snprintf(buf, n, "%s(%s%s%s%s)%s", s->op, dt, cnt, rt, ro, sq);
}

/* Another primitive, root or reduce op: the ranks' programs went apart. */
static bool same_call(const ds_comm_sig *a, const ds_comm_sig *b) {
    if (strncmp(a->op, b->op, sizeof a->op) != 0 || a->seq != b->seq || a->root != b->root) return false;
    return !(a->rop >= 0 && b->rop >= 0 && a->rop != b->rop);
}

/* The same call on other data: every rank refuses it, and can go on. */
static bool same_data(const ds_comm_sig *a, const ds_comm_sig *b) {
    if (a->dtype >= 0 && b->dtype >= 0 && a->dtype != b->dtype) return false;
    return !(a->strict && b->strict && a->count >= 0 && b->count >= 0 && a->count != b->count);
}

/* Every rank's signature into *all (or checked and freed when all is NULL):
 * a mismatch names both calls and ranks, on every rank. */
static int exchange(ds_comm_group *g, const ds_comm_sig *mine, ds_comm_sig **allp, const char *what) {
    ds_comm_sig *all = malloc((size_t)g->size * sizeof *all);
    if (!all) return ds_fail(DS_ERR_NOMEM, "%s: out of memory", what), -1;
    int rc = ds_comm_ctl_allgather(g, mine, all, sizeof *mine, what);
    for (int r = 1; rc == 0 && ds_comm_check_enabled() && r < g->size; r++) {
        bool call = same_call(&all[r], &all[0]);
        if (call && same_data(&all[r], &all[0])) continue;
        char a[128], b[128];
        bool rop = all[r].rop >= 0 && all[0].rop >= 0 && all[r].rop != all[0].rop;
        describe(a, sizeof a, &all[r], rop);
        describe(b, sizeof b, &all[0], rop);
        if (!call) S.broken = true;
        rc = (ds_fail(call ? DS_ERR_ARG : DS_ERR_STATE, "comm check: rank %d called %s while rank %d called %s",
                      g->ranks[r], a, g->ranks[0], b), -1);
    }
    if (rc || !allp) free(all);
    else *allp = all;
    return rc;
}

int ds_comm_begin(ds_comm_group **gp, ds_comm_sig *sig, bool p2p, ds_comm_sig **all, char *what, size_t n) {
    if (all) *all = NULL;
    if (ds_comm_init()) return -1;
    if (S.broken) return ds_fail(DS_ERR_STATE, "%s: an earlier collective failed on rank %d; the job cannot go on",
                                 sig->op, S.rank), -1;
    ds_comm_group *g = *gp ? *gp : world_group();
    if (g->rank < 0)
        return ds_fail(DS_ERR_ARG, "%s: rank %d is not a member of group %s", sig->op, ds_comm_rank(NULL), g->name),
               -1;
    *gp = g;
    ds_comm_progress();
    sig->seq = p2p ? 0 : ++g->seq;
    describe(what, n, sig, false);
    if (p2p || g->size == 1 || !S.initialized) return 0;
    int64_t id = flight_record(what, g);
    if (!all && !ds_comm_check_enabled()) {
        flight_mark(id, F_FLIGHT);
        return 0;
    }
    int rc = exchange(g, sig, all, what);
    flight_mark(id, rc ? F_FAILED : F_FLIGHT);
    return rc;
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
    w->flight = peer < 0 && g->size > 1 ? S.flights : 0;
    w->nresults = nresults;
    snprintf(w->what, sizeof w->what, "%s", what);
    return w;
}

static void drop(ds_tensor **t) {
    if (*t) ds_tensor_release(*t);
    *t = NULL;
}

/* The bytes a backend reads or writes until completion: no tensor may
 * swap them out meanwhile (ds_storage_pin). */
static void pin_all(ds_comm_work *w, bool on) {
    ds_tensor *ts[] = { w->target, w->buf, w->keep };
    for (size_t i = 0; i < sizeof ts / sizeof *ts; i++) {
        if (!ts[i]) continue;
        if (on) ds_storage_pin(ts[i]->storage, "a collective in flight (wait for it first)");
        else ds_storage_unpin(ts[i]->storage);
    }
    w->pinned = on;
}

void ds_comm_work_free(ds_comm_work *w) {
    if (!w) return;
    if (w->pinned) pin_all(w, false);
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
    if (w->pinned) pin_all(w, false);
    drop(&w->target);
    drop(&w->buf);
    drop(&w->keep);
    w->state = rc ? -1 : 1;
    return rc;
}

ds_comm_work *ds_comm_work_launch(ds_comm_work *w, const ds_comm_backend *be, int rc, void *req) {
    if (rc) {
        flight_mark(w->flight, F_FAILED);
        ds_comm_work_free(w);
        return NULL;
    }
    w->be = be;
    w->req = req;
    pin_all(w, true);
    w->next = S.inflight;
    S.inflight = w;
    return w;
}

ds_comm_work *ds_comm_work_local(ds_comm_work *w) {
    if (finish(w)) { ds_comm_work_free(w); return NULL; }
    return w;
}

/* The backend says w is done: out of the list, results ready. An orphan
 * (its owner let go while it flew) is freed here: true then, and the
 * caller must not touch w again. */
static bool complete(ds_comm_work *w) {
    w->be->free_req(w->req);
    w->req = NULL;
    unlink_work(w);
    flight_mark(w->flight, finish(w) ? F_FAILED : F_DONE);
    if (!w->orphan) return false;
    ds_comm_work_free(w);
    return true;
}

int ds_comm_work_test(ds_comm_work *w, bool *done) {
    *done = false;
    if (w->req && w->state == 0) {
        bool d = false;
        if (test_work(w, &d)) {
            w->state = -1;
            S.broken = true;
            flight_mark(w->flight, F_FAILED);
            return -1;
        }
        if (!d) return 0;
        if (complete(w)) {
            *done = true;
            return 0;
        }
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
        if (complete(w)) return 0;
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
