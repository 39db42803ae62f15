/* The reference for bench/comm.lua: MPI's all-reduce called directly from
 * C, in place on a float buffer (MPI_SUM, MPI_COMM_WORLD), in the same
 * process and the same MPI as ds.comm. Built as a shared library by
 * bench/comm.sh and loaded with LuaJIT's FFI; every rank calls it
 * together, after ds.comm has started MPI.
 *
 *   double ref_allreduce_seconds(long n, int iters, int nonblocking)
 *     seconds per call over `iters` calls on n floats, after one warm-up
 *     call and a barrier; the slowest rank's figure, on every rank.
 *     nonblocking 0: MPI_Allreduce; 1: MPI_Iallreduce + MPI_Wait, the MPI
 *     calls ds.comm makes (it polls with MPI_Test instead of waiting). */
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

static void allreduce(float *buf, long n, int nonblocking) {
    if (!nonblocking) {
        MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        return;
    }
    MPI_Request r;
    MPI_Iallreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &r);
    MPI_Wait(&r, MPI_STATUS_IGNORE);
}

double ref_allreduce_seconds(long n, int iters, int nonblocking) {
    float *buf = malloc((size_t)n * sizeof *buf);
    if (!buf) return -1;
    memset(buf, 0, (size_t)n * sizeof *buf);   /* zeros: sums stay finite however many calls */
    allreduce(buf, n, nonblocking);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; i++) allreduce(buf, n, nonblocking);
    double t = (MPI_Wtime() - t0) / iters, slowest;
    MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    free(buf);
    return slowest;
}
