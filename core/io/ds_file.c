#define _GNU_SOURCE          /* renameat2, RENAME_EXCHANGE */
#include "ds_file.h"
#include "ds_error.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int ds_file_mkdirs(const char *path, mode_t mode) {
    char buf[PATH_MAX];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof buf) return ds_fail(DS_ERR_ARG, "mkdir: bad path '%s'", path), -1;
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != '\0') continue;
        char c = buf[i];
        buf[i] = '\0';
        /* each directory walked as the guarded open walks it: none is made
         * through a link another user planted */
        int fd = ds_file_open_dir(buf);
        if (fd < 0) {
            /* missing, or made by another rank since (EEXIST); a directory
             * refused for its owner or mode is refused again below */
            if (mkdir(buf, mode) != 0 && errno != EEXIST)
                return ds_fail(DS_ERR_IO, "cannot create directory '%s': %s", buf, strerror(errno)), -1;
            fd = ds_file_open_dir(buf);
        }
        if (fd < 0) return -1;
        close(fd);
        buf[i] = c;
    }
    return 0;
}

bool ds_file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

int ds_file_fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ds_fail(DS_ERR_IO, "cannot open directory '%s': %s", dir, strerror(errno)), -1;
    int rc = fsync(fd);
    int err = errno;
    close(fd);
    if (rc != 0) return ds_fail(DS_ERR_IO, "cannot fsync directory '%s': %s", dir, strerror(err)), -1;
    return 0;
}

int ds_file_fsync_parent(const char *path) {
    char dir[PATH_MAX];
    const char *slash = strrchr(path, '/');
    if (!slash) return ds_file_fsync_dir(".");
    if (slash == path) return ds_file_fsync_dir("/");
    size_t n = (size_t)(slash - path);
    if (n >= sizeof dir) return ds_fail(DS_ERR_ARG, "path too long: '%s'", path), -1;
    memcpy(dir, path, n);
    dir[n] = '\0';
    return ds_file_fsync_dir(dir);
}
int ds_file_replace_dir(const char *src, const char *dst) {
    if (!ds_file_exists(dst)) {
        if (rename(src, dst) != 0)
            return ds_fail(DS_ERR_IO, "cannot rename '%s' to '%s': %s", src, dst, strerror(errno)), -1;
        return ds_file_fsync_parent(dst);
    }
    if (renameat2(AT_FDCWD, src, AT_FDCWD, dst, RENAME_EXCHANGE) == 0)
        return ds_file_fsync_parent(dst) || ds_file_remove_tree(src) ? -1 : 0;     /* src holds the old one */
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
        return ds_fail(DS_ERR_IO, "cannot exchange '%s' and '%s': %s", src, dst, strerror(errno)), -1;
    char old[PATH_MAX];
    if (snprintf(old, sizeof old, "%s.old", src) >= (int)sizeof old)
        return ds_fail(DS_ERR_ARG, "path too long: '%s'", src), -1;
    if (ds_file_remove_tree(old)) return -1;
    if (rename(dst, old) != 0 || rename(src, dst) != 0)
        return ds_fail(DS_ERR_IO, "cannot move '%s' into '%s' (the old one is in '%s'): %s", src, dst, old,
                       strerror(errno)), -1;
    return ds_file_fsync_parent(dst) || ds_file_remove_tree(old) ? -1 : 0;
}

/* nftw stops at a non-zero return and passes it on: 1 says the error is set */
static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)flag; (void)ftw;
    if (remove(path) != 0 && errno != ENOENT) {
        ds_fail(DS_ERR_IO, "cannot remove '%s': %s", path, strerror(errno));
        return 1;
    }
    return 0;
}

int ds_file_remove_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return 0;
    int rc = nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    if (rc == -1) ds_fail(DS_ERR_IO, "cannot remove '%s': %s", path, strerror(errno));
    return rc ? -1 : 0;
}

/* ---------------------------------------------------------------- guarded opens */

#define MAX_LINKS 40         /* as the kernel's */

static bool trusted_uid(uid_t uid) { return uid == 0 || uid == geteuid(); }

/* A message's head: "'path': " when what it is about (`at`) is not path. */
static const char *about(char head[PATH_MAX + 4], const char *path, const char *at) {
    if (strcmp(path, at) == 0) return "";
    snprintf(head, PATH_MAX + 4, "'%s': ", path);
    return head;
}

/* The directory open as fd, shown as `at`: 0, or -1 when another user
 * could put a link or a file in it. Writing, that is any other user's
 * directory and a group- or world-writable one without the sticky bit;
 * reading, only a world-writable one without it: a directory of another
 * user (a container's root reading a bind mount, a shared project folder)
 * holds what that user chose to put there. */
static int check_dir(int fd, const char *at, const char *path, bool writing) {
    struct stat st;
    if (fstat(fd, &st) != 0) return ds_fail(DS_ERR_IO, "'%s': cannot stat '%s': %s", path, at, strerror(errno)), -1;
    mode_t open_to = writing ? S_IWGRP | S_IWOTH : S_IWOTH;
    const char *why = writing && !trusted_uid(st.st_uid) ? "owned by another user"
                    : (st.st_mode & open_to) && !(st.st_mode & S_ISVTX)
                    ? (writing ? "writable by group or others without the sticky bit"
                               : "writable by others without the sticky bit") : NULL;
    if (!why) return 0;
    char head[PATH_MAX + 4];
    return ds_fail(DS_ERR_IO, "%sthe directory '%s' is %s (mode %o, owner uid %u; this process runs as uid %u): "
                   "another user could plant links or files there, so dslua does not %s it", about(head, path, at),
                   at, why, (unsigned)(st.st_mode & 07777), (unsigned)st.st_uid, (unsigned)geteuid(),
                   writing ? "write through" : "read from"), -1;
}

/* Where a walk starts: "/" for an absolute path, "." otherwise. */
static int walk_start(bool absolute, char *at, const char *path, bool writing) {
    strcpy(at, absolute ? "/" : ".");
    int fd = open(at, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ds_fail(DS_ERR_IO, "'%s': cannot open '%s': %s", path, at, strerror(errno)), -1;
    if (check_dir(fd, at, path, writing)) return close(fd), -1;
    return fd;
}

/* at = at/name: where the walk is, for messages ("name" from ".") */
static void walk_into(char *at, const char *name) {
    size_t n = strcmp(at, ".") == 0 ? 0 : strlen(at);
    snprintf(at + n, PATH_MAX - n, "%s%s", n == 0 || at[n - 1] == '/' ? "" : "/", name);
}

/* The target of the trusted link `name` in fd followed by what is left of
 * the path, into next. A link is trusted when root or this user owns it,
 * or, reading, the owner of the directory holding it (who could have put
 * the file there as well). -1 with the error. */
static int follow(int fd, const char *name, const struct stat *st, const char *after, char *next, const char *at,
                  const char *path, bool writing) {
    char link[PATH_MAX], target[PATH_MAX], head[PATH_MAX + 4];
    snprintf(link, sizeof link, "%s", at);
    walk_into(link, name);
    struct stat dir;
    bool dir_owners = !writing && fstat(fd, &dir) == 0 && dir.st_uid == st->st_uid;
    if (!trusted_uid(st->st_uid) && !dir_owners)
        return ds_fail(DS_ERR_IO, "%s'%s' is a link owned by another user (uid %u): dslua does not follow it",
                       about(head, path, link), link, (unsigned)st->st_uid), -1;
    ssize_t t = readlinkat(fd, name, target, sizeof target - 1);
    if (t < 0) return ds_fail(DS_ERR_IO, "'%s': cannot read the link '%s': %s", path, link, strerror(errno)), -1;
    if (snprintf(next, PATH_MAX, "%.*s%s%s", (int)t, target, *after ? "/" : "", after) >= PATH_MAX)
        return ds_fail(DS_ERR_ARG, "'%s': too long once its links are followed", path), -1;
    return 0;
}

/* Walks path (ds_file.h): returns the checked directory holding its last
 * component, whose name goes to leaf ("." for "/"); with follow_leaf a
 * trusted link there is followed too. -1 with the error. */
static int walk(const char *path, bool follow_leaf, bool writing, char leaf[NAME_MAX + 1]) {
    char rest[PATH_MAX], at[PATH_MAX], next[PATH_MAX];
    if (!*path || strlen(path) >= sizeof rest) return ds_fail(DS_ERR_ARG, "bad path '%.200s'", path), -1;
    strcpy(rest, path);
    int fd = walk_start(rest[0] == '/', at, path, writing), links = 0;
    const char *p = rest;
    while (fd >= 0) {
        while (*p == '/') p++;
        size_t n = strcspn(p, "/");
        const char *after = p + n;
        while (*after == '/') after++;
        if (n > NAME_MAX) return close(fd), ds_fail(DS_ERR_ARG, "'%s': a name in it is too long", path), -1;
        memcpy(leaf, n ? p : ".", n ? n : 1);
        leaf[n ? n : 1] = '\0';
        struct stat st;
        if ((*after || follow_leaf) && fstatat(fd, leaf, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode)) {
            if (++links > MAX_LINKS) return close(fd), ds_fail(DS_ERR_IO, "'%s': more than %d links", path, MAX_LINKS), -1;
            if (follow(fd, leaf, &st, after, next, at, path, writing)) return close(fd), -1;
            strcpy(rest, next);
            p = rest;
            if (rest[0] == '/') close(fd), fd = walk_start(true, at, path, writing);
            continue;
        }
        if (!*after) return fd;
        int sub = openat(fd, leaf, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        walk_into(at, leaf);
        close(fd);
        if (sub < 0) return ds_fail(DS_ERR_IO, "'%s': cannot open the directory '%s': %s", path, at, strerror(errno)), -1;
        if (check_dir(sub, at, path, writing)) return close(sub), -1;
        fd = sub;
        p = after;
    }
    return -1;
}

static const char *kind_name(mode_t m) {
    return S_ISDIR(m) ? "a directory" : S_ISFIFO(m) ? "a FIFO" : S_ISCHR(m) || S_ISBLK(m) ? "a device"
         : S_ISSOCK(m) ? "a socket" : S_ISLNK(m) ? "a link" : "not a regular file";
}

/* fd, just opened from path for `how`: 0 if dslua may use it (ds_file.h). */
static int check_file(int fd, const char *path, ds_file_mode how, int64_t max_bytes) {
    struct stat st;
    if (fstat(fd, &st) != 0) return ds_fail(DS_ERR_IO, "cannot stat '%s': %s", path, strerror(errno)), -1;
    if (!S_ISREG(st.st_mode))
        return ds_fail(DS_ERR_IO, "'%s' is %s, expected a regular file", path, kind_name(st.st_mode)), -1;
    if (how == DS_FILE_READ && st.st_size > max_bytes)
        return ds_fail(DS_ERR_IO, "'%s' is %lld bytes, more than the %lld it may hold", path, (long long)st.st_size,
                       (long long)max_bytes), -1;
    if (how != DS_FILE_READ && st.st_uid != geteuid())
        return ds_fail(DS_ERR_IO, "'%s' belongs to another user (uid %u): dslua writes only its own files", path,
                       (unsigned)st.st_uid), -1;
    if (how != DS_FILE_READ && st.st_nlink > 1)
        return ds_fail(DS_ERR_IO, "'%s' has %u hard links: dslua does not write a file other names share", path,
                       (unsigned)st.st_nlink), -1;
    return 0;
}

int ds_file_open(const char *path, ds_file_mode how, int64_t max_bytes) {
    char leaf[NAME_MAX + 1];
    int dfd = walk(path, true, how != DS_FILE_READ, leaf);
    if (dfd < 0) return -1;
    /* O_NONBLOCK until checked: opening a FIFO would wait for its other end */
    int flags = how == DS_FILE_READ ? O_RDONLY : how == DS_FILE_APPEND ? O_WRONLY | O_APPEND | O_CREAT : O_WRONLY | O_CREAT;
    int fd = openat(dfd, leaf, flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644), err = errno;
    struct stat st;
    /* ELOOP: a link swapped in since the walk; ENXIO: a FIFO with no reader */
    if (fd < 0 && (err == ELOOP || err == ENXIO) && fstatat(dfd, leaf, &st, AT_SYMLINK_NOFOLLOW) == 0)
        ds_fail(DS_ERR_IO, "'%s' is %s, expected a regular file", path, kind_name(st.st_mode));
    else if (fd < 0)
        ds_fail(DS_ERR_IO, "cannot open '%s': %s", path, strerror(err));
    close(dfd);
    if (fd < 0) return -1;
    if (check_file(fd, path, how, max_bytes)) return close(fd), -1;
    if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0 || (how == DS_FILE_WRITE && ftruncate(fd, 0) != 0)) {
        ds_fail(DS_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
        return close(fd), -1;
    }
    return fd;
}

int ds_file_open_dir(const char *path) {
    char leaf[NAME_MAX + 1];
    int dfd = walk(path, true, true, leaf);
    if (dfd < 0) return -1;
    int fd = openat(dfd, leaf, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    close(dfd);
    if (fd < 0) return ds_fail(DS_ERR_IO, "cannot open the directory '%s': %s", path, strerror(errno)), -1;
    if (check_dir(fd, path, path, true)) return close(fd), -1;
    return fd;
}

char *ds_file_read(const char *path, int64_t max_bytes, size_t *n) {
    int fd = ds_file_open(path, DS_FILE_READ, max_bytes);
    if (fd < 0) return NULL;
    /* read to the end, not to st_size: /proc files say 0, and a file that
     * grows meanwhile stops at the bound */
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    ssize_t got = 1;
    int err = 0;
    while (buf && got != 0 && !err && (int64_t)len <= max_bytes) {
        if (len + 1 == cap) {
            char *more = realloc(buf, cap * 2);
            if (!more) free(buf);
            if (!(buf = more)) break;
            cap *= 2;
        }
        got = read(fd, buf + len, cap - 1 - len);
        if (got > 0) len += (size_t)got;
        else if (got < 0 && errno != EINTR) err = errno;
    }
    close(fd);
    if (!buf) return ds_fail(DS_ERR_NOMEM, "out of memory reading '%s'", path);
    if (err || (int64_t)len > max_bytes) {
        free(buf);
        if (err) return ds_fail(DS_ERR_IO, "cannot read '%s': %s", path, strerror(err));
        return ds_fail(DS_ERR_IO, "'%s' grew past the %lld bytes it may hold", path, (long long)max_bytes);
    }
    buf[len] = '\0';
    *n = len;
    return buf;
}

/* n bytes to fd; -1 with the error naming path */
static int write_all(int fd, const void *data, size_t n, const char *path) {
    const char *p = data;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return ds_fail(DS_ERR_IO, "cannot write '%s': %s", path, strerror(errno)), -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

int ds_file_append(const char *path, const void *data, size_t n) {
    int fd = ds_file_open(path, DS_FILE_APPEND, 0);
    if (fd < 0) return -1;
    int rc = write_all(fd, data, n, path);
    if (close(fd) != 0 && rc == 0) rc = -1, ds_fail(DS_ERR_IO, "cannot write '%s': %s", path, strerror(errno));
    return rc;
}

int ds_file_write_atomic(const char *path, const void *data, size_t n) {
    char leaf[NAME_MAX + 1], tmp[NAME_MAX + 32];
    int dfd = walk(path, false, true, leaf);
    if (dfd < 0) return -1;
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", leaf, (long)getpid());
    unlinkat(dfd, tmp, 0);              /* what a killed process of this pid left */
    int fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) {
        ds_fail(DS_ERR_IO, "cannot create '%s.tmp.%ld': %s", path, (long)getpid(), strerror(errno));
        return close(dfd), -1;
    }
    int rc = write_all(fd, data, n, path);
    if (rc == 0 && fsync(fd) != 0) rc = -1, ds_fail(DS_ERR_IO, "cannot write '%s' to disk: %s", path, strerror(errno));
    if (close(fd) != 0 && rc == 0) rc = -1, ds_fail(DS_ERR_IO, "cannot write '%s': %s", path, strerror(errno));
    if (rc == 0 && renameat(dfd, tmp, dfd, leaf) != 0)
        rc = -1, ds_fail(DS_ERR_IO, "cannot rename '%s.tmp.%ld' to '%s': %s", path, (long)getpid(), path, strerror(errno));
    if (rc) unlinkat(dfd, tmp, 0);
    else if (fsync(dfd) != 0) rc = -1, ds_fail(DS_ERR_IO, "cannot fsync the directory of '%s': %s", path, strerror(errno));
    close(dfd);
    return rc;
}
