"""The weight-to-dense kernels, and where "decode once, then cuBLAS" overtakes the fused kernels.

Part 1, bandwidth: for each shape, the CUDA kernels ``tca_bme_to_dense`` (30 / 50 / 70%) and
``lowbit_to_dense`` (4-bit g128, 8-bit g128, 2-bit g64): median time with the L2 flushed before
every call, bytes moved (compressed weight read + dense fp16 written) over time, against the
measured copy bandwidth; the torch-op decoders they replace are timed on the first shape.

Part 2, crossover: at each N, the fused kernel (SpMM on TCA-BME, the fused low-bit kernel) against
decode + F.linear (cuBLAS) and cuBLAS alone on the dense weight; the smallest N from which decode +
cuBLAS stays ahead is the crossover that ``lowbit_mm`` (``fused_max_n``) and the SparseLinear policy
(its decode bandwidth) use.

    spinfer bench to_dense [--quick] [--quants 1:128,4:128] [--sparsities 0.5] [--ns 64,128] [--csv F]   (needs a CUDA GPU)
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

import spinfer
from spinfer.bench import parse_quants, parse_shapes, require_cuda, write_rows
from spinfer.format import TCABME
from spinfer.format.tca_bme import decode
from spinfer.quant import LowBitWeight
from spinfer.quant.lowbit import dequantize
from spinfer.timing import copy_bandwidth, median_time

SHAPES = [(28672, 8192), (8192, 28672), (14336, 4096), (4096, 14336)]
SPARSITIES = [0.3, 0.5, 0.7]
QUANTS = [(4, 128), (8, 128), (2, 64)]
NS = [16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048]
QUICK_NS = [32, 64, 128, 256, 512, 1024]


def crossover(ns, fused, decoded):
    """Smallest N from which decode + cuBLAS is at least as fast at every larger N measured."""
    best = None
    for n in reversed(ns):
        if decoded[n] <= fused[n]:
            best = n
        else:
            break
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="spinfer bench to_dense")
    p.add_argument("--shapes", default=",".join(f"{m}x{k}" for m, k in SHAPES))
    p.add_argument("--ns", default=None, help="token counts of the crossover part")
    p.add_argument("--quick", action="store_true", help="fewer N, 50%% sparsity and 4-bit only in part 2")
    p.add_argument("--quants", default=None,
                   help="low-bit widths and group sizes, e.g. 1:128,4:128 (default 4:128,8:128,2:64; --quick: 4:128 in part 2)")
    p.add_argument("--sparsities", default=None, help="TCA-BME sparsities, e.g. 0.5 ('' for none)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--csv", default=None)
    a = p.parse_args(argv)
    if not require_cuda("to_dense"):
        return 2
    dev = torch.device("cuda")
    shapes = parse_shapes(a.shapes)
    ns = [int(v) for v in a.ns.split(",")] if a.ns else (QUICK_NS if a.quick else NS)
    quants = parse_quants(a.quants) if a.quants is not None else QUANTS
    sparsities = [float(v) for v in a.sparsities.split(",") if v] if a.sparsities is not None else SPARSITIES
    spinfer.build.load_extension()
    copy = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}; copy bandwidth {copy / 1e9:.0f} GB/s (read + write); "
          f"fp16, L2 flushed, median of {a.reps}", flush=True)
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)

    def timed(fn):
        return median_time(fn, dev, reps=a.reps)

    print("\n== part 1: to dense, GB/s moved (compressed read + fp16 written) and % of copy")
    print(f"{'shape':>12} {'weight':>12} {'us':>8} {'GB/s':>7} {'% copy':>7} {'torch ops us':>13}")
    for si, (m, k) in enumerate(shapes):
        w = torch.randn(m, k, device=dev, generator=gen).half()
        for sp in sparsities:
            ws = w.masked_fill(torch.rand(m, k, device=dev, generator=gen) < sp, 0)
            enc = TCABME.from_dense(ws)
            t = timed(enc.to_dense)
            moved = enc.storage_bytes().total + 2 * m * k
            t_old = (timed(lambda: decode(enc.bitmap, enc.values, enc.gtile_offset, enc.shape))
                     if si == 0 else float("nan"))
            print(f"{m:>6}x{k:<5} {f'TCA-BME {int(sp * 100)}%':>12} {t * 1e6:8.1f} {moved / t / 1e9:7.0f} "
                  f"{100 * moved / t / copy:6.0f}% {t_old * 1e6:13.0f}", flush=True)
            rows.append(dict(part="to_dense", m=m, k=k, weight=f"tca-bme-{sp}", n=0, us=t * 1e6,
                             gbps=moved / t / 1e9, copy_pct=100 * moved / t / copy, torch_ops_us=t_old * 1e6))
            del enc, ws
        for bits, group in quants:
            q = LowBitWeight.quantize(w, bits, group)
            t = timed(q.dequantize)
            moved = q.storage_bytes().total + 2 * m * k
            t_old = (timed(lambda: dequantize(q.qweight, q.scale_zero, q.bits, q.group_size, q.shape))
                     if si == 0 else float("nan"))
            print(f"{m:>6}x{k:<5} {f'{bits}-bit g{group}':>12} {t * 1e6:8.1f} {moved / t / 1e9:7.0f} "
                  f"{100 * moved / t / copy:6.0f}% {t_old * 1e6:13.0f}", flush=True)
            rows.append(dict(part="to_dense", m=m, k=k, weight=f"{bits}-bit-g{group}", n=0, us=t * 1e6,
                             gbps=moved / t / 1e9, copy_pct=100 * moved / t / copy, torch_ops_us=t_old * 1e6))
            del q

    print("\n== part 2: fused kernel against decode + cuBLAS, x cuBLAS on the dense weight (us)")
    if a.sparsities is None:
        sparsities = [0.5] if a.quick else [0.5, 0.7]
    if a.quants is None and a.quick:
        quants = [(4, 128)]
    summary = []
    for m, k in shapes:
        w = torch.randn(m, k, device=dev, generator=gen).half()
        cases = []
        for sp in sparsities:
            ws = w.masked_fill(torch.rand(m, k, device=dev, generator=gen) < sp, 0)
            enc = TCABME.from_dense(ws)
            cases.append((f"TCA-BME {int(sp * 100)}%",
                          lambda x, enc=enc: spinfer.spmm(x, enc),
                          lambda x, enc=enc: F.linear(x, enc.to_dense())))
        for bits, group in quants:
            q = LowBitWeight.quantize(w, bits, group)
            out = torch.empty(max(ns), m, device=dev, dtype=torch.float16)
            cases.append((f"{bits}-bit g{group}",
                          lambda x, q=q, out=out: spinfer.lowbit_mm(x, q, out=out[: x.shape[0]]),  # fused at any N
                          lambda x, q=q: F.linear(x, spinfer.ops.lowbit_to_dense(q))))
        for label, fused, decoded in cases:
            t_f, t_d = {}, {}
            cells = []
            for n in ns:
                x = torch.randn(n, k, device=dev, generator=gen).half()
                t_ref = timed(lambda: F.linear(x, w))
                t_f[n], t_d[n] = timed(lambda: fused(x)), timed(lambda: decoded(x))
                cells.append(f"{n}: {t_ref / t_f[n]:.2f}/{t_ref / t_d[n]:.2f}")
                rows.append(dict(part="crossover", m=m, k=k, weight=label, n=n, us=t_f[n] * 1e6,
                                 gbps=float("nan"), copy_pct=float("nan"), torch_ops_us=float("nan"),
                                 decode_cublas_us=t_d[n] * 1e6, cublas_us=t_ref * 1e6))
            x_over = crossover(ns, t_f, t_d)
            summary.append((m, k, label, x_over))
            print(f"{m:>6}x{k:<5} {label:>12} fused/decoded x cuBLAS: " + "  ".join(cells)
                  + f"  | crossover N = {x_over}", flush=True)
        del cases
    print("\ncrossover (smallest N from which decode + cuBLAS stays ahead; None: never in the sweep):")
    for m, k, label, x_over in summary:
        print(f"  {m:>6}x{k:<5} {label:>12}: {x_over}")
    if a.csv:
        for r in rows:
            r.setdefault("decode_cublas_us", float("nan"))
            r.setdefault("cublas_us", float("nan"))
        write_rows(rows, a.csv)
        print(f"wrote {a.csv}")
    return 0 if all(math.isfinite(r["us"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
