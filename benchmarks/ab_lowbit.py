"""A/B of fused low-bit launch configurations in one process (interleaved, L2 flushed), for
tuning the planner. A configuration is a '+'-joined list of SPINFER_* environment overrides read
by the planner at every launch (LOWBIT_SPLITS); 'auto' is the planner's own choice.

    python benchmarks/ab_lowbit.py --configs auto,LOWBIT_SPLITS=2,LOWBIT_SPLITS=4 \\
        [--shapes 14336x4096,4096x14336] [--ns 1,8,16] [--quant 4:128]
"""

import argparse

import torch
import torch.nn.functional as F

import spinfer
from spinfer.quant import LowBitWeight

from ab_spmm import compare  # benchmarks/ is on sys.path when this script runs


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
    cases = []
    for shape in a.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        w = torch.randn(m, k, device=dev).half()
        q = LowBitWeight.quantize(w, bits, group)
        for n in (int(v) for v in a.ns.split(",")):
            x = torch.randn(n, k, device=dev).half()
            out = torch.empty(n, m, device=dev).half()
            cases.append((f"{m:>5}x{k:<5} N={n:<3}", lambda x=x, w=w: F.linear(x, w),
                          lambda x=x, q=q, out=out: spinfer.lowbit_mm(x, q, out=out)))
    compare(configs, cases, dev)


if __name__ == "__main__":
    main()
