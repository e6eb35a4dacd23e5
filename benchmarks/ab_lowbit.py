"""A/B of fused low-bit launch configurations in one process (interleaved, L2 flushed), for
tuning the planner. A configuration is a '+'-joined list of SPINFER_* environment overrides read
by the planner or the launch at every call (LOWBIT_SPLITS, LOWBIT_BN, LOWBIT_BALANCED, LOWBIT_ROTATE,
LOWBIT_XSUM); 'auto' is the planner's own choice.

    python benchmarks/ab_lowbit.py --configs auto,LOWBIT_SPLITS=2,LOWBIT_SPLITS=4 \\
        [--shapes 14336x4096,4096x14336] [--ns 1,8,16] [--quant 4:128] [--dtype bf16]
"""

import argparse

import torch

import spinfer
from spinfer.quant import LowBitWeight

from ab_spmm import build_cases, compare  # benchmarks/ is on sys.path when this script runs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="auto,LOWBIT_SPLITS=1,LOWBIT_SPLITS=2,LOWBIT_SPLITS=4")
    p.add_argument("--shapes", default="14336x4096,4096x14336")
    p.add_argument("--ns", default="1,8,16")
    p.add_argument("--quant", default="4:128", help="bits:group")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"), help="weights, x and cuBLAS's reference")
    p.add_argument("--rounds", type=int, default=1, help="least of this many shuffled rounds per call")
    a = p.parse_args()
    configs = a.configs.split(",")
    bits, group = (int(v) for v in a.quant.split(":"))
    spinfer.build.load_extension()
    dev = torch.device("cuda")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    print(f"{torch.cuda.get_device_name(dev)}: x cuBLAS {a.dtype} (us), {bits}-bit g{group}; configs: {configs}")
    def prepare(w):
        q = LowBitWeight.quantize(w, bits, group)
        out = torch.empty(max(int(n) for n in a.ns.split(",")), w.shape[0], device=dev, dtype=dtype)
        return lambda x: spinfer.lowbit_mm(x, q, out=out[: x.shape[0]])

    cases = build_cases(a.shapes, a.ns, dev, prepare, dtype)
    compare(configs, cases, dev, a.rounds)


if __name__ == "__main__":
    main()
