"""Property test: random corruption of valid encodings only ever raises ValueError or
TypeError, and whatever still validates decodes and multiplies without other errors."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spinfer
from spinfer.format import TCABME


def corrupt(enc: TCABME, data) -> dict:
    parts = dict(bitmap=enc.bitmap.clone(), values=enc.values.clone(),
                 gtile_offset=enc.gtile_offset.clone(), shape=list(enc.shape),
                 group_tile=list(enc.group_tile))
    kind = data.draw(st.sampled_from(
        ["flip_bit", "set_word", "set_offset", "shift_offsets", "truncate_values",
         "extend_values", "dtype", "shape", "group_tile", "swap_arrays", "reshape"]))
    if kind == "flip_bit":
        i = data.draw(st.integers(0, parts["bitmap"].numel() - 1))
        b = data.draw(st.integers(0, 63))
        parts["bitmap"][i] ^= (1 << b) if b < 63 else -(1 << 63)
    elif kind == "set_word":
        i = data.draw(st.integers(0, parts["bitmap"].numel() - 1))
        parts["bitmap"][i] = data.draw(st.integers(-(2**63), 2**63 - 1))
    elif kind == "set_offset":
        i = data.draw(st.integers(0, parts["gtile_offset"].numel() - 1))
        parts["gtile_offset"][i] = data.draw(st.integers(-(2**31), 2**31 - 1))
    elif kind == "shift_offsets":
        parts["gtile_offset"] += data.draw(st.integers(-64, 64))
    elif kind == "truncate_values":
        n = parts["values"].numel()
        parts["values"] = parts["values"][: data.draw(st.integers(0, max(n - 1, 0)))]
    elif kind == "extend_values":
        parts["values"] = torch.cat([parts["values"], torch.ones(data.draw(st.integers(1, 16)),
                                                                 dtype=parts["values"].dtype)])
    elif kind == "dtype":
        name = data.draw(st.sampled_from(["bitmap", "values", "gtile_offset"]))
        parts[name] = parts[name].to(data.draw(st.sampled_from(
            [torch.int32, torch.int64, torch.float32, torch.float16, torch.uint8])))
    elif kind == "shape":
        parts["shape"][data.draw(st.integers(0, 1))] = data.draw(st.integers(-5, 300))
    elif kind == "group_tile":
        parts["group_tile"][data.draw(st.integers(0, 1))] = data.draw(st.integers(-16, 256))
    elif kind == "swap_arrays":
        parts["bitmap"], parts["gtile_offset"] = parts["gtile_offset"], parts["bitmap"]
    elif kind == "reshape":
        parts["bitmap"] = parts["bitmap"].reshape(1, -1)
    return parts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), m=st.integers(1, 140), k=st.integers(1, 140),
       sparsity=st.sampled_from([0.0, 0.5, 0.9, 1.0]), via=st.sampled_from(["init", "state_dict"]),
       seed=st.integers(0, 2**32 - 1))
def test_corruption_only_raises_value_or_type_errors(data, m, k, sparsity, via, seed):
    gen = torch.Generator().manual_seed(seed)  # hypothesis must be able to replay the matrix
    w = torch.randn(m, k, generator=gen).half()
    w[torch.rand(m, k, generator=gen) < sparsity] = 0
    parts = corrupt(TCABME.from_dense(w), data)
    try:
        if via == "init":
            enc = TCABME(**parts)
        else:
            meta = torch.tensor([1, *parts["shape"], *parts["group_tile"]])
            enc = TCABME.from_state_dict({"bitmap": parts["bitmap"], "values": parts["values"],
                                          "gtile_offset": parts["gtile_offset"], "meta": meta})
    except (ValueError, TypeError):
        return
    dense = enc.to_dense()  # a corruption that still validates is a different valid matrix
    assert dense.shape == enc.shape
    x = torch.randn(3, enc.shape[1]).to(enc.dtype)
    y = spinfer.spmm(x, enc)
    assert y.shape == (3, enc.shape[0])
