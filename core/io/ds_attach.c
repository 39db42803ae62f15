/* accept4, pipe2 and struct ucred (SO_PEERCRED) are GNU extensions */
#define _GNU_SOURCE
#include "ds_attach.h"
#include "ds_error.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define MAX_CLIENTS 16

typedef struct {
    char *p;
    size_t len, cap;
} buffer;

static int buffer_add(buffer *b, const void *data, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return -1;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, data, n);
    b->len += n;
    return 0;
}

static void buffer_drop(buffer *b, size_t n) {
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
}

static void put_u32(unsigned char *h, size_t n) {
    h[0] = (unsigned char)(n >> 24);
    h[1] = (unsigned char)(n >> 16);
    h[2] = (unsigned char)(n >> 8);
    h[3] = (unsigned char)n;
}

static size_t get_u32(const char *p) {
    const unsigned char *h = (const unsigned char *)p;
    return (size_t)h[0] << 24 | (size_t)h[1] << 16 | (size_t)h[2] << 8 | (size_t)h[3];
}

static int buffer_frame(buffer *b, const void *data, size_t len) {
    unsigned char h[4];
    put_u32(h, len);
    return buffer_add(b, h, 4) || buffer_add(b, data, len) ? -1 : 0;
}

/* The first complete frame of b, moved out (malloc'd): 1; 0 when b holds
 * less than a frame; -1 when its length is over the limit. */
static int buffer_take_frame(buffer *b, char **data, size_t *len) {
    if (b->len < 4) return 0;
    size_t n = get_u32(b->p);
    if (n > DS_ATTACH_MAX_FRAME) return -1;
    if (b->len < 4 + n) return 0;
    char *d = malloc(n + 1);
    if (!d) return -1;
    memcpy(d, b->p + 4, n);
    d[n] = '\0';
    buffer_drop(b, 4 + n);
    *data = d;
    *len = n;
    return 1;
}

/* ------------------------------------------------------------ checks */

static bool private_mode(mode_t m) { return (m & 077) == 0; }

int ds_attach_check_dir(const char *dir, bool create) {
    struct stat st;
    if (lstat(dir, &st) != 0) {
        if (errno != ENOENT || !create) {
            ds_fail(DS_ERR_IO, "attach: cannot use %s: %s", dir, strerror(errno));
            return -1;
        }
        if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
            ds_fail(DS_ERR_IO, "attach: cannot create %s: %s", dir, strerror(errno));
            return -1;
        }
        if (lstat(dir, &st) != 0) {
            ds_fail(DS_ERR_IO, "attach: cannot use %s: %s", dir, strerror(errno));
            return -1;
        }
    }
    if (S_ISLNK(st.st_mode) || !S_ISDIR(st.st_mode)) {
        ds_fail(DS_ERR_STATE, "attach: %s is not a directory%s", dir, S_ISLNK(st.st_mode) ? " (a symbolic link)" : "");
        return -1;
    }
    if (st.st_uid != geteuid()) {
        ds_fail(DS_ERR_STATE, "attach: %s belongs to uid %d, not to this user (uid %d)", dir, (int)st.st_uid,
                (int)geteuid());
        return -1;
    }
    if (!private_mode(st.st_mode)) {
        ds_fail(DS_ERR_STATE, "attach: %s has mode %04o: group or others may open it (chmod 700 %s)", dir,
                (unsigned)(st.st_mode & 07777), dir);
        return -1;
    }
    return 0;
}

/* The directory part of path checked, for listen and dial alike. */
static int check_parent(const char *path) {
    const char *slash = strrchr(path, '/');
    char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
    if (!slash) return ds_attach_check_dir(".", false);
    size_t n = slash == path ? 1 : (size_t)(slash - path);
    memcpy(dir, path, n);
    dir[n] = '\0';
    return ds_attach_check_dir(dir, false);
}

static int socket_address(const char *path, struct sockaddr_un *a) {
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    if (strlen(path) >= sizeof a->sun_path) {
        ds_fail(DS_ERR_ARG, "attach: socket path %s is longer than %d bytes (set DSLUA_ATTACH_DIR to a shorter "
                "directory)", path, (int)sizeof a->sun_path - 1);
        return -1;
    }
    strcpy(a->sun_path, path);
    return 0;
}

/* ------------------------------------------------------------ the server */

/* The sockets this process serves, for ds_attach_unlink_all: a signal
 * that ends the process removes them without taking any lock. */
#define MAX_SERVED 4
static char served[MAX_SERVED][sizeof(((struct sockaddr_un *)0)->sun_path)];

static void serving(const char *path, bool on) {
    for (int i = 0; i < MAX_SERVED; i++) {
        if (on ? served[i][0] == '\0' : strcmp(served[i], path) == 0) {
            if (on) strcpy(served[i], path); else served[i][0] = '\0';
            return;
        }
    }
}

void ds_attach_unlink_all(void) {
    for (int i = 0; i < MAX_SERVED; i++)
        if (served[i][0]) unlink(served[i]);
}

typedef struct request {
    struct request *next;
    uint64_t client;
    char *data;
    size_t len;
} request;

typedef struct {
    int fd;
    uint64_t id;
    buffer in, out;
    int waiting;                 /* requests queued and not answered yet */
    double last;                 /* when it last sent or took bytes (monotonic s) */
} client;

struct ds_attach_server {
    char *path;
    uid_t uid;
    int listen_fd, wake[2];
    pthread_t thread;
    pthread_mutex_t mu;          /* guards everything below */
    pthread_cond_t arrived;
    bool stop;
    client clients[MAX_CLIENTS];
    int nclients;
    uint64_t next_id;
    request *head, *tail;
};

static double monotonic(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Under mu. A request whose memory could not be had is dropped: its
 * client waits, the job goes on. */
static void enqueue(ds_attach_server *s, uint64_t id, char *data, size_t len) {
    request *r = malloc(sizeof *r);
    if (!r) { free(data); return; }
    *r = (request){ NULL, id, data, len };
    if (s->tail) s->tail->next = r; else s->head = r;
    s->tail = r;
    pthread_cond_signal(&s->arrived);
}

static void notice(ds_attach_server *s, const char *text) {
    char *d = strdup(text);
    if (d) enqueue(s, 0, d, strlen(d));
}

/* tell: queue a NULL request from the client, so the job forgets its
 * session (what it typed into the job's REPL). */
static void drop_client(ds_attach_server *s, int k, bool tell) {
    client *c = &s->clients[k];
    if (tell) enqueue(s, c->id, NULL, 0);
    if (c->fd >= 0) close(c->fd);
    free(c->in.p);
    free(c->out.p);
    s->clients[k] = s->clients[--s->nclients];
}

/* A peer of another uid gets one frame saying why, then the door. */
static void refuse(int fd, const char *why) {
    unsigned char h[4];
    size_t n = strlen(why);
    put_u32(h, n);
    if (send(fd, h, 4, MSG_NOSIGNAL) == 4 && send(fd, why, n, MSG_NOSIGNAL) < 0) { /* the peer may be gone already */ }
    close(fd);
}

/* A 17th client takes the place of the one idle longest (no request
 * waiting, nothing left to send it), so idle peers never lock the job's
 * user out; false when every client waits for a reply. */
static bool drop_idlest(ds_attach_server *s) {
    int k = -1;
    for (int j = 0; j < s->nclients; j++) {
        client *c = &s->clients[j];
        if (!c->waiting && !c->out.len && (k < 0 || c->last < s->clients[k].last)) k = j;
    }
    if (k < 0) return false;
    char msg[200];
    snprintf(msg, sizeof msg, "error: attach: disconnected: a new client came and the job serves %d at most; this one "
             "was idle longest (%.0f s)", MAX_CLIENTS, monotonic() - s->clients[k].last);
    refuse(s->clients[k].fd, msg);
    s->clients[k].fd = -1;
    drop_client(s, k, true);
    return true;
}

static void accept_one(ds_attach_server *s) {
    int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    struct ucred cred;
    socklen_t len = sizeof cred;
    char msg[256];
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
        refuse(fd, "error: attach: refused: cannot read the peer's credentials");
        return;
    }
    if (cred.uid != s->uid) {
        snprintf(msg, sizeof msg, "error: attach: refused: the job runs as uid %d, this client as uid %d",
                 (int)s->uid, (int)cred.uid);
        refuse(fd, msg);
        snprintf(msg, sizeof msg, "attach: refused a connection from uid %d (pid %d): the job runs as uid %d",
                 (int)cred.uid, (int)cred.pid, (int)s->uid);
        notice(s, msg);
        return;
    }
    if (s->nclients == MAX_CLIENTS && !drop_idlest(s)) {
        refuse(fd, "error: attach: refused: the job already has 16 attached clients, each waiting for a reply");
        return;
    }
    s->clients[s->nclients++] = (client){ .fd = fd, .id = ++s->next_id, .last = monotonic() };
}

/* Reads what client k sent and queues its complete frames; false when it
 * hung up or broke the protocol (the caller drops it). */
static bool read_client(ds_attach_server *s, int k) {
    client *c = &s->clients[k];
    char chunk[65536];
    for (;;) {
        ssize_t n = read(c->fd, chunk, sizeof chunk);
        if (n == 0) return false;
        if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
        if (buffer_add(&c->in, chunk, (size_t)n)) return false;
        c->last = monotonic();
        char *data;
        size_t len;
        int got;
        while ((got = buffer_take_frame(&c->in, &data, &len)) == 1) {
            enqueue(s, c->id, data, len);
            c->waiting++;
        }
        if (got < 0) return false;
    }
}

static bool write_client(client *c) {
    while (c->out.len) {
        ssize_t n = send(c->fd, c->out.p, c->out.len, MSG_NOSIGNAL);     /* a client gone: EPIPE, no signal */
        if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
        buffer_drop(&c->out, (size_t)n);
        c->last = monotonic();
    }
    return true;
}

static void *serve(void *arg) {
    ds_attach_server *s = arg;
    struct pollfd fds[2 + MAX_CLIENTS];
    uint64_t ids[MAX_CLIENTS];
    for (;;) {
        pthread_mutex_lock(&s->mu);
        if (s->stop) { pthread_mutex_unlock(&s->mu); return NULL; }
        int n = s->nclients;
        fds[0] = (struct pollfd){ s->wake[0], POLLIN, 0 };
        fds[1] = (struct pollfd){ s->listen_fd, POLLIN, 0 };
        for (int k = 0; k < n; k++) {
            fds[2 + k] = (struct pollfd){ s->clients[k].fd, (short)(POLLIN | (s->clients[k].out.len ? POLLOUT : 0)), 0 };
            ids[k] = s->clients[k].id;
        }
        pthread_mutex_unlock(&s->mu);
        if (poll(fds, (nfds_t)(2 + n), -1) < 0) continue;
        pthread_mutex_lock(&s->mu);
        if (fds[0].revents) {
            char junk[64];
            while (read(s->wake[0], junk, sizeof junk) > 0) {}
        }
        for (int j = 0; j < n; j++) {
            if (!fds[2 + j].revents) continue;
            int k = 0;                /* the client may have moved in the array */
            while (k < s->nclients && s->clients[k].id != ids[j]) k++;
            if (k == s->nclients) continue;
            bool ok = true;
            if (fds[2 + j].revents & (POLLIN | POLLHUP | POLLERR)) ok = read_client(s, k);
            if (ok && (fds[2 + j].revents & POLLOUT)) ok = write_client(&s->clients[k]);
            if (!ok) drop_client(s, k, true);
        }
        if (fds[1].revents & POLLIN) accept_one(s);
        pthread_mutex_unlock(&s->mu);
    }
}

ds_attach_server *ds_attach_listen(const char *path, uid_t uid) {
    struct sockaddr_un addr;
    if (socket_address(path, &addr) || check_parent(path)) return NULL;
    struct stat st;
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) return ds_fail(DS_ERR_STATE, "attach: %s exists and is not a socket", path);
        unlink(path);         /* a job that died left it; the directory is ours alone */
    }
    ds_attach_server *s = calloc(1, sizeof *s);
    if (!s) return ds_fail(DS_ERR_NOMEM, "attach: out of memory");
    s->uid = uid;
    s->listen_fd = s->wake[0] = s->wake[1] = -1;
    s->path = strdup(path);
    const char *failed = NULL;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (!s->path) failed = "out of memory";
    else if (fd < 0) failed = "socket";
    else if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0) failed = "bind";
    else if (chmod(path, 0600) != 0) failed = "chmod";
    else if (listen(fd, 8) != 0) failed = "listen";
    else if (pipe2(s->wake, O_CLOEXEC | O_NONBLOCK) != 0) failed = "pipe";
    if (failed) {
        ds_fail(DS_ERR_IO, "attach: cannot serve %s: %s: %s", path, failed, strerror(errno));
        if (fd >= 0) { close(fd); unlink(path); }
        if (s->wake[0] >= 0) { close(s->wake[0]); close(s->wake[1]); }
        free(s->path);
        free(s);
        return NULL;
    }
    s->listen_fd = fd;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->arrived, NULL);
    /* signals stay with the main thread: Ctrl-C, SIGTERM and MPI's own */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&s->thread, NULL, serve, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        ds_fail(DS_ERR_STATE, "attach: cannot start the serving thread: %s", strerror(rc));
        close(fd);
        unlink(path);
        close(s->wake[0]);
        close(s->wake[1]);
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->arrived);
        free(s->path);
        free(s);
        return NULL;
    }
    serving(path, true);
    return s;
}

int ds_attach_next(ds_attach_server *s, double timeout, uint64_t *from, char **data, size_t *len) {
    pthread_mutex_lock(&s->mu);
    if (!s->head && timeout > 0) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        double t = (double)until.tv_sec + (double)until.tv_nsec * 1e-9 + timeout;
        until.tv_sec = (time_t)t;
        until.tv_nsec = (long)((t - (double)until.tv_sec) * 1e9);
        while (!s->head && pthread_cond_timedwait(&s->arrived, &s->mu, &until) == 0) {}
    }
    request *r = s->head;
    if (r) {
        s->head = r->next;
        if (!s->head) s->tail = NULL;
    }
    pthread_mutex_unlock(&s->mu);
    if (!r) return 0;
    *from = r->client;
    *data = r->data;
    *len = r->len;
    free(r);
    return 1;
}

int ds_attach_reply(ds_attach_server *s, uint64_t id, const void *data, size_t len) {
    if (len > DS_ATTACH_MAX_FRAME) {
        ds_fail(DS_ERR_ARG, "attach: a reply of %zu bytes is over the %u-byte limit", len, DS_ATTACH_MAX_FRAME);
        return -1;
    }
    int rc = 1;
    pthread_mutex_lock(&s->mu);
    for (int k = 0; k < s->nclients; k++) {
        client *c = &s->clients[k];
        if (c->id != id) continue;
        if (c->waiting) c->waiting--;
        if (c->out.len && c->out.len + 4 + len > DS_ATTACH_MAX_UNREAD) {
            /* a client that does not read: its replies would grow the job without end */
            char msg[200];
            snprintf(msg, sizeof msg, "attach: client %llu disconnected: %zu bytes of replies it has not read "
                     "(at most %u)", (unsigned long long)id, c->out.len + 4 + len, DS_ATTACH_MAX_UNREAD);
            notice(s, msg);
            drop_client(s, k, true);
            break;
        }
        rc = buffer_frame(&c->out, data, len);
        if (rc) ds_fail(DS_ERR_NOMEM, "attach: out of memory for a reply of %zu bytes", len);
        break;
    }
    pthread_mutex_unlock(&s->mu);
    if (rc == 0 && write(s->wake[1], "", 1) < 0) { /* the pipe is full: the thread is awake anyway */ }
    return rc;
}

/* Replies still queued when the job ends (the last request often asks it
 * to go on) get up to a second to reach their clients. */
static void flush_replies(ds_attach_server *s) {
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int k = 0; k < s->nclients; k++) {
        client *c = &s->clients[k];
        while (c->out.len && write_client(c)) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            int left_ms = 1000 - (int)((now.tv_sec - t0.tv_sec) * 1000 + (now.tv_nsec - t0.tv_nsec) / 1000000);
            if (left_ms <= 0) return;
            struct pollfd p = { c->fd, POLLOUT, 0 };
            if (c->out.len && poll(&p, 1, left_ms) <= 0) return;
        }
    }
}

void ds_attach_close(ds_attach_server *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    pthread_mutex_unlock(&s->mu);
    if (write(s->wake[1], "", 1) < 0) { /* as above */ }
    pthread_join(s->thread, NULL);
    flush_replies(s);
    while (s->nclients) drop_client(s, 0, false);
    while (s->head) {
        request *r = s->head;
        s->head = r->next;
        free(r->data);
        free(r);
    }
    close(s->listen_fd);
    close(s->wake[0]);
    close(s->wake[1]);
    serving(s->path, false);
    unlink(s->path);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->arrived);
    free(s->path);
    free(s);
}

/* ------------------------------------------------------------ the client */

struct ds_attach_conn {
    int fd;
    buffer in;
};

ds_attach_conn *ds_attach_dial(const char *path) {
    struct sockaddr_un addr;
    if (socket_address(path, &addr) || check_parent(path)) return NULL;
    struct stat st;
    if (lstat(path, &st) != 0) return ds_fail(DS_ERR_IO, "attach: cannot use %s: %s", path, strerror(errno));
    if (!S_ISSOCK(st.st_mode)) return ds_fail(DS_ERR_STATE, "attach: %s is not a socket", path);
    if (st.st_uid != geteuid())
        return ds_fail(DS_ERR_STATE, "attach: %s belongs to uid %d, not to this user (uid %d)", path,
                       (int)st.st_uid, (int)geteuid());
    if (!private_mode(st.st_mode))
        return ds_fail(DS_ERR_STATE, "attach: %s has mode %04o: group or others may open it", path,
                       (unsigned)(st.st_mode & 07777));
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return ds_fail(DS_ERR_IO, "attach: socket: %s", strerror(errno));
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        int e = errno;
        close(fd);
        return ds_fail(DS_ERR_IO, "attach: cannot connect to %s: %s%s", path, strerror(e),
                       e == ECONNREFUSED ? " (the job is no longer running)" : "");
    }
    ds_attach_conn *c = calloc(1, sizeof *c);
    if (!c) { close(fd); return ds_fail(DS_ERR_NOMEM, "attach: out of memory"); }
    c->fd = fd;
    return c;
}

int ds_attach_send(ds_attach_conn *c, const void *data, size_t len) {
    if (len > DS_ATTACH_MAX_FRAME) {
        ds_fail(DS_ERR_ARG, "attach: a request of %zu bytes is over the %u-byte limit", len, DS_ATTACH_MAX_FRAME);
        return -1;
    }
    buffer b = {0};
    if (buffer_frame(&b, data, len)) { free(b.p); ds_fail(DS_ERR_NOMEM, "attach: out of memory"); return -1; }
    size_t off = 0;
    while (off < b.len) {
        ssize_t n = send(c->fd, b.p + off, b.len - off, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            free(b.p);
            ds_fail(DS_ERR_IO, "attach: cannot send to the job: %s", strerror(errno));
            return -1;
        }
        off += (size_t)n;
    }
    free(b.p);
    return 0;
}

int ds_attach_recv(ds_attach_conn *c, double timeout, char **data, size_t *len) {
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        int got = buffer_take_frame(&c->in, data, len);
        if (got < 0) { ds_fail(DS_ERR_IO, "attach: the job sent a malformed message"); return -1; }
        if (got) return 1;
        int wait_ms = -1;
        if (timeout >= 0) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            double left = timeout - ((double)(now.tv_sec - t0.tv_sec) + (double)(now.tv_nsec - t0.tv_nsec) * 1e-9);
            if (left <= 0) return 0;
            wait_ms = (int)(left * 1000) + 1;
        }
        struct pollfd p = { c->fd, POLLIN, 0 };
        int rc = poll(&p, 1, wait_ms);
        if (rc < 0 && errno == EINTR) return 0;     /* the caller looks at its signal */
        if (rc < 0) { ds_fail(DS_ERR_IO, "attach: poll: %s", strerror(errno)); return -1; }
        if (rc == 0) continue;
        char chunk[65536];
        ssize_t n = read(c->fd, chunk, sizeof chunk);
        if (n < 0 && errno == EINTR) return 0;
        if (n < 0) { ds_fail(DS_ERR_IO, "attach: cannot read from the job: %s", strerror(errno)); return -1; }
        if (n == 0) { ds_fail(DS_ERR_IO, "attach: the job closed the connection (it has ended)"); return -1; }
        if (buffer_add(&c->in, chunk, (size_t)n)) { ds_fail(DS_ERR_NOMEM, "attach: out of memory"); return -1; }
    }
}

void ds_attach_hangup(ds_attach_conn *c) {
    if (!c) return;
    close(c->fd);
    free(c->in.p);
    free(c);
}
