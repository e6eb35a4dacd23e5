"""SMBD SpMM against cuBLAS fp16 (F.linear on the dense pruned weight), same process.

For each (M, K), N and sparsity: median time with the L2 flushed before every call, the
ratio cuBLAS time / spmm time, and achieved bandwidth (compressed weight + x + y bytes over
time) against the device-to-device copy bandwidth measured here (bytes read + written).

    spinfer bench spmm [--quick] [--csv out.csv]      (or python benchmarks/bench_spmm.py)
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

import spinfer
from spinfer.bench import cublas_flat_time, parse_shapes, require_cuda, time_against_cublas, write_rows
from spinfer import tuning
from spinfer.format import TCABME
from spinfer.timing import copy_bandwidth

SHAPES = [(28672, 8192), (8192, 28672), (14336, 4096), (4096, 14336), (4096, 4096), (12288, 4096)]
NS = [1, 8, 16, 32, 64, 128, 256]
SPARSITIES = [0.3, 0.4, 0.5, 0.6, 0.7]
QUICK_SHAPES = SHAPES[:4]
QUICK_NS = [1, 8, 16, 32]
QUICK_SPARSITIES = [0.3, 0.5, 0.7]


def print_summary(rows) -> None:
    """Issue 3's criteria: geomean / min of x cuBLAS over the four large shapes at N in
    {1, 8, 16, 32} per sparsity, and achieved bandwidth (% of copy) at N <= 16."""
    issue_shapes = set(QUICK_SHAPES)
    print("\nsummary over (M, K) in " + ", ".join(f"{m}x{k}" for m, k in QUICK_SHAPES) + ", N in {1, 8, 16, 32}:")
    for s in sorted({r["sparsity"] for r in rows}):
        sel = [r for r in rows if r["sparsity"] == s and (r["M"], r["K"]) in issue_shapes and r["N"] in (1, 8, 16, 32)]
        suspect = [f"{r['M']}x{r['K']} N={r['N']}" for r in sel if r.get("timing_suspect")]
        sel = [r for r in sel if not r.get("timing_suspect")]
        if not sel:
            continue
        if suspect:
            print(f"  sparsity {s:.1f}: left out, timing suspect: {', '.join(suspect)}")
        sp = [r["speedup"] for r in sel]
        gm = math.exp(sum(math.log(v) for v in sp) / len(sp))
        bw = [r["pct_copy"] for r in sel if r["N"] <= 16]
        print(f"  sparsity {s:.1f}: geomean {gm:.2f}x cuBLAS, min {min(sp):.2f}x, max {max(sp):.2f}x; "
              f"bandwidth at N<=16 {min(bw):.0f}-{max(bw):.0f}% of copy ({len(sel)} cases)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="spinfer bench spmm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the four large shapes, N<=32, 30/50/70%%")
    p.add_argument("--shapes", default=None, help="e.g. 28672x8192,4096x4096")
    p.add_argument("--ns", default=None, help="e.g. 1,8,16")
    p.add_argument("--sparsities", default=None, help="e.g. 0.5,0.7")
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--csv", default=None)
    p.add_argument("--tuned", action="store_true",
                   help="time each layer with its split-K factor measured first by spinfer.tuning.tune_spmm "
                        "(in memory) instead of the planner's rule")
    a = p.parse_args(argv)
    if not require_cuda("spmm"):
        return 2
    dev = torch.device("cuda")
    dt = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    shapes = parse_shapes(a.shapes) if a.shapes else (
        QUICK_SHAPES if a.quick else SHAPES)
    ns = [int(v) for v in a.ns.split(",")] if a.ns else (QUICK_NS if a.quick else NS)
    sps = [float(v) for v in a.sparsities.split(",")] if a.sparsities else (
        QUICK_SPARSITIES if a.quick else SPARSITIES)

    spinfer.build.load_extension()
    bw = copy_bandwidth(dev)
    name = torch.cuda.get_device_name(dev)
    print(f"device {name}; torch {torch.__version__}; copy bandwidth {bw / 1e9:.0f} GB/s (read+write); "
          f"{a.dtype}; L2 flushed before every call; median of {a.reps}; split-K "
          f"{'tuned per layer and N (spinfer.tuning)' if a.tuned else 'by the planner'}")
    rows = []
    header = f"{'M':>6} {'K':>6} {'N':>4} {'sparsity':>8} {'cuBLAS us':>10} {'spmm us':>9} {'x cuBLAS':>8} " \
             f"{'GB/s':>6} {'% copy':>6} {'CR':>5} {'splits':>6}"
    print(header)
    for m, k in shapes:
        gen = torch.Generator(device=dev).manual_seed(m * 31 + k)
        dense = torch.randn(m, k, device=dev, generator=gen).to(dt)
        flat = cublas_flat_time(dense, dev, a.reps)  # held against this weight's rows (time_against_cublas)
        for s in sps:
            w = dense.masked_fill(torch.rand(m, k, device=dev, generator=gen) < s, 0.0)
            enc = TCABME.from_dense(w)
            wbytes = enc.storage_bytes().total
            # splits: the tuned factor per N (0 where the planner's was best), or 0 everywhere:
            # explicit, so a tuned table in the user's cache never leaks into planner figures.
            chosen = {n: r["splits"] for n, r in tuning.tune_spmm(enc, ns, save=False).items()} if a.tuned \
                else dict.fromkeys(ns, 0)
            prev = None  # (N, op seconds) of the previous row
            for n in ns:
                x = torch.randn(n, k, device=dev, generator=gen).to(dt)
                y = spinfer.spmm(x, enc, splits=chosen[n])
                ref = F.linear(x, w)
                err = float((y.float() - ref.float()).norm() / ref.float().norm())
                t_dense, t_sp, suspects = time_against_cublas(
                    lambda: F.linear(x, w), lambda: spinfer.spmm(x, enc, splits=chosen[n]), dev, a.reps, n, flat, prev,
                    "spmm")
                prev = (n, t_sp)
                moved = wbytes + 2 * n * k + 2 * n * m
                r = dict(M=m, K=k, N=n, sparsity=s, cublas_us=t_dense * 1e6, spmm_us=t_sp * 1e6,
                         speedup=t_dense / t_sp, gbps=moved / t_sp / 1e9, pct_copy=100 * moved / t_sp / bw,
                         cr=enc.compression_ratio, rel_err_vs_cublas=err, splits=chosen[n],
                         timing_suspect=bool(suspects), dtype=a.dtype, device=name)
                rows.append(r)
                print(f"{m:>6} {k:>6} {n:>4} {s:>8.1f} {r['cublas_us']:>10.1f} {r['spmm_us']:>9.1f} "
                      f"{r['speedup']:>8.2f} {r['gbps']:>6.0f} {r['pct_copy']:>6.1f} {r['cr']:>5.2f} "
                      f"{chosen[n] or 'plan':>6}", flush=True)
                for warning in suspects:
                    print(f"  WARNING: {warning}", flush=True)
                if err > 1e-2:  # a fast wrong answer is not a result: say so on the row
                    print(f"  WARNING: spmm differs from cuBLAS by {err:.2e} (relative) on this case", flush=True)
    print_summary(rows)
    if a.csv:
        write_rows(rows, a.csv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
