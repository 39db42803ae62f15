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

int ds_file_mkdirs(const char *path) {
    char buf[PATH_MAX];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof buf) return ds_fail(DS_ERR_ARG, "mkdir: bad path '%s'", path), -1;
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != '\0') continue;
        char c = buf[i];
        buf[i] = '\0';
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            return ds_fail(DS_ERR_IO, "cannot create directory '%s': %s", buf, strerror(errno)), -1;
        buf[i] = c;
    }
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
        return ds_fail(DS_ERR_IO, "'%s' exists and is not a directory", path), -1;
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
int ds_file_write_atomic(const char *path, const void *data, size_t n) {
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp)
        return ds_fail(DS_ERR_ARG, "path too long: '%s'", path), -1;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return ds_fail(DS_ERR_IO, "cannot create '%s': %s", tmp, strerror(errno)), -1;
    const char *p = data;
    size_t left = n;
    while (left > 0) {
        ssize_t w = write(fd, p, left);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) {
            ds_fail(DS_ERR_IO, "cannot write '%s': %s", tmp, strerror(errno));
            close(fd);
            unlink(tmp);
            return -1;
        }
        p += w;
        left -= (size_t)w;
    }
    if (fsync(fd) != 0 || close(fd) != 0) {
        ds_fail(DS_ERR_IO, "cannot write '%s' to disk: %s", tmp, strerror(errno));
        unlink(tmp);
        return -1;
    }
    if (rename(tmp, path) != 0) {
        ds_fail(DS_ERR_IO, "cannot rename '%s' to '%s': %s", tmp, path, strerror(errno));
        unlink(tmp);
        return -1;
    }
    return ds_file_fsync_parent(path);
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
