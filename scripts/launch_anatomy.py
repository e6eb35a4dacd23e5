"""Where a launch's fixed cost goes: time against K at a fixed M (least-squares slope and
intercept) for cuBLAS, the low-bit kernel and the SMBD kernel, the event floor of an empty
kernel, and the per-layer time of 8 different layers replayed back to back in one CUDA graph
(what a decode step sees) against the same layers timed one by one.

    python scripts/launch_anatomy.py [--m 14336] [--ks 512,1024,2048,4096,8192,16384 | none] [--ns 1,16]
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

import spinfer
from spinfer import TCABME, LowBitWeight
from spinfer.timing import _flush_l2, _l2_flush_buffer, median_time


def fit(ks, ts):
    """Least squares t = slope * K/1024 + fixed, in us."""
    xs = [k / 1024 for k in ks]
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sum((x - mx) ** 2 for x in xs)
    return slope, mt - slope * mx


def ops_for(w, dev):
    """The three ops on one random weight, pruned to 50% for the sparse one."""
    q = LowBitWeight.quantize(w, 4, 128)
    ws = w.clone()
    ws[torch.rand(ws.shape, device=dev) < 0.5] = 0
    enc = TCABME.from_dense(ws)
    return {
        "cublas": lambda x, w=w: F.linear(x, w),
        "w4g128": lambda x, q=q: spinfer.lowbit_mm(x, q),
        "spmm50": lambda x, e=enc: spinfer.spmm(x, e),
        "spmm50-1split": lambda x, e=enc: spinfer.spmm(x, e, splits=1),
    }


def graph_time(calls, dev, reps=30):
    """Median device seconds of one replay of a graph that runs ``calls`` back to back."""
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream(dev).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    flush = _l2_flush_buffer(dev)
    times = []
    for _ in range(reps):
        _flush_l2(flush)
        torch.cuda._sleep(200_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=14336)
    p.add_argument("--ks", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--ns", default="1,16")
    p.add_argument("--layers", type=int, default=8, help="layers in the back-to-back graph")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("launch_anatomy.py times CUDA kernels: it needs a GPU")
    spinfer.build.load_extension()
    dev = torch.device("cuda")
    ks = [] if a.ks == "none" else [int(v) for v in a.ks.split(",")]
    ns = [int(v) for v in a.ns.split(",")]
    print(torch.cuda.get_device_name(dev), f"M={a.m}, fp16, L2 flushed, device time (us)")
    empty = median_time(lambda: torch.cuda._sleep(0), dev, reps=50)
    print(f"empty kernel (event floor): {empty * 1e6:.2f} us")

    rows = {}  # (op, n) -> [us per k]
    for k in ks:
        w = torch.randn(a.m, k, device=dev).half()
        ops = ops_for(w, dev)
        for n in ns:
            x = torch.randn(n, k, device=dev).half()
            cells = []
            for name, op in ops.items():
                t = median_time(lambda: op(x), dev, reps=40) * 1e6
                rows.setdefault((name, n), []).append(t)
                cells.append(f"{name} {t:7.1f}")
            print(f"K={k:<6} N={n:<3} " + " | ".join(cells), flush=True)
        del w, ops
    if ks:
        print("\nfit t = slope * K/1024 + fixed (us):")
    for (name, n), ts in rows.items():
        slope, fixed = fit(ks, ts)
        print(f"  {name:<14} N={n:<3} slope {slope:6.2f}  fixed {fixed:6.2f}")

    # Back to back: `layers` different M x 4096 layers in one graph, against each timed alone.
    k = 4096
    layers = [ops_for(torch.randn(a.m, k, device=dev).half(), dev) for _ in range(a.layers)]
    print(f"\n{a.layers} different {a.m}x{k} layers: alone (median of layers) vs back to back in one graph, per layer (us)")
    for n in ns:
        x = torch.randn(n, k, device=dev).half()
        for name in layers[0]:
            alone = statistics.median(median_time(lambda: l[name](x), dev, reps=20) for l in layers) * 1e6
            chained = graph_time([lambda l=l: l[name](x) for l in layers], dev) / a.layers * 1e6
            print(f"  {name:<14} N={n:<3} alone {alone:7.1f}  chained {chained:7.1f}  saved {alone - chained:5.1f}")


if __name__ == "__main__":
    main()
