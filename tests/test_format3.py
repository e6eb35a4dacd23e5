"""Checkpoints saved in low-bit format 3 (before the sixty-eighth session's format 4) load: the
qweight is the same in both, and format 3's (scale, zero) pairs in 64-row tiles become records.
The files in tests/data were written by spinfer at 520849e (tests/data/make_format3.py)."""

import os

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

import spinfer
from spinfer.nn import SparseLinear
from spinfer.quant import LowBitWeight
from spinfer.quant.lowbit import (
    RECORD_DTYPE_ZEROS,
    RECORD_NIBBLE_ZEROS,
    records_from_format3,
)
from tests.conftest import rel_err

DATA = os.path.join(os.path.dirname(__file__), "data")


def _state(name):
    saved = load_file(os.path.join(DATA, "format3-lowbit.safetensors"))
    return {k.split(".", 1)[1]: v for k, v in saved.items() if k.startswith(name + ".")}


@pytest.mark.parametrize("name, records", [("w4g128", RECORD_NIBBLE_ZEROS), ("w2g64", RECORD_NIBBLE_ZEROS),
                                           ("w8", RECORD_DTYPE_ZEROS), ("hqq", RECORD_DTYPE_ZEROS)])
def test_lowbit_weight_of_format3_loads_the_same_weight(name, records):
    state = _state(name)
    expected = state.pop("expected")
    assert state["meta"][0] == 3 and state["scale_zero"].dim() == 4
    q = LowBitWeight.from_state_dict(state)
    assert q.scale_zero.shape[-1] == records  # 4-bit integer zeros where they fit, as a fresh quantization
    assert q.dequantize().dtype == expected.dtype and torch.equal(q.dequantize(), expected)
    again = LowBitWeight.from_state_dict(q.state_dict())  # saved again: format 4
    assert q.state_dict()["meta"][0] == 4 and torch.equal(again.dequantize(), expected)


def test_sparse_linear_saved_in_format3_loads_and_gives_its_outputs():
    io = load_file(os.path.join(DATA, "format3-model-io.safetensors"))
    model = spinfer.load(nn.Sequential(nn.Linear(256, 70).half()), os.path.join(DATA, "format3-model.safetensors"))
    layer = model[0]
    assert isinstance(layer, SparseLinear) and layer.format == "lowbit"
    assert layer.scale_zero.shape == (2, 2, RECORD_NIBBLE_ZEROS)
    assert rel_err(model(io["x"]), io["y"]) <= 1e-3  # (the CPU kernel's sums may be ordered otherwise now)
    with torch.device("meta"):  # (no dense weight allocated: load assigns the file's tensors)
        skeleton = nn.Sequential(nn.Linear(256, 70).half())
    assigned = spinfer.load(skeleton, os.path.join(DATA, "format3-model.safetensors"))
    assert assigned[0].scale_zero.shape == (2, 2, RECORD_NIBBLE_ZEROS)
    assert torch.equal(assigned(io["x"]), model(io["x"]))
    # load_state_dict into a layer built now (format 4 records) takes it too, in either dtype
    state = load_file(os.path.join(DATA, "format3-model.safetensors"))
    state = {k.split(".", 1)[1]: v for k, v in state.items()}
    fresh = SparseLinear.from_linear(nn.Linear(256, 70).half(), quant="w4", policy="lowbit")
    fresh.load_state_dict(state)
    assert rel_err(fresh(io["x"]), io["y"]) <= 1e-3
    bf = SparseLinear.from_linear(nn.Linear(256, 70).bfloat16(), quant="w4", policy="lowbit")
    bf.load_state_dict(state)
    assert bf.scale_zero.dtype == torch.bfloat16
    ref = layer.weight_object()
    got = bf.weight_object()
    assert torch.equal(got.zeros.float(), ref.zeros.float()) and torch.equal(got.scales, ref.scales.bfloat16())


def test_records_of_another_dtype_load_with_their_zeros():
    """4-bit zeros are bits inside the records; the cast load_state_dict makes into a layer of the
    other dtype would have converted them as numbers (a bf16 layer loading an fp16 state read wrong
    zeros before the layer rebuilt the records)."""
    torch.manual_seed(0)
    for src, dst in ((torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)):
        a = SparseLinear.from_linear(nn.Linear(256, 70).to(src), quant="w4", policy="lowbit")
        b = SparseLinear.from_linear(nn.Linear(256, 70).to(dst), quant="w4", policy="lowbit")
        b.load_state_dict(a.state_dict())
        wa, wb = a.weight_object(), b.weight_object()
        assert b.scale_zero.dtype == dst and b.scale_zero.shape[-1] == RECORD_NIBBLE_ZEROS
        assert torch.equal(wa.zeros.float(), wb.zeros.float()) and torch.equal(wb.scales, wa.scales.to(dst))
        assert torch.equal(wb.qweight, wa.qweight)
        # with assign=True the layer takes the incoming tensors as they are, records and bias alike
        c = SparseLinear.from_linear(nn.Linear(256, 70).to(dst), quant="w4", policy="lowbit")
        c.load_state_dict(a.state_dict(), assign=True)
        assert c.scale_zero.dtype == c.bias.dtype == src and c.weight_dtype == src
        x = torch.randn(2, 256).to(src)
        assert torch.equal(c(x), a(x))


def test_format3_errors_name_the_problem():
    state = _state("w4g128")
    bad = dict(state, scale_zero=state["scale_zero"][:1])  # a tile short
    with pytest.raises(ValueError, match="format 3 scale_zero of 70 rows has 2 tiles, got 1"):
        LowBitWeight.from_state_dict(bad)
    bad = dict(state, scale_zero=state["scale_zero"][..., :1])
    with pytest.raises(ValueError, match=r"format 3 scale_zero is \[Mp/64, K/group_size, 64, 2\]"):
        LowBitWeight.from_state_dict(bad)
    with pytest.raises(ValueError, match="format 3 scale_zero is"):
        records_from_format3([1, 2], 70, 4)
    for version in (2, 5):
        meta = state["meta"].clone()
        meta[0] = version
        with pytest.raises(ValueError, match=f"format version {version} is not supported \\(this version reads 3, 4\\)"):
            LowBitWeight.from_state_dict(dict(state, meta=meta))
