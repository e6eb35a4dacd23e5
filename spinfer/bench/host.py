"""Host time of one eager call per linear layer: what an eager (not graph-captured) decode step pays,
being bound by host time at batch 1 (docs/policy.md, "Host time of an eager call").

Each call is issued back to back on a small layer (default 512x512 fp16, N = 1, no grad) so the GPU
queue absorbs the kernels and the host's seconds per call are what is measured
(``timing.host_overhead``), in rounds that interleave the calls; the least of the rounds. Ratios
are against ``F.linear`` on the dense weight in the same process: the host's speed can vary by up
to 2x between processes.

    spinfer bench host [--shape 512x512] [--n 1] [--rounds 5] [--reps 2000]   (needs a CUDA GPU)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import spinfer
from spinfer.bench import require_cuda
from spinfer.timing import host_overhead


def calls(m: int, k: int, n: int) -> dict:
    """The calls compared, on one random weight (pruned to 50% for the sparse ones, 4-bit g128 for
    the low-bit ones) with a bias, each a no-argument function."""
    dev = torch.device("cuda")
    dense = torch.randn(m, k, device=dev, dtype=torch.float16) / k ** 0.5
    bias = torch.randn(m, device=dev, dtype=torch.float16)
    pruned = spinfer.magnitude_prune(dense, 0.5)
    enc = spinfer.TCABME.from_dense(pruned)
    q = spinfer.LowBitWeight.quantize(dense, 4, 128)
    linear = nn.Linear(k, m, device=dev, dtype=torch.float16)
    with torch.no_grad():
        linear.weight.copy_(pruned)
        linear.bias.copy_(bias)
    layers = {policy: spinfer.SparseLinear.from_linear(linear, quant="w4" if policy == "lowbit" else None,
                                                       policy=policy) for policy in ("sparse", "lowbit", "dense")}
    x = torch.randn(n, k, device=dev, dtype=torch.float16)
    out = torch.empty(n, m, device=dev, dtype=torch.float16)
    op_args = (x, enc.bitmap, enc.values, enc.gtile_offset, m, k, 64, 64, enc.max_run, bias, 0, enc.row_offset)
    return {
        "F.linear (dense)": lambda: F.linear(x, pruned, bias),
        "nn.Linear (dense)": lambda: linear(x),
        "spinfer.spmm": lambda: spinfer.spmm(x, enc, bias),
        "spinfer::spmm_out op": lambda: torch.ops.spinfer.spmm_out(*op_args, out=out),
        "spinfer::spmm op": lambda: torch.ops.spinfer.spmm(*op_args),
        "spinfer.lowbit_mm (4-bit)": lambda: spinfer.lowbit_mm(x, q, bias),
        "SparseLinear sparse": lambda: layers["sparse"](x),
        "SparseLinear w4": lambda: layers["lowbit"](x),
        "SparseLinear dense": lambda: layers["dense"](x),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="spinfer bench host")
    p.add_argument("--shape", default="512x512", help="MxK of the layer")
    p.add_argument("--n", type=int, default=1, help="tokens per call")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=2000, help="calls per measurement")
    a = p.parse_args(argv)
    if not require_cuda("host"):
        return 2
    m, k = (int(v) for v in a.shape.split("x"))
    with torch.no_grad():
        fns = calls(m, k, a.n)
        for fn in fns.values():  # the extension, the policy's choices and the kernels' first launches
            fn()
        torch.cuda.synchronize()
        best = {name: float("inf") for name in fns}
        for _ in range(a.rounds):
            for name, fn in fns.items():
                best[name] = min(best[name], host_overhead(fn, "cuda", reps=a.reps))
    base = best["F.linear (dense)"]
    print(f"{torch.cuda.get_device_name()}: host time per eager call, {m}x{k} fp16 with bias, N = {a.n}, no grad "
          f"(least of {a.rounds} rounds of {a.reps} calls)")
    for name, t in best.items():
        print(f"  {name:28s} {t * 1e6:7.2f} us  {t / base:5.2f}x F.linear")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
