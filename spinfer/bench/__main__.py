"""``spinfer bench {spmm,lowbit,to_dense,e2e,policy,host,cpu,compression,roofline}``: run a study, print
its table, and write CSV and PNG files into a results folder.

    spinfer bench compression [--shape 4096x4096] [--quick] [--out results]
    spinfer bench roofline --csv results/spmm.csv [--lowbit-csv results/lowbit.csv]
                           [--bandwidth GBPS --flops TFLOPS | --measure]
    spinfer bench spmm [--quick] [--csv results/spmm.csv]          (needs a CUDA GPU)
    spinfer bench lowbit [--quick] [--csv results/lowbit.csv]      (needs a CUDA GPU)
    spinfer bench to_dense [--quick] [--csv results/to_dense.csv]  (needs a CUDA GPU)
    spinfer bench e2e [--layers 4] [--batches 1,8,16]              (CUDA; --tiny --device cpu smoke run)
    spinfer bench policy [--calibrate]                             (needs a CUDA GPU)
    spinfer bench host [--shape 512x512] [--n 1]                   (needs a CUDA GPU)
    spinfer bench cpu [--quick] [--csv results/cpu.csv]            (the CPU path: compiled decoder)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..analysis import compression, roofline
from . import parse_shapes


def run_compression(argv) -> int:
    p = argparse.ArgumentParser(prog="spinfer bench compression")
    p.add_argument("--shape", default="4096x4096")
    p.add_argument("--quick", action="store_true", help="1024x1024, fewer points")
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    try:
        m, k = (int(v) for v in a.shape.split("x"))
    except ValueError:
        raise ValueError(f"--shape must look like 4096x4096, got {a.shape!r}") from None
    if a.quick:
        m, k = min(m, 1024), min(k, 1024)
    sps = [0.0, 0.3, 0.5, 0.7, 0.9] if a.quick else [i / 10 for i in range(10)] + [0.95, 0.99]
    rows = compression.sweep((m, k), sps, progress=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    compression.write_csv(rows, out / "compression.csv")
    compression.plot(rows, out / "compression.png", title=f"Compression ratio, {m}x{k} fp16, random sparsity")
    names = [n for n in rows[0] if n != "sparsity"]
    print(f"compression ratio vs dense fp16, {m}x{k}, random sparsity (scipy formats measured from scipy objects)")
    print(f"{'sparsity':>8} " + " ".join(f"{n:>15}" for n in names))
    for r in rows:
        print(f"{r['sparsity']:>8.2f} " + " ".join(f"{r[n]:>15.3f}" for n in names))
    print("TCA-BME overtakes:")
    for n in names:
        if n not in ("tca-bme", "tca-bme-eq9"):
            x = compression.crossover(rows, n)
            print(f"  {n:<16} {'never in the sweep' if x is None else f'from sparsity {x:.3f}'}")
    print(f"wrote {out / 'compression.csv'} and {out / 'compression.png'}")
    return 0


def run_roofline(argv) -> int:
    p = argparse.ArgumentParser(prog="spinfer bench roofline")
    p.add_argument("--csv", required=True, help="a CSV written by spinfer bench spmm")
    p.add_argument("--lowbit-csv", help="a CSV written by spinfer bench lowbit: adds the low-bit points")
    p.add_argument("--bandwidth", type=float, help="GB/s (copy, read + write) of the device to model")
    p.add_argument("--flops", type=float, help="dense fp16 TFLOP/s of the device to model")
    p.add_argument("--measure", action="store_true", help="measure the ceilings on this GPU")
    p.add_argument("--max-n", type=int, default=256)
    p.add_argument("--shapes", help="keep only these MxK shapes, e.g. 28672x8192,4096x14336")
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    if a.measure:
        c = roofline.measure_ceilings()
    elif a.bandwidth or a.flops:
        if not (a.bandwidth and a.flops):
            raise ValueError("give both --bandwidth and --flops")
        c = roofline.Ceilings(a.bandwidth * 1e9, a.flops * 1e12, name="user-given", measured=False)
    else:
        c = roofline.Ceilings()
    pts = roofline.points_from_bench_csv(a.csv, max_n=a.max_n)
    if a.lowbit_csv:
        pts += roofline.points_from_lowbit_csv(a.lowbit_csv, max_n=a.max_n)
    if a.shapes:
        keep = set(parse_shapes(a.shapes))
        pts = [pt for pt in pts if (pt["M"], pt["K"]) in keep]
    if not pts:
        raise ValueError(f"{a.csv} holds no benchmark rows" + (f" for shapes {a.shapes}" if a.shapes else ""))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    roofline.plot(c, pts, out / "roofline.png")
    print(f"ceilings: {c.bandwidth / 1e9:.0f} GB/s, {c.flops / 1e12:.0f} TFLOP/s ({c.name})")
    print(f"{'kind':<10} {'M':>6} {'K':>6} {'N':>4} {'FLOP/B':>7} {'TFLOP/s':>8} {'% of roof':>9}")
    for pt in pts:
        if pt["N"] <= 16:
            print(f"{pt['kind']:<10} {pt['M']:>6} {pt['K']:>6} {pt['N']:>4} {pt['intensity']:>7.2f} "
                  f"{pt['flops'] / 1e12:>8.2f} {100 * roofline.roof_fraction(pt, c):>8.0f}%")
    print("share of the roof at N <= 16, per series:")
    for kind, (lo, med, hi) in roofline.roof_summary(pts, c, max_n=16).items():
        print(f"  {kind:<10} {100 * lo:>4.0f}% .. {100 * hi:>4.0f}%, median {100 * med:.0f}%")
    print(f"wrote {out / 'roofline.png'}")
    return 0




def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    studies = {"compression": run_compression, "roofline": run_roofline}
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    study, rest = argv[0], argv[1:]
    if study == "spmm":
        from .spmm import main as spmm_main

        return spmm_main(rest)
    if study == "policy":
        from .policy import main as policy_main

        return policy_main(rest)
    if study == "e2e":
        from .e2e import main as e2e_main

        return e2e_main(rest)
    if study == "lowbit":
        from .lowbit import main as lowbit_main

        return lowbit_main(rest)
    if study == "host":
        from .host import main as host_main

        return host_main(rest)
    if study == "cpu":
        from .cpu import main as cpu_main

        return cpu_main(rest)
    if study == "to_dense":
        from .to_dense import main as to_dense_main

        return to_dense_main(rest)
    if study not in studies:
        print(f"spinfer bench: unknown study {study!r}; choose from spmm, lowbit, to_dense, e2e, policy, host, cpu, "
              "compression, roofline", file=sys.stderr)
        return 2
    try:
        return studies[study](rest)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"spinfer bench {study}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
