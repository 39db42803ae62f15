/* The Unix socket behind `dslua attach`: a running job serves one per rank,
 * a client (the attach REPL) connects to it. No network port.
 *
 * Security rests on three things: the socket lives in a directory only
 * its owner can open (0700, owned by the effective uid, not a symbolic
 * link), the socket itself is 0600, and the server accepts only peers of
 * one uid, read with SO_PEERCRED (the job's own, unless a test says
 * otherwise). The client checks the directory and the socket the same way
 * before it connects, so it never talks to a socket someone else planted.
 *
 * The job side is a thread: it accepts connections, reads requests and
 * queues them, and writes the replies the training loop queues, so the
 * training loop only ever looks at the queue (ds_attach_next) at its step
 * boundary and never blocks on a client. Messages are frames: a 4-byte
 * big-endian length, then that many bytes. */
#ifndef DS_ATTACH_H
#define DS_ATTACH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define DS_ATTACH_MAX_FRAME (64u << 20)     /* bytes in one message */
#define DS_ATTACH_MAX_UNREAD (16u << 20)    /* bytes of replies a client may leave unread before the next */

typedef struct ds_attach_server ds_attach_server;
typedef struct ds_attach_conn ds_attach_conn;

/* Checks that dir is a directory (not a link) owned by the effective uid
 * with no group or other permission bits; with create, makes it (0700)
 * when missing (its parent must exist). 0, or -1 with the error naming
 * dir and what is wrong. */
int ds_attach_check_dir(const char *dir, bool create);

/* Serves the socket path (its directory must pass ds_attach_check_dir; a
 * stale socket there is replaced) with mode 0600, accepting peers of uid
 * only. NULL with the error. */
ds_attach_server *ds_attach_listen(const char *path, uid_t uid);

/* The next queued request, waiting up to timeout seconds (0: only looks).
 * Returns 1 with *client (> 0), *data (malloc'd, the caller frees it) and
 * *len; 1 with *data NULL when that client has hung up; 1 with *client 0
 * for a notice of the server's own (a refused peer); 0 when nothing came. */
int ds_attach_next(ds_attach_server *s, double timeout, uint64_t *client, char **data, size_t *len);

/* Queues a reply frame for client. 0; 1 when that client has gone (its
 * reply is dropped: detaching is not an error) or has been disconnected
 * for leaving more than DS_ATTACH_MAX_UNREAD bytes unread (a notice says
 * so); -1 with the error. At MAX_CLIENTS clients a new one takes the
 * place of the one idle longest. */
int ds_attach_reply(ds_attach_server *s, uint64_t client, const void *data, size_t len);

/* Stops the thread, closes every connection and removes the socket. */
void ds_attach_close(ds_attach_server *s);
/* Removes every socket this process serves (async-signal-safe: for the
 * handler of a signal that ends the process). */
void ds_attach_unlink_all(void);

/* Connects to the socket at path after checking it and its directory
 * (owner and mode bits as above). NULL with the error. */
ds_attach_conn *ds_attach_dial(const char *path);
/* Sends one frame (blocking). 0, or -1 with the error. */
int ds_attach_send(ds_attach_conn *c, const void *data, size_t len);
/* Receives one frame, waiting up to timeout seconds (< 0: no limit).
 * 1 with *data (malloc'd) and *len; 0 when the time ran out or a signal
 * came; -1 with the error (the job closed the connection, ...). */
int ds_attach_recv(ds_attach_conn *c, double timeout, char **data, size_t *len);
void ds_attach_hangup(ds_attach_conn *c);

#endif
