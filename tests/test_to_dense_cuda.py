"""The weight-to-dense kernels (spinfer::tca_bme_to_dense, spinfer::lowbit_to_dense) against the
CPU reference decoders, bit for bit: odd shapes, every sparsity from empty to dense, adversarial
bitmaps (-0.0 and NaN patterns, one dense GroupTile among empty ones, one dense row), every
low-bit width and group size with fractional zeros, both dtypes; outputs land in memory that
held a poison pattern, so an element left unwritten shows; corrupt offsets stay in bounds; and
lowbit_mm above fused_max_n(bits) (decode once, then cuBLAS) against float64. Skipped without a GPU."""

import re

import pytest
import torch

import spinfer
from spinfer.format import TCABME
from spinfer.ops.lowbit_mm import fused_max_n
from spinfer.quant import LowBitWeight
from spinfer.quant.lowbit import dequantize
from tests.conftest import rel_err, run_direct_op_calls
from tests.test_tca_bme import bits, random_sparse

pytestmark = pytest.mark.cuda

DTYPES = [torch.float16, torch.bfloat16]
POISON = 0x7E55  # a NaN pattern none of the references contain


def into_poison(shape, dtype, fn):
    """fn()'s result, which must occupy the block a poisoned tensor of the same size just freed
    (the caching allocator hands it back), so elements the kernel skips keep the poison."""
    poison = torch.full(shape, POISON, dtype=torch.int16, device="cuda").view(dtype)
    ptr = poison.data_ptr()
    del poison
    out = fn()
    assert out.data_ptr() == ptr, "the output did not reuse the poisoned block"
    return out


def check_tca_bme(w):
    enc = TCABME.from_dense(w.cuda())
    out = into_poison(w.shape, w.dtype, enc.to_dense)
    assert out.is_contiguous() and out.shape == w.shape
    assert torch.equal(bits(out.cpu()), bits(w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 9), (63, 65), (64, 64), (4097, 1000), (300, 4104)])
@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.7, 0.9, 0.999, 1.0])
def test_tca_bme_to_dense_is_bit_exact(shape, sparsity, dtype):
    check_tca_bme(random_sparse(shape, sparsity, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tca_bme_adversarial_patterns(dtype):
    w = torch.zeros(256, 320, dtype=dtype)
    w[64:128, 128:192] = torch.randn(64, 64).to(dtype)  # one dense GroupTile among empty ones
    w[200, :] = torch.randn(320).to(dtype)  # one dense row
    w[:, 0] = torch.randn(256).to(dtype)  # a dense first column
    w[5, 7] = -0.0  # kept (a stored pattern), unlike +0.0
    w[6, 8] = float("nan")
    w[250:, 300:] = float("-inf")
    check_tca_bme(w)


def test_tca_bme_corrupt_offsets_stay_in_bounds():
    enc = TCABME.from_dense(random_sparse((130, 200), 0.5, torch.float16).cuda())
    for offsets in (torch.full_like(enc.gtile_offset, 2**31 - 1), -enc.gtile_offset - 5,
                    enc.gtile_offset.flip(0)):
        out = torch.ops.spinfer.tca_bme_to_dense(enc.bitmap, enc.values, offsets, 130, 200, 64, 64)
        torch.cuda.synchronize()  # an out-of-bounds read would fault here (and in compute-sanitizer)
        assert out.shape == (130, 200)


def random_lowbit(m, k, nbits, group, dtype):
    """A LowBitWeight with random codes, scales and fractional (HQQ-style) zeros."""
    g = k if group is None else group
    w_q = torch.randint(0, 1 << nbits, (m, k), dtype=torch.uint8)
    scale = (torch.rand(m, k // g) * 0.02 + 0.001).to(dtype)
    zero = (torch.rand(m, k // g) * ((1 << nbits) - 1)).to(dtype)
    return LowBitWeight.from_hqq(w_q, scale, zero, nbits, group, (m, k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nbits", [1, 2, 4, 8])
@pytest.mark.parametrize("shape_group", [((333, 1152), 32), ((65, 1280), 64), ((4097, 1024), 128),
                                         ((64, 1280), 256), ((7, 1000), None), ((130, 8), None)],
                         ids=lambda s: f"{s[0][0]}x{s[0][1]}-g{s[1]}")
def test_lowbit_to_dense_is_bit_exact(shape_group, nbits, dtype):
    (m, k), group = shape_group
    q = random_lowbit(m, k, nbits, group, dtype)
    ref = dequantize(q.qweight, q.scale_zero, q.bits, q.group_size, q.shape)
    qc = q.to("cuda")
    out = into_poison((m, k), dtype, lambda: spinfer.ops.lowbit_to_dense(qc))
    assert out.is_contiguous() and out.shape == (m, k)
    assert torch.equal(bits(out.cpu()), bits(ref))


def test_lowbit_dequantize_undoes_act_order():
    from tests.test_lowbit import random_gptq

    qweight, scales, qzeros, g_idx, w_ref = random_gptq(512, 96, 4, 128, act_order=True)
    q = LowBitWeight.from_gptq(qweight, scales, qzeros, bits=4, group_size=128, g_idx=g_idx)
    assert q.perm is not None
    assert torch.equal(bits(q.to("cuda").dequantize().cpu()), bits(q.dequantize()))


def test_direct_op_calls_with_bad_arrays_raise():
    """The ops called directly reach their C++ checks, which name the problem (in a subprocess:
    see run_direct_op_calls)."""
    out = run_direct_op_calls(
        "from spinfer.format import TCABME\n"
        "from spinfer.quant import LowBitWeight\n"
        "enc = TCABME.from_dense(torch.randn(64, 128, device='cuda').half())\n"
        "q = LowBitWeight.quantize(torch.randn(64, 256).half(), 4, 128).to('cuda')\n"
        "t, l = torch.ops.spinfer.tca_bme_to_dense, torch.ops.spinfer.lowbit_to_dense\n"
        "for call in (lambda: t(enc.bitmap, enc.values, enc.gtile_offset, 64, 128, 32, 32),\n"
        "             lambda: t(enc.bitmap[:-1], enc.values, enc.gtile_offset, 64, 128, 64, 64),\n"
        "             lambda: t(enc.bitmap, enc.values, enc.gtile_offset[:-1], 64, 128, 64, 64),\n"
        "             lambda: t(enc.bitmap, enc.values, enc.gtile_offset.long(), 64, 128, 64, 64),\n"
        "             lambda: l(q.qweight, q.scale_zero, 3, 128, 64, 256),\n"
        "             lambda: l(q.qweight[:, :, :32], q.scale_zero, 4, 128, 64, 256),\n"
        "             lambda: l(q.qweight, q.scale_zero[:, :, :32], 4, 128, 64, 256),\n"
        "             lambda: l(q.qweight, q.scale_zero, 4, 100, 64, 256)):\n"
        "    try:\n"
        "        call()\n"
        "        print('no error')\n"
        "    except (ValueError, TypeError) as e:\n"
        "        print(type(e).__name__, str(e).splitlines()[0])\n"
    )
    lines = out.splitlines()
    expected = ["ValueError .*GroupTile 64x64", "ValueError bitmap has", "ValueError gtile_offset has",
                "TypeError gtile_offset must be torch.int32", "ValueError bits must be", "ValueError qweight must be",
                "ValueError scale_zero must be", "ValueError bad low-bit geometry"]
    assert len(lines) == len(expected), out
    for line, pattern in zip(lines, expected):
        assert re.match(pattern, line), (line, pattern)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nbits", [2, 4, 8])
def test_lowbit_mm_above_fused_max_n(nbits, dtype):
    """N > fused_max_n(bits): the weight decoded once, then one cuBLAS GEMM (act-order gathers x)."""
    from tests.test_lowbit import random_gptq

    qweight, scales, qzeros, g_idx, _ = random_gptq(1024, 200, nbits, 128, act_order=True)
    q = LowBitWeight.from_gptq(qweight, scales.to(dtype), qzeros, bits=nbits, group_size=128, g_idx=g_idx)
    w = q.dequantize().double()  # CPU reference
    qc = q.to("cuda")
    b = torch.randn(200).to(dtype)
    for n in (fused_max_n(nbits) + 1, 1000):
        x = torch.randn(n, 1024).to(dtype)
        y = spinfer.lowbit_mm(x.cuda(), qc, b.cuda())
        ref = x.double() @ w.t() + b.double()
        assert rel_err(y, ref) <= {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype], f"N={n}"
