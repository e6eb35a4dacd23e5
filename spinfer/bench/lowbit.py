"""Weight-only low-bit kernels against cuBLAS and torch's int4 kernel, same process.

For each (M, K), N and configuration (bits, group): median time with the L2 flushed before
every call of cuBLAS (F.linear on the dense weight, fp16 or --dtype bf16, the activations'
dtype too), spinfer.lowbit_mm (the dispatch:
fused kernel for N <= fused_max_n(bits), dequantize + cuBLAS above; the fused kernel is also
timed above it, the "fused us" column) and, for 4-bit g128, torch's
``aten._weight_int4pack_mm`` (tinygemm; bf16 activations, which is what it accepts on CUDA).
Reports ratios to cuBLAS and the fused kernel's bandwidth (packed weight + scales + zeros + x +
y bytes over time) against the measured copy bandwidth.

    spinfer bench lowbit [--quick] [--dtype bf16] [--csv out.csv]     (or python benchmarks/bench_lowbit.py)
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

import spinfer
from spinfer import tuning
from spinfer.bench import (cublas_flat_time, parse_quants, parse_shapes, require_cuda, time_against_cublas,
                           write_rows)
from spinfer.ops.lowbit_mm import FUSED_MAX_N, fused_max_n
from spinfer.quant import LowBitWeight
from spinfer.timing import copy_bandwidth, median_time

SHAPES = [(28672, 8192), (8192, 28672), (14336, 4096), (4096, 14336)]
NS = [1, 8, 16, 32, 64, 128, 256]
CONFIGS = [(4, 128), (8, 128), (2, 64), (4, 32), (1, 128)]
QUICK_NS = [1, 8, 16, 32]
QUICK_CONFIGS = [(4, 128), (8, 128), (2, 64)]
# Issue 4's targets: (bits, group) -> {N: minimum geomean ratio to cuBLAS}
TARGETS = {
    (4, 128): {1: 3.3, 8: 3.0, 16: 2.8, 32: 2.0},
    (8, 128): {1: 1.8, 8: 1.7, 16: 1.7},
    (2, 64): {1: 5.0},
}


def torch_int4(x_bf16, m, k, gen):
    """A callable running torch's int4 kernel (g128) on random packed data, or None where this
    torch build lacks it."""
    try:
        packed = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device=x_bf16.device, generator=gen)
        w = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
        sz = (torch.rand(k // 128, m, 2, device=x_bf16.device, generator=gen) * 0.01).to(torch.bfloat16)
        fn = lambda: torch.ops.aten._weight_int4pack_mm(x_bf16, w, 128, sz)  # noqa: E731
        fn()
        return fn
    except (RuntimeError, TypeError, AttributeError) as exc:
        print(f"  torch int4 kernel unavailable: {str(exc).splitlines()[0]}", flush=True)
        return None


def print_summary(rows, dtype="fp16") -> None:
    """Issue 4's criteria: geomean of x cuBLAS over the four issue shapes only (rows of other
    shapes are in the table but not in the summary), per configuration and N. The targets are
    issue 4's fp16 ones; a bf16 run is printed against them too, for comparison."""
    print(f"\nsummary: geomean of x cuBLAS {dtype} over " + ", ".join(f"{m}x{k}" for m, k in SHAPES))
    rows = [r for r in rows if (r["M"], r["K"]) in set(SHAPES)]
    for (bits, group), targets in TARGETS.items():
        for n in sorted({r["N"] for r in rows}):
            sel = [r for r in rows if (r["bits"], r["group"]) == (bits, group) and r["N"] == n]
            if len(sel) < len(SHAPES):
                continue
            suspect = [f"{r['M']}x{r['K']}" for r in sel if r.get("timing_suspect")]
            sel = [r for r in sel if not r.get("timing_suspect")]
            if not sel:
                print(f"  {bits}-bit g{group:<4} N={n:<4} not judged: timing suspect on every shape")
                continue
            gm = math.exp(sum(math.log(r["speedup"]) for r in sel) / len(sel))
            t = targets.get(n)
            issue = "" if dtype == "fp16" else "fp16 "  # the issue's targets are against cuBLAS fp16
            verdict = "" if t is None else f"  {issue}target >= {t:.1f}x: {'met' if gm >= t else 'MISSED'}"
            if suspect:  # a geomean over fewer shapes is not the target's
                verdict = (f"  over {len(sel)} of {len(SHAPES)} shapes (timing suspect on {', '.join(suspect)}): "
                           "not judged")
            bw = sum(r["pct_copy"] for r in sel) / len(sel)
            print(f"  {bits}-bit g{group:<4} N={n:<4} geomean {gm:5.2f}x  (min {min(r['speedup'] for r in sel):.2f}x, "
                  f"mean bandwidth {bw:.0f}% of copy){verdict}")
    sel = [r for r in rows if r["int4_speedup"] is not None]
    for n in sorted({r["N"] for r in sel}):
        s = [r["int4_speedup"] for r in sel if r["N"] == n]
        if len(s) == len(SHAPES):
            print(f"  torch int4 g128 (bf16) N={n:<4} geomean {math.exp(sum(map(math.log, s)) / len(s)):5.2f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="spinfer bench lowbit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N<=32; 4-bit g128, 8-bit g128, 2-bit g64")
    p.add_argument("--shapes", default=None, help="e.g. 28672x8192,4096x4096")
    p.add_argument("--ns", default=None, help="e.g. 1,8,16")
    p.add_argument("--configs", default=None, help="bits:group pairs, e.g. 4:128,2:64")
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16",
                   help="of the activations, the weight's scales and the cuBLAS baseline")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--csv", default=None)
    p.add_argument("--tuned", action="store_true",
                   help="time each layer with its split-K factor measured first by spinfer.tuning.tune_lowbit "
                        "(in memory) instead of the planner's rule")
    a = p.parse_args(argv)
    if not require_cuda("lowbit"):
        return 2
    dev = torch.device("cuda")
    dt = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    tol = 2e-3 if a.dtype == "fp16" else 1e-2  # the tests' bounds against the dequantized reference
    shapes = parse_shapes(a.shapes) if a.shapes else SHAPES
    ns = [int(v) for v in a.ns.split(",")] if a.ns else (QUICK_NS if a.quick else NS)
    configs = parse_quants(a.configs) if a.configs else (
        QUICK_CONFIGS if a.quick else CONFIGS)

    spinfer.build.load_extension()
    bw = copy_bandwidth(dev)
    name = torch.cuda.get_device_name(dev)
    print(f"device {name}; torch {torch.__version__}; copy bandwidth {bw / 1e9:.0f} GB/s (read+write); {a.dtype}; "
          f"L2 flushed before every call; median of {a.reps}; fused kernel for N <= "
          f"{FUSED_MAX_N} (by bits); split-K {'tuned per layer and N (spinfer.tuning)' if a.tuned else 'by the planner'}")
    print(f"{'M':>6} {'K':>6} {'N':>4} {'bits':>4} {'group':>5} {'cuBLAS us':>10} {'lowbit us':>9} {'x cuBLAS':>8} "
          f"{'GB/s':>6} {'% copy':>6} {'int4 us':>8} {'x cuBLAS':>8} {'fused us':>8} {'splits':>6}")
    rows = []
    for m, k in shapes:
        gen = torch.Generator(device=dev).manual_seed(m * 31 + k)
        dense = torch.randn(m, k, device=dev, generator=gen).to(dt)
        flat = cublas_flat_time(dense, dev, a.reps)  # held against this weight's rows (time_against_cublas)
        for bits, group in configs:
            q = LowBitWeight.quantize(dense, bits, group)
            wq = q.dequantize()
            wbytes = q.storage_bytes().total
            # splits: the tuned factor per N (0: the planner's), or 0 everywhere: explicit, so a
            # tuned table in the user's cache never leaks into planner figures.
            fused_ns = [n for n in ns if n <= fused_max_n(bits)]
            chosen = dict.fromkeys(ns, 0)
            if a.tuned:
                chosen.update({n: r["splits"] for n, r in tuning.tune_lowbit(q, fused_ns, save=False).items()})
            prev = None  # (N, op seconds) of the previous row
            for n in ns:
                x = torch.randn(n, k, device=dev, generator=gen).to(dt)
                y = spinfer.lowbit_mm(x, q, splits=chosen[n])
                ref = F.linear(x, wq)
                err = float((y.float() - ref.float()).norm() / ref.float().norm())
                t_dense, t_q, suspects = time_against_cublas(
                    lambda: F.linear(x, dense), lambda: spinfer.lowbit_mm(x, q, splits=chosen[n]), dev, a.reps, n, flat,
                    prev, "lowbit_mm")
                prev = (n, t_q)
                out = torch.empty(n, m, device=dev, dtype=x.dtype)
                t_f = t_q if n <= fused_max_n(bits) else median_time(lambda: spinfer.lowbit_mm(x, q, out=out, splits=0), dev,
                                                                reps=a.reps)
                t_i4 = None
                if (bits, group) == (4, 128):
                    fn = torch_int4(x.bfloat16(), m, k, gen)
                    t_i4 = median_time(fn, dev, reps=a.reps) if fn else None
                moved = wbytes + 2 * n * k + 2 * n * m
                r = dict(M=m, K=k, N=n, bits=bits, group=group, cublas_us=t_dense * 1e6, lowbit_us=t_q * 1e6,
                         fused_us=t_f * 1e6,
                         speedup=t_dense / t_q, gbps=moved / t_q / 1e9, pct_copy=100 * moved / t_q / bw,
                         int4_us=None if t_i4 is None else t_i4 * 1e6,
                         int4_speedup=None if t_i4 is None else t_dense / t_i4, rel_err_vs_dequant=err,
                         splits=chosen[n], timing_suspect=bool(suspects), dtype=a.dtype, device=name)
                rows.append(r)
                i4 = f"{r['int4_us']:>8.1f} {r['int4_speedup']:>8.2f}" if t_i4 else f"{'-':>8} {'-':>8}"
                print(f"{m:>6} {k:>6} {n:>4} {bits:>4} {group:>5} {r['cublas_us']:>10.1f} {r['lowbit_us']:>9.1f} "
                      f"{r['speedup']:>8.2f} {r['gbps']:>6.0f} {r['pct_copy']:>6.1f} {i4} {r['fused_us']:>8.1f} "
                      f"{chosen[n] or 'plan':>6}", flush=True)
                for warning in suspects:
                    print(f"  WARNING: {warning}", flush=True)
                if err > tol:  # a fast wrong answer is not a result: say so on the row
                    print(f"  WARNING: lowbit_mm differs from the dequantized reference by {err:.2e}", flush=True)
    print_summary(rows, a.dtype)
    if a.csv:
        write_rows(rows, a.csv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
