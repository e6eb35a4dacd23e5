"""A/B of fused low-bit launch configurations in one process (interleaved, L2 flushed), for
tuning the planner. A configuration is a '+'-joined list of SPINFER_* environment overrides read
by the planner at every launch (LOWBIT_SPLITS); 'auto' is the planner's own choice.

    python benchmarks/ab_lowbit.py --configs auto,LOWBIT_SPLITS=2,LOWBIT_SPLITS=4 \\
        [--shapes 14336x4096,4096x14336] [--ns 1,8,16] [--quant 4:128]
"""

import argparse
import math

import torch
import torch.nn.functional as F

import spinfer
from spinfer.quant import LowBitWeight
from spinfer.timing import median_time

from ab_spmm import apply  # benchmarks/ is on sys.path when this script runs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="auto,LOWBIT_SPLITS=1,LOWBIT_SPLITS=2,LOWBIT_SPLITS=4")
    p.add_argument("--shapes", default="14336x4096,4096x14336")
    p.add_argument("--ns", default="1,8,16")
    p.add_argument("--quant", default="4:128", help="bits:group")
    a = p.parse_args()
    configs = a.configs.split(",")
    bits, group = (int(v) for v in a.quant.split(":"))
    spinfer.build.load_extension()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}: x cuBLAS (us), {bits}-bit g{group}; configs: {configs}")
    logs = {c: [] for c in configs}
    for shape in a.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        w = torch.randn(m, k, device=dev).half()
        q = LowBitWeight.quantize(w, bits, group)
        for n in (int(v) for v in a.ns.split(",")):
            x = torch.randn(n, k, device=dev).half()
            out = torch.empty(n, m, device=dev).half()
            t_ref = median_time(lambda: F.linear(x, w), dev, reps=40)
            cells = []
            for c in configs:
                apply(c)
                t = median_time(lambda: spinfer.lowbit_mm(x, q, out=out), dev, reps=40)
                logs[c].append(math.log(t_ref / t))
                cells.append(f"{t_ref / t:4.2f} ({t * 1e6:6.1f})")
            apply("auto")
            print(f"{m:>5}x{k:<5} N={n:<3} cuBLAS {t_ref * 1e6:6.1f} | " + " | ".join(cells), flush=True)
    print("geomean x cuBLAS: " + " | ".join(f"{c}: {math.exp(sum(v) / len(v)):.3f}" for c, v in logs.items()))


if __name__ == "__main__":
    main()
