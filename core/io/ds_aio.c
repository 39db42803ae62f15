#include "ds_aio.h"
#include "ds_error.h"
#include "ds_file.h"

#include <aio.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* A request that ended at the end of the file, which has no errno. */
#define AIO_EOF (-1)

struct ds_aio_file {
    int fd;                 /* -1 once closed */
    int refs;               /* the owner's, and one per request */
    int64_t size;
    ds_aio_req *pending;    /* requests not yet complete */
    char path[];
};

struct ds_aio_req {
    struct aiocb cb;
    ds_aio_file *f;
    ds_tensor *t;           /* held until complete */
    bool write, complete;
    int err;                /* 0, an errno, or AIO_EOF */
    int64_t offset, nbytes, moved;
    ds_aio_req *prev, *next;
};

/* The directory a file goes into, opened, if this user owns it and no one
 * else may write into it: nobody else can then plant a link in it. -1
 * with the error. */
static int open_private_dir(const char *dir, const char *path) {
    int fd = ds_file_open_dir(dir);     /* no link another user planted followed on the way */
    if (fd < 0) {
        char why[1024];
        snprintf(why, sizeof why, "%s", ds_error_message());
        return ds_fail(DS_ERR_IO, "aio.open: '%s': %s", path, why), -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        ds_fail(DS_ERR_IO, "aio.open: cannot stat the directory of '%s': %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    if (st.st_uid != geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH))) {
        ds_fail(DS_ERR_IO, "aio.open: '%s': its directory '%s' is %s (mode %03o, owner uid %u; this process runs as "
                "uid %u): dslua writes only into directories of its own user that others cannot write", path, dir,
                st.st_uid != geteuid() ? "owned by another user" : "writable by others", (unsigned)(st.st_mode & 0777),
                (unsigned)st.st_uid, (unsigned)geteuid());
        close(fd);
        return -1;
    }
    return fd;
}

/* Makes path a new file of nbytes: created under a temporary name with
 * O_EXCL | O_NOFOLLOW (nothing planted there is opened), sized, then
 * renamed over path (a link at path is replaced, never followed). */
static int create_fresh(const char *path, int64_t nbytes) {
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    size_t dlen = slash ? (size_t)(slash - path) : 0;
    char dir[4096], tmp[4096 + 32];
    if (!*base || dlen >= sizeof dir || strlen(base) + 32 > sizeof tmp)
        return ds_fail(DS_ERR_ARG, "aio.open: '%s' is not a file path", path), -1;
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (dlen == 0) snprintf(dir, sizeof dir, "/");
    else snprintf(dir, sizeof dir, "%.*s", (int)dlen, path);
    int dfd = open_private_dir(dir, path);
    if (dfd < 0) return -1;
    static unsigned counter;
    int fd = -1;
    for (int tries = 0; fd < 0 && tries < 100; tries++) {
        snprintf(tmp, sizeof tmp, ".%s.%ld.%u.tmp", base, (long)getpid(), ++counter);
        fd = openat(dfd, tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0 && errno != EEXIST) break;
    }
    if (fd < 0) {
        ds_fail(DS_ERR_IO, "aio.open: cannot create '%s': %s", path, strerror(errno));
        close(dfd);
        return -1;
    }
    const char *failed = NULL;
    if (ftruncate(fd, (off_t)nbytes) != 0) failed = "size";
    else if (renameat(dfd, tmp, dfd, base) != 0) failed = "rename into";
    if (failed) {
        ds_fail(DS_ERR_IO, "aio.open: cannot %s '%s' (%lld bytes): %s", failed, path, (long long)nbytes,
                strerror(errno));
        unlinkat(dfd, tmp, 0);
        close(fd);
        fd = -1;
    }
    close(dfd);
    return fd;
}

ds_aio_file *ds_aio_open(const char *path, int64_t nbytes) {
    if (nbytes < 0) return ds_fail(DS_ERR_ARG, "aio.open: '%s': size must be >= 0, got %lld", path, (long long)nbytes);
    size_t len = strlen(path);
    ds_aio_file *f = calloc(1, sizeof *f + len + 1);
    if (!f) return ds_fail(DS_ERR_NOMEM, "aio.open: out of memory for '%s'", path);
    memcpy(f->path, path, len + 1);
    f->refs = 1;
    f->size = nbytes;
    if ((f->fd = create_fresh(path, nbytes)) < 0) {
        free(f);
        return NULL;
    }
    return f;
}

const char *ds_aio_path(const ds_aio_file *f) { return f->path; }
int64_t ds_aio_size(const ds_aio_file *f) { return f->size; }

static void file_unref(ds_aio_file *f) {
    if (--f->refs == 0) free(f);
}

/* Complete: off the file's pending list, the tensor let go. */
static void finish(ds_aio_req *r, int err) {
    r->complete = true;
    r->err = err;
    if (r->prev) r->prev->next = r->next;
    else r->f->pending = r->next;
    if (r->next) r->next->prev = r->prev;
    r->prev = r->next = NULL;
    ds_storage_unpin(r->t->storage);
    ds_tensor_release(r->t);
    r->t = NULL;
}

/* Submits what is left of r's bytes. */
static void submit(ds_aio_req *r) {
    memset(&r->cb, 0, sizeof r->cb);
    r->cb.aio_fildes = r->f->fd;
    r->cb.aio_buf = (char *)ds_tensor_data(r->t) + r->moved;
    r->cb.aio_nbytes = (size_t)(r->nbytes - r->moved);
    r->cb.aio_offset = (off_t)(r->offset + r->moved);
    r->cb.aio_sigevent.sigev_notify = SIGEV_NONE;
    if ((r->write ? aio_write(&r->cb) : aio_read(&r->cb)) != 0) finish(r, errno);
}

/* Advances r: collects a finished transfer and resubmits a short one. With
 * block, returns only once r is complete. */
static void progress(ds_aio_req *r, bool block) {
    while (!r->complete) {
        if (block) {
            /* an interrupted wait just waits again: the transfer is still
             * using the tensor, so it cannot be abandoned */
            const struct aiocb *list[1] = { &r->cb };
            aio_suspend(list, 1, NULL);
        }
        int e = aio_error(&r->cb);
        if (e == EINPROGRESS) {
            if (block) continue;
            return;
        }
        ssize_t n = aio_return(&r->cb);
        if (e != 0) finish(r, e);
        else if (n == 0) finish(r, r->write ? EIO : AIO_EOF);
        else if ((r->moved += n) == r->nbytes) finish(r, 0);
        else submit(r);
    }
}

static ds_aio_req *start(ds_aio_file *f, ds_tensor *t, int64_t offset, bool write) {
    const char *op = write ? "write" : "read";
    char s[96];
    if (f->fd < 0) return ds_fail(DS_ERR_STATE, "aio.%s: '%s' is closed", op, f->path);
    if (ds_tensor_device(t).type != DS_DEV_CPU || !ds_tensor_is_contiguous(t))
        return ds_fail(DS_ERR_ARG, "aio.%s: '%s': the tensor (%s %s) must be contiguous and on the CPU", op, f->path,
                       ds_dtype_name(t->dtype), ds_shape_str(t, s, sizeof s));
    int64_t nbytes = ds_tensor_numel(t) * (int64_t)ds_dtype_size(t->dtype);
    if (offset < 0 || offset > f->size - nbytes)
        return ds_fail(DS_ERR_ARG, "aio.%s: '%s': %lld bytes at offset %lld do not fit in the file's %lld bytes", op,
                       f->path, (long long)nbytes, (long long)offset, (long long)f->size);
    ds_aio_req *r = calloc(1, sizeof *r);
    if (!r) return ds_fail(DS_ERR_NOMEM, "aio.%s: out of memory for a request on '%s'", op, f->path);
    ds_tensor_retain(t);
    ds_storage_pin(t->storage, "an asynchronous file transfer (wait for it first)");
    r->t = t;
    r->f = f;
    f->refs++;
    r->write = write;
    r->offset = offset;
    r->nbytes = nbytes;
    if ((r->next = f->pending)) r->next->prev = r;
    f->pending = r;
    if (nbytes == 0) finish(r, 0);
    else submit(r);
    return r;
}

ds_aio_req *ds_aio_write(ds_aio_file *f, ds_tensor *t, int64_t offset) { return start(f, t, offset, true); }
ds_aio_req *ds_aio_read(ds_aio_file *f, ds_tensor *t, int64_t offset) { return start(f, t, offset, false); }

/* Sets the error of a failed request. */
static int report(const ds_aio_req *r) {
    const char *op = r->write ? "write" : "read", *dir = r->write ? "to" : "from";
    if (r->err == AIO_EOF)
        ds_fail(DS_ERR_IO, "aio: %s of %lld bytes at offset %lld %s '%s' hit the end of the file after %lld bytes",
                op, (long long)r->nbytes, (long long)r->offset, dir, r->f->path, (long long)r->moved);
    else
        ds_fail(DS_ERR_IO, "aio: %s of %lld bytes at offset %lld %s '%s' failed: %s", op, (long long)r->nbytes,
                (long long)r->offset, dir, r->f->path, strerror(r->err));
    return -1;
}

int ds_aio_wait(ds_aio_req *r) {
    progress(r, true);
    return r->err ? report(r) : 0;
}

bool ds_aio_done(ds_aio_req *r) {
    progress(r, false);
    return r->complete;
}

int64_t ds_aio_req_bytes(const ds_aio_req *r) { return r->nbytes; }

void ds_aio_req_free(ds_aio_req *r) {
    if (!r) return;
    progress(r, true);
    file_unref(r->f);
    free(r);
}

int ds_aio_close(ds_aio_file *f) {
    int rc = 0;
    while (f->pending) {
        ds_aio_req *r = f->pending;
        progress(r, true);
        if (r->err && rc == 0) rc = report(r);
    }
    if (f->fd >= 0 && close(f->fd) != 0 && rc == 0) {
        ds_fail(DS_ERR_IO, "aio.close: '%s': %s", f->path, strerror(errno));
        rc = -1;
    }
    f->fd = -1;
    file_unref(f);
    return rc;
}
