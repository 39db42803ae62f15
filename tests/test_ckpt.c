/* Checkpoint files without Lua: SHA-256 against FIPS 180-2's vector, a
 * safetensors round trip with ranged reads and CRC-32s, a truncated file
 * refused naming the tensor, a directory put in place of another, and the
 * guarded read: whole past its first buffer, bounded, a FIFO refused; ranks
 * making one folder at once all succeed. */
#include "ds_error.h"
#include "ds_file.h"
#include "ds_ops.h"
#include "ds_safetensors.h"
#include "ds_sha256.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

static char dir[] = "/tmp/test_ckpt_XXXXXX";

static void test_sha256(void) {
    char hex[DS_SHA256_HEX];
    check(ds_sha256_bytes("abc", 3, hex) == 0 &&
          strcmp(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad") == 0,
          "sha256(abc) = %s", hex);
}

static void test_round_trip(void) {
    char path[256];
    snprintf(path, sizeof path, "%s/a.safetensors", dir);
    int64_t n = 10, shape[2] = { 3, 2 };
    ds_tensor *a = ds_arange(0, 10, 1, DS_F32, DS_CPU_DEVICE);
    ds_tensor *b = ds_tensor_full(2, shape, DS_BF16, DS_CPU_DEVICE, 1.5);
    const char *names[] = { "a", "b" }, *keys[] = { "format" }, *values[] = { "pt" };
    ds_tensor *ts[] = { a, b };
    uint32_t crc[2];
    ds_safetensors_saved saved;
    check(ds_safetensors_save(path, 2, names, ts, 1, keys, values, crc, -1, &saved) == 0, "save: %s", ds_error_message());
    char hex[DS_SHA256_HEX];
    check(ds_sha256_file(path, hex) == 0 && strcmp(hex, saved.sha256) == 0, "the file's SHA-256 is the one returned");
    ds_safetensors_file *f = ds_safetensors_open(path);
    check(f != NULL, "open: %s", ds_error_message());
    if (!f) return;
    check(ds_safetensors_count(f) == 2, "two tensors");
    const ds_safetensors_entry *e = ds_safetensors_entry_at(f, ds_safetensors_find(f, "b"));
    check(e->dtype == DS_BF16 && e->ndim == 2 && e->shape[0] == 3 && e->shape[1] == 2, "b is bf16 [3, 2]");
    ds_tensor *part = ds_safetensors_read(f, ds_safetensors_find(f, "a"), 4, 3);
    check(part && ds_tensor_get(part, 0) == 4 && ds_tensor_get(part, 2) == 6, "elements 4..6 of a");
    ds_tensor *into = ds_tensor_full(1, &n, DS_F64, DS_CPU_DEVICE, -1);
    check(ds_safetensors_read_into(f, 0, 0, 5, into, 5) == 0 && ds_tensor_get(into, 4) == -1 &&
          ds_tensor_get(into, 9) == 4, "read_into converts to f64 at an offset");
    uint32_t c;
    check(ds_safetensors_entry_crc32(f, 1, &c) == 0 && c == crc[1], "b's CRC-32");
    const char *k, *v;
    ds_safetensors_metadata_at(f, 0, &k, &v);
    check(strcmp(k, "format") == 0 && strcmp(v, "pt") == 0, "metadata");
    ds_safetensors_close(f);
    /* the file cut short: refused at open, naming the tensor it cuts */
    check(truncate(path, saved.bytes - 3) == 0, "truncate");
    check(ds_safetensors_open(path) == NULL && strstr(ds_error_message(), "tensor 'b'") &&
          strstr(ds_error_message(), "truncated"), "truncated: %s", ds_error_message());
    ds_tensor_release(into);
    ds_tensor_release(part);
    ds_tensor_release(a);
    ds_tensor_release(b);
}

static void test_replace_dir(void) {
    char src[256], dst[256], file[300];
    snprintf(src, sizeof src, "%s/new", dir);
    snprintf(dst, sizeof dst, "%s/tag", dir);
    for (int round = 0; round < 2; round++) {      /* a rename, then an exchange */
        check(ds_file_mkdirs(src, 0755) == 0, "mkdirs");
        snprintf(file, sizeof file, "%s/round", src);
        char text[2] = { (char)('0' + round), 0 };
        check(ds_file_write_atomic(file, text, 1) == 0, "write_atomic");
        check(ds_file_replace_dir(src, dst) == 0, "replace_dir: %s", ds_error_message());
        snprintf(file, sizeof file, "%s/round", dst);
        FILE *fp = fopen(file, "r");
        int got = fp ? fgetc(fp) : -1;
        if (fp) fclose(fp);
        check(got == '0' + round && !ds_file_exists(src), "round %d in place, the old one gone", round);
    }
}

static void test_guarded_read(void) {
    char path[256], fifo[256];
    snprintf(path, sizeof path, "%s/big", dir);
    enum { N = 100000 };
    char *text = malloc(N);
    for (int i = 0; i < N; i++) text[i] = (char)('a' + i % 26);
    check(ds_file_write_atomic(path, text, N) == 0, "write_atomic: %s", ds_error_message());
    size_t n = 0;
    char *got = ds_file_read(path, N, &n);
    check(got && n == N && memcmp(got, text, N) == 0 && got[N] == '\0', "read back all %d bytes", N);
    free(got);
    check(!ds_file_read(path, N - 1, &n) && strstr(ds_error_message(), "more than the 99999"), "bounded: %s",
          ds_error_message());
    snprintf(fifo, sizeof fifo, "%s/fifo", dir);
    check(mkfifo(fifo, 0600) == 0, "mkfifo");
    check(!ds_file_read(fifo, N, &n) && strstr(ds_error_message(), "is a FIFO, expected a regular file"), "FIFO: %s",
          ds_error_message());
    check(ds_file_open(fifo, DS_FILE_APPEND, 0) < 0 && strstr(ds_error_message(), "is a FIFO"), "FIFO for writing: %s",
          ds_error_message());
    free(text);
}

/* Every rank makes the nvme folder's missing parents at the same moment: a
 * folder another rank made between a failed open and mkdir is no error. */
static void test_mkdirs_race(void) {
    enum { RANKS = 8, ROUNDS = 40 };
    int failed = 0;
    for (int round = 0; round < ROUNDS; round++) {
        char path[256];
        snprintf(path, sizeof path, "%s/race%d/a/b/rank", dir, round);
        pid_t kids[RANKS];
        for (int r = 0; r < RANKS; r++) {
            kids[r] = fork();
            if (kids[r] == 0) _exit(ds_file_mkdirs(path, 0700) == 0 ? 0 : 1);
        }
        for (int r = 0; r < RANKS; r++) {
            int status = 0;
            waitpid(kids[r], &status, 0);
            failed += !WIFEXITED(status) || WEXITSTATUS(status) != 0;
        }
    }
    check(failed == 0, "%d of %d concurrent mkdirs failed", failed, RANKS * ROUNDS);
}

int main(void) {
    if (!mkdtemp(dir)) return perror("mkdtemp"), 1;
    test_sha256();
    test_round_trip();
    test_replace_dir();
    test_guarded_read();
    test_mkdirs_race();
    ds_file_remove_tree(dir);
    return check_summary("test_ckpt");
}
