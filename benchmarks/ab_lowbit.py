"""A/B of fused low-bit launch configurations in one process (interleaved, L2 flushed), for
tuning the planner. A configuration is a '+'-joined list of SPINFER_* environment overrides read
by the planner or the launch at every call (LOWBIT_SPLITS, LOWBIT_BN, LOWBIT_BALANCED, LOWBIT_ROTATE,
LOWBIT_XSUM); 'auto' is the planner's own choice.

    python benchmarks/ab_lowbit.py --configs auto,LOWBIT_SPLITS=2,LOWBIT_SPLITS=4 \\
        [--shapes 14336x4096,4096x14336] [--ns 1,8,16] [--quant 4:128] [--dtype bf16] [--plans]

--plans prints each configuration's launch (spinfer.ops.lowbit_mm.lowbit_plan) per case before timing.
"""

import argparse

import torch

import spinfer
from spinfer.quant import LowBitWeight

from ab_spmm import build_cases, compare, print_launches  # benchmarks/ is on sys.path when this script runs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="auto,LOWBIT_SPLITS=1,LOWBIT_SPLITS=2,LOWBIT_SPLITS=4")
    p.add_argument("--shapes", default="14336x4096,4096x14336")
    p.add_argument("--ns", default="1,8,16")
    p.add_argument("--quant", default="4:128", help="bits:group")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"), help="weights, x and cuBLAS's reference")
    p.add_argument("--rounds", type=int, default=1, help="least of this many shuffled rounds per call")
    p.add_argument("--plans", action="store_true", help="print each configuration's launch per case")
    a = p.parse_args()
    configs = a.configs.split(",")
    bits, group = (int(v) for v in a.quant.split(":"))
    spinfer.build.load_extension()
    dev = torch.device("cuda")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    print(f"{torch.cuda.get_device_name(dev)}: x cuBLAS {a.dtype} (us), {bits}-bit g{group}; configs: {configs}")
    weights = []  # ((m, k), weight) in --shapes order

    def prepare(w):
        q = LowBitWeight.quantize(w, bits, group)
        weights.append((tuple(w.shape), q))
        out = torch.empty(max(int(n) for n in a.ns.split(",")), w.shape[0], device=dev, dtype=dtype)
        return lambda x: spinfer.lowbit_mm(x, q, out=out[: x.shape[0]])

    cases = build_cases(a.shapes, a.ns, dev, prepare, dtype)
    if a.plans:
        print_plans(configs, weights, [int(v) for v in a.ns.split(",")], dtype)
    compare(configs, cases, dev, a.rounds)


def print_plans(configs, weights, ns, dtype=torch.float16):
    """One line per weight ((m, k), LowBitWeight pairs) and N, a cell per configuration: the
    planner's kernel (the GEMV and its loader, the balanced schedule, or tiles of tile_rows rows),
    token tile, split count and stages a split, split tail rows, and the resident blocks an SM
    (lowbit_plan)."""
    from spinfer.ops.lowbit_mm import lowbit_plan

    def cell(q, n):
        p = lowbit_plan(q, n, dtype=dtype)
        kind = (f"gemv ring {p['gemv_ring']} warps {p['gemv_warps']}" if p["gemv"]
                else "balanced" if p["balanced"] else f"rows {p['tile_rows']}")
        tail = f" tail {p['tail_splits']}x{p['tail_iters']}" if p["tail_splits"] > 1 else ""
        return f"{kind} bn {p['bn']} splits {p['splits']}x{p['iters_per_split']}{tail} res {p['resident_blocks']}"

    print_launches(configs, weights, ns, cell)


if __name__ == "__main__":
    main()
