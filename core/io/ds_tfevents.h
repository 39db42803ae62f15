/* TensorBoard event files, written and read without TensorFlow: TFRecord
 * framing (length, masked CRC-32C of it, data, masked CRC-32C of the data)
 * around Event protobufs encoded by hand. What DeepSpeed's monitors write
 * through torch's SummaryWriter: a file_version record, then scalars. */
#ifndef DS_TFEVENTS_H
#define DS_TFEVENTS_H

#include <stddef.h>
#include <stdint.h>

typedef struct ds_tfevents ds_tfevents;

/* CRC-32C (Castagnoli), as TFRecord uses it before masking. */
uint32_t ds_tfevents_crc32c(const void *data, size_t n);

/* Creates dir/events.out.tfevents.<seconds>.<host>.<pid>.<n> (dir must
 * exist) and writes the "brain.Event:2" record. NULL with the error set. */
ds_tfevents *ds_tfevents_open(const char *dir);
const char *ds_tfevents_path(const ds_tfevents *w);
/* One Event{wall_time, step, summary{value{tag, simple_value}}}. */
int ds_tfevents_scalar(ds_tfevents *w, const char *tag, float value, int64_t step, double wall_time);
int ds_tfevents_flush(ds_tfevents *w);
/* Flushes, closes and frees w; -1 when the last bytes could not be written. */
int ds_tfevents_close(ds_tfevents *w);

/* One event as read back: the file_version record has tag NULL and
 * file_version set; a summary gives one event per simple_value. */
typedef struct {
    double wall_time;
    int64_t step;
    const char *file_version;
    const char *tag;
    float value;
} ds_tfevent;

/* fn's non-zero return stops the read and is returned. */
typedef int (*ds_tfevents_fn)(const ds_tfevent *e, void *ctx);

/* Every record of the file at path, both CRCs checked (a mismatch is an
 * error naming the path and the record's offset). A file that ends inside
 * its last record, as one does while or after its writer was stopped, is
 * read up to that record, whose offset goes to *torn_at (-1 when none). */
int ds_tfevents_read(const char *path, ds_tfevents_fn fn, void *ctx, long *torn_at);

#endif
