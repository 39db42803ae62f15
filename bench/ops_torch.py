"""PyTorch side of the benchmarks: the rows of bench/ops.lua, measured the
same way (one sizing call, warm-up, median of samples), on the same thread
count. Run by bench/run.sh with /usr/bin/python3:

    ops_torch.py THREADS [quick]

Prints one line per row, read by bench/table.lua:
    result  torch  <op>  <shape>  <value>  <unit>      (unit: s per call, or gflops)
"""
import sys
import time

import torch
import torch.nn.functional as F

threads = int(sys.argv[1])
quick = len(sys.argv) > 2 and sys.argv[2] == "quick"
SAMPLES = 3 if quick else 7
SAMPLE_S = 0.02 if quick else 0.1

torch.set_num_threads(threads)
torch.set_grad_enabled(False)
torch.manual_seed(0)


def time_per_call(fn):
    t0 = time.perf_counter()
    fn()
    k = max(1, int(SAMPLE_S / max(time.perf_counter() - t0, 1e-9)))
    for _ in range(max(2, k)):
        fn()
    t = []
    for _ in range(SAMPLES):
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        t.append((time.perf_counter() - t0) / k)
    t.sort()
    return t[SAMPLES // 2]


def emit(op, shape, value, unit):
    print("result\ttorch\t%s\t%s\t%s\t%s" % (op, "x".join(map(str, shape)), value, unit), flush=True)


def bench(op, shape, fn, flops=None):
    t = time_per_call(fn)
    if flops:
        emit(op, shape, "%.6g" % (flops / t * 1e-9), "gflops")
    else:
        emit(op, shape, "%.6g" % t, "s")


print("info\ttorch\tthreads\t%d" % torch.get_num_threads())
print("info\ttorch\tversion\t%s" % torch.__version__)

for n in (256, 512, 1024, 2048):
    a, b = torch.randn(n, n), torch.randn(n, n)
    bench("matmul", (n, n), lambda: torch.matmul(a, b), 2 * n * n * n)

big_shapes = ((4096, 768), (8192, 1024))
for s in big_shapes:
    a, b = torch.randn(s), torch.randn(s)
    bench("add", s, lambda: a + b)
for s in big_shapes:
    a, b = torch.randn(s), torch.randn(s)
    bench("add_", s, lambda: a.add_(b))
for s in big_shapes:
    x = torch.randn(s)
    bench("gelu_tanh", s, lambda: F.gelu(x, approximate="tanh"))
for s in big_shapes:
    x, w, b = torch.randn(s), torch.randn(s[1]), torch.randn(s[1])
    bench("layer_norm", s, lambda: F.layer_norm(x, (s[1],), w, b, 1e-5))
for s in big_shapes:
    x = torch.randn(s)
    bench("softmax", s, lambda: torch.softmax(x, -1))

a, b = torch.randn(16), torch.randn(16)
bench("small_add", (16,), lambda: a + b)
