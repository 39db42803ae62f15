/* Guarded and durable file operations.
 *
 * Guarded: every file dslua reads or writes outside the data loaders is
 * opened here. The path is walked from "/" (or ".") one directory at a
 * time with O_NOFOLLOW. Writing, each directory must be owned by root or
 * this user and not writable by group or others unless sticky, so nobody
 * else can plant a link or a file where dslua writes, and a link is
 * followed only when root or this user owns it. Reading, a directory of
 * another user is read (a container's root on a bind mount), one writable
 * by others without the sticky bit is not, and a link is followed when
 * root, this user or the owner of its directory owns it. What is opened
 * must be a regular file (a FIFO or a device would block or never end), a
 * read no larger than its bound, a written file this user's with one link.
 *
 * Durable: a file or a directory becomes visible under its final name only
 * once its bytes are on disk, so a process killed at any point leaves
 * either the old or the new version, never a torn one. Errors name the
 * path and strerror. */
#ifndef DS_FILE_H
#define DS_FILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef enum {
    DS_FILE_READ,       /* at most max_bytes */
    DS_FILE_APPEND,     /* created (0644) when missing */
    DS_FILE_WRITE       /* created (0644) or emptied */
} ds_file_mode;

/* The guarded open (above): a file descriptor, or -1 with the error.
 * max_bytes bounds reads only. */
int ds_file_open(const char *path, ds_file_mode how, int64_t max_bytes);
/* The directory at path, walked and checked as the directories above a
 * written file are: a descriptor (O_DIRECTORY), or -1 with the error. */
int ds_file_open_dir(const char *path);
/* The whole file, at most max_bytes, NUL-terminated (malloc'd; *n its
 * length), through the guarded open; NULL with the error. */
char *ds_file_read(const char *path, int64_t max_bytes, size_t *n);
/* Appends n bytes to path through the guarded open. */
int ds_file_append(const char *path, const void *data, size_t n);

/* mkdir -p, each directory walked and checked as by ds_file_open_dir. */
int ds_file_mkdirs(const char *path, mode_t mode);
bool ds_file_exists(const char *path);
/* Writes data to path: a temporary file beside it (path.tmp.<pid>, made
 * with O_EXCL | O_NOFOLLOW in the directory the guarded walk opened),
 * fsync, rename over path (a link there is replaced, never followed),
 * fsync of the directory. */
int ds_file_write_atomic(const char *path, const void *data, size_t n);
/* fsync of a directory: renames and creations in it become durable. */
int ds_file_fsync_dir(const char *dir);
/* fsync of the directory holding path. */
int ds_file_fsync_parent(const char *path);
/* Puts directory src in dst's place in one step (a rename, or with a dst
 * already there an exchange: renameat2 RENAME_EXCHANGE), then removes the
 * old dst. Where the file system cannot exchange (NFS, old kernels) dst
 * is moved aside first, so for a moment there is none. */
int ds_file_replace_dir(const char *src, const char *dst);
/* rm -r; a missing path is not an error. */
int ds_file_remove_tree(const char *path);

#endif
