"""The same step phase in PyTorch, for bench/step.sh: fp32 master weights
of N elements with their gradients, torch.optim.AdamW (fused on a GPU,
foreach on the CPU) with clip_grad_norm_, then the copy into bf16 weights.
Prints `result torch step <device> <N> <ms> ms`, the median of the steps.

    python3 bench/step_torch.py N [quick]
"""
import statistics
import sys
import time

import torch

n = int(sys.argv[1])
dev = 'cuda' if torch.cuda.is_available() else 'cpu'
steps = 5 if len(sys.argv) > 2 and sys.argv[2] == 'quick' else 10
master = torch.nn.Parameter(torch.randn(n, device=dev) * 0.02)
master.grad = torch.randn(n, device=dev) * 1e-3
weights = torch.empty(n, device=dev, dtype=torch.bfloat16)
fused = {'fused': True} if dev == 'cuda' else {}
opt = torch.optim.AdamW([master], lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), **fused)


def sync():
    if dev == 'cuda':
        torch.cuda.synchronize()


times = []
for i in range(steps + 2):
    sync()
    t0 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_([master], 1.0)
    opt.step()
    weights.copy_(master.detach())
    sync()
    if i >= 2:
        times.append(time.perf_counter() - t0)
print(f'result torch step {dev} {n} {1000 * statistics.median(times):.3f} ms')
