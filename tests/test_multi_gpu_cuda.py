"""Kernels and SparseLinear on a second GPU while the first is current. Each launch must run on
its tensors' device (the bindings' device guards), and what the extension keeps between calls
(occupancy answers, shared-memory opt-ins, split-K arrival counters and their capture reserve,
a layer's kept eager launches) must belong to one device. Skipped without two GPUs. (Written in
the sixty-first session, when no two-GPU machine was lent: it has run only with both devices
mapped to one GPU, docs/session61-h100-2026-11-25.log section 4.)"""

import copy

import pytest
import torch

import spinfer
from spinfer.format import TCABME
from spinfer.quant import LowBitWeight
from tests.conftest import rel_err, run_direct_op_calls
from tests.test_tca_bme import random_sparse

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def test_every_op_runs_on_its_tensors_device_first_touched_there():
    # A fresh process, so that every per-device cache is first filled for the second GPU while the
    # first is current, and then asked for the first: a cache keyed without the device would hand
    # one GPU's opt-ins, occupancy or counters to the other.
    out = run_direct_op_calls("""
from spinfer.format import TCABME
from spinfer.quant import LowBitWeight
from tests.conftest import rel_err
from tests.test_tca_bme import random_sparse

torch.manual_seed(0)
assert torch.cuda.current_device() == 0
w = random_sparse((1000, 1536), 0.5, torch.float16)
q = LowBitWeight.quantize(torch.randn(1000, 1536).half(), 4, 128)
for dev in ("cuda:1", "cuda:0"):
    enc, qd = TCABME.from_dense(w.to(dev)), q.to(dev)
    assert torch.equal(spinfer.ops.tca_bme_to_dense(enc).cpu(), w)
    assert torch.equal(spinfer.ops.lowbit_to_dense(qd).cpu(), q.dequantize())
    for n in (1, 8, 16, 33):
        x = torch.randn(n, 1536).half()
        for splits in (None, 0, 3):
            y = spinfer.spmm(x.to(dev), enc, splits=splits)
            assert y.device == torch.device(dev), y.device
            assert rel_err(y, x.double() @ w.double().t()) <= 2e-3, (dev, n, splits)
            y = spinfer.lowbit_mm(x.to(dev), qd, splits=splits)
            assert y.device == torch.device(dev), y.device
            assert rel_err(y, x.double() @ q.dequantize().double().t()) <= 2e-3, (dev, n, splits)
    assert torch.cuda.current_device() == 0
print("ok")
""")
    assert out.strip().endswith("ok")


@pytest.mark.parametrize("policy", ["sparse", "lowbit"])
def test_sparse_linear_on_each_gpu_keeps_its_own_launches(policy):
    torch.manual_seed(1)
    lin = torch.nn.Linear(1536, 1000).half()
    with torch.no_grad():
        lin.weight.copy_(random_sparse((1000, 1536), 0.5, torch.float16))
    layer = spinfer.SparseLinear.from_linear(lin, policy=policy, quant="w4" if policy == "lowbit" else None)
    w = layer.weight_object().to_dense() if policy == "sparse" else layer.weight_object().dequantize()
    on1 = layer.to("cuda:1")
    on0 = copy.deepcopy(layer).to("cuda:0")
    xs = {n: torch.randn(n, 1536).half() for n in (1, 8, 16)}
    with torch.no_grad(), torch.cuda.device(0):
        for _ in range(2):  # the second round through each layer's kept launches
            for layer_, dev in ((on1, "cuda:1"), (on0, "cuda:0")):
                for n, x in xs.items():
                    y = layer_(x.to(dev))
                    assert y.device == torch.device(dev)
                    ref = x.double() @ w.double().t() + lin.bias.double()
                    assert rel_err(y, ref) <= 2e-3, (dev, n)


def test_split_launches_interleaved_on_two_gpus_and_captured_on_the_second():
    # Split-K counters are per (device, stream) and re-armed by each launch: launches alternating
    # between the GPUs without a synchronization give the same bits every time; a CUDA graph
    # captured on the second GPU takes its slice of that GPU's capture reserve.
    torch.manual_seed(2)
    w = random_sparse((4097, 2048), 0.5, torch.float16)
    encs = {d: TCABME.from_dense(w.to(d)) for d in ("cuda:0", "cuda:1")}
    xs = {d: torch.randn(8, 2048).half().to(d) for d in encs}
    first = {d: spinfer.spmm(xs[d], encs[d], splits=4) for d in encs}
    for _ in range(20):
        for d in encs:
            assert torch.equal(spinfer.spmm(xs[d], encs[d], splits=4), first[d])
    with torch.cuda.device(1):
        out = torch.empty_like(first["cuda:1"])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.ops.spinfer.spmm_out(xs["cuda:1"], encs["cuda:1"].bitmap, encs["cuda:1"].values,
                                       encs["cuda:1"].gtile_offset, 4097, 2048, 64, 64, encs["cuda:1"].max_run,
                                       None, 4, encs["cuda:1"].row_offset, out=out)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize(1)
            assert torch.equal(out, first["cuda:1"])
    assert rel_err(first["cuda:0"].cpu(), xs["cuda:0"].cpu().double() @ w.double().t()) <= 2e-3
