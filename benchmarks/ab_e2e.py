"""A/B of launch configurations end to end, in one process: the decode step of the Llama-shaped
stack (spinfer/bench/e2e.py) captured once per (variant, configuration) as a CUDA graph, with the
configuration's SPINFER_* overrides set while it is planned and captured (ab_spmm.apply), then all
graphs replayed round by round in a shuffled order. Separate processes differed by 1-2% between
runs of one build, as much as the effects measured (docs/quant.md, thirty-seventh session).

    python benchmarks/ab_e2e.py --variants w4,w2g64 --configs auto,LOWBIT_RING=0,LOWBIT_RING=2 \\
        [--dims 8192,28672,64,8] [--batch 1] [--layers 4] [--steps 64] [--rounds 7] \\
        [--glues fused,pdl,pdl-sdpa] [--profile [--positions] [--dump kernels.json]] [--soak 4]

Prints each graph's tokens/s (the best and the median round) and its ratio to dense captured with
the same glue (--glues: every graph, dense included, once per glue mode of e2e.py, by default the
one `spinfer bench e2e` takes; "pdl-sdpa" is the pdl glue with torch's index_copy_, SDPA and mask
for the attention step instead of its Triton kernel, pdl_glue.decode_attention). A config item
NODES=P sets the preferred shared-memory carveout P (percent) on every kernel node of the captured
graph, torch's included, before it is instantiated (the driver API through ctypes). --profile lists
each graph's kernels with their durations and the idle gaps before them (torch.profiler);
--positions also puts the graphs side by side, kernel by kernel in step order (where a kernel
name's mean hides which layer moved); --soak replays each graph for a while, printing wall-clock
times to line up with a clock log (nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw
--format=csv -lms 50).
"""

import argparse
import json
import statistics
import time

import torch

import spinfer
import spinfer.bench.e2e as e2e
from spinfer.bench.e2e import Stack, build_variant, capture, settle_graph_launches
from spinfer.timing import profiled_kernels, rounds_of

from ab_spmm import apply  # benchmarks/ is on sys.path when this script runs


def set_node_carveout(graph, percent):
    """Every kernel node of a captured, not yet instantiated graph gets this preferred shared-memory
    carveout (CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 14); returns how many."""
    import ctypes

    cu = ctypes.CDLL("libcuda.so.1")
    g = ctypes.c_void_p(graph.raw_cuda_graph())
    n = ctypes.c_size_t(0)
    assert cu.cuGraphGetNodes(g, None, ctypes.byref(n)) == 0
    nodes = (ctypes.c_void_p * n.value)()
    assert cu.cuGraphGetNodes(g, nodes, ctypes.byref(n)) == 0
    value = (ctypes.c_ubyte * 64)()
    ctypes.c_uint.from_buffer(value).value = percent
    done = 0
    for node in nodes:
        kind = ctypes.c_int(-1)
        assert cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) == 0
        if kind.value == 0:  # CU_GRAPH_NODE_TYPE_KERNEL
            assert cu.cuGraphKernelNodeSetAttribute(ctypes.c_void_p(node), 14, value) == 0
            done += 1
    return done


def capture_with(model, x, pos, nodes=None):
    """The decode step's graph (e2e.capture); with `nodes`, every kernel node gets that preferred
    shared-memory carveout before the graph is instantiated."""
    g = capture(model, x, pos, keep_graph=nodes is not None)
    if nodes is not None:
        print(f"carveout {nodes} on {set_node_carveout(g, nodes)} kernel nodes")
        g.instantiate()
    return g


def kernel_table(graph, pos, steps=8, dump=None):
    """Per kernel name, over `steps` replays of the graph (torch.profiler's CUDA activity): calls
    per step, mean duration and mean idle gap before it (its start less the previous kernel's end),
    us; then the step's summed durations and gaps."""
    pos.zero_()
    kernels = profiled_kernels(graph.replay, steps)
    if dump is not None:  # every kernel's (name, start, end), us
        dump.append([(e.name[:120], e.time_range.start, e.time_range.end) for e in kernels])
    rows, prev_end = {}, None
    for e in kernels:
        name = e.name.split("(")[0].split("<")[0][-48:]
        r = rows.setdefault(name, [0, 0.0, 0.0])
        r[0] += 1
        r[1] += e.time_range.end - e.time_range.start
        if prev_end is not None:
            r[2] += max(0.0, e.time_range.start - prev_end)
        prev_end = e.time_range.end
    out = [f"{'kernel':<48} {'/step':>5} {'us':>7} {'gap':>6}"]
    for name, (n, dur, gap) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        out.append(f"{name:<48} {n / steps:>5.1f} {dur / n:>7.2f} {gap / n:>6.2f}")
    out.append(f"{'step: kernels / gaps':<48} {'':>5} {sum(r[1] for r in rows.values()) / steps:>7.1f} "
               f"{sum(r[2] for r in rows.values()) / steps:>6.1f}")
    return "\n".join(out)


def position_table(dumps):
    """The graphs side by side, one row per kernel of the step in launch order: its name, mean
    duration and mean gap before it (us) over the profiled steps. `dumps`: label -> [(name, start,
    end), ...] of whole steps (kernel_table's dump). Under programmatic dependent launch a kernel
    starts before the one ahead of it ends: its duration then includes that wait, and its gap is
    negative."""
    tables = {}
    for label, runs in dumps.items():
        names = [r[0] for r in runs]
        n = len(runs)
        step = next(p for p in range(1, n + 1) if n % p == 0 and all(names[i] == names[i % p] for i in range(n)))
        rows = []
        for pos in range(step):
            durs = [runs[i][2] - runs[i][1] for i in range(pos, n, step)]
            gaps = [runs[i][1] - runs[i - 1][2] for i in range(pos or step, n, step)]  # none before the first launch
            short = names[pos].split("(")[0].split("<")[0][-20:]
            rows.append((short, statistics.mean(durs), statistics.mean(gaps) if gaps else 0.0))
        tables[label] = rows
    out = ["pos  " + "  ".join(f"{label[:34]:>34}" for label in tables)]
    for pos in range(max(len(t) for t in tables.values())):
        cells = [f"{t[pos][0]:>20} {t[pos][1]:6.2f} {t[pos][2]:6.2f}" if pos < len(t) else " " * 34
                 for t in tables.values()]
        out.append(f"{pos:>3}  " + "  ".join(cells))
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="w4")
    p.add_argument("--configs", default="auto,LOWBIT_RING=0,LOWBIT_RING=2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dims", default="4096,14336,32,8",
                   help="hidden, MLP, heads, KV heads (Llama-70B: 8192,28672,64,8)")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--glues", default=None,
                   help=f"glue modes of e2e.py, each with its own graphs ({', '.join(e2e.GLUES)}); default: the one "
                        f"`spinfer bench e2e` takes (pdl with Triton on sm_90+, else fused)")
    p.add_argument("--profile", action="store_true", help="also each graph's kernels, durations and gaps")
    p.add_argument("--positions", action="store_true",
                   help="with --profile: also every graph side by side, kernel by kernel in step order")
    p.add_argument("--dump", default="", help="with --profile: every kernel's name, start and end to this JSON")
    p.add_argument("--soak", type=float, default=0.0,
                   help="then replay each graph for this many seconds, printing wall-clock start and end (to "
                        "line up with a clock and power log, e.g. nvidia-smi -lms)")
    a = p.parse_args()
    spinfer.build.load_extension()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    hidden, inter, heads, kv = (int(v) for v in a.dims.split(","))
    base = Stack(a.layers, hidden, inter, heads, kv, a.steps + 8, a.batch, fused=True).to(dev, torch.float16)
    x = torch.randn(a.batch, 1, hidden, device=dev, dtype=torch.float16)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    settle_graph_launches(dev)  # every figure in the state a process with many graphs is in
    # The benchmark's own default: an A/B under the fused glue missed a 5% loss that only the pdl
    # glue's early launches showed (docs/kernels.md, sixty-seventh session).
    glues = (a.glues or ("pdl" if e2e.pdl_glue.available(dev) else "fused")).split(",")
    for glue in glues:
        mode = "pdl" if glue == "pdl-sdpa" else glue
        if mode not in e2e.GLUES or (mode == "pdl" and not e2e.pdl_glue.available(dev)):
            raise SystemExit(f"ab_e2e: glue {glue!r} is not one of {e2e.GLUES + ('pdl-sdpa',)} or needs Triton on "
                             f"sm_90+ (pdl)")
    graphs, dense_of = {}, {}  # label -> graph; label -> the dense graph's label of its glue
    models = {name: build_variant(base, name, a.batch) for name in a.variants.split(",")}  # kept alive
    attention = e2e.pdl_glue.KERNELS.get("decode_attention")
    for glue in glues:
        e2e._GLUE["mode"] = "pdl" if glue == "pdl-sdpa" else glue
        if glue == "pdl-sdpa":  # captured without the attention kernel (e2e._attention_kernel)
            e2e.pdl_glue.KERNELS.pop("decode_attention", None)
        elif attention is not None:
            e2e.pdl_glue.KERNELS["decode_attention"] = attention
        tag = f" [{glue}]" if len(glues) > 1 else ""
        graphs["dense" + tag] = capture_with(base, x, pos)
        for name, model in models.items():
            for config in a.configs.split(","):
                items = config.split("+")
                nodes = next((int(i[6:]) for i in items if i.startswith("NODES=")), None)
                apply("+".join(i for i in items if not i.startswith("NODES=")) or "auto")
                graphs[f"{name} {config}{tag}"] = capture_with(model, x, pos, nodes)
        dense_of.update({label: "dense" + tag for label in graphs if label not in dense_of})
    if attention is not None:  # every graph is captured: the module as it was
        e2e.pdl_glue.KERNELS["decode_attention"] = attention
    apply("auto")
    def steps_of(g):
        def run():
            pos.zero_()
            for _ in range(a.steps):
                g.replay()
        return run

    # Shuffled rounds, each run after one untimed run (the previous graph's weights out of L2).
    times = rounds_of({label: steps_of(g) for label, g in graphs.items()}, dev, rounds=a.rounds, shuffle=True,
                      reps=1, warmup=1, flush_l2=False, max_seconds=None)
    print(f"{torch.cuda.get_device_name(dev)}: {a.layers} fused layers ({a.dims}), batch {a.batch}, {a.steps} steps, "
          f"{a.rounds} shuffled rounds")
    print(f"{'graph':<40} {'tokens/s best':>13} {'median':>9} {'x dense best':>12} {'median':>7}")
    for label, ts in times.items():
        best, med = min(ts), statistics.median(ts)
        dense = times[dense_of[label]]
        rate = a.batch * a.steps
        print(f"{label:<40} {rate / best:>13.1f} {rate / med:>9.1f} {min(dense) / best:>12.3f} "
              f"{statistics.median(dense) / med:>7.3f}")
    for label, g in graphs.items() if a.soak > 0 else ():
        torch.cuda.synchronize()
        t0, n = time.time(), 0
        while time.time() - t0 < a.soak:
            for _ in range(50):
                pos.zero_()
                for _ in range(a.steps):
                    g.replay()
            torch.cuda.synchronize()
            n += 50 * a.steps
        t1 = time.time()
        print(f"soak {label!r}: {t0:.3f} .. {t1:.3f}, {a.batch * n / (t1 - t0):.1f} tokens/s (wall)")
    if a.profile:
        dumps = {}
        for label, g in graphs.items():
            dumps[label] = []
            print(f"\n== {label}\n{kernel_table(g, pos, dump=dumps[label])}")
        if a.positions:
            print("\n" + position_table({label: runs[0] for label, runs in dumps.items()}))
        if a.dump:
            with open(a.dump, "w") as f:
                json.dump(dumps, f)


if __name__ == "__main__":
    main()
