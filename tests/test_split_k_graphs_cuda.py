"""Split-K launches inside CUDA graphs: after an eager split launch on the device, a captured
launch takes arrival counters from a pre-zeroed reserve instead of recording a zeroing node
(spinfer/csrc/bindings.cpp, arrival_counters); graphs replayed on two streams, interleaved
with eager launches, all stay exact.  Skipped without a GPU."""

import os
import subprocess
import sys
import tempfile

import pytest
import torch

import spinfer
from spinfer.format import TCABME
from spinfer.quant import LowBitWeight
from tests.conftest import rel_err
from tests.test_tca_bme import random_sparse

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _ext():
    spinfer.build.load_extension()


def zeroing_nodes(g) -> int:
    """Mentions of a memset or of torch's fill kernel (what at::zeros records) in the DOT dump of
    a graph captured with keep_graph=True: zero exactly when no node zeroes memory."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "graph.dot")
        g.debug_dump(path)
        with open(path) as f:
            dot = f.read().upper()
    return dot.count("MEMSET") + dot.count("FILLFUNCTOR")


def capture(fn):
    """(graph, fn's result, zeroing nodes recorded) for fn() captured in a CUDA graph."""
    g = torch.cuda.CUDAGraph(keep_graph=True)  # keeps the cudaGraph_t for the dump
    with torch.cuda.graph(g):
        out = fn()
    zeroing = zeroing_nodes(g)
    g.instantiate()
    return g, out, zeroing


@pytest.mark.parametrize("lowbit_splits", ["2", "-1"])  # -1: the low-bit balanced schedule
def test_captured_split_launches_zero_nothing_after_an_eager_one(lowbit_splits, monkeypatch):
    monkeypatch.setenv("SPINFER_SPLITS", "4")
    monkeypatch.setenv("SPINFER_LOWBIT_SPLITS", lowbit_splits)
    w = random_sparse((500, 1024), 0.5, torch.float16, device="cuda")
    enc = TCABME.from_dense(w)
    q = LowBitWeight.quantize(torch.randn(700, 1024, device="cuda").half(), 4, 128)
    wq = q.dequantize().double()
    x = torch.randn(3, 1024, device="cuda").half()
    spinfer.spmm(x, enc)  # an eager split launch: the device's reserve exists from here on
    spinfer.lowbit_mm(x, q)
    g, (ys, yq), zeroing = capture(lambda: (spinfer.spmm(x, enc), spinfer.lowbit_mm(x, q)))
    assert zeroing == 0, f"the graph zeroes memory ({zeroing} mentions)"
    for _ in range(3):
        x.copy_(torch.randn(3, 1024, device="cuda").half())
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(ys, x.double() @ w.double().t()) <= 2e-3
        assert rel_err(yq, x.double() @ wq.t()) <= 2e-3


def test_graphs_on_two_streams_and_eager_launches_interleaved(monkeypatch):
    """Each captured launch owns its counters: two graphs with different split factors and
    tile counts replayed on two streams, with eager split launches queued between them, never
    disturb one another."""
    shapes, splits = [(300, 1450), (700, 3000), (130, 900)], ["4", "3", "7"]
    ws = [random_sparse(s, 0.5, torch.float16, device="cuda") for s in shapes]
    encs = [TCABME.from_dense(w) for w in ws]
    xs = [torch.randn(9, w.shape[1], device="cuda").half() for w in ws]
    graphs, outs = [], []
    for i in range(2):
        monkeypatch.setenv("SPINFER_SPLITS", splits[i])
        spinfer.spmm(xs[i], encs[i])  # warm-up, eager
        g, y, _ = capture(lambda i=i: spinfer.spmm(xs[i], encs[i]))
        graphs.append(g)
        outs.append(y)
    monkeypatch.setenv("SPINFER_SPLITS", splits[2])
    side = torch.cuda.Stream()
    for step in range(4):
        for i in range(2):
            xs[i].copy_(torch.randn_like(xs[i]))
        side.wait_stream(torch.cuda.current_stream())
        graphs[0].replay()
        with torch.cuda.stream(side):
            graphs[1].replay()
        eager = spinfer.spmm(xs[2], encs[2])
        torch.cuda.synchronize()
        for i, y in enumerate(outs + [eager]):
            ref = xs[i].double() @ ws[i].double().t()
            assert rel_err(y, ref) <= 2e-3, f"step {step}, layer {i}"


_FIRST_IN_A_GRAPH = """
import os, sys, tempfile, torch, spinfer
from spinfer.format import TCABME
spinfer.build.load_extension()
os.environ["SPINFER_SPLITS"] = "4"
w = torch.randn(500, 1024, device="cuda").half()
w[torch.rand(500, 1024, device="cuda") < 0.5] = 0
enc = TCABME.from_dense(w)
x = torch.randn(3, 1024, device="cuda").half()
g = torch.cuda.CUDAGraph(keep_graph=True)
with torch.cuda.graph(g):
    y = spinfer.spmm(x, enc)
path = os.path.join(tempfile.mkdtemp(), "graph.dot")
g.debug_dump(path)
g.instantiate()
g.replay()
torch.cuda.synchronize()
err = float((y.double() - x.double() @ w.double().t()).norm() / (x.double() @ w.double().t()).norm())
dot = open(path).read().upper()
print(dot.count("MEMSET") + dot.count("FILLFUNCTOR"), err)
"""


def test_a_split_launch_first_captured_still_zeroes_its_counters():
    """In a fresh process whose first split launch is inside a capture there is no reserve yet:
    the launch records the zeroing of its counters and is exact (so the count above is not
    vacuous)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    out = subprocess.run([sys.executable, "-c", _FIRST_IN_A_GRAPH], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    zeroing, err = out.stdout.split()[-2:]
    assert int(zeroing) >= 1, out.stdout
    assert float(err) <= 2e-3, out.stdout
