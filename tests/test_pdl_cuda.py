"""Programmatic dependent launch (sm_90; spinfer/csrc/launch.cuh): a launch may start while the
kernel before it still runs, so each kernel must wait for it before reading x or writing
anything. Chains of layers that read the previous layer's output and overwrite its input
(ping-pong buffers), split and unsplit, eager and in a CUDA graph, must equal the same chain
launched without it, bit for bit.  Skipped without a GPU."""

import pytest
import torch

import spinfer
from spinfer.format import TCABME
from spinfer.quant import LowBitWeight
from tests.conftest import rel_err
from tests.test_tca_bme import random_sparse

pytestmark = pytest.mark.cuda
K = 1024


@pytest.fixture(autouse=True)
def _ext():
    spinfer.build.load_extension()


def layers():
    """Square layers (so outputs feed the next layer): TCA-BME and 4-bit, with split factors
    that alternate between 1 and several (the split-K epilogue writes counters and partials)."""
    torch.manual_seed(0)
    out = []
    for i in range(8):
        if i % 2 == 0:
            w = random_sparse((K, K), 0.5, torch.float16, device="cuda") * (K ** -0.5) * 1.4
            out.append((TCABME.from_dense(w), w, 1 if i % 4 == 0 else 4))
        else:
            q = LowBitWeight.quantize(torch.randn(K, K, device="cuda").half() * (K ** -0.5), 4, 128)
            out.append((q, q.dequantize(), 1 if i % 4 == 1 else 3))
    return out


def chain(ls, a, b):
    """x in a; layer i reads one buffer and writes the other; returns the buffer holding the
    last output."""
    src, dst = a, b
    for weight, _, splits in ls:
        if isinstance(weight, TCABME):
            m, k = weight.shape
            torch.ops.spinfer.spmm_out(src, weight.bitmap, weight.values, weight.gtile_offset, m, k, 64, 64,
                                       weight.max_run, None, splits, out=dst)
        else:
            torch.ops.spinfer.lowbit_mm_out(src, weight.qweight, weight.scale_zero, 4, 128, K, K, None, None, splits,
                                            out=dst)
        src, dst = dst, src
    return src


@pytest.mark.parametrize("n", [1, 16, 40])
def test_chained_layers_equal_with_and_without_pdl(monkeypatch, n):
    ls = layers()
    x = torch.randn(n, K, device="cuda").half()
    ref = x.double()
    for _, w, _ in ls:
        ref = ref @ w.double().t()
    results = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("SPINFER_PDL", pdl)
        a, b = x.clone(), torch.empty_like(x)
        results[pdl, "eager"] = chain(ls, a, b).clone()
        a.copy_(x)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = chain(ls, a, b)
        for _ in range(3):
            a.copy_(x)
            g.replay()
        torch.cuda.synchronize()
        results[pdl, "graph"] = y.clone()
    base = results["0", "eager"]
    assert rel_err(base, ref) <= 1e-2, "the chain itself is off"
    for key, y in results.items():
        assert torch.equal(y, base), f"SPINFER_PDL={key[0]}, {key[1]}: differs from launches without PDL"
