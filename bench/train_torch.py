"""Training throughput of the same models in PyTorch, for bench/train.sh.

GPT-2 124M as nanoGPT writes it (B=4, T=128, tied lm_head, tanh GELU,
torch.optim.AdamW with fused=False and PyTorch's default foreach) and the
MNIST MLP 784-256-10 (SGD with momentum), on random batches made up front.
Each step is a plain loop: forward, loss, backward, optimizer step,
zero_grad. Prints `result torch <model> <shape> <value> <unit>` lines with
the median over the timed samples, as bench/train.lua does.

    python3 bench/train_torch.py THREADS [gpt2|mlp|all] [quick]
"""
import inspect
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        # torch 1.13 has no F.scaled_dot_product_attention: nanoGPT's slow path
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float('-inf')).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate='tanh'))


class GPT(nn.Module):
    def __init__(self, vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith('c_proj.weight') else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        T = idx.size(1)
        pos = torch.arange(T, dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x, y):
        return F.cross_entropy(self.net(x.reshape(x.size(0), 784)), y)


def time_steps(step, warmup, samples, k):
    """Median seconds per step over `samples` samples of `k` steps."""
    for i in range(warmup):
        step(i)
    times, i = [], warmup
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(k):
            step(i)
            i += 1
        times.append((time.perf_counter() - t0) / k)
    return statistics.median(times)


def train(model, opt, batches, warmup, samples, k):
    last = [0.0]

    def step(i):
        x, y = batches[i % len(batches)]
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        last[0] = loss.item()

    return time_steps(step, warmup, samples, k), last[0]


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    which = 'all'
    quick = False
    for a in sys.argv[2:]:
        if a == 'quick':
            quick = True
        else:
            which = a
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    print(f'info\ttorch\tthreads\t{torch.get_num_threads()}', flush=True)

    if which in ('all', 'gpt2'):
        B, T = 4, 128
        model = GPT()
        V = model.wte.num_embeddings
        batches = []
        for _ in range(4):
            ids = torch.randint(0, V, (B, T + 1))
            batches.append((ids[:, :T].contiguous(), ids[:, 1:].contiguous()))
        # foreach as PyTorch defaults it; torch 1.13's AdamW has no fused
        # path at all, later versions get fused=False said explicitly
        extra = {'fused': False} if 'fused' in inspect.signature(torch.optim.AdamW).parameters else {}
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                **extra)
        sec, loss = train(model, opt, batches, 1 if quick else 2, 2 if quick else 5, 1)
        print(f'bench/train_torch.py: gpt2 {sec:.3f} s/step, last loss {loss:.4f}', file=sys.stderr)
        print(f'result\ttorch\tgpt2_124M\tB{B}xT{T}\t{B * T / sec:.2f}\ttokens/s', flush=True)
        del model, opt, batches

    if which in ('all', 'mlp'):
        B = 128
        model = MLP()
        batches = [(torch.randn(B, 1, 28, 28), torch.randint(0, 10, (B,))) for _ in range(8)]
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        sec, loss = train(model, opt, batches, 5 if quick else 20, 3 if quick else 11, 5 if quick else 20)
        print(f'bench/train_torch.py: mlp {sec * 1000:.3f} ms/step, last loss {loss:.4f}', file=sys.stderr)
        print(f'result\ttorch\tmlp_784-256-10\tB{B}\t{B / sec:.2f}\tsamples/s', flush=True)


if __name__ == '__main__':
    main()
