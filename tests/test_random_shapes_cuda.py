"""Randomised shapes for every CUDA path a user reaches: the SMBD SpMM, the low-bit kernels (GEMV,
fused, decode + cuBLAS) and SparseLinear, each against a float64 reference, into NaN-poisoned
outputs where the op takes one (the SpMM and low-bit tests' own helpers). The parametrised tests
pin the shapes the kernels were built around; these draw M, K and N from wide log-uniform ranges
(1 to a few thousand), so tile, chunk, split and tail edges fall where nobody chose them. Every
run draws new cases; a failure names its seed, and SPINFER_TEST_SEED=<seed> replays it."""

import math
import os
import random

import pytest
import torch

import spinfer
from spinfer.format import TCABME
from spinfer.nn import SparseLinear
from spinfer.quant import LowBitWeight
from tests.conftest import rel_err
from spinfer.ops.lowbit_mm import fused_max_n
from tests.test_lowbit_cuda import exact_reference, fused, reference
from tests.test_spmm_cuda import spmm_poisoned
from tests.test_tca_bme import random_sparse

pytestmark = pytest.mark.cuda
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
CASES = int(os.environ.get("SPINFER_TEST_CASES", "24"))


def seeds():
    fixed = os.environ.get("SPINFER_TEST_SEED")
    if fixed is not None:
        return [int(fixed)]
    base = random.SystemRandom().randrange(1 << 30)
    return [base + i for i in range(CASES)]


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


@pytest.fixture(autouse=True)
def _ext():
    spinfer.build.load_extension()


@pytest.mark.parametrize("seed", seeds())
def test_spmm_random_shape(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    m, k, n = log_uniform(rng, 1, 5000), log_uniform(rng, 1, 3000), log_uniform(rng, 1, 300)
    sparsity = rng.choice([0.0, 0.999, 1.0, rng.random(), rng.random()])
    dtype = rng.choice([torch.float16, torch.bfloat16])
    case = f"seed {seed}: M={m} K={k} N={n} sparsity={sparsity:.3f} {dtype}"
    w = random_sparse((m, k), sparsity, dtype, device="cuda")
    if rng.random() < 0.2:
        w[rng.randrange(m)] = torch.randn(k, device="cuda").to(dtype)  # one dense row
    enc = TCABME.from_dense(w)
    x = torch.randn(n, k, device="cuda").to(dtype)
    bias = torch.randn(m, device="cuda").to(dtype) if rng.random() < 0.5 else None
    ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    ref_norm = ref.norm().item()
    y = spmm_poisoned(x, enc, bias)
    if ref_norm == 0:  # an all-zero weight without a bias
        assert torch.equal(y, torch.zeros_like(y)), case
        return
    assert rel_err(y, ref) <= TOL[dtype], case
    assert rel_err(spinfer.spmm(x, enc, bias), ref) <= TOL[dtype], case + " (allocating call)"
    layer = SparseLinear(enc, bias, policy="auto")
    with torch.no_grad():
        assert rel_err(layer(x), ref) <= TOL[dtype], case + f" (SparseLinear, {layer.choose(n)})"


@pytest.mark.parametrize("seed", seeds())
def test_lowbit_random_shape(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bits = rng.choice([1, 2, 4, 8])
    group = rng.choice([32, 64, 128, 256, None])
    m, n = log_uniform(rng, 1, 5000), log_uniform(rng, 1, 300)
    k = log_uniform(rng, 1, 3000) if group is None else group * log_uniform(rng, 1, 24)
    dtype = rng.choice([torch.float16, torch.bfloat16])
    case = f"seed {seed}: M={m} K={k} N={n} bits={bits} group={group} {dtype}"
    q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").to(dtype), bits, group)
    x = torch.randn(n, k, device="cuda").to(dtype)
    bias = torch.randn(m, device="cuda").to(dtype) if rng.random() < 0.5 else None
    # The fused and GEMV kernels against the weight's exact values, the decode + cuBLAS path (the
    # allocating call above fused_max_n) against the weight rounded to its dtype, which it multiplies
    # (test_lowbit_cuda.exact_reference says why the two differ on small outputs).
    exact = exact_reference(x, q, bias)
    ref = exact if n <= fused_max_n(bits) else reference(x, q, bias)
    assert rel_err(fused(x, q, bias), exact) <= TOL[dtype], case
    assert rel_err(spinfer.lowbit_mm(x, q, bias), ref) <= TOL[dtype], case + " (allocating call)"
    layer = SparseLinear(q, bias, policy="lowbit")
    with torch.no_grad():
        assert rel_err(layer(x), ref) <= TOL[dtype], case + " (SparseLinear)"
