"""PyTorch's side of bench/gpu.sh, on the same GPU and the same rows as
bench/gpu.lua:
    python3 bench/gpu_torch.py train B bf16|f32|tf32 V [MODEL] [compile] [quick]
    python3 bench/gpu_torch.py ops [quick]
MODEL: gpt2_124M (the default), gpt2_xl (1.5B), both T=1024, as nanoGPT
writes GPT-2 (SDPA attention, tied lm_head); llama_1B, TinyLlama's 1.1B
shape at T=2048 (RMSNorm, RoPE, grouped-query SDPA, SwiGLU, untied lm_head).
Fused AdamW, bf16 through autocast over fp32 weights, gradient clipping
1.0. V is the vocab: for GPT-2 50257, or 50304 as nanoGPT pads it (its
loss then over all 50304)."""
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

args = sys.argv[1:]
quick = "quick" in args
dev = "cuda"


def result(row, shape, value, unit, impl="torch"):
    print(f"result\t{impl}\t{row}\t{shape}\t{value:.6g}\t{unit}", flush=True)


def time_per_call(fn):
    fn(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(); torch.cuda.synchronize()
    k = max(1, int((0.02 if quick else 0.2) / max(time.perf_counter() - t0, 1e-6)))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) / k)
    return statistics.median(ts)


class Block(nn.Module):
    def __init__(s, C, H):
        super().__init__()
        s.H = H
        s.ln_1, s.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        s.c_attn, s.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        s.c_fc, s.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(s, x):
        B, T, C = x.shape
        q, k, v = s.c_attn(s.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, s.H, C // s.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + s.c_proj(y)
        return x + s.mlp_proj(F.gelu(s.c_fc(s.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(s, V=50257, T=1024, L=12, H=12, C=768, classes=None):
        super().__init__()
        s.classes = classes or V    # the loss over the first classes of V logits (bench/curve_torch.py)
        s.wte, s.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        s.h = nn.ModuleList(Block(C, H) for _ in range(L))
        s.ln_f = nn.LayerNorm(C)
        s.lm_head = nn.Linear(C, V, bias=False)
        s.lm_head.weight = s.wte.weight
        for name, p in s.named_parameters():   # nanoGPT's init, as models/gpt2.lua
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * L) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            else:
                nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)

    def forward(s, idx, y):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in s.h:
            x = b(x)
        logits = s.lm_head(s.ln_f(x))[..., : s.classes]
        return F.cross_entropy(logits.reshape(-1, s.classes), y.reshape(-1))


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class LlamaLayer(nn.Module):
    def __init__(s, C, H, KV, I):
        super().__init__()
        s.H, s.KV = H, KV
        s.input_layernorm, s.post_attention_layernorm = nn.RMSNorm(C, eps=1e-5), nn.RMSNorm(C, eps=1e-5)
        D = C // H
        s.q_proj, s.k_proj = nn.Linear(C, C, bias=False), nn.Linear(C, KV * D, bias=False)
        s.v_proj, s.o_proj = nn.Linear(C, KV * D, bias=False), nn.Linear(C, C, bias=False)
        s.gate_proj, s.up_proj = nn.Linear(C, I, bias=False), nn.Linear(C, I, bias=False)
        s.down_proj = nn.Linear(I, C, bias=False)

    def forward(s, x, cos, sin):
        B, T, C = x.shape
        D = C // s.H
        h = s.input_layernorm(x)
        q = rope(s.q_proj(h).view(B, T, s.H, D).transpose(1, 2), cos, sin)
        k = rope(s.k_proj(h).view(B, T, s.KV, D).transpose(1, 2), cos, sin)
        v = s.v_proj(h).view(B, T, s.KV, D).transpose(1, 2)
        k, v = k.repeat_interleave(s.H // s.KV, 1), v.repeat_interleave(s.H // s.KV, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + s.o_proj(y)
        h = s.post_attention_layernorm(x)
        return x + s.down_proj(F.silu(s.gate_proj(h)) * s.up_proj(h))


class Llama(nn.Module):
    def __init__(s, V=32000, T=2048, L=22, H=32, KV=4, C=2048, I=5632):
        super().__init__()
        s.embed_tokens = nn.Embedding(V, C)
        s.layers = nn.ModuleList(LlamaLayer(C, H, KV, I) for _ in range(L))
        s.norm = nn.RMSNorm(C, eps=1e-5)
        s.lm_head = nn.Linear(C, V, bias=False)
        for p in s.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
        D = C // H
        ang = torch.outer(torch.arange(T).float(), 10000.0 ** (-torch.arange(0, D, 2).float() / D))
        ang = torch.cat((ang, ang), -1)
        s.register_buffer("cos", ang.cos(), persistent=False)
        s.register_buffer("sin", ang.sin(), persistent=False)

    def forward(s, idx, y):
        T = idx.shape[1]
        x = s.embed_tokens(idx)
        cos, sin = s.cos[:T].to(x.dtype), s.sin[:T].to(x.dtype)
        for layer in s.layers:
            x = layer(x, cos, sin)
        logits = s.lm_head(s.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))


# bench/gpu.lua's MODELS: the module and its context length
MODELS = {
    "gpt2_124M": (lambda V: GPT(V=V), 1024),
    "gpt2_xl": (lambda V: GPT(V=V, L=48, H=25, C=1600), 1024),
    "llama_1B": (lambda V: Llama(V=V), 2048),
}


def train(B, dtype, V, name, compiled):
    build, T = MODELS[name]
    steps = 3 if quick else 10
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"      # tf32: f32 with TF32 matmuls
    model = build(V).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    fwd = torch.compile(model) if compiled else model
    batches = [torch.randint(0, min(V, 50257), (B, T + 1), device=dev) for _ in range(4)]

    def step(i):
        ids = batches[i % 4]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = fwd(ids[:, :-1], ids[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(i)
    torch.cuda.synchronize()
    sec = (time.perf_counter() - t0) / steps
    impl = "torch_compile" if compiled else "torch"
    shape = f"B{B}xT{T}_{dtype}_V{V}"
    result(name, shape, B * T / sec, "tokens/s", impl)
    result(name + "_peak", shape, torch.cuda.max_memory_allocated() / 2**30, "GiB", impl)
    print(f"bench/gpu_torch.py: {impl} {name} {shape} {1000 * sec:.1f} ms/step, last loss {loss.item():.4f}",
          file=sys.stderr)


def bandwidth():
    """bench/gpu.lua's bandwidth rows: bytes moved per second on 2^28 elements."""
    n = 2**28
    with torch.no_grad():
        for dt in ("bf16", "f32"):
            tdt = torch.bfloat16 if dt == "bf16" else torch.float32
            es = 2 if dt == "bf16" else 4

            def rate(row, shape, moved, fn):
                result(row, f"{shape}_{dt}", moved * n * es / time_per_call(fn) / 1e12, "TB/s")

            a, c = torch.randn(n, device=dev, dtype=tdt), torch.randn(n, device=dev, dtype=tdt)
            rate("bw_add", "256Mi", 3, lambda: a + c)
            rate("bw_gelu_tanh", "256Mi", 2, lambda: F.gelu(a, approximate="tanh"))
            del c
            rows = n // 768
            x = a[: rows * 768].view(rows, 768)
            w, b = torch.randn(768, device=dev, dtype=tdt), torch.randn(768, device=dev, dtype=tdt)
            rate("bw_layer_norm", f"{rows}x768", 2 * rows * 768 / n, lambda: F.layer_norm(x, (768,), w, b))
            rate("bw_softmax", f"{n // 1024}x1024", 2, lambda: torch.softmax(a.view(n // 1024, 1024), -1))
            # eager's fp8 cast and transposed copy (bench/gpu.lua's one pass)
            rate("bw_fp8_cast_transpose", f"{rows}x768", rows * 768 * (es + 2) / es / n,
                 lambda: (x * 1.0).to(torch.float8_e4m3fn).t().contiguous())
            del a, x
            torch.cuda.empty_cache()


def ops():
    torch.set_grad_enabled(True)
    # tf32: f32 under torch.backends.cuda.matmul.allow_tf32 (its f32 SDPA runs the same
    # memory-efficient kernel either way)
    for dt in ("bf16", "f32", "tf32"):
        torch.backends.cuda.matmul.allow_tf32 = dt == "tf32"
        tdt = torch.bfloat16 if dt == "bf16" else torch.float32
        r = lambda *s: torch.randn(*s, device=dev, dtype=tdt)
        q, k, v = r(8, 12, 1024, 64), r(8, 12, 1024, 64), r(8, 12, 1024, 64)
        with torch.no_grad():
            result("attention_fwd", f"8x12x1024x64_{dt}",
                   time_per_call(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), "s")
        for t in (q, k, v):
            t.requires_grad_()
        g = r(8, 12, 1024, 64)
        result("attention_fwd_bwd", f"8x12x1024x64_{dt}",
               time_per_call(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)), "s")
        del q, k, v, g
    torch.backends.cuda.matmul.allow_tf32 = False
    for dt in ("bf16", "f32"):
        tdt = torch.bfloat16 if dt == "bf16" else torch.float32
        r = lambda *s: torch.randn(*s, device=dev, dtype=tdt)
        x, w, b = r(8192, 768), r(768), r(768)
        h = r(8192, 3072)
        wl, bl = r(2304, 768), r(2304)
        with torch.no_grad():
            result("layer_norm", f"8192x768_{dt}", time_per_call(lambda: F.layer_norm(x, (768,), w, b)), "s")
            result("gelu_tanh", f"8192x3072_{dt}", time_per_call(lambda: F.gelu(h, approximate="tanh")), "s")
            result("linear_bias", f"8192x768x2304_{dt}", time_per_call(lambda: F.linear(x, wl, bl)), "s")
        w1, b1 = (r(3072, 768) * 0.03).requires_grad_(), r(3072).requires_grad_()
        w2, b2 = (r(768, 3072) * 0.02).requires_grad_(), r(768).requires_grad_()
        gm = r(8192, 768)
        mlp = lambda: F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2).backward(gm)
        result("mlp_fwd_bwd", f"8192x768x3072_{dt}", time_per_call(mlp), "s")
        del w1, b1, w2, b2, gm
        logits = r(8192, 50257).requires_grad_()
        y = torch.randint(0, 50257, (8192,), device=dev)
        result("cross_entropy_fwd_bwd", f"8192x50257_{dt}",
               time_per_call(lambda: F.cross_entropy(logits, y).backward()), "s")
        del logits
        a, c = r(124 * 2**20), r(124 * 2**20)
        with torch.no_grad():
            result("add", f"124Mi_{dt}", time_per_call(lambda: a + c), "s")
            n = 8192
            m1, m2 = r(n, n), r(n, n)
            sec = time_per_call(lambda: m1 @ m2)
            result("matmul", f"8192^3_{dt}", 2 * n**3 / sec / 1e12, "TFLOP/s")
        del a, c, m1, m2
        torch.cuda.empty_cache()
    bandwidth()
    big = torch.randn(2**28, device=dev)
    out = torch.empty_like(big)
    result("copy", "1GiB", 2 * 2**30 / time_per_call(lambda: out.copy_(big)) / 1e12, "TB/s")


def main():
    print(f"info\ttorch\tdevice\t{torch.cuda.get_device_name()}")
    if args and args[0] == "train":
        named = [a for a in args[4:] if a in MODELS]
        train(int(args[1]), args[2], int(args[3]), named[0] if named else "gpt2_124M", "compile" in args)
    elif args and args[0] == "ops":
        ops()
    else:
        sys.exit("usage: python3 bench/gpu_torch.py train B bf16|f32|tf32 V [gpt2_124M|gpt2_xl|llama_1B] [compile] [quick] "
                 "| ops [quick]")


if __name__ == "__main__":      # bench/curve_torch.py imports its GPT
    main()
