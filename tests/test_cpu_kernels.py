"""The compiled CPU decoder (spinfer/cpu_kernels.py, csrc/cpu/decode.cpp) against the torch-op
reference decoder, bit for bit; its checks; and the fallback to the reference."""

import warnings

import pytest
import torch

import spinfer
from spinfer import cpu_kernels
from spinfer.format import TCABME
from spinfer.format.tca_bme import decode, encode

from .test_tca_bme import bits, random_sparse


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


@pytest.mark.parametrize("pattern", ["one_dense_group_tile", "empty_rows", "dense_first_column", "one_dense_row",
                                     "checkerboard"])
def test_decoder_on_adversarial_patterns(lib, pattern):
    w = random_sparse((257, 200), 0.0, torch.bfloat16)
    mask = torch.zeros(w.shape, dtype=torch.bool)
    if pattern == "one_dense_group_tile":
        mask[64:128, 128:192] = True
    elif pattern == "empty_rows":
        mask[:] = True
        mask[10:90] = False
        mask[256] = False
    elif pattern == "dense_first_column":
        mask[:, 0] = True
    elif pattern == "one_dense_row":
        mask[130] = True
    else:
        mask[::2, ::2] = True
        mask[1::2, 1::2] = True
    w = torch.where(mask, w, torch.zeros_like(w))
    enc = TCABME.from_dense(w)
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
    x = torch.randn(3, 160, dtype=torch.float16)
    assert torch.equal(bits(enc.to_dense()), bits(w))
    y = spinfer.spmm(x, enc)
    ref = (x.float() @ w.float().t()).to(x.dtype)
    assert torch.equal(bits(y), bits(ref))  # decode + the same fp32 product: the same bits
    for policy in ("auto", "sparse"):  # decode + F.linear, and the op
        layer = spinfer.nn.SparseLinear(enc, None, policy=policy)
        assert layer.format == "tca-bme"
        layer(x)
    assert calls == [(96, 160)] * 4


def test_without_the_library_the_reference_decodes(monkeypatch):
    monkeypatch.setenv("SPINFER_CPU_KERNELS", "0")
    assert cpu_kernels.library() is None
    assert "SPINFER_CPU_KERNELS=0" in cpu_kernels.unavailable_reason()
    w = random_sparse((70, 90), 0.5, torch.bfloat16)
    enc = TCABME.from_dense(w)
    assert torch.equal(bits(enc.to_dense()), bits(w))
    x = torch.randn(2, 90, dtype=torch.bfloat16)
    assert torch.equal(bits(spinfer.spmm(x, enc)), bits((x.float() @ w.float().t()).to(x.dtype)))


def test_a_failing_compiler_warns_once_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_failure", None)
    monkeypatch.setenv("SPINFER_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.warns(RuntimeWarning, match="CPU decoder is unavailable.*failed on decode.cpp"):
        assert cpu_kernels.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call says nothing
        assert cpu_kernels.library() is None
    assert "failed on decode.cpp" in cpu_kernels.unavailable_reason()
    w = random_sparse((40, 50), 0.5, torch.float16)
    assert torch.equal(bits(TCABME.from_dense(w).to_dense()), bits(w))
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))


def test_the_library_is_built_once_per_source_and_flags(lib, monkeypatch, tmp_path):
    path = cpu_kernels.library_path(cpu_kernels.compiler())
    assert path.exists() and path.parent.name.startswith("cpu-")
    assert "-O3" in cpu_kernels.flags()
    monkeypatch.setattr(cpu_kernels, "BASE_FLAGS", cpu_kernels.BASE_FLAGS + ["-DSPINFER_TEST_FLAG"])
    assert cpu_kernels.library_path(cpu_kernels.compiler()) != path
