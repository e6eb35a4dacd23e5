"""A/B of SpMM launch configurations in one process (interleaved, L2 flushed), for tuning the
planner. A configuration is a '+'-joined list of SPINFER_* environment overrides read by the
planner at every launch (SPLITS, STAGES, LOADER, DECODE, VALUE_CAP, MIN_BLOCKS, BN, SPLIT_MARGIN,
SPLIT_FIXED, SPLIT_CAP, SPLIT_RULE, WGMMA, COUNT_ROWS, ROW_TABLE); 'auto' is the planner's own choice.

    python benchmarks/ab_spmm.py --configs auto,STAGES=3,SPLITS=8 \\
        [--shapes 28672x8192,4096x14336] [--ns 1,8,16,32] [--sparsity 0.5] [--plans]

--plans prints each configuration's launch (spinfer.ops.spmm.spmm_plan) per case before timing.
"""

import argparse
import math
import os

import torch
import torch.nn.functional as F

import spinfer
from spinfer.format import TCABME
from spinfer.timing import least_of_rounds


def apply(config):
    for key in [k for k in os.environ if k.startswith("SPINFER_") and k != "SPINFER_CACHE"]:
        del os.environ[key]
    if config != "auto":
        for item in config.split("+"):
            key, value = item.split("=")
            os.environ[f"SPINFER_{key}"] = value


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="auto,STAGES=3,STAGES=4,SPLITS=2,SPLITS=8")
    p.add_argument("--shapes", default="28672x8192,4096x14336")
    p.add_argument("--ns", default="1,8,16,32")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=1, help="least of this many shuffled rounds per call")
    p.add_argument("--plans", action="store_true", help="print each configuration's launch per case")
    a = p.parse_args()
    configs = a.configs.split(",")
    spinfer.build.load_extension()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}: x cuBLAS (us), sparsity {a.sparsity}; configs: {configs}")
    encs = []  # ((m, k), encoding) in --shapes order; a shape given twice has two weights

    def prepare(w):
        w[torch.rand(w.shape, device=dev) < a.sparsity] = 0
        enc = TCABME.from_dense(w)
        encs.append((tuple(w.shape), enc))
        return lambda x: spinfer.spmm(x, enc)

    cases = build_cases(a.shapes, a.ns, dev, prepare)
    if a.plans:
        print_plans(configs, encs, [int(v) for v in a.ns.split(",")])
    compare(configs, cases, dev, a.rounds)


def print_plans(configs, encs, ns):
    """One line per weight ((m, k), encoding pairs) and N, a cell per configuration: the planner's
    token tile, wgmma group, rows a block, split count and GroupTiles a split, and the resident
    blocks an SM (spmm_plan)."""
    from spinfer.ops.spmm import spmm_plan

    def cell(enc, n):
        q = spmm_plan(enc, n)
        return (f"bn {q['bn']} wg {q['wgmma']} rows {q['rows']} splits {q['splits']}x{q['k_per_split']} "
                f"res {q['resident_blocks']}")

    print_launches(configs, encs, ns, cell)


def print_launches(configs, weights, ns, cell):
    """The --plans lines of the A/B scripts: one per weight ((m, k), weight pairs) and N, with
    cell(weight, n), the launch described under each configuration's environment; the planner's
    own choice is restored after."""
    for (m, k), w in weights:
        for n in ns:
            cells = []
            for c in configs:
                apply(c)
                cells.append(f"{c}: {cell(w, n)}")
            apply("auto")
            print(f"plan {m:>5}x{k:<5} N={n:<3} " + " | ".join(cells), flush=True)


def build_cases(shapes, ns, dev, prepare, dtype=torch.float16):
    """(label, cuBLAS call, op call) per shape and N: a random weight of `dtype` per shape, handed
    to prepare(w), which may prune it in place and returns the op as a function of x; cuBLAS
    multiplies by the weight as prepare left it, in the same dtype."""
    cases = []
    for shape in shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        w = torch.randn(m, k, device=dev).to(dtype)
        op = prepare(w)
        for n in (int(v) for v in ns.split(",")):
            x = torch.randn(n, k, device=dev).to(dtype)
            cases.append((f"{m:>5}x{k:<5} N={n:<3}", lambda x=x, w=w: F.linear(x, w), lambda x=x, op=op: op(x)))
    return cases


def compare(configs, cases, dev, rounds=1):
    """Times each case's (cuBLAS, op) pair with the op under every configuration, interleaved in
    one process; prints x cuBLAS (us) per case and the geomean per configuration. With rounds > 1
    each call keeps its least median over that many rounds, rounds after the first in a shuffled
    order (spinfer.timing.least_of_rounds with shuffle): six such rounds gave identical plans
    under two names the same least median in every case tried (docs/quant.md, twenty-sixth
    session). A configuration's environment is applied inside its call, before the launch (host
    time, which the device-time measurement does not see)."""
    logs = {c: [] for c in configs}
    for label, ref, op in cases:
        fns = {"cuBLAS": ref}
        for c in configs:
            fns[c] = lambda c=c: (apply(c), op())
        best = least_of_rounds(fns, dev, rounds=rounds, shuffle=True, reps=40)
        apply("auto")
        t_ref = best["cuBLAS"]
        cells = []
        for c in configs:
            logs[c].append(math.log(t_ref / best[c]))
            cells.append(f"{t_ref / best[c]:4.2f} ({best[c] * 1e6:6.1f})")
        print(f"{label} cuBLAS {t_ref * 1e6:6.1f} | " + " | ".join(cells), flush=True)
    print("geomean x cuBLAS: " + " | ".join(f"{c}: {math.exp(sum(v) / len(v)):.3f}" for c, v in logs.items()))


if __name__ == "__main__":
    main()
