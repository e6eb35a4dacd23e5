"""The compiled CPU decoders and the TCA-BME encoder (spinfer/cpu_kernels.py, csrc/cpu/codec.cpp)
against the torch-op references, bit for bit; their checks; and the fallback to the references."""

import warnings

import pytest
import torch

import spinfer
from spinfer import cpu_kernels
from spinfer.format import TCABME
from spinfer.format.tca_bme import decode, encode, encode_reference
from spinfer.quant import LowBitWeight
from spinfer.quant.lowbit import dequantize, restore_k_order

from spinfer.ops.lowbit_mm import CPU_DIRECT_MAX_N as LOWBIT_CPU_DIRECT_MAX_N
from spinfer.ops.spmm import CPU_DIRECT_MAX_N

from .conftest import rel_err
from .test_tca_bme import bits, random_sparse

bits_of = bits  # (the low-bit tests' own `bits` is a bit width)


@pytest.fixture(scope="module")
def lib():
    lib = cpu_kernels.library()
    if lib is None:  # CI and every development machine have a compiler: a None here is a defect
        pytest.fail(f"the CPU decoder did not build: {cpu_kernels.unavailable_reason()}")
    return lib


def compiled(enc: TCABME) -> torch.Tensor:
    out = cpu_kernels.tca_bme_decode(enc.bitmap, enc.values, enc.gtile_offset, *enc.shape, enc.group_tile)
    assert out is not None and out.dtype == enc.values.dtype and tuple(out.shape) == enc.shape
    return out


def reference(enc: TCABME) -> torch.Tensor:
    return decode(enc.bitmap, enc.values, enc.gtile_offset, enc.shape, enc.group_tile)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (7, 9), (64, 64), (63, 65), (300, 1450), (4097, 1000)])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.999, 1.0])
def test_decoder_matches_the_reference_bit_for_bit(lib, shape, sparsity, dtype):
    w = random_sparse(shape, sparsity, dtype)
    enc = TCABME.from_dense(w)
    out = compiled(enc)
    assert torch.equal(bits(out), bits(reference(enc)))
    assert torch.equal(bits(out), bits(w))


def same_arrays(a, b) -> bool:
    return all(x.dtype == y.dtype and torch.equal(bits(x) if x.is_floating_point() else x,
                                                  bits(y) if y.is_floating_point() else y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (7, 9), (64, 64), (63, 65), (300, 1450), (4097, 1000)])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.999, 1.0])
def test_encoder_matches_the_reference(lib, shape, sparsity, dtype):
    w = random_sparse(shape, sparsity, dtype)
    arrays = cpu_kernels.tca_bme_encode(w, (64, 64))
    assert arrays is not None and same_arrays(arrays, encode_reference(w))
    assert same_arrays(encode(w), arrays)  # encode (TCABME.from_dense) takes this path on the CPU


@pytest.mark.parametrize("group_tile", [(16, 16), (32, 128), (128, 64), (48, 80)])
def test_encoder_takes_any_group_tile_and_keeps_special_values(lib, group_tile):
    w = random_sparse((201, 333), 0.6, torch.float16)
    w[0, :4] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf")], dtype=torch.float16)
    w[200, 332] = torch.finfo(torch.float16).tiny / 4
    w = w.t().contiguous().t()  # a column-major view: encoded as its values, not its memory
    assert same_arrays(cpu_kernels.tca_bme_encode(w, group_tile), encode_reference(w, group_tile))


@pytest.mark.parametrize("group_tile", [(16, 16), (32, 128), (128, 64), (48, 80)])
def test_decoder_takes_any_group_tile(lib, group_tile):
    w = random_sparse((201, 333), 0.6, torch.float16)
    enc = TCABME.from_dense(w, group_tile=group_tile)
    assert torch.equal(bits(compiled(enc)), bits(w))


def test_decoder_keeps_signed_zeros_nan_and_infinities(lib):
    w = random_sparse((96, 130), 0.5, torch.float16)
    w[0, :4] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf")], dtype=torch.float16)
    w[95, 129] = torch.finfo(torch.float16).tiny / 4  # a subnormal
    enc = TCABME.from_dense(w)
    assert torch.equal(bits(compiled(enc)), bits(w))


def adversarial(pattern: str, dtype) -> torch.Tensor:
    """A 257x200 weight whose nonzeros follow ``pattern``, fresh random values where they stand."""
    w = random_sparse((257, 200), 0.0, dtype)
    mask = torch.zeros(w.shape, dtype=torch.bool)
    if pattern == "one_dense_group_tile":  # among empty ones
        mask[64:128, 128:192] = True
    elif pattern == "empty_rows":
        mask[:] = True
        mask[10:90] = False
        mask[256] = False
    elif pattern == "dense_first_column":
        mask[:, 0] = True
    elif pattern == "one_dense_row":
        mask[130] = True
    else:  # checkerboard
        mask[::2, ::2] = True
        mask[1::2, 1::2] = True
    return torch.where(mask, w, torch.zeros_like(w))


@pytest.mark.parametrize("pattern", ["one_dense_group_tile", "empty_rows", "dense_first_column", "one_dense_row",
                                     "checkerboard"])
def test_encoder_and_decoder_on_adversarial_patterns(lib, pattern):
    w = adversarial(pattern, torch.bfloat16)
    enc = TCABME.from_dense(w)
    assert same_arrays((enc.bitmap, enc.values, enc.gtile_offset), encode_reference(w))
    assert torch.equal(bits(compiled(enc)), bits(w))


def test_decoder_gives_the_same_bits_on_any_number_of_threads(lib):
    w = random_sparse((1000, 700), 0.5, torch.float16)
    enc = TCABME.from_dense(w)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 3, 64):  # 64: more threads than GroupTile rows (16)
            torch.set_num_threads(n)
            outs.append(compiled(enc))
    finally:
        torch.set_num_threads(before)
    for out in outs:
        assert torch.equal(bits(out), bits(w))


def test_decoder_refuses_a_run_past_the_values(lib):
    w = random_sparse((128, 128), 0.5, torch.float16)
    bitmap, values, offsets = encode(w)
    short = values[: int(offsets[-2])]  # the last GroupTile's run is missing
    with pytest.raises(ValueError, match="past the values"):
        cpu_kernels.tca_bme_decode(bitmap, short, offsets, 128, 128, (64, 64))
    bad = offsets.clone()
    bad[1] = -5
    with pytest.raises(ValueError, match="past the values"):
        cpu_kernels.tca_bme_decode(bitmap, values, bad, 128, 128, (64, 64))


def test_decoder_checks_sizes_and_dtypes(lib):
    w = random_sparse((128, 128), 0.5, torch.float16)
    bitmap, values, offsets = encode(w)
    with pytest.raises(ValueError, match="do not fit a 128x192 weight"):
        cpu_kernels.tca_bme_decode(bitmap, values, offsets, 128, 192, (64, 64))
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.tca_bme_decode(bitmap[:-1], values, offsets, 128, 128, (64, 64))
    with pytest.raises(TypeError, match="int64 / fp16 or bf16 / int32"):
        cpu_kernels.tca_bme_decode(bitmap, values.float(), offsets, 128, 128, (64, 64))
    with pytest.raises(TypeError, match="int64 / fp16 or bf16 / int32"):
        cpu_kernels.tca_bme_decode(bitmap, values, offsets.long(), 128, 128, (64, 64))


def test_decoder_reads_non_contiguous_arrays(lib):
    w = random_sparse((130, 70), 0.5, torch.float16)
    bitmap, values, offsets = encode(w)
    spread = torch.empty(2 * values.numel(), dtype=values.dtype)
    spread[::2] = values
    out = cpu_kernels.tca_bme_decode(bitmap, spread[::2], offsets, 130, 70, (64, 64))
    assert torch.equal(bits(out), bits(w))


def test_layers_and_ops_use_the_compiled_decoder(lib, monkeypatch):
    calls = []
    real = cpu_kernels.tca_bme_decode

    def counting(*args, **kwargs):
        calls.append(args[3:5])
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "tca_bme_decode", counting)
    w = random_sparse((96, 160), 0.5, torch.float16)
    enc = TCABME.from_dense(w)
    x = torch.randn(CPU_DIRECT_MAX_N + 1, 160, dtype=torch.float16)  # past the direct kernel's tokens
    assert torch.equal(bits(enc.to_dense()), bits(w))
    y = spinfer.spmm(x, enc)
    # decode + the same fp32 product (W @ x.T, as float32_product forms it): the same bits. x @ W.T
    # is the same sum in another order, which some BLAS builds round differently (AMD EPYC, AVX-512).
    ref = torch.mm(w.float(), x.float().t()).t().to(x.dtype)
    assert torch.equal(bits(y), bits(ref))
    for policy in ("auto", "sparse"):  # decode + F.linear, and the op
        layer = spinfer.nn.SparseLinear(enc, None, policy=policy)
        assert layer.format == "tca-bme"
        layer(x)
    assert calls == [(96, 160)] * 4


def float64_reference(x, w, bias=None):
    y = x.double() @ w.double().t()
    return y if bias is None else y + bias.double()


def assert_float32_sum(y, x, w):
    """y = x @ w.T summed in float32 in any order: fp16 / bf16 products are exact in float32, so
    each element is within k rounding units of the sum of its terms' magnitudes (the textbook
    bound for recursive summation), whatever the cancellation."""
    assert y.dtype == torch.float32
    err = (y.double() - float64_reference(x, w)).abs()
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (63, 65), (300, 1450), (4097, 1000)])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.999])
def test_a_few_tokens_multiply_straight_from_the_arrays(lib, monkeypatch, shape, sparsity, dtype):
    calls = []
    real = cpu_kernels.tca_bme_spmm
    monkeypatch.setattr(cpu_kernels, "tca_bme_spmm", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(cpu_kernels, "tca_bme_decode", lambda *a, **kw: pytest.fail("decoded"))
    m, k = shape
    w = random_sparse(shape, sparsity, dtype)
    enc = TCABME.from_dense(w)
    bias = torch.randn(m, dtype=dtype)
    layer = spinfer.nn.SparseLinear(enc, bias)
    for n in (1, 5, CPU_DIRECT_MAX_N):
        x = torch.randn(n, k, dtype=dtype)
        ref = float64_reference(x, w, bias)
        for y in (spinfer.spmm(x, enc, bias), layer(x),
                  torch.ops.spinfer.spmm(x, enc.bitmap, enc.values, enc.gtile_offset, m, k, 64, 64, enc.max_run,
                                         bias, 0, None)):
            assert y.dtype == dtype and y.shape == (n, m)
            # float32 sums, rounded once to the dtype: within that rounding of the exact product
            assert rel_err(y, ref) <= (1e-3 if dtype == torch.float16 else 8e-3)
            assert torch.equal(bits(y), bits(spinfer.spmm(x, enc, bias)))  # every path the same kernel
    assert calls and set(calls) == {1, 5, CPU_DIRECT_MAX_N}


@pytest.mark.parametrize("group_tile", [(16, 16), (128, 64), (48, 80)])
@pytest.mark.parametrize("pattern", ["one_dense_group_tile", "empty_rows", "one_dense_row"])
def test_the_direct_kernel_on_other_group_tiles_and_patterns(lib, group_tile, pattern):
    w = adversarial(pattern, torch.float16)
    mask = w != 0
    enc = TCABME.from_dense(w, group_tile=group_tile)
    x = torch.randn(3, 200, dtype=torch.float16)
    y = cpu_kernels.tca_bme_spmm(x, enc.bitmap, enc.values, enc.gtile_offset, 257, 200, group_tile)
    assert_float32_sum(y, x, w)
    assert bool((y[:, ~mask.any(1)] == 0).all())  # empty rows sum to exactly zero


def test_the_direct_kernel_refuses_a_run_past_the_values(lib):
    w = random_sparse((128, 128), 0.5, torch.float16)
    bitmap, values, offsets = encode(w)
    x = torch.randn(2, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="past the values"):
        cpu_kernels.tca_bme_spmm(x, bitmap, values[: int(offsets[-2])], offsets, 128, 128, (64, 64))
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.tca_bme_spmm(x, bitmap[:-1], values, offsets, 128, 128, (64, 64))


def test_without_the_library_the_reference_decodes(monkeypatch):
    monkeypatch.setenv("SPINFER_CPU_KERNELS", "0")
    assert cpu_kernels.library() is None
    assert "SPINFER_CPU_KERNELS=0" in cpu_kernels.unavailable_reason()
    w = random_sparse((70, 90), 0.5, torch.bfloat16)
    assert cpu_kernels.tca_bme_encode(w, (64, 64)) is None
    enc = TCABME.from_dense(w)
    assert same_arrays((enc.bitmap, enc.values, enc.gtile_offset), encode_reference(w))
    assert torch.equal(bits(enc.to_dense()), bits(w))
    x = torch.randn(2, 90, dtype=torch.bfloat16)
    assert torch.equal(bits(spinfer.spmm(x, enc)), bits((x.float() @ w.float().t()).to(x.dtype)))


def test_a_failing_compiler_warns_once_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_failure", None)
    monkeypatch.setenv("SPINFER_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.warns(RuntimeWarning, match="CPU decoders are unavailable.*failed on codec.cpp"):
        assert cpu_kernels.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call says nothing
        assert cpu_kernels.library() is None
    assert "failed on codec.cpp" in cpu_kernels.unavailable_reason()
    w = random_sparse((40, 50), 0.5, torch.float16)
    assert torch.equal(bits(TCABME.from_dense(w).to_dense()), bits(w))
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))


def test_the_library_is_built_once_per_source_and_flags(lib, monkeypatch, tmp_path):
    path = cpu_kernels.library_path(cpu_kernels.compiler())
    assert path.exists() and path.parent.name.startswith("cpu-")
    assert "-O3" in cpu_kernels.flags()
    monkeypatch.setattr(cpu_kernels, "BASE_FLAGS", cpu_kernels.BASE_FLAGS + ["-DSPINFER_TEST_FLAG"])
    assert cpu_kernels.library_path(cpu_kernels.compiler()) != path


# ---- the low-bit dequantizer ----

def lowbit_reference(q) -> torch.Tensor:
    return dequantize(q.qweight, q.scale_zero, q.bits, q.group_size, q.shape, q.perm)


def lowbit_compiled(q) -> torch.Tensor:
    out = cpu_kernels.lowbit_dequantize(q.qweight, q.scale_zero, q.bits, q.group_size, *q.shape)
    assert out is not None and out.dtype == q.scale_zero.dtype and tuple(out.shape) == q.shape
    return out if q.perm is None else restore_k_order(out, q.perm)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256, None])
def test_dequantizer_matches_the_reference_bit_for_bit(lib, bits, group_size, dtype):
    for m, k in ((1, 256), (65, 512), (130, 768)):
        q = LowBitWeight.quantize(torch.randn(m, k, dtype=dtype), bits, group_size)
        out = lowbit_compiled(q)
        assert torch.equal(bits_of(out), bits_of(lowbit_reference(q)))
        assert torch.equal(bits_of(q.dequantize()), bits_of(out))  # the layer's path is this one


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", [(7, 1000), (64, 33), (300, 1450), (1, 1)])
def test_dequantizer_on_odd_shapes(lib, bits, shape):
    # per-channel groups: no group size of 32-256 divides these K
    for dtype in (torch.float16, torch.bfloat16):
        q = LowBitWeight.quantize(torch.randn(shape, dtype=dtype), bits, None)
        assert torch.equal(bits_of(lowbit_compiled(q)), bits_of(lowbit_reference(q)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantizer_with_fractional_zeros_extreme_scales_and_a_permutation(lib, dtype):
    # HQQ-style float zeros, scales that overflow to infinity and that give subnormal results,
    # and an act-order permutation of K
    m, k, g = 70, 512, 64
    q = LowBitWeight.quantize(torch.randn(m, k, dtype=dtype), 4, g)
    scales = torch.rand(m, k // g) * 0.1
    scales[0] = 60000.0 if dtype == torch.float16 else 3e38  # (q - zero) * scale overflows
    scales[1] = 1e-7 if dtype == torch.float16 else 1e-39  # subnormal results
    zeros = torch.rand(m, k // g) * 15  # fractional
    perm = torch.randperm(k)
    q2 = LowBitWeight(q.qweight, scales.to(dtype), zeros.to(dtype), 4, g, (m, k), perm)
    out, ref = lowbit_compiled(q2), lowbit_reference(q2)
    assert torch.isinf(ref[0]).any() and (ref[1][ref[1] != 0].abs() < torch.finfo(dtype).tiny).any()
    assert torch.equal(bits_of(out), bits_of(ref))
    assert torch.equal(bits_of(q2.dequantize()), bits_of(ref))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scalar_roundings_match_torch(lib, dtype):
    # every rounding case: ties both ways, the overflow threshold, subnormal results and their
    # ties, the least normal, signed zeros, infinities; plus random floats over the whole range
    f16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    f16 = f16[~torch.isnan(f16)].float()
    halfway = (f16[:-1] + f16[1:]) / 2  # the ties of fp16
    bf = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    bf = bf[~torch.isnan(bf)].float()
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 65504.0, 65519.99, 65520.0, 2.0**-24, 2.0**-25,
                            1.5 * 2.0**-25, 2.0**-14, 2.0**-14 * (1 - 2.0**-11), 3.4e38, 1e-45])
    rand = torch.randint(-(2**31), 2**31 - 1, (200000,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([f16, halfway, halfway.nextafter(torch.tensor(0.0)), bf, special, rand])
    x = x[~torch.isnan(x)].contiguous()
    out = torch.empty(x.numel(), dtype=dtype)
    lib.spinfer_round_floats(x.data_ptr(), x.numel(), int(dtype == torch.bfloat16), out.data_ptr())
    assert torch.equal(bits_of(out), bits_of(x.to(dtype)))


def test_dequantizer_checks_sizes_and_dtypes(lib):
    q = LowBitWeight.quantize(torch.randn(64, 256, dtype=torch.float16), 4, 128)
    with pytest.raises(ValueError, match="do not fit a 64x512"):
        cpu_kernels.lowbit_dequantize(q.qweight, q.scale_zero, 4, 128, 64, 512)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.lowbit_dequantize(q.qweight, q.scale_zero, 4, 64, 64, 256)
    with pytest.raises(ValueError, match="cannot dequantize 3-bit"):
        cpu_kernels.lowbit_dequantize(q.qweight, q.scale_zero, 3, 128, 64, 256)
    with pytest.raises(TypeError, match="qweight must be int32"):
        cpu_kernels.lowbit_dequantize(q.qweight.long(), q.scale_zero, 4, 128, 64, 256)
    with pytest.raises(TypeError, match="scale_zero fp16 or bf16"):
        cpu_kernels.lowbit_dequantize(q.qweight, q.scale_zero.float(), 4, 128, 64, 256)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256, None])
def test_a_few_tokens_multiply_straight_from_the_low_bit_arrays(lib, monkeypatch, bits, group_size, dtype):
    # Groups that hold whole words take the four-words-at-a-time unpack (codec.cpp, kWordSpan: 1 bit
    # from 128 columns, 2 bits from 64, 4 bits from 32, 8 bits from 16, or one group a row); 1-bit
    # g32 / g64 and 2-bit g32 the value-by-value one.
    monkeypatch.setattr(cpu_kernels, "lowbit_dequantize", lambda *a, **kw: pytest.fail("dequantized"))
    for m, k in ((1, 256), (130, 1000 if group_size is None else 768)):
        q = LowBitWeight.quantize(torch.randn(m, k, dtype=dtype), bits, group_size)
        w = lowbit_reference(q)
        bias = torch.randn(m, dtype=dtype)
        layer = spinfer.nn.SparseLinear(q, bias)
        for n in range(1, LOWBIT_CPU_DIRECT_MAX_N + 1):
            x = torch.randn(n, k, dtype=dtype)
            ref = float64_reference(x, w, bias)
            y = spinfer.lowbit_mm(x, q, bias)
            assert y.dtype == dtype and y.shape == (n, m)
            assert rel_err(y, ref) <= (1e-3 if dtype == torch.float16 else 8e-3)
            assert torch.equal(bits_of(layer(x)), bits_of(y))
            y32 = cpu_kernels.lowbit_spmm(x, q.qweight, q.scale_zero, q.bits, q.group_size, m, k)
            assert_float32_sum(y32, x, w)  # so the weight's values are the reference's


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits, group_size, k", [(4, 32, 256), (1, 32, 256), (4, None, 1001)])  # both unpacks
def test_a_nan_scale_spoils_its_rows_in_the_direct_kernel_as_in_the_reference(lib, bits, group_size, k, dtype):
    m = 70
    q = LowBitWeight.quantize(torch.randn(m, k, dtype=dtype), bits, group_size)
    scales = q.scales.clone()
    scales[5, -1] = float("nan")
    scales[9, 0] = float("inf")
    q = LowBitWeight(q.qweight, scales, q.zeros, bits, group_size, (m, k))
    x = torch.randn(2, k, dtype=dtype)
    y = cpu_kernels.lowbit_spmm(x, q.qweight, q.scale_zero, bits, q.group_size, m, k)
    ref = x.double() @ lowbit_reference(q).double().t()
    assert torch.equal(y.isnan(), ref.isnan()) and bool(y[:, 5].isnan().all())
    finite = ~ref.isnan()
    assert torch.equal(y[finite].isinf(), ref[finite].isinf())
    rows = [r for r in range(m) if r not in (5, 9)]
    assert_float32_sum(y[:, rows], x, lowbit_reference(q)[rows])


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_an_infinite_scale_gives_inf_not_nan_through_the_padding_columns(lib, bits):
    # One group a row over K = 1001: the words that straddle K are unpacked whole, and their
    # padding columns must be zeros, not (0 - zero) * inf = NaN (times x's zero padding: NaN).
    m, k = 64, 1001
    q = LowBitWeight.quantize(torch.rand(m, k, dtype=torch.float16) + 1, bits, None)  # zero 0, every q > 0
    scales = q.scales.clone()
    scales[3, 0] = float("inf")
    q = LowBitWeight(q.qweight, scales, q.zeros, bits, None, (m, k))
    x = torch.rand(2, k, dtype=torch.float16) + 0.5
    y = cpu_kernels.lowbit_spmm(x, q.qweight, q.scale_zero, bits, k, m, k)
    assert bool((y[:, 3] == float("inf")).all())
    rows = [r for r in range(m) if r != 3]
    assert_float32_sum(y[:, rows], x, lowbit_reference(q)[rows])


def test_the_low_bit_direct_kernel_takes_groups_the_layers_do_not(lib):
    # The C interface takes any group size that divides K: 8-bit groups of 16 hold whole words but
    # put 8 groups in a chunk, past the four-words-at-a-time unpack's 4 (one_group_per_word).
    from spinfer.quant.lowbit import pack, tile_scale_zero

    m, k = 70, 256
    for bits, g, frac in ((8, 16, 0.0), (8, 8, 0.0), (4, 16, 0.0), (2, 16, 0.0), (4, 16, 0.25)):
        q = torch.randint(0, 1 << bits, (m, k), dtype=torch.uint8)
        scale = (torch.rand(m, k // g) + 0.5).half()
        zero = (torch.randint(0, 1 << bits, (m, k // g)) + frac).half()  # 4-bit records, or (frac) the dtype's
        qweight = pack(q, bits)
        scale_zero = tile_scale_zero(torch.stack([scale, zero], -1), bits)
        assert scale_zero.shape[-1] == (80 if bits <= 4 and not frac else 128)
        w = ((q.float().reshape(m, k // g, g) - zero.float()[..., None]) * scale.float()[..., None]).reshape(m, k)
        x = torch.randn(3, k, dtype=torch.float16)
        y = cpu_kernels.lowbit_spmm(x, qweight, scale_zero, bits, g, m, k)
        assert_float32_sum(y, x, w.half())


def test_the_direct_kernels_refuse_x_of_another_dtype_or_shape(lib):
    q = LowBitWeight.quantize(torch.randn(70, 256, dtype=torch.float16), 4, 128)
    enc = TCABME.from_dense(random_sparse((70, 256), 0.5, torch.float16))
    calls = {
        "low-bit": lambda x: cpu_kernels.lowbit_spmm(x, q.qweight, q.scale_zero, 4, 128, 70, 256),
        "TCA-BME": lambda x: cpu_kernels.tca_bme_spmm(x, enc.bitmap, enc.values, enc.gtile_offset, 70, 256, (64, 64)),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match="x is torch.bfloat16, the weight torch.float16"):
            call(torch.randn(2, 256, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match=r"x must be \[N >= 1, 256\], got \(2, 255\)"):
            call(torch.randn(2, 255, dtype=torch.float16))
        x = torch.randn(256, 3, dtype=torch.float16).t()  # not contiguous: read as it is
        assert torch.equal(call(x), call(x.contiguous())), name


def test_the_low_bit_direct_kernel_takes_act_order(lib):
    m, k, g = 70, 512, 64
    q = LowBitWeight.quantize(torch.randn(m, k, dtype=torch.float16), 4, g)
    q2 = LowBitWeight(q.qweight, q.scales, q.zeros, 4, g, (m, k), torch.randperm(k))
    x = torch.randn(3, k, dtype=torch.float16)
    assert rel_err(spinfer.lowbit_mm(x, q2), float64_reference(x, lowbit_reference(q2))) <= 1e-3
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.lowbit_spmm(x, q.qweight, q.scale_zero, 4, g, m, 1024)


def test_lowbit_layers_and_ops_use_the_compiled_dequantizer(lib, monkeypatch):
    calls = []
    real = cpu_kernels.lowbit_dequantize

    def counting(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "lowbit_dequantize", counting)
    q = LowBitWeight.quantize(torch.randn(96, 256, dtype=torch.bfloat16), 4, 64)
    x = torch.randn(LOWBIT_CPU_DIRECT_MAX_N + 1, 256, dtype=torch.bfloat16)  # past the direct kernel's tokens
    ref = (x.float() @ lowbit_reference(q).float().t()).to(x.dtype)
    assert torch.equal(bits_of(spinfer.lowbit_mm(x, q)), bits_of(ref))
    layer = spinfer.nn.SparseLinear(q, None)
    assert layer.format == "lowbit"
    layer(x)
    assert calls == [4, 4]


def test_without_the_library_the_reference_dequantizes(monkeypatch):
    monkeypatch.setenv("SPINFER_CPU_KERNELS", "0")
    q = LowBitWeight.quantize(torch.randn(70, 256, dtype=torch.float16), 2, 64)
    assert cpu_kernels.lowbit_dequantize(q.qweight, q.scale_zero, 2, 64, 70, 256) is None
    assert torch.equal(bits_of(q.dequantize()), bits_of(lowbit_reference(q)))


@pytest.mark.parametrize("extensions", [(), ("ssse3", "popcnt", "f16c")], ids=["portable", "without-avx"])
def test_the_builds_without_x86_extensions_give_the_same_bits(lib, monkeypatch, tmp_path, extensions):
    # The scalar forms (no SSSE3 shuffle, no F16C conversion, no POPCNT): what a CPU without them,
    # or another architecture, runs; and the SSE forms without AVX's 8-wide sums.
    if not set(extensions) <= cpu_kernels._cpu_flags():
        pytest.skip(f"this CPU lacks one of {extensions}")
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_failure", None)
    monkeypatch.setattr(cpu_kernels, "flags", lambda: list(cpu_kernels.BASE_FLAGS) + [f"-m{e}" for e in extensions])
    monkeypatch.setenv("SPINFER_CACHE", str(tmp_path))
    portable = cpu_kernels.library()
    assert portable is not None and portable is not lib
    assert cpu_kernels.library_path(cpu_kernels.compiler()).is_relative_to(tmp_path)
    for dtype in (torch.float16, torch.bfloat16):
        w = random_sparse((300, 1450), 0.6, dtype)
        assert same_arrays(cpu_kernels.tca_bme_encode(w, (64, 64)), encode_reference(w))
        enc = TCABME.from_dense(w)
        assert torch.equal(bits_of(compiled(enc)), bits_of(w))
        x = torch.randn(3, 1450, dtype=dtype)
        y = cpu_kernels.tca_bme_spmm(x, enc.bitmap, enc.values, enc.gtile_offset, 300, 1450, (64, 64))
        assert_float32_sum(y, x, w)
        x = torch.randn(3, 1001, dtype=dtype)
        for bits in (1, 4, 8):
            q = LowBitWeight.quantize(torch.randn(70, 1001, dtype=dtype), bits, None)
            assert torch.equal(bits_of(lowbit_compiled(q)), bits_of(lowbit_reference(q)))
            y = cpu_kernels.lowbit_spmm(x, q.qweight, q.scale_zero, bits, 1001, 70, 1001)
            assert_float32_sum(y, x, lowbit_reference(q))
        x = torch.randn(5, 256, dtype=dtype)
        for bits, group_size in ((4, 32), (1, 32)):  # both unpacks of the direct kernel
            q = LowBitWeight.quantize(torch.randn(70, 256, dtype=dtype), bits, group_size)
            y = cpu_kernels.lowbit_spmm(x, q.qweight, q.scale_zero, bits, group_size, 70, 256)
            assert_float32_sum(y, x, lowbit_reference(q))


def test_encoder_refuses_runs_that_do_not_fit_their_offsets(lib):
    # (only a weight written between the two passes can do this through tca_bme_encode)
    w = random_sparse((128, 128), 0.5, torch.float16)
    bitmap, values, offsets = encode_reference(w)
    out = torch.full_like(values, 7.0)
    bad = offsets.clone()
    bad[2] = bad[1]  # GroupTile 1 gets an empty run
    rc = lib.spinfer_tca_bme_pack(w.data_ptr(), 128, 128, 64, 64, bad.data_ptr(), out.data_ptr(), out.numel(), 1)
    assert rc == 1
    rc = lib.spinfer_tca_bme_pack(w.data_ptr(), 128, 128, 64, 64, offsets.data_ptr(), out.data_ptr(),
                                  out.numel() - 1, 1)  # the values array one short
    assert rc == 1
    rc = lib.spinfer_tca_bme_pack(w.data_ptr(), 128, 128, 64, 64, offsets.data_ptr(), out.data_ptr(), out.numel(), 1)
    assert rc == 0 and torch.equal(bits(out), bits(values))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_more_tokens_multiply_band_by_band_in_float32(lib, monkeypatch, dtype):
    # Above the direct kernels' N the weight is decoded a band of rows at a time (CPU_BAND_BYTES of
    # float32 each) and multiplied in float32: here bands of 64 rows over 300, the last one short.
    import importlib

    linear_input = importlib.import_module("spinfer.ops.linear_input")
    spmm_ops, lowbit_ops = importlib.import_module("spinfer.ops.spmm"), importlib.import_module("spinfer.ops.lowbit_mm")
    m, k = 300, 512
    monkeypatch.setattr(linear_input, "CPU_BAND_BYTES", 64 * 4 * k)
    rows = []
    decode, dequantize_rows = spmm_ops.decode_on_cpu, lowbit_ops.dequantize_on_cpu
    monkeypatch.setattr(spmm_ops, "decode_on_cpu",
                        lambda b, v, o, mm, kk, gt: rows.append(mm) or decode(b, v, o, mm, kk, gt))
    monkeypatch.setattr(lowbit_ops, "dequantize_on_cpu",
                        lambda qw, sz, bits, g, mm, kk: rows.append(mm) or dequantize_rows(qw, sz, bits, g, mm, kk))
    tol = 1e-3 if dtype == torch.float16 else 8e-3
    bias = torch.randn(m, dtype=dtype)
    x = torch.randn(LOWBIT_CPU_DIRECT_MAX_N + 3, k, dtype=dtype)
    w = random_sparse((m, k), 0.6, dtype)
    y = spinfer.spmm(x, TCABME.from_dense(w), bias)
    assert rows == [64, 64, 64, 64, 44]
    assert y.dtype == dtype and y.is_contiguous() and y.shape == (x.shape[0], m)
    assert rel_err(y, float64_reference(x, w, bias)) <= tol
    rows.clear()
    q = LowBitWeight.quantize(torch.randn(m, k, dtype=dtype), 4, 128)
    q = LowBitWeight(q.qweight, q.scales, q.zeros, 4, 128, (m, k), torch.randperm(k))  # act-order
    y = spinfer.lowbit_mm(x, q, bias)
    assert rows == [64, 64, 64, 64, 44]
    assert y.dtype == dtype and y.is_contiguous() and y.shape == (x.shape[0], m)
    assert rel_err(y, float64_reference(x, lowbit_reference(q), bias)) <= tol
