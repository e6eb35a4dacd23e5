"""How far each issue target is from what memory allows: for every configuration of a
bench_spmm / bench_lowbit CSV, the geomean over its rows of the measured ratio to cuBLAS and of
the *floor ratio*, cuBLAS time over the op's own bytes at the measured copy bandwidth plus the
event floor (an empty kernel between two CUDA events, 3.2 us on the H100: docs/kernels.md,
tenth session). The op's bytes are the CSV's achieved GB/s times its time; the copy bandwidth is
GB/s over the CSV's percent of copy. No op can beat its floor ratio; a target above ~90% of it
asks for near-copy streaming.

    python benchmarks/target_floors.py docs/spmm-v11-h100-2026-11-23.csv docs/lowbit-h100-2026-11-23g.csv \\
        [--shapes 28672x8192,8192x28672,14336x4096,4096x14336] [--ns 1,8,16,32] [--event-us 3.2]
"""

import argparse
import csv
import math
from collections import defaultdict


def floor_rows(path, shapes, ns, event_us):
    """(config, measured ratio, floor ratio) per row of a benchmark CSV within shapes x ns."""
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            m, k, n = int(r["M"]), int(r["K"]), int(r["N"])
            if (m, k) not in shapes or n not in ns:
                continue
            if "sparsity" in r:
                config, op_us = f"spmm {float(r['sparsity']):.0%}", float(r["spmm_us"])
            else:
                config, op_us = f"{r['bits']}-bit g{r['group']}", float(r["lowbit_us"])
            gbps, pct = float(r["gbps"]), float(r["pct_copy"])
            copy_gbps = gbps / pct * 100
            floor_us = gbps * op_us / copy_gbps + event_us  # bytes / copy bandwidth, in us
            cublas_us = float(r["cublas_us"])
            yield (config, n), cublas_us / op_us, cublas_us / floor_us


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(paths, shapes, ns, event_us=3.2):
    """{(config, N): (measured geomean, floor geomean, cases)}, and (config, "all") over every N
    (the SpMM issue's geomean over its 16 cases)."""
    cells = defaultdict(list)
    for path in paths:
        for (config, n), measured, floor in floor_rows(path, shapes, ns, event_us):
            cells[(config, n)].append((measured, floor))
            cells[(config, "all")].append((measured, floor))
    order = lambda key: (key[0], key[1] == "all", key[1] if key[1] != "all" else 0)
    return {key: (geomean([m for m, _ in cells[key]]), geomean([f for _, f in cells[key]]), len(cells[key]))
            for key in sorted(cells, key=order)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", nargs="+")
    p.add_argument("--shapes", default="28672x8192,8192x28672,14336x4096,4096x14336")
    p.add_argument("--ns", default="1,8,16,32")
    p.add_argument("--event-us", type=float, default=3.2)
    a = p.parse_args(argv)
    shapes = {tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")}
    ns = {int(v) for v in a.ns.split(",")}
    print(f"{'config':<14} {'N':>3} {'measured':>9} {'floor':>7} {'share':>6}  cases")
    for (config, n), (measured, floor, cases) in summarize(a.csv, shapes, ns, a.event_us).items():
        print(f"{config:<14} {n:>3} {measured:>8.2f}x {floor:>6.2f}x {measured / floor:>6.0%}  {cases}")


if __name__ == "__main__":
    main()
