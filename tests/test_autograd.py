"""Gradients through spmm, lowbit_mm and SparseLinear: x and bias get F.linear's gradients against
a float64 reference, the compressed weight is frozen (encoders detach it; arrays that ask for
gradients are refused), calls with nothing to differentiate build no graph, and out= refuses
autograd. CPU always; CUDA where a GPU is present."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spinfer
from spinfer import LowBitWeight, SparseLinear, TCABME
from tests.conftest import rel_err
from tests.test_lowbit import random_gptq
from tests.test_tca_bme import random_sparse

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def input_grads(op, x, bias, g):
    """x.grad and bias.grad of op(x, bias) with incoming gradient g, on fresh leaves."""
    x = x.detach().requires_grad_()
    bias = bias.detach().requires_grad_() if bias is not None else None
    op(x, bias).backward(g)
    return x.grad, (bias.grad if bias is not None else None)


def check_linear_grads(op, w_ref, lead, k, m, dtype, device, with_bias=True):
    x = torch.randn(*lead, k, device=device).to(dtype)
    bias = torch.randn(m, device=device).to(dtype) if with_bias else None
    g = torch.randn(*lead, m, device=device).to(dtype)
    gx, gb = input_grads(op, x, bias, g)
    g2 = g.double().reshape(-1, m)
    assert gx.shape == x.shape and gx.dtype == dtype
    assert rel_err(gx.reshape(-1, k), g2 @ w_ref.double().to(g2.device)) <= TOL[dtype]
    if with_bias:
        assert rel_err(gb, g2.sum(0)) <= TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lead", [(1,), (2, 7)])
def test_spmm_input_and_bias_gradients(device, dtype, lead):
    torch.manual_seed(0)
    w = random_sparse((300, 1000), 0.7, dtype).to(device)  # odd shape: padded GroupTiles on both axes
    enc = TCABME.from_dense(w)
    check_linear_grads(lambda x, b: spinfer.spmm(x, enc, b), w, lead, 1000, 300, dtype, device)
    check_linear_grads(lambda x, b: spinfer.spmm(x, enc, b), w, lead, 1000, 300, dtype, device, with_bias=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("n", [1, 5])
def test_lowbit_input_gradients_with_act_order(device, bits, n):
    """GPTQ's act-order permutation: forward gathers x's columns, backward must put them back.
    N = 1 is the GEMV kernel's case on CUDA, N = 5 the fused kernel's."""
    torch.manual_seed(1)
    qweight, scales, qzeros, g_idx, w_ref = random_gptq(512, 72, bits, 128, act_order=True)
    q = LowBitWeight.from_gptq(qweight, scales, qzeros, bits=bits, group_size=128, g_idx=g_idx).to(device)
    assert q.perm is not None
    check_linear_grads(lambda x, b: spinfer.lowbit_mm(x, q, b), w_ref, (n,), 512, 72, torch.float16, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_bounded_backward_decodes_a_large_weight_in_bands(device, dtype, request):
    """With set_backward_band_bytes, backward decodes a larger weight a band of whole row tiles at
    a time (slices of the arrays), summing the bands' products in fp32: the bands cover the rows
    exactly, each is the matching rows of the full decode, and the gradients are F.linear's."""
    from spinfer.ops.lowbit_mm import _lowbit_bands
    from spinfer.ops.spmm import _tca_bme_bands

    torch.manual_seed(2)
    m, k = 300, 1000  # odd: the last band holds the padded rows
    assert spinfer.set_backward_band_bytes(2 * k * 128 + 5) is None  # bands of 128 rows; the default decodes whole
    request.addfinalizer(lambda: spinfer.set_backward_band_bytes(None))
    w = random_sparse((m, k), 0.7, dtype).to(device)
    w[5] = 1.5  # one dense row, and an empty GroupTile row
    w[64:128] = 0.0
    encs = {"tca-bme 64x64": TCABME.from_dense(w),
            "tca-bme 32x64": TCABME.from_dense(w.cpu(), group_tile=(32, 64)).to(device) if device == "cpu" else None}
    q = LowBitWeight.quantize(w, 4, None)  # per-channel: no group size divides K = 1000
    for name, enc in encs.items():
        if enc is None:  # (the CUDA kernels take 64x64 GroupTiles only)
            continue
        bands = list(_tca_bme_bands(enc.bitmap, enc.values, enc.gtile_offset, m, k, *enc.group_tile))
        assert [(r0, r1) for r0, r1, _ in bands] == [(0, 128), (128, 256), (256, 300)], name
        full = enc.to_dense()
        for r0, r1, band in bands:
            assert torch.equal(band, full[r0:r1]), (name, r0)
        check_linear_grads(lambda x, b: spinfer.spmm(x, enc, b), w, (2, 7), k, m, dtype, device)
    bands = list(_lowbit_bands(q.qweight, q.scale_zero, 4, q.group_size, m, k))
    assert [(r0, r1) for r0, r1, _ in bands] == [(0, 128), (128, 256), (256, 300)]
    full = q.dequantize()
    for r0, r1, band in bands:
        assert torch.equal(band, full[r0:r1]), r0
    check_linear_grads(lambda x, b: spinfer.lowbit_mm(x, q, b), full, (3,), k, m, dtype, device)


def test_backward_decodes_whole_unless_bounded_and_the_bound_is_checked():
    from spinfer.ops.linear_input import band_rows

    assert band_rows(28672, 8192, 64) == 28672  # the default: one decode, the fastest
    for bad in (0, -1, True, 1.5, "64"):
        with pytest.raises(ValueError, match="positive int or None"):
            spinfer.set_backward_band_bytes(bad)
    try:
        spinfer.set_backward_band_bytes(1)  # below one tile: a tile of 64 rows each
        assert band_rows(28672, 8192, 64) == 64
        spinfer.set_backward_band_bytes(64 << 20)
        assert band_rows(28672, 8192, 64) == 4096 and band_rows(1000, 8192, 64) == 1000
    finally:
        spinfer.set_backward_band_bytes(None)


@pytest.mark.parametrize("device", DEVICES)
def test_calls_with_nothing_to_differentiate_build_no_graph(device):
    w = random_sparse((128, 256), 0.5, torch.float16).to(device)
    enc, q = TCABME.from_dense(w), LowBitWeight.quantize(w, 4, 128)
    x = torch.randn(3, 256, device=device).half()
    for op in (lambda x: spinfer.spmm(x, enc), lambda x: spinfer.lowbit_mm(x, q)):
        assert op(x).grad_fn is None
        with torch.no_grad():
            assert not op(x.clone().requires_grad_()).requires_grad
        assert op(x.clone().requires_grad_()).grad_fn is not None


@pytest.mark.parametrize("device", DEVICES)
def test_an_empty_batch_keeps_its_graph(device):
    """N = 0 under autograd, as F.linear: an empty x.grad and a zero bias gradient."""
    w = random_sparse((64, 256), 0.5, torch.float16).to(device)
    enc, q = TCABME.from_dense(w), LowBitWeight.quantize(w, 4, 128)
    for op in (lambda x, b: spinfer.spmm(x, enc, b), lambda x, b: spinfer.lowbit_mm(x, q, b)):
        x = torch.randn(2, 0, 256, device=device).half().requires_grad_()
        b = torch.randn(64, device=device).half().requires_grad_()
        y = op(x, b)
        assert y.shape == (2, 0, 64)
        y.sum().backward()
        assert x.grad.shape == x.shape and torch.equal(b.grad, torch.zeros_like(b))


def test_the_compressed_weight_is_frozen():
    param = nn.Parameter(random_sparse((64, 128), 0.5, torch.float16))
    enc, q = TCABME.from_dense(param), LowBitWeight.quantize(param, 4, 64)  # encoders detach
    assert not enc.values.requires_grad and not q.scale_zero.requires_grad
    x = torch.randn(2, 128).half().requires_grad_()
    spinfer.spmm(x, enc).sum().backward()  # gradients reach x, not the Parameter
    assert x.grad is not None and param.grad is None
    # arrays handed over asking for gradients are refused at the forward call, not left without them
    asks = TCABME(enc.bitmap, enc.values.clone().requires_grad_(), enc.gtile_offset, enc.shape)
    with pytest.raises(RuntimeError, match="compressed weight"):
        spinfer.spmm(x, asks)
    asks = LowBitWeight(q.qweight, None, None, 4, 64, q.shape, scale_zero=q.scale_zero.clone().requires_grad_())
    with pytest.raises(RuntimeError, match="compressed weight"):
        spinfer.lowbit_mm(x, asks)


@pytest.mark.parametrize("device", DEVICES)
def test_lowbit_out_refuses_autograd(device):
    q = LowBitWeight.quantize(torch.randn(64, 128).half(), 4, 64).to(device)
    x = torch.randn(2, 128, device=device).half()
    out = torch.empty(2, 64, device=device).half()
    with pytest.raises(RuntimeError, match="out= does not support automatic differentiation"):
        spinfer.lowbit_mm(x.requires_grad_(), q, out=out)
    with torch.no_grad():
        spinfer.lowbit_mm(x, q, out=out)  # fine without a graph


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["spmm_out", "lowbit_mm_out"])
def test_the_out_ops_refuse_arguments_that_require_grad(device, op):
    # As torch's own out= ops do. Before, a direct call ran: on CUDA out came back detached from
    # the graph, so x silently got no gradient through it.
    dense = spinfer.magnitude_prune(torch.randn(64, 128), 0.5).half()
    if op == "spmm_out":
        w = TCABME.from_dense(dense).to(device)
        args = (w.bitmap, w.values, w.gtile_offset, 64, 128, 64, 64, w.max_run)
        call = lambda x, b, out: torch.ops.spinfer.spmm_out(x, *args, b, 0, w.row_offset, out=out)
        ref_w = w.to_dense()
    else:
        w = LowBitWeight.quantize(dense, 4, 64).to(device)
        args = (w.qweight, w.scale_zero, 4, 64, 64, 128, None)
        call = lambda x, b, out: torch.ops.spinfer.lowbit_mm_out(x, *args, b, 0, False, out=out)
        ref_w = w.dequantize()
    x = torch.randn(3, 128, device=device).half()
    bias = torch.randn(64, device=device).half()
    out = torch.full((3, 64), float("nan"), device=device).half()
    for name, grad_x, grad_b, grad_out in (("x", True, False, False), ("bias", False, True, False),
                                           ("out", False, False, True)):
        with pytest.raises(RuntimeError, match=f"out=... arguments don't support automatic differentiation, but "
                                               f"'{name}' requires grad"):
            call(x.clone().requires_grad_(grad_x), bias.clone().requires_grad_(grad_b),
                 out.clone().requires_grad_(grad_out))
    assert bool(out.isnan().all())  # refused before any write
    version = out._version
    with torch.no_grad():
        call(x.requires_grad_(), bias.requires_grad_(), out)
    assert out._version > version and not out.requires_grad  # an in-place write, with no graph
    ref = x.double() @ ref_w.double().t() + bias.double()
    assert rel_err(out, ref) <= 2e-3
    call(x.detach(), bias.detach(), out)  # grad mode on, nothing requires grad: runs
    assert rel_err(out, ref) <= 2e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["dense", "sparse", "lowbit"])
def test_sparse_linear_passes_gradients_to_the_layers_before_it(device, policy):
    """A frozen compressed base layer with a trainable layer in front (an adapter): the front
    layer's weight gradient equals the one through F.linear on the same (pruned or dequantized)
    weight."""
    torch.manual_seed(2)
    w = random_sparse((96, 160), 0.6, torch.float16)
    bias = torch.randn(96).half()
    layer = SparseLinear.from_weight(w, bias, policy=policy, quant="w4" if policy == "lowbit" else None,
                                     group_size=32).to(device)
    w_eff = layer.weight_object().dequantize() if policy == "lowbit" else w
    front = nn.Linear(48, 160).half().to(device)
    x = torch.randn(5, 48, device=device).half()
    g = torch.randn(5, 96, device=device).half()
    layer(front(x)).backward(g)
    ours = front.weight.grad.clone()
    front.zero_grad()
    F.linear(front(x), w_eff.to(device), bias.to(device)).backward(g)
    assert rel_err(ours, front.weight.grad) <= 2e-3


def test_compiled_backward():
    enc = TCABME.from_dense(random_sparse((128, 192), 0.5, torch.float16))
    fn = torch.compile(lambda x: spinfer.spmm(x, enc).float().square().sum(), fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 192).half()
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    (lambda x: spinfer.spmm(x, enc).float().square().sum())(xe).backward()
    fn(xc).backward()
    assert torch.equal(xc.grad, xe.grad)
