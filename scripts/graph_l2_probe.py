"""What one layer's kernel costs the other launches of a CUDA graph (docs/kernels.md, thirty-ninth
session). A graph of 200 small torch kernels (h.add_(1) on a 4096-wide fp16 row, like the
elementwise glue of a decode step) with one layer kernel in the middle, N = 1, is replayed against
the graph without it; the layer's own graph is timed too. "extra" is what is left:

    graph - plain graph - the layer's own graph

Variants: the low-bit GEMV on registers and on its shared-memory ring (4-bit g128), the SMBD
kernel at 50% (bulk loader, the cp.async loader, and with SPINFER_L2_EVICT_FIRST=0), cuBLAS on
the dense weight, a 64 MB copy, and "after flush": the plain graph timed after an eager 512 MB
write. Every graph is replayed round by round in a shuffled order in one process. With --profile,
each graph's small kernels, by position, with their mean duration and the idle gap before them.

    python scripts/graph_l2_probe.py [--m 28672 --k 8192] [--rounds 7] [--replays 30] [--profile]

On an H100 (2026-11-24): every launch starts ~0.16 us later, the whole graph long, once the graph
holds a kernel that streams more than L2 holds with the normal L2 policy (cuBLAS, the ring, the
SMBD kernel before its evict_first hint, a copy, or a flush before the graph); not after the
register GEMV (ld.global.nc) or the SMBD kernel's hinted bulk copies.
"""

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import spinfer
from spinfer.format import TCABME
from spinfer.quant import LowBitWeight
from spinfer.timing import profiled_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ab_spmm import apply  # noqa: E402  (the A/B scripts' SPINFER_* overrides)

VARIANTS = {  # name: the SPINFER_* overrides while its graph is captured (ab_spmm.apply's form)
    "plain": "auto",
    "w4 registers": "LOWBIT_RING=0",
    "w4 ring": "LOWBIT_RING=2",
    "w4 ring normal L2": "LOWBIT_RING=2+L2_EVICT_FIRST=0",
    "w4 fused": "LOWBIT_GEMV=0",
    "w4 fused normal L2": "LOWBIT_GEMV=0+L2_EVICT_FIRST=0",
    "spmm50": "auto",
    "spmm50 cp_async": "LOADER=cp_async",
    "spmm50 cp_async normal L2": "LOADER=cp_async+L2_EVICT_FIRST=0",
    "spmm50 normal L2": "L2_EVICT_FIRST=0",
    "cublas": "auto",
    "copy 64 MB": "auto",
    "after flush": "auto",
}
NAME_W = 26  # the variant column's width


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=28672)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--small", type=int, default=200, help="small kernels in the graph")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--replays", type=int, default=30, help="timed replays of each graph a round")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args(argv)
    spinfer.build.load_extension()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w = torch.randn(a.m, a.k, device=dev, dtype=torch.float16) * 0.02
    q4 = LowBitWeight.quantize(w, 4, 128)
    sparse = w.clone()
    sparse[torch.rand(sparse.shape, device=dev) < 0.5] = 0
    enc = TCABME.from_dense(sparse)
    del sparse
    x = torch.randn(1, a.k, device=dev, dtype=torch.float16)
    h = torch.randn(1, 4096, device=dev, dtype=torch.float16)
    src = torch.randn(32 << 20, device=dev, dtype=torch.float16)
    dst = torch.empty_like(src)
    flush = torch.empty(256 << 20, device=dev, dtype=torch.float16)
    layers = {
        "w4": lambda: spinfer.lowbit_mm(x, q4),
        "spmm50": lambda: spinfer.spmm(x, enc),
        "cublas": lambda: F.linear(x, w),
        "copy 64 MB": lambda: dst.copy_(src),
    }

    def layer_of(name):
        for key, fn in layers.items():
            if name.startswith(key):
                return fn
        return None

    stream = torch.cuda.Stream()
    graphs = {}  # name: (graph with the small kernels, the layer's own graph or None)
    for name, config in VARIANTS.items():
        apply(config)
        layer = layer_of(name)

        def body(small=True):
            for i in range(a.small):
                if layer is not None and i == a.small // 2:
                    layer()
                if small:
                    h.add_(1.0)

        with torch.cuda.stream(stream):
            body()  # warm-up: builds the kernels, makes the planner's choices
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                body()
            alone = None
            if layer is not None:
                alone = torch.cuda.CUDAGraph()
                with torch.cuda.graph(alone, stream=stream):
                    body(small=False)
        graphs[name] = (g, alone)
    apply("auto")

    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {name: ([], []) for name in graphs}
    names = list(graphs)
    for r in range(a.rounds + 1):  # round 0 warms up
        random.shuffle(names)
        for name in names:
            for which, graph in enumerate(graphs[name]):
                if graph is None:
                    continue
                for _ in range(a.replays):
                    if name == "after flush":
                        flush.zero_()
                    e0.record()
                    graph.replay()
                    e1.record()
                    e1.synchronize()
                    if r:
                        times[name][which].append(e0.elapsed_time(e1) * 1000)
    print(f"{torch.cuda.get_device_name(dev)}: {a.small} small kernels + one {a.m}x{a.k} layer at N = 1, "
          f"{a.rounds} rounds x {a.replays} replays, median us")
    print(f"{'variant':<{NAME_W}} {'graph':>8} {'- plain':>8} {'alone':>7} {'extra':>7} {'per launch':>10}")
    base = statistics.median(times["plain"][0])
    for name in graphs:
        t = statistics.median(times[name][0])
        alone = statistics.median(times[name][1]) if times[name][1] else 0.0
        extra = t - base - alone
        print(f"{name:<{NAME_W}} {t:8.2f} {t - base:8.2f} {alone:7.2f} {extra:7.2f} {extra / a.small:10.3f}")
    if a.profile:
        profile_positions(graphs, a.small)
    return 0


def profile_positions(graphs, small, replays=10):
    """Per position bin: the mean duration of the small kernels and the idle gap before them, us."""
    mid = small // 2
    bins = [(0, mid), (mid, mid + 1), (mid + 1, mid + 2), (mid + 2, mid + 11), (mid + 11, small + 1)]
    print("by position in the graph: mean duration / idle gap before, us (the layer at position "
          f"{mid} where there is one)")
    print(f"{'variant':<{NAME_W}} " + " ".join(f"{f'{lo}-{hi - 1}':>12}" for lo, hi in bins))
    for name, (graph, _) in graphs.items():
        kernels = profiled_kernels(lambda: (graph.replay(), torch.cuda.synchronize()), replays)
        per = len(kernels) // replays
        dur, gap = [0.0] * per, [0.0] * per
        for r in range(replays):
            seq = kernels[r * per:(r + 1) * per]
            for i, e in enumerate(seq):
                dur[i] += (e.time_range.end - e.time_range.start) / replays
                if i:
                    gap[i] += max(0.0, e.time_range.start - seq[i - 1].time_range.end) / replays
        cells = []
        for lo, hi in bins:
            idx = range(lo, min(hi, per))
            cells.append(f"{sum(dur[i] for i in idx) / len(idx):5.2f}/{sum(gap[i] for i in idx) / len(idx):5.2f}"
                         if len(idx) else "-")
        print(f"{name:<{NAME_W}} " + " ".join(f"{c:>12}" for c in cells))


if __name__ == "__main__":
    sys.exit(main())
