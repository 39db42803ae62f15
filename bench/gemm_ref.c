/* The GEMM ceiling: raw cblas_sgemm on square f32 matrices, C = A B, timed
 * the way bench/ops.lua times ds.matmul (warm-up, then the median of
 * several samples), on the thread count given.
 *
 *   bench_gemm_ref THREADS [N ...]       (default N: 256 512 1024 2048)
 *
 * Prints one line per size, read by bench/table.lua:
 *   result  sgemm  matmul  NxN  <gflops>  gflops
 */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define SAMPLES 7

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void fill(float *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = (float)(seed >> 8) / (float)(1u << 24) - 0.5f;
    }
}

/* Calls per sample so one sample lasts about 0.1 s: timer noise stays small
 * at N = 256 and N = 2048 does not take minutes. */
static int calls_for(int n) {
    double flops = 2.0 * n * n * n;
    int k = (int)(2e9 / flops);
    return k < 1 ? 1 : k;
}

static double gemm_gflops(int n) {
    size_t nn = (size_t)n * n;
    float *a = malloc(nn * sizeof *a), *b = malloc(nn * sizeof *b), *c = malloc(nn * sizeof *c);
    if (!a || !b || !c) {
        fprintf(stderr, "bench_gemm_ref: out of memory at N=%d\n", n);
        exit(1);
    }
    fill(a, nn, 1);
    fill(b, nn, 2);
    int k = calls_for(n);
    for (int w = 0; w < 2 * k; w++)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
    double t[SAMPLES];
    for (int s = 0; s < SAMPLES; s++) {
        double t0 = now();
        for (int i = 0; i < k; i++)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
        t[s] = (now() - t0) / k;
    }
    qsort(t, SAMPLES, sizeof t[0], cmp_double);
    free(a);
    free(b);
    free(c);
    return 2.0 * n * n * (double)n / t[SAMPLES / 2] * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 2 || atoi(argv[1]) < 1) {
        fprintf(stderr, "usage: bench_gemm_ref THREADS [N ...]\n");
        return 2;
    }
    openblas_set_num_threads(atoi(argv[1]));
    printf("info\tsgemm\tthreads\t%d\n", openblas_get_num_threads());
    static const int sizes[] = { 256, 512, 1024, 2048 };
    int nsizes = argc > 2 ? argc - 2 : (int)(sizeof sizes / sizeof sizes[0]);
    for (int i = 0; i < nsizes; i++) {
        int n = argc > 2 ? atoi(argv[i + 2]) : sizes[i];
        if (n < 1) {
            fprintf(stderr, "bench_gemm_ref: bad size '%s'\n", argv[i + 2]);
            return 2;
        }
        printf("result\tsgemm\tmatmul\t%dx%d\t%.6g\tgflops\n", n, n, gemm_gflops(n));
        fflush(stdout);
    }
    return 0;
}
