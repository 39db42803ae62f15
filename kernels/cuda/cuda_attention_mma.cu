/* The host side of attention on tensor cores (cuda_attention_mma.cuh):
 * which calls qualify, launch sizes, and the launches. */
#include "cuda_common.cuh"
#include "cuda_attention_check.h"
#include "cuda_attention_choice.h"
#include "cuda_attention_mma.h"
#include "cuda_attention_mma.cuh"
#include "cuda_attention_wgmma.cuh"

#include <stdio.h>

#include <vector>

static bool view_fits(const ds_kview &x) {
    int64_t es = (int64_t)ds_dtype_size(x.dtype);
    if (x.stride[3] != 1 || ((uintptr_t)x.data & 15)) return false;
    for (int d = 0; d < 3; d++)
        if (x.stride[d] * es % 16) return false;
    return true;
}

/* The shared memory a block may opt in to on the current device, asked
 * once per device (past 64 devices, at every call); 0 when CUDA fails. */
static int smem_optin() {
    static int known[64];
    int dev, limit = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    if (dev < 64 && known[dev]) return known[dev];
    if (cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) return 0;
    if (dev < 64) known[dev] = limit;
    return limit;
}

/* Whether all three kernels' tiles of T at head dim D fit the device's
 * shared memory (f32 at D = 128 needs 165 KiB: an H100's, not an A100's;
 * 3xTF32 needs no more than TF32). */
template <typename T> static bool smem_fits(int D) {
    size_t need = mma_forward_smem<T>(D);
    if (mma_dq_smem<T>(D) > need) need = mma_dq_smem<T>(D);
    if (mma_dkdv_smem<T>(D) > need) need = mma_dkdv_smem<T>(D);
    return need <= (size_t)smem_optin();
}

bool ds_cuda_attention_mma_fits(const ds_kview *views, int n) {
    const ds_kview &q = views[0], &v = views[2];
    int D = (int)q.shape[3];
    if ((D != 64 && D != 128) || v.shape[3] != q.shape[3]) return false;
    bool fits = q.dtype == DS_BF16 ? smem_fits<__nv_bfloat16>(D)
              : q.dtype == DS_F16 ? smem_fits<__half>(D) : q.dtype == DS_F32 && smem_fits<float>(D);
    for (int i = 0; i < n && fits; i++) fits = view_fits(views[i]);
    return fits;
}

template <typename T, int D>
static int forward_run(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, const mma_geom &g) {
    static uint64_t asked;
    size_t sm = mma_forward_smem<T>(D);
    if (ds_cuda_allow_smem(mma_forward_kernel<T, D>, sm, &asked)) return -1;
    mma_forward_kernel<T, D><<<mma_query_blocks(g), MMA_THREADS, sm, ds_cuda_stream()>>>(out, lse, q, k, v, g);
    return ds_cuda_launched("attention mma_forward_kernel");
}

template <typename T, int D>
static int backward_run(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k,
                        ds_kview v, ds_kview out, ds_kview lse, const mma_geom &g) {
    float *stats = (float *)ds_cuda_scratch(mma_stats_bytes(g));
    if (!stats) return -1;
    cudaStream_t st = ds_cuda_stream();
    int rc = 0;
    mma_stats_kernel<T, D><<<mma_stats_blocks(g), MMA_STATS_THREADS, 0, st>>>(stats, dout, out, lse, g);
    rc = ds_cuda_launched("attention mma_stats_kernel");
    static uint64_t asked_dq, asked_dkdv;
    size_t sq = mma_dq_smem<T>(D), skv = mma_dkdv_smem<T>(D);
    if (rc == 0) rc = ds_cuda_allow_smem(mma_dq_kernel<T, D>, sq, &asked_dq);
    if (rc == 0) {
        mma_dq_kernel<T, D><<<mma_dq_blocks<T>(g, D), MMA_THREADS, sq, st>>>(dq, dout, q, k, v, stats, g);
        rc = ds_cuda_launched("attention mma_dq_kernel");
    }
    if (rc == 0) rc = ds_cuda_allow_smem(mma_dkdv_kernel<T, D>, skv, &asked_dkdv);
    if (rc == 0) {
        mma_dkdv_kernel<T, D><<<mma_dkdv_blocks(g, D), MMA_THREADS, skv, st>>>(dk, dv, dout, q, k, v, stats, g);
        rc = ds_cuda_launched("attention mma_dkdv_kernel");
    }
    ds_cuda_scratch_free(stats);
    return rc;
}

template <int D>
static int forward_of(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, const mma_geom &g, bool tf32) {
    if (q.dtype == DS_BF16) return forward_run<__nv_bfloat16, D>(out, lse, q, k, v, g);
    if (q.dtype == DS_F16) return forward_run<__half, D>(out, lse, q, k, v, g);
    return tf32 ? forward_run<float, D>(out, lse, q, k, v, g) : forward_run<tf32x3, D>(out, lse, q, k, v, g);
}

template <int D>
static int backward_of(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k, ds_kview v,
                       ds_kview out, ds_kview lse, const mma_geom &g, bool tf32) {
    if (q.dtype == DS_BF16) return backward_run<__nv_bfloat16, D>(dq, dk, dv, dout, q, k, v, out, lse, g);
    if (q.dtype == DS_F16) return backward_run<__half, D>(dq, dk, dv, dout, q, k, v, out, lse, g);
    return tf32 ? backward_run<float, D>(dq, dk, dv, dout, q, k, v, out, lse, g)
                : backward_run<tf32x3, D>(dq, dk, dv, dout, q, k, v, out, lse, g);
}

/* The mma.sync forward; f32 in TF32 where tf32, else in 3xTF32. */
static int mma_forward(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, double scale, int causal,
                       bool tf32) {
    mma_geom g = mma_geom_of(q, k, scale, causal);
    return q.shape[3] == 64 ? forward_of<64>(out, lse, q, k, v, g, tf32)
                            : forward_of<128>(out, lse, q, k, v, g, tf32);
}

/* ---- the Hopper kernels, trusted once they agree ----
 * Their PTX is checked on the CPU by an emulator whose reading of the ISA
 * could be wrong in ways only hardware shows. So the first call per device,
 * pass (forward or backward) and variant (bf16 or f16, head dim 64 or 128)
 * runs the Hopper kernel beside the mma.sync one on a small problem (2
 * heads of 200 queries and keys: two key tiles, one partial; causal and
 * not) and compares every output with the bound the two kernels'
 * roundings and orders of summation allow (the backwards on the same
 * forward out and lse, mma.sync's); past it, one line on stderr names the
 * pass, the variant and the element, and that pass of the variant stays
 * on mma.sync for the process. The forward and the backward fed by TMA
 * are variants of their own, each checked first on the same problem:
 * past the bound its line names it and the pass runs the cp.async wgmma
 * kernels (if those agree) or mma.sync. Grouped calls (k and v with fewer heads
 * than q) follow their variant's answer: the check runs ungrouped, as
 * grouping changes only which head a block's tiles come from and how many
 * query tiles a dK/dV block walks, integer arithmetic around the same
 * instructions, which the emulator runs as the device does
 * (tests/test_wgmma_attention.cc and test_wgmma_backward.cc check the
 * grouped kernels). */

static int wgmma_on = 1;

int ds_cuda_attention_set_wgmma(int on) {
    if (on >= 0) wgmma_on = on != 0;
    return wgmma_on;
}

/* Why a pass of a variant runs where it runs: indices of why_not (below);
 * up to WHY_NOT_HOPPER no Hopper kernel of any pass can run. */
enum { WHY_RUNS, WHY_OFF, WHY_NOT_HOPPER, WHY_SMEM, WHY_DISAGREES, WHY_CAPTURING, WHY_NO_MAPS, WHY_STALLED };

#ifdef DS_CUDA_WGMMA
static ds_kview check_view(void *data, ds_dtype dt, int ndim, const int64_t *shape, const int64_t *stride) {
    ds_kview x = {};
    x.data = data, x.dtype = dt, x.ndim = ndim;
    for (int d = 0; d < ndim; d++) x.shape[d] = shape[d], x.stride[d] = stride[d];
    return x;
}

/* Tensor i of the check problem ([1, CHECK_H, CHECK_T, D] of dt) at buf, and its lse rows at lse. */
static ds_kview check_tensor(unsigned char *buf, int i, ds_dtype dt, int D) {
    int64_t shape[4] = { 1, CHECK_H, CHECK_T, D }, strides[4] = { CHECK_H * CHECK_T * D, CHECK_T * D, D, 1 };
    return check_view(buf + (size_t)i * CHECK_H * CHECK_T * D * 2, dt, 4, shape, strides);
}
static ds_kview check_lse(unsigned char *lse) {
    int64_t lshape[3] = { 1, CHECK_H, CHECK_T }, lst[3] = { CHECK_H * CHECK_T, CHECK_T, 1 };
    return check_view(lse, DS_F32, 3, lshape, lst);
}

/* The check's device buffer: `tensors` of the problem's size in dt, then
 * `lses` lse rows; x's values (as many tensors as it holds) copied into
 * the first. NULL when CUDA fails. */
static unsigned char *check_upload(ds_dtype dt, int D, int tensors, int lses, const std::vector<float> &x) {
    const size_t n = (size_t)CHECK_H * CHECK_T * D, rows = (size_t)CHECK_H * CHECK_T;
    std::vector<uint16_t> h(x.size());
    for (size_t i = 0; i < x.size(); i++) h[i] = dt == DS_BF16 ? ds_f32_to_bf16(x[i]) : ds_f32_to_f16(x[i]);
    unsigned char *buf = (unsigned char *)ds_cuda_scratch(tensors * n * 2 + lses * rows * 4);
    if (buf && ds_cuda_ok(cudaMemcpyAsync(buf, h.data(), h.size() * 2, cudaMemcpyHostToDevice, ds_cuda_stream()),
                          "attention check: cudaMemcpyAsync")) {
        ds_cuda_scratch_free(buf);
        return NULL;
    }
    return buf;
}

/* Copies the check's tensors first..first+count-1 (into t[], as floats)
 * and its lse rows (lse[] from buf's lse area, `lses` of them) back, and
 * frees buf; 0, or -1 when CUDA fails (rc: a failure already). */
static int check_download(int rc, unsigned char *buf, ds_dtype dt, int D, int tensors, int first, int count,
                          std::vector<float> *t, int lses, std::vector<float> *lse) {
    const size_t n = (size_t)CHECK_H * CHECK_T * D, rows = (size_t)CHECK_H * CHECK_T;
    cudaStream_t st = ds_cuda_stream();
    std::vector<uint16_t> ob(count * n);
    std::vector<float> lb(lses * rows);
    if (rc == 0) rc = ds_cuda_ok(cudaMemcpyAsync(ob.data(), buf + first * n * 2, ob.size() * 2,
                                                 cudaMemcpyDeviceToHost, st), "attention check: cudaMemcpyAsync");
    if (rc == 0 && lses)
        rc = ds_cuda_ok(cudaMemcpyAsync(lb.data(), buf + tensors * n * 2, lb.size() * 4, cudaMemcpyDeviceToHost, st),
                        "attention check: cudaMemcpyAsync");
    int synced = ds_cuda_ok(cudaStreamSynchronize(st), "attention check: cudaStreamSynchronize");
    if (rc == 0) rc = synced;
    ds_cuda_scratch_free(buf);
    for (int w = 0; w < count && rc == 0; w++) {
        t[w].resize(n);
        for (size_t i = 0; i < n; i++)
            t[w][i] = dt == DS_BF16 ? ds_bf16_to_f32(ob[w * n + i]) : ds_f16_to_f32(ob[w * n + i]);
    }
    for (int w = 0; w < lses && rc == 0; w++) lse[w].assign(lb.begin() + w * rows, lb.begin() + (w + 1) * rows);
    return rc;
}

/* A stall record on the device (wt_stall), every byte set; NULL when CUDA fails. */
static wt_stall *stall_new() {
    wt_stall *r = (wt_stall *)ds_cuda_scratch(sizeof *r);
    if (r && ds_cuda_ok(cudaMemsetAsync(r, 0xff, sizeof *r, ds_cuda_stream()), "attention: cudaMemsetAsync")) {
        ds_cuda_scratch_free(r);
        return NULL;
    }
    return r;
}

/* The mma.sync forward and the Hopper one (with a stall record the TMA
 * kernel, else cp.async's) on the check problem in dtype dt (its values
 * in x, as floats: q, k, v), their outputs and lse back on the host; 1
 * where the TMA kernel has no tensor maps. */
static int check_run(ds_dtype dt, int D, int causal, double scale, const std::vector<float> &x, wt_stall *stall,
                     std::vector<float> out[2], std::vector<float> lse[2]) {
    unsigned char *buf = check_upload(dt, D, 5, 2, x);
    if (!buf) return -1;
    const size_t rows = (size_t)CHECK_H * CHECK_T;
    ds_kview q = check_tensor(buf, 0, dt, D), k = check_tensor(buf, 1, dt, D), v = check_tensor(buf, 2, dt, D);
    int rc = 0;
    for (int w = 0; w < 2 && rc == 0; w++) {
        ds_kview o = check_tensor(buf, 3 + w, dt, D), l = check_lse(buf + (size_t)5 * rows * D * 2 + w * rows * 4);
        rc = w == 0 ? mma_forward(o, l, q, k, v, scale, causal, false)
                    : ds_cuda_attention_wgmma_forward(o, l, q, k, v, scale, causal, stall);
    }
    if (rc == 1) {
        ds_cuda_scratch_free(buf);
        return 1;
    }
    return check_download(rc, buf, dt, D, 5, 3, 2, out, 2, lse);
}

/* The mma.sync forward, then both backwards on its out and lse, on the
 * check problem (x: q, k, v, dO): grads[w] the mma.sync (0) and Hopper
 * (1; with a stall record the TMA kernels, else cp.async's) backwards'
 * dq, dk, dv, and out and lse, back on the host; 1 where the TMA kernels
 * have no tensor maps. */
static int check_run_backward(ds_dtype dt, int D, int causal, double scale, const std::vector<float> &x,
                              wt_stall *stall,
                              std::vector<float> grads[2][3], std::vector<float> &out, std::vector<float> &lse) {
    /* q, k, v, dO, out, then dq, dk, dv twice; one lse */
    unsigned char *buf = check_upload(dt, D, 11, 1, x);
    if (!buf) return -1;
    ds_kview t[11];
    for (int i = 0; i < 11; i++) t[i] = check_tensor(buf, i, dt, D);
    ds_kview l = check_lse(buf + (size_t)11 * CHECK_H * CHECK_T * D * 2);
    mma_geom g = mma_geom_of(t[0], t[1], scale, causal);
    int rc = mma_forward(t[4], l, t[0], t[1], t[2], scale, causal, false);
    if (rc == 0) rc = D == 64 ? backward_of<64>(t[5], t[6], t[7], t[3], t[0], t[1], t[2], t[4], l, g, false)
                              : backward_of<128>(t[5], t[6], t[7], t[3], t[0], t[1], t[2], t[4], l, g, false);
    if (rc == 0) rc = ds_cuda_attention_wgmma_backward(t[8], t[9], t[10], t[3], t[0], t[1], t[2], t[4], l, scale,
                                                       causal, stall);
    if (rc == 1) {
        ds_cuda_scratch_free(buf);
        return 1;
    }
    std::vector<float> got[7];
    rc = check_download(rc, buf, dt, D, 11, 4, 7, got, 1, &lse);
    if (rc) return rc;
    out = got[0];
    for (int w = 0; w < 2; w++)
        for (int i = 0; i < 3; i++) grads[w][i] = got[1 + 3 * w + i];
    return 0;
}

/* The passes the Hopper kernels are checked and trusted for: the forward
 * staging by cp.async, the backward staging by cp.async, the forward and
 * the backward fed by TMA. */
enum { PASS_FORWARD, PASS_BACKWARD, PASS_TMA, PASS_TMA_BACKWARD, PASSES };

/* After a TMA kernel's check (rc its run's answer): 1 when a bounded
 * mbarrier wait ran out, with the line on stderr naming the pass, the
 * variant and the barrier; 0 when none did; -1 when CUDA fails. Frees the
 * record. */
static int check_stalled(int rc, wt_stall *stall, const char *pass, ds_dtype dt, int D, int causal,
                         const char *then) {
    wt_stall seen = { -1, 0 };
    cudaStream_t st = ds_cuda_stream();
    if (rc == 0) rc = ds_cuda_ok(cudaMemcpyAsync(&seen, stall, sizeof seen, cudaMemcpyDeviceToHost, st),
                                 "attention check: cudaMemcpyAsync");
    ds_cuda_scratch_free(stall);
    if (rc == 0) rc = ds_cuda_ok(cudaStreamSynchronize(st), "attention check: cudaStreamSynchronize");
    if (rc) return -1;
    char line[512];
    if (!wt_check_stalled(seen, pass, dt == DS_BF16, D, causal, then, line, sizeof line)) return 0;
    fprintf(stderr, "%s\n", line);
    return 1;
}

/* 1 when pass's Hopper kernel agrees with mma.sync on variant (dt, D), 0
 * (and the line on stderr) when not, 2 when the TMA kernel has no tensor
 * maps, 3 (and the line) when it stalled, -1 when CUDA fails. */
static int wgmma_agrees(ds_dtype dt, int D, int pass) {
    static const char *const names[] = { "forward", "backward", "TMA forward", "TMA backward" };
    static const char *const then[] = { "the forward stays on mma.sync", "the backward stays on mma.sync",
                                        "the forward runs the cp.async wgmma kernel where that one agrees",
                                        "the backward runs the cp.async wgmma kernels where those agree" };
    bool bwd = pass == PASS_BACKWARD || pass == PASS_TMA_BACKWARD;
    const double u = dt == DS_BF16 ? 1.0 / 256 : 1.0 / 2048, scale = 1.0 / sqrt((double)D);
    static const char *const what[] = { "dq", "dk", "dv" };
    std::vector<float> x = attn_check_inputs(dt, D, bwd ? 4 : 3);
    for (int causal = 0; causal < 2; causal++) {
        long at = 0;
        int which = 0;
        double worst;
        std::vector<float> grads[2][3], out[2], lse[2];
        wt_stall *stall = NULL;
        if ((pass == PASS_TMA || pass == PASS_TMA_BACKWARD) && !(stall = stall_new())) return -1;
        int rc = bwd ? check_run_backward(dt, D, causal, scale, x, stall, grads, out[0], lse[0])
                     : check_run(dt, D, causal, scale, x, stall, out, lse);
        if (stall && rc == 1) ds_cuda_scratch_free(stall);
        else if (stall && (rc = check_stalled(rc, stall, names[pass], dt, D, causal, then[pass])) > 0) return 3;
        if (rc) return rc < 0 ? -1 : 2;
        if (bwd) worst = attn_check_backward_compare(x, D, causal, scale, u, out[0], lse[0], grads[0], grads[1],
                                                     &which, &at);
        else worst = attn_check_compare(x, D, causal, scale, u, out[0], out[1], lse[0], lse[1], &at);
        if (!(worst <= 1)) {
            fprintf(stderr,
                    "dslua: attention: the sm_90a wgmma %s (%s, head dim %d, causal %d) is off from the mma.sync "
                    "kernel by %.3g times the bound on %s %ld of its check; %s\n",
                    names[pass], dt == DS_BF16 ? "bf16" : "f16", D, causal, worst,
                    bwd ? what[which] : at < 0 ? "lse" : "out", at < 0 ? -1 - at : at, then[pass]);
            return 0;
        }
    }
    return 1;
}

/* Why a variant runs where it runs, per wgmma_takes's answer. */
static const char *const why_not[] = { "", "switched off", "not compute capability 9.0",
                                       "too little shared memory", "off from mma.sync on its check",
                                       "not checked yet: the stream is capturing a graph",
                                       "no tensor maps: the driver has no cuTensorMapEncodeTiled",
                                       "stalled: an mbarrier wait ran out" };

/* Per device (up to 64), pass and variant: 0 not known yet, else 1 +
 * why_not's index (1: runs on the Hopper kernel). */
static signed char known[64][PASSES][4];

static signed char &known_of(int dev, int pass, ds_dtype dt, int D) {
    return known[dev][pass][(dt == DS_F16) * 2 + (D == 128)];
}

/* Whether the current device runs variant (dt, D) of a pass on its Hopper
 * kernel: known per device (past 64, never), pass and variant; *why (an
 * index of why_not) says why not. -1 when CUDA fails. */
static int wgmma_takes(ds_dtype dt, int D, int pass, int *why) {
    int dev, major = 0, minor = 0;
    *why = WHY_OFF;
    if (!wgmma_on || (dt != DS_BF16 && dt != DS_F16)) return 0;
    if (ds_cuda_ok(cudaGetDevice(&dev), "attention: cudaGetDevice")) return -1;
    *why = WHY_NOT_HOPPER;
    if (dev >= 64) return 0;
    signed char &k = known_of(dev, pass, dt, D);
    if (k == 0) {
        if (ds_cuda_ok(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "attention") ||
            ds_cuda_ok(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "attention"))
            return -1;
        int w = major == 9 && minor == 0 ? WHY_RUNS : WHY_NOT_HOPPER;
        bool tma = pass == PASS_TMA || pass == PASS_TMA_BACKWARD, bwd = pass == PASS_BACKWARD || pass == PASS_TMA_BACKWARD;
        size_t need = bwd ? ds_cuda_attention_wgmma_backward_smem(D, tma) : ds_cuda_attention_wgmma_smem(D, tma);
        if (!w && need > (size_t)smem_optin()) w = WHY_SMEM;
        cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
        if (!w && ds_cuda_ok(cudaStreamIsCapturing(ds_cuda_stream(), &capturing), "attention")) return -1;
        if (!w && capturing != cudaStreamCaptureStatusNone) {
            *why = WHY_CAPTURING;     /* the check copies and waits: not inside a capture, and not known until it runs */
            return 0;
        }
        if (!w) {
            int agrees = wgmma_agrees(dt, D, pass);
            if (agrees < 0) return -1;
            if (agrees != 1) w = agrees == 3 ? WHY_STALLED : agrees ? WHY_NO_MAPS : WHY_DISAGREES;
        }
        k = (signed char)(1 + w);
    }
    *why = k - 1;
    return k == 1;
}
#else
static const char *const why_not[] = { "", "switched off", "built without an sm_90a target" };

static int wgmma_takes(ds_dtype, int, int, int *why) {
    *why = wgmma_on ? WHY_NOT_HOPPER : WHY_OFF;
    return 0;
}
#endif

/* A pass's kernel for variant (dt, D) (backward: the backward's, else
 * the forward's): 2 the TMA one, 1 cp.async's, 0 mma.sync, -1 when CUDA
 * fails; *why says why not the TMA kernel. */
static int pass_takes(ds_dtype dt, int D, bool backward, int *why) {
    int r = wgmma_takes(dt, D, backward ? PASS_TMA_BACKWARD : PASS_TMA, why), cp;
    if (r) return r < 0 ? -1 : 2;
    if (*why <= WHY_NOT_HOPPER) return 0;   /* off, or not Hopper: the cp.async kernel is out too */
    r = wgmma_takes(dt, D, backward ? PASS_BACKWARD : PASS_FORWARD, &cp);
    if (r == 0) *why = cp;
    return r;
}

const char *ds_cuda_attention_pass_kernel(ds_dtype dt, int D, int backward, const char **why) {
    static const char *const kernels[] = { "mma.sync", "wgmma", "wgmma-tma" };
    int w, r = pass_takes(dt, D, backward, &w);
    *why = r == 2 ? "" : why_not[w];
    return r < 0 ? NULL : kernels[r];
}

/* ---- a TMA kernel stalling after its check ----
 * A stall in a later call (a shape or a device state the check did not
 * meet) leaves that call's outputs unwritten: its record goes to a
 * deferred fault (ds_cuda_fault_open), so the next synchronisation
 * reports it as that call's error rather than letting garbage flow on,
 * and from then on that pass of the variant runs the other kernels. */
#ifdef DS_CUDA_WGMMA
struct stall_note { int dev, pass; ds_dtype dt; int D; };

static void describe_stall(char *buf, size_t n, const void *ctx, ds_index_hit hit) {
    const stall_note *c = (const stall_note *)ctx;
    char where[160];
    wt_stall_name(where, sizeof where, hit.value);
    known_of(c->dev, c->pass, c->dt, c->D) = 1 + WHY_STALLED;
    snprintf(buf, n, "attention: the sm_90a TMA %s stalled (an mbarrier wait ran out: %s, block %lld; %s, head "
             "dim %d): its outputs are not written; later calls run the other kernels",
             c->pass == PASS_TMA ? "forward" : "backward", where, (long long)hit.pos,
             c->dt == DS_BF16 ? "bf16" : "f16", c->D);
}

/* Runs a TMA pass (run(stall): its kernels' launch) with a stall record
 * that becomes a deferred fault; run's answer (1: nothing launched). */
template <typename Run> static int with_stall_record(ds_dtype dt, int D, int pass, Run run) {
    stall_note note = { 0, pass, dt, D };
    if (ds_cuda_ok(cudaGetDevice(&note.dev), "attention: cudaGetDevice")) return -1;
    ds_index_hit *hit = ds_cuda_fault_open(describe_stall, &note, sizeof note);
    wt_stall *stall = hit ? stall_new() : NULL;
    if (!stall) {
        if (hit) hit->pos = -1;   /* nothing will write it */
        return -1;
    }
    int rc = run(stall);
    if (rc == 0) rc = ds_cuda_ok(cudaMemcpyAsync(hit, stall, sizeof *hit, cudaMemcpyDeviceToHost, ds_cuda_stream()),
                                 "attention: cudaMemcpyAsync");
    if (rc) hit->pos = -1;
    ds_cuda_scratch_free(stall);
    return rc;
}
#endif

int ds_cuda_attention_mma_forward(ds_kview out, ds_kview lse, ds_kview q, ds_kview k, ds_kview v, double scale,
                                  int causal, bool tf32) {
    int why, w = pass_takes(q.dtype, (int)q.shape[3], false, &why);
    if (w < 0) return -1;
#ifdef DS_CUDA_WGMMA
    if (w == 2) {
        int rc = with_stall_record(q.dtype, (int)q.shape[3], PASS_TMA, [&](wt_stall *stall) {
            return ds_cuda_attention_wgmma_forward(out, lse, q, k, v, scale, causal, stall);
        });
        if (rc != 1) return rc;
        w = wgmma_takes(q.dtype, (int)q.shape[3], PASS_FORWARD, &why);   /* views TMA cannot map */
        if (w < 0) return -1;
    }
    if (w) return ds_cuda_attention_wgmma_forward(out, lse, q, k, v, scale, causal, NULL);
#endif
    return mma_forward(out, lse, q, k, v, scale, causal, tf32);
}

int ds_cuda_attention_mma_backward(ds_kview dq, ds_kview dk, ds_kview dv, ds_kview dout, ds_kview q, ds_kview k,
                                   ds_kview v, ds_kview out, ds_kview lse, double scale, int causal, bool tf32) {
    int why, w = pass_takes(q.dtype, (int)q.shape[3], true, &why);
    if (w < 0) return -1;
#ifdef DS_CUDA_WGMMA
    if (w == 2) {
        int rc = with_stall_record(q.dtype, (int)q.shape[3], PASS_TMA_BACKWARD, [&](wt_stall *stall) {
            return ds_cuda_attention_wgmma_backward(dq, dk, dv, dout, q, k, v, out, lse, scale, causal, stall);
        });
        if (rc != 1) return rc;
        w = wgmma_takes(q.dtype, (int)q.shape[3], PASS_BACKWARD, &why);   /* views TMA cannot map */
        if (w < 0) return -1;
    }
    if (w) return ds_cuda_attention_wgmma_backward(dq, dk, dv, dout, q, k, v, out, lse, scale, causal, NULL);
#endif
    mma_geom g = mma_geom_of(q, k, scale, causal);
    return q.shape[3] == 64 ? backward_of<64>(dq, dk, dv, dout, q, k, v, out, lse, g, tf32)
                            : backward_of<128>(dq, dk, dv, dout, q, k, v, out, lse, g, tf32);
}
