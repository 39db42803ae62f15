"""Where the GPU time of dslua's training steps goes, kernel by kernel:
runs `dslua bench/gpu.lua steps B DTYPE V N` under Nsight Compute (only the
kernel durations, clocks left as they are) and prints each kernel's total
time per step, largest first, against the steps' wall time without ncu.
    python3 bench/gpu_kernels.py [B] [bf16|f32] [V] [N]   (defaults 8 bf16 50304 3)
N includes the first, slow step; the table divides by N."""
import collections
import csv
import io
import subprocess
import sys

B, dtype, V, n = (sys.argv[1:] + ["8", "bf16", "50304", "3"][len(sys.argv) - 1:])[:4]
cmd = ["build/dslua", "bench/gpu.lua", "steps", B, dtype, V, n]
wall = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
out = subprocess.run(["ncu", "--csv", "--clock-control", "none", "--metrics", "gpu__time_duration.sum"] + cmd,
                     check=True, capture_output=True, text=True).stdout
rows = [r for r in csv.reader(io.StringIO(out[out.find('"ID"'):])) if len(r) > 5]
head = rows[0]
name_at, value_at, unit_at = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
total, count = collections.Counter(), collections.Counter()
scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}


def short_name(full):
    """The kernel's name and template arguments without its parameter list:
    up to the first "(" outside <...> (template arguments such as
    (ds_dtype)-1 have their own), less "void "."""
    depth = 0
    for i, ch in enumerate(full):
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            full = full[:i]
            break
    return full.removeprefix("void ")[:60]


for r in rows[1:]:
    name = short_name(r[name_at])
    total[name] += float(r[value_at].replace(",", "")) * scale[r[unit_at]]
    count[name] += 1
steps = int(n)
gpu = sum(total.values()) / steps
print(f"{B}x1024 {dtype} V{V}: without ncu {wall}; kernels {gpu:.1f} ms/step over {steps} steps, "
      f"{sum(count.values()) // steps} launches/step")
print(f"{'kernel':<62}{'ms/step':>9}{'calls':>7}{'share':>7}")
for name, t in total.most_common(40):
    print(f"{name:<62}{t / steps:9.2f}{count[name] // steps:7d}{100 * t / steps / gpu:6.1f}%")
