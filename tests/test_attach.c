/* The attach socket and the reload hash without Lua: SHA-256 known
 * answers, frames through the serving thread, a peer of another uid refused
 * (SO_PEERCRED) and, run as root, the kernel refusing another user at the
 * 0700 directory and at the 0600 socket itself. */
#define _GNU_SOURCE
#include "ds_attach.h"
#include "ds_error.h"
#include "ds_sha256.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

static void test_sha256(void) {
    char hex[DS_SHA256_HEX];
    check(ds_sha256_bytes("", 0, hex) == 0 &&
          strcmp(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855") == 0, "sha256('') = %s", hex);
    check(ds_sha256_bytes("abc", 3, hex) == 0 &&
          strcmp(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad") == 0, "sha256('abc') = %s", hex);
}

static void test_frames(const char *dir) {
    char path[256];
    snprintf(path, sizeof path, "%s/frames.sock", dir);
    ds_attach_server *s = ds_attach_listen(path, geteuid());
    check(s != NULL, "listen: %s", ds_error_message());
    if (!s) return;
    struct stat st;
    check(stat(path, &st) == 0 && (st.st_mode & 0777) == 0600, "the socket is 0600 (%o)", st.st_mode & 0777);
    ds_attach_conn *c = ds_attach_dial(path);
    check(c != NULL, "dial: %s", ds_error_message());
    if (!c) { ds_attach_close(s); return; }
    check(ds_attach_send(c, "hello", 5) == 0, "send");
    uint64_t from;
    char *data;
    size_t len;
    check(ds_attach_next(s, 5, &from, &data, &len) == 1 && len == 5 && memcmp(data, "hello", 5) == 0,
          "the thread queued the request");
    free(data);
    check(ds_attach_next(s, 0, &from, &data, &len) == 0, "nothing more queued");
    check(ds_attach_reply(s, from, "world!", 6) == 0, "reply");
    check(ds_attach_recv(c, 5, &data, &len) == 1 && len == 6 && memcmp(data, "world!", 6) == 0, "the reply came back");
    free(data);
    check(ds_attach_recv(c, 0.05, &data, &len) == 0, "recv times out");
    ds_attach_hangup(c);
    check(ds_attach_next(s, 5, &from, &data, &len) == 1 && data == NULL, "a hang-up is queued as a NULL request");
    check(ds_attach_reply(s, from, "late", 4) == 1, "a reply to a client that left is dropped");
    ds_attach_close(s);
    check(access(path, F_OK) != 0, "close removes the socket");
}

static void test_peer_uid(const char *dir) {
    char path[256];
    snprintf(path, sizeof path, "%s/uid.sock", dir);
    ds_attach_server *s = ds_attach_listen(path, geteuid() + 4242);    /* as if the job were another user's */
    if (!s) { check(0, "listen: %s", ds_error_message()); return; }
    ds_attach_conn *c = ds_attach_dial(path);
    char *data = NULL;
    size_t len;
    check(c && ds_attach_recv(c, 5, &data, &len) == 1 && strstr(data, "error: attach: refused: the job runs as uid"),
          "the peer is told it was refused: %s", data ? data : ds_error_message());
    free(data);
    uint64_t from = 1;
    check(ds_attach_next(s, 5, &from, &data, &len) == 1 && from == 0 && strstr(data, "refused a connection from uid"),
          "the job gets a notice");
    free(data);
    ds_attach_hangup(c);
    ds_attach_close(s);
}

/* Connects to path as uid/gid 65534 (a raw connect, no client checks):
 * the errno it got, or 0 when it got in. */
static int connect_as_nobody(const char *path) {
    pid_t pid = fork();
    if (pid == 0) {
        if (setgid(65534) || setuid(65534)) _exit(200);
        int fd = socket(AF_UNIX, SOCK_STREAM, 0);
        struct sockaddr_un a = { .sun_family = AF_UNIX };
        snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
        _exit(connect(fd, (struct sockaddr *)&a, sizeof a) == 0 ? 0 : errno);
    }
    int status;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void test_other_user(const char *dir) {
    if (geteuid() != 0) {
        printf("test_attach: not root: the other-user checks need setuid, skipped\n");
        return;
    }
    char path[256];
    snprintf(path, sizeof path, "%s/other.sock", dir);
    ds_attach_server *s = ds_attach_listen(path, geteuid());
    if (!s) { check(0, "listen: %s", ds_error_message()); return; }
    int e = connect_as_nobody(path);
    check(e == EACCES, "another user stops at the 0700 directory (errno %d)", e);
    chmod(dir, 0755);                /* the directory open: the socket's own 0600 still refuses */
    e = connect_as_nobody(path);
    check(e == EACCES, "another user stops at the 0600 socket (errno %d)", e);
    check(ds_attach_check_dir(dir, false) != 0 && strstr(ds_error_message(), "has mode 0755"),
          "a 0755 directory is refused: %s", ds_error_message());
    check(ds_attach_dial(path) == NULL && strstr(ds_error_message(), "has mode 0755"), "the client refuses it too");
    chmod(dir, 0700);
    ds_attach_close(s);
}

int main(void) {
    char dir[] = "/tmp/test_attach.XXXXXX";
    if (!mkdtemp(dir)) { perror("mkdtemp"); return 1; }
    test_sha256();
    test_frames(dir);
    test_peer_uid(dir);
    test_other_user(dir);
    rmdir(dir);
    return check_summary("test_attach");
}
