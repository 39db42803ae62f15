/* The monitors' file formats without Lua: CRC-32C known answers (RFC 3720),
 * event files written and read back, a torn file refused, and a plot
 * written as a PNG. */
#define _GNU_SOURCE
#include "ds_error.h"
#include "ds_plot.h"
#include "ds_tfevents.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

static void test_crc32c(void) {
    unsigned char zeros[32] = {0}, ones[32];
    memset(ones, 0xFF, sizeof ones);
    check(ds_tfevents_crc32c("123456789", 9) == 0xE3069283u, "crc32c('123456789')");
    check(ds_tfevents_crc32c(zeros, 32) == 0x8A9136AAu, "crc32c(32 zero bytes)");
    check(ds_tfevents_crc32c(ones, 32) == 0x62A8AB43u, "crc32c(32 0xFF bytes)");
}

typedef struct {
    int n;
    char tags[4][32];
    float values[4];
    long long steps[4];
    double walls[4];
} seen;

static int collect(const ds_tfevent *e, void *ctx) {
    seen *s = ctx;
    if (s->n >= 4) return 1;
    snprintf(s->tags[s->n], sizeof s->tags[0], "%s", e->file_version ? e->file_version : e->tag);
    s->values[s->n] = e->value;
    s->steps[s->n] = e->step;
    s->walls[s->n] = e->wall_time;
    s->n++;
    return 0;
}

static void test_events(const char *dir) {
    ds_tfevents *w = ds_tfevents_open(dir);
    check(w != NULL, "open: %s", ds_error_message());
    if (!w) return;
    char path[512];
    snprintf(path, sizeof path, "%s", ds_tfevents_path(w));
    check(ds_tfevents_scalar(w, "Train/Samples/train_loss", 2.5f, 16, 100.25) == 0, "scalar");
    check(ds_tfevents_scalar(w, "Train/Samples/lr", 1e-3f, 1LL << 40, 101.5) == 0, "scalar, a large step");
    check(ds_tfevents_close(w) == 0, "close: %s", ds_error_message());
    seen s = {0};
    long torn = 0;
    check(ds_tfevents_read(path, collect, &s, &torn) == 0 && torn == -1, "read: %s", ds_error_message());
    check(s.n == 3, "3 events, got %d", s.n);
    check(strcmp(s.tags[0], "brain.Event:2") == 0, "file_version first: %s", s.tags[0]);
    check(strcmp(s.tags[1], "Train/Samples/train_loss") == 0 && s.values[1] == 2.5f && s.steps[1] == 16 &&
          s.walls[1] == 100.25, "the loss event");
    check(s.values[2] == 1e-3f && s.steps[2] == 1LL << 40 && s.walls[2] == 101.5, "the lr event");

    /* one byte less: the last record is torn */
    FILE *f = fopen(path, "rb");
    char buf[4096];
    size_t n = f ? fread(buf, 1, sizeof buf, f) : 0;
    if (f) fclose(f);
    f = fopen(path, "wb");
    if (f) { fwrite(buf, 1, n - 1, f); fclose(f); }
    seen t = {0};
    torn = -1;
    check(ds_tfevents_read(path, collect, &t, &torn) == 0 && t.n == 2 && torn > 0,
          "a torn file is read up to its last record: %d events, torn at %ld: %s", t.n, torn, ds_error_message());
    unlink(path);

    char missing[512];
    snprintf(missing, sizeof missing, "%s/missing", dir);
    check(ds_tfevents_open(missing) == NULL && strstr(ds_error_message(), missing), "a missing dir is named: %s",
          ds_error_message());
}

static void test_plot(const char *dir) {
    double x[50], y[50];
    for (int i = 0; i < 50; i++) { x[i] = 8 * i; y[i] = 3.0 / (1 + i); }
    ds_plot_series panels[2] = {{"loss", x, y, 50, NULL}, {"flat", x, x, 1, NULL}};
    char path[512];
    snprintf(path, sizeof path, "%s/c.png", dir);
    check(ds_plot_png(path, "step", panels, 2, 600, 400) == 0, "plot: %s", ds_error_message());
    FILE *f = fopen(path, "rb");
    unsigned char sig[8] = {0};
    if (f) { check(fread(sig, 1, 8, f) == 8, "read the PNG"); fclose(f); }
    check(memcmp(sig, "\x89PNG\r\n\x1a\n", 8) == 0, "a PNG signature");
    unlink(path);
    check(ds_plot_png(path, "step", panels, 2, 100, 100) != 0, "too small is refused");
    /* two runs of one name share a panel: two panels fit 200 pixels */
    ds_plot_series runs[3] = {{"loss", x, y, 50, "run 1"}, {"loss", x, y, 20, "run 2"}, {"flat", x, x, 1, NULL}};
    check(ds_plot_png(path, "step", runs, 3, 600, 200) == 0, "two runs in one panel: %s", ds_error_message());
    unlink(path);
}

int main(void) {
    char dir[] = "/tmp/test_monitor.XXXXXX";
    if (!mkdtemp(dir)) { perror("mkdtemp"); return 1; }
    test_crc32c();
    test_events(dir);
    test_plot(dir);
    rmdir(dir);
    return check_summary("test_monitor");
}
