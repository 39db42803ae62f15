/* Fused optimizer steps on the GPU: one pass over flat f32 buffers, one
 * thread per element, calling the per-element updates of ds_optim_elem.h with
 * the f32 hyperparameters the CPU uses. Lamb needs each piece's norms
 * before its update: the moments pass leaves one partial pair of norms per
 * chunk and a block per piece sums its chunks in a fixed order; only those
 * sums go to the host, which takes the trust ratios (summing over ranks
 * first when the pieces are shards) and hands them to the update pass. */
#include "cuda_pointwise.cuh"
#include "../ds_optim_elem.h"

#include <stdlib.h>
#include <string.h>

static unsigned elem_blocks(int64_t n) { return ds_cuda_blocks(n, DS_CUDA_THREADS); }

/* The gradient times the step's grad_scale, rounded to f32 on its own as
 * a separate scaling pass rounds it (never fused into a multiply-add). */
static __device__ float scaled(float g, float grad_scale) { return __fmul_rn(g, grad_scale); }

/* The 16-bit copy of p (shadow NULL: none): its run's checks, and one
 * element's store after its update. */
struct shadow_args {
    uint16_t *data;
    ds_dtype dtype;
};

static int shadow_of(const char *op, ds_kview shadow, int64_t n, shadow_args *out) {
    if (ds_optim_check_shadow(op, shadow, n)) return -1;
    out->data = (uint16_t *)shadow.data;
    out->dtype = shadow.dtype;
    return 0;
}

static __device__ void store_shadow(shadow_args s, int64_t i, float p) {
    if (s.data) s.data[i] = ds_optim_half(p, s.dtype);
}

/* ---- SGD ---- */

static __global__ void sgd_kernel(float *p, float *buf, const float *g, shadow_args sh, int64_t n, float grad_scale,
                                  float lr, float wd, float mom, float damp, int nesterov, int first) {
    DS_CUDA_LOOP(i, n) {
        float gs = scaled(g[i], grad_scale);
        if (buf) ds_sgd_momentum_elem(&p[i], &buf[i], gs, lr, wd, mom, damp, nesterov, first);
        else ds_sgd_elem(&p[i], gs, lr, wd);
        store_shadow(sh, i, p[i]);
    }
}

static int cuda_sgd(ds_kview p, ds_kview g, ds_kview buf, ds_kview shadow, const ds_sgd_params *h) {
    ds_kview v[3] = { p, g, buf };
    int64_t n = ds_kview_numel(&p);
    shadow_args sh;
    if (ds_optim_check_buffers("sgd", v, 3) || shadow_of("sgd", shadow, n, &sh)) return -1;
    if (n == 0) return 0;
    sgd_kernel<<<elem_blocks(n), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        (float *)p.data, (float *)buf.data, (const float *)g.data, sh, n, (float)h->grad_scale, (float)h->lr,
        (float)h->weight_decay, (float)h->momentum, (float)h->dampening, h->nesterov, h->first);
    return ds_cuda_launched("sgd_kernel");
}

/* ---- Adam, AdamW ---- */

static __global__ void adam_kernel(float *p, float *m, float *v, const float *g, shadow_args sh, int64_t n,
                                   float grad_scale, float b1, float b2, float eps, float wd, float decay, float step,
                                   float sbc2, int decoupled) {
    DS_CUDA_LOOP(i, n) {
        ds_adam_elem(&p[i], &m[i], &v[i], scaled(g[i], grad_scale), b1, b2, eps, wd, decay, step, sbc2, decoupled);
        store_shadow(sh, i, p[i]);
    }
}

static int cuda_adam(ds_kview p, ds_kview g, ds_kview m, ds_kview v, ds_kview shadow, const ds_adam_params *h) {
    ds_kview b[4] = { p, g, m, v };
    int64_t n = ds_kview_numel(&p);
    shadow_args sh;
    if (ds_optim_check_buffers("adam", b, 4) || shadow_of("adam", shadow, n, &sh)) return -1;
    if (n == 0) return 0;
    adam_kernel<<<elem_blocks(n), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        (float *)p.data, (float *)m.data, (float *)v.data, (const float *)g.data, sh, n, (float)h->grad_scale,
        (float)h->beta1, (float)h->beta2, (float)h->eps, (float)h->weight_decay, (float)h->decay, (float)h->step_size,
        (float)h->sqrt_bc2, h->decoupled);
    return ds_cuda_launched("adam_kernel");
}

/* ---- Adagrad ---- */

static __global__ void adagrad_kernel(float *p, float *sum, const float *g, shadow_args sh, int64_t n,
                                      float grad_scale, float clr, float eps, float wd) {
    DS_CUDA_LOOP(i, n) {
        ds_adagrad_elem(&p[i], &sum[i], scaled(g[i], grad_scale), clr, eps, wd);
        store_shadow(sh, i, p[i]);
    }
}

static int cuda_adagrad(ds_kview p, ds_kview g, ds_kview sum, ds_kview shadow, const ds_adagrad_params *h) {
    ds_kview b[3] = { p, g, sum };
    int64_t n = ds_kview_numel(&p);
    shadow_args sh;
    if (ds_optim_check_buffers("adagrad", b, 3) || shadow_of("adagrad", shadow, n, &sh)) return -1;
    if (n == 0) return 0;
    adagrad_kernel<<<elem_blocks(n), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        (float *)p.data, (float *)sum.data, (const float *)g.data, sh, n, (float)h->grad_scale, (float)h->clr,
        (float)h->eps, (float)h->weight_decay);
    return ds_cuda_launched("adagrad_kernel");
}

/* ---- Lamb ----
 * Piece k (elements [seg[k], seg[k+1])) is cut into chunks of LAMB_CHUNK;
 * its chunks are cstart[k] .. cstart[k+1]-1 of all chunks. */

#define LAMB_CHUNK 4096

struct lamb_args {
    float *p, *m, *v;
    const float *g;
    const int64_t *seg, *cstart;   /* device copies, nseg + 1 each */
    int nseg;
    float b1, b2, eps, wd, grad_scale;
    int inside;
};

static __device__ int lamb_segment(const lamb_args &a, int64_t c) { return ds_cuda_piece_of(a.cstart, a.nseg, c); }

/* Moments, then |p|^2 and |u|^2 of each chunk into part[2c], part[2c+1]. */
static __global__ void lamb_norms_kernel(lamb_args a, int64_t chunks, double *part) {
    for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
        int k = lamb_segment(a, c);
        int64_t lo = a.seg[k] + (c - a.cstart[k]) * LAMB_CHUNK, hi = lo + LAMB_CHUNK < a.seg[k + 1] ? lo + LAMB_CHUNK
                                                                                                  : a.seg[k + 1];
        double w = 0, u = 0;
        for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            ds_lamb_moments(&a.m[i], &a.v[i], a.g[i], a.b1, a.b2, a.grad_scale);
            float up = ds_lamb_update(a.p[i], a.m[i], a.v[i], a.eps, a.wd, a.inside);
            w += (double)a.p[i] * a.p[i];
            u += (double)up * up;
        }
        w = pw_block_sum(w);
        u = pw_block_sum(u);
        if (threadIdx.x == 0) {
            part[2 * c] = w;
            part[2 * c + 1] = u;
        }
    }
}

/* Block k sums piece k's chunks in a fixed order: |p|^2 into sq[k], |u|^2
 * into sq[nseg + k]. */
static __global__ void lamb_sum_kernel(lamb_args a, const double *part, double *sq) {
    for (int k = blockIdx.x; k < a.nseg; k += gridDim.x) {
        double w = 0, u = 0;
        for (int64_t c = a.cstart[k] + threadIdx.x; c < a.cstart[k + 1]; c += blockDim.x) {
            w += part[2 * c];
            u += part[2 * c + 1];
        }
        w = pw_block_sum(w);
        u = pw_block_sum(u);
        if (threadIdx.x == 0) {
            sq[k] = w;
            sq[a.nseg + k] = u;
        }
    }
}

/* p -= step_size * ratio * update, the rate rounded to f32 as on the CPU */
static __global__ void lamb_apply_kernel(lamb_args a, int64_t chunks, const double *coeff, double step_size) {
    for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
        int k = lamb_segment(a, c);
        int64_t lo = a.seg[k] + (c - a.cstart[k]) * LAMB_CHUNK, hi = lo + LAMB_CHUNK < a.seg[k + 1] ? lo + LAMB_CHUNK
                                                                                                  : a.seg[k + 1];
        float rate = (float)(step_size * coeff[k]);
        for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
            a.p[i] -= rate * ds_lamb_update(a.p[i], a.m[i], a.v[i], a.eps, a.wd, a.inside);
    }
}

/* A Lamb launch's host table: seg, each piece's first chunk (nseg + 1
 * each, *bytes in all), then n_extra doubles for the caller; *chunks is
 * the number of chunks. NULL after ds_kernel_fail. */
static int64_t *lamb_table(const int64_t *seg, int nseg, size_t n_extra, size_t *bytes, int64_t *chunks) {
    *bytes = 2 * (size_t)(nseg + 1) * sizeof(int64_t);
    int64_t *host = (int64_t *)malloc(*bytes + n_extra * sizeof(double));
    if (!host) {
        ds_kernel_fail("lamb: out of memory for %d segments", nseg);
        return NULL;
    }
    int64_t *cstart = host + nseg + 1;
    cstart[0] = 0;
    for (int k = 0; k < nseg; k++) {
        host[k] = seg[k];
        cstart[k + 1] = cstart[k] + (seg[k + 1] - seg[k] + LAMB_CHUNK - 1) / LAMB_CHUNK;
    }
    host[nseg] = seg[nseg];
    *chunks = cstart[nseg];
    return host;
}

static lamb_args lamb_args_of(const char *dev, ds_kview p, ds_kview g, ds_kview m, ds_kview v, int nseg,
                              const ds_lamb_params *h) {
    lamb_args a = { (float *)p.data, (float *)m.data, (float *)v.data, (const float *)g.data, (const int64_t *)dev,
                    (const int64_t *)dev + nseg + 1, nseg, (float)h->beta1, (float)h->beta2, (float)h->eps,
                    (float)h->weight_decay, (float)h->grad_scale, h->eps_inside_sqrt };
    return a;
}

/* Only the per-piece sums leave the device. */
static int cuda_lamb_norms(ds_kview p, ds_kview g, ds_kview m, ds_kview v, const int64_t *seg, int nseg,
                           double *w_sq, double *u_sq, const ds_lamb_params *h) {
    ds_kview b[4] = { p, g, m, v };
    if (ds_optim_check_buffers("lamb_norms", b, 4) ||
        ds_lamb_check_segments("lamb_norms", seg, nseg, ds_kview_numel(&p)))
        return -1;
    if (nseg == 0) return 0;
    size_t bytes;
    int64_t chunks;
    int64_t *host = lamb_table(seg, nseg, 0, &bytes, &chunks);
    if (!host) return -1;
    /* device: seg, cstart, the sums (2 nseg), then the partial norms */
    char *dev = (char *)ds_cuda_scratch(bytes + 2 * ((size_t)nseg + (size_t)chunks) * sizeof(double));
    if (!dev) {
        free(host);
        return -1;
    }
    double *sq = (double *)(dev + bytes), *part = sq + 2 * nseg;
    lamb_args a = lamb_args_of(dev, p, g, m, v, nseg, h);
    cudaStream_t st = ds_cuda_stream();
    int rc = ds_cuda_ok(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, st), "cudaMemcpyAsync");
    if (rc == 0 && chunks > 0) {
        lamb_norms_kernel<<<ds_cuda_blocks(chunks, 1), DS_CUDA_THREADS, 0, st>>>(a, chunks, part);
        rc = ds_cuda_launched("lamb_norms_kernel");
    }
    if (rc == 0) {
        lamb_sum_kernel<<<ds_cuda_blocks(nseg, 1), DS_CUDA_THREADS, 0, st>>>(a, part, sq);
        rc = ds_cuda_launched("lamb_sum_kernel");
    }
    if (rc == 0)
        rc = ds_cuda_ok(cudaMemcpyAsync(w_sq, sq, (size_t)nseg * sizeof(double), cudaMemcpyDeviceToHost, st),
                        "cudaMemcpyAsync");
    if (rc == 0)
        rc = ds_cuda_ok(cudaMemcpyAsync(u_sq, sq + nseg, (size_t)nseg * sizeof(double), cudaMemcpyDeviceToHost, st),
                        "cudaMemcpyAsync");
    ds_cuda_scratch_free(dev);
    if (rc == 0) rc = ds_cuda_ok(cudaStreamSynchronize(st), "cudaStreamSynchronize");
    free(host);
    return rc;
}

static int cuda_lamb_apply(ds_kview p, ds_kview m, ds_kview v, const int64_t *seg, int nseg, const double *coeff,
                           const ds_lamb_params *h) {
    ds_kview b[3] = { p, m, v };
    if (ds_optim_check_buffers("lamb_apply", b, 3) ||
        ds_lamb_check_segments("lamb_apply", seg, nseg, ds_kview_numel(&p)))
        return -1;
    if (nseg == 0) return 0;
    /* host and device: seg, cstart, coeff, so that one copy carries them */
    size_t bytes;
    int64_t chunks;
    int64_t *host = lamb_table(seg, nseg, (size_t)nseg, &bytes, &chunks);
    if (!host) return -1;
    size_t all = bytes + (size_t)nseg * sizeof(double);
    char *dev = (char *)ds_cuda_scratch(all);
    if (!dev) {
        free(host);
        return -1;
    }
    memcpy((char *)host + bytes, coeff, (size_t)nseg * sizeof(double));
    ds_kview none = { 0 };
    lamb_args a = lamb_args_of(dev, p, none, m, v, nseg, h);
    cudaStream_t st = ds_cuda_stream();
    /* from pageable memory the call returns once the bytes are staged, so
     * the host table may go right after it */
    int rc = ds_cuda_ok(cudaMemcpyAsync(dev, host, all, cudaMemcpyHostToDevice, st), "cudaMemcpyAsync");
    if (rc == 0 && chunks > 0) {
        lamb_apply_kernel<<<ds_cuda_blocks(chunks, 1), DS_CUDA_THREADS, 0, st>>>(a, chunks,
                                                                                 (const double *)(dev + bytes),
                                                                                 h->step_size);
        rc = ds_cuda_launched("lamb_apply_kernel");
    }
    ds_cuda_scratch_free(dev);
    free(host);
    return rc;
}

/* ---- Lion ---- */

static __global__ void lion_kernel(float *p, float *m, const float *g, shadow_args sh, int64_t n, float grad_scale,
                                   float lr, float b1, float b2, float decay) {
    DS_CUDA_LOOP(i, n) {
        ds_lion_elem(&p[i], &m[i], scaled(g[i], grad_scale), lr, b1, b2, decay);
        store_shadow(sh, i, p[i]);
    }
}

static int cuda_lion(ds_kview p, ds_kview g, ds_kview m, ds_kview shadow, const ds_lion_params *h) {
    ds_kview b[3] = { p, g, m };
    int64_t n = ds_kview_numel(&p);
    shadow_args sh;
    if (ds_optim_check_buffers("lion", b, 3) || shadow_of("lion", shadow, n, &sh)) return -1;
    if (n == 0) return 0;
    lion_kernel<<<elem_blocks(n), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        (float *)p.data, (float *)m.data, (const float *)g.data, sh, n, (float)h->grad_scale, (float)h->lr,
        (float)h->beta1, (float)h->beta2, (float)h->decay);
    return ds_cuda_launched("lion_kernel");
}

/* ---- the 1-bit optimizers: one thread per byte of signs, or per element ---- */

static __global__ void onebit_pack_kernel(const float *x, float *err, uint8_t *bits, int64_t nb, float scale) {
    DS_CUDA_LOOP(i, nb) bits[i] = ds_onebit_pack8(x + 8 * i, err + 8 * i, scale);
}

static int cuda_onebit_pack(ds_kview x, ds_kview err, ds_kview bits, double scale) {
    if (ds_onebit_check("onebit_pack", x, err, bits)) return -1;
    int64_t nb = ds_kview_numel(&bits);
    if (nb == 0) return 0;
    onebit_pack_kernel<<<elem_blocks(nb), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        (const float *)x.data, (float *)err.data, (uint8_t *)bits.data, nb, (float)scale);
    return ds_cuda_launched("onebit_pack_kernel");
}

static __global__ void onebit_unpack_kernel(float *out, const uint8_t *bits, int64_t n, float scale, int accumulate) {
    DS_CUDA_LOOP(i, n) {
        float s = ds_onebit_unpack1(bits[i / 8], (int)(i % 8), scale);
        out[i] = accumulate ? out[i] + s : s;
    }
}

static int cuda_onebit_unpack(ds_kview out, ds_kview bits, double scale, int accumulate) {
    ds_kview none;
    memset(&none, 0, sizeof none);
    if (ds_onebit_check("onebit_unpack", out, none, bits)) return -1;
    int64_t n = ds_kview_numel(&out);
    if (n == 0) return 0;
    onebit_unpack_kernel<<<elem_blocks(n), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        (float *)out.data, (const uint8_t *)bits.data, n, (float)scale, accumulate);
    return ds_cuda_launched("onebit_unpack_kernel");
}

static __global__ void onebit_update_kernel(int op, float *p, const float *g, float *m, const float *v, float *acc,
                                            int64_t n, float b1, float eps, float lr, float wd, float lrs) {
    DS_CUDA_LOOP(i, n) ds_onebit_elem(op, &p[i], g ? &g[i] : NULL, &m[i], &v[i], acc ? &acc[i] : NULL, b1, eps, lr, wd,
                                      lrs);
}

static int cuda_onebit_update(ds_onebit_op op, ds_kview p, ds_kview g, ds_kview m, ds_kview v, ds_kview acc,
                              const ds_onebit_params *h) {
    ds_kview b[5] = { p, m, v, g, acc };
    if (ds_optim_check_buffers("onebit_update", b, 5)) return -1;
    int64_t n = ds_kview_numel(&p);
    if (n == 0) return 0;
    onebit_update_kernel<<<elem_blocks(n), DS_CUDA_THREADS, 0, ds_cuda_stream()>>>(
        (int)op, (float *)p.data, (const float *)g.data, (float *)m.data, (const float *)v.data, (float *)acc.data, n,
        (float)h->beta1, (float)h->eps, (float)h->lr, (float)h->weight_decay, (float)h->lrs);
    return ds_cuda_launched("onebit_update_kernel");
}

extern "C" const ds_kernels_optim ds_cuda_optim = {
    cuda_sgd, cuda_adam, cuda_adagrad, cuda_lamb_norms, cuda_lamb_apply, cuda_lion,
    cuda_onebit_pack, cuda_onebit_unpack, cuda_onebit_update,
};
