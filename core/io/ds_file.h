/* Durable file operations for checkpoints: a file or a directory becomes
 * visible under its final name only once its bytes are on disk, so a
 * process killed at any point leaves either the old or the new version,
 * never a torn one. Errors name the path and strerror. */
#ifndef DS_FILE_H
#define DS_FILE_H

#include <stdbool.h>
#include <stddef.h>

/* mkdir -p (mode 0755). */
int ds_file_mkdirs(const char *path);
bool ds_file_exists(const char *path);
/* Writes data to path: a temporary file beside it (path.tmp.<pid>),
 * fsync, rename over path, fsync of the directory. */
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
