"""Bad input to the encoder and malformed encoded arrays raise ValueError/TypeError that
name the problem."""

import pytest
import torch

from spinfer.format import TCABME
from tests.test_tca_bme import random_sparse


def encoded(shape=(100, 130), sparsity=0.5):
    return TCABME.from_dense(random_sparse(shape, sparsity, torch.float16))


@pytest.mark.parametrize(
    "weight, error, words",
    [
        (torch.ones(8, dtype=torch.float16), ValueError, "2-D"),
        (torch.ones(2, 3, 4, dtype=torch.float16), ValueError, "2-D"),
        (torch.ones(8, 8), TypeError, "float32"),
        (torch.ones(8, 8, dtype=torch.int32), TypeError, "torch.int32"),
        (torch.ones(0, 8, dtype=torch.float16), ValueError, "empty"),
        (torch.ones(8, 0, dtype=torch.float16), ValueError, "empty"),
        ([[1.0]], TypeError, "torch.Tensor"),
        (torch.ones(8, 8, dtype=torch.float16, device="meta"), ValueError, "meta device"),
    ],
)
def test_from_dense_rejects(weight, error, words):
    with pytest.raises(error, match=words):
        TCABME.from_dense(weight)


@pytest.mark.parametrize("gt", [(8, 64), (64, 0), (48, 20), "64"])
def test_bad_group_tile(gt):
    with pytest.raises(ValueError, match="group_tile"):
        TCABME.from_dense(torch.ones(8, 8, dtype=torch.float16), group_tile=gt)


def rebuild(enc, **over):
    parts = dict(bitmap=enc.bitmap, values=enc.values, gtile_offset=enc.gtile_offset,
                 shape=enc.shape, group_tile=enc.group_tile)
    parts.update(over)
    return TCABME(**parts)


def test_non_monotone_offsets():
    enc = encoded()
    off = enc.gtile_offset.clone()
    off[1], off[2] = int(off[2]), int(off[1])  # ints: tensor elements are views
    with pytest.raises(ValueError, match="monotone"):
        rebuild(enc, gtile_offset=off)


def test_offsets_out_of_range():
    enc = encoded()
    off = enc.gtile_offset.clone()
    off[-1] += 8
    with pytest.raises(ValueError, match="values has"):
        rebuild(enc, gtile_offset=off)
    off = enc.gtile_offset.clone()
    off[0] = -8
    with pytest.raises(ValueError, match=r"gtile_offset\[0\]"):
        rebuild(enc, gtile_offset=off)


def test_misaligned_offset():
    enc = encoded()
    off = enc.gtile_offset.clone()
    off[1] += 1
    with pytest.raises(ValueError, match="multiple of 8"):
        rebuild(enc, gtile_offset=off)


def test_popcount_disagrees_with_run():
    enc = encoded(sparsity=0.0)  # full GroupTiles: runs have no padding slack
    bm = enc.bitmap.clone()
    bm[0] = 0  # drop 64 nonzeros from GroupTile 0
    with pytest.raises(ValueError, match="GroupTile 0"):
        rebuild(enc, bitmap=bm)


@pytest.mark.parametrize("word, bit", [(3 * 64 + 49, 0), (2 * 64 + 0, 5)])
def test_bits_in_the_padding_region(word, bit):
    # 100x130 pads to 128x192: a 2x3 GroupTile grid.  One nonzero in GroupTiles 2 and 3 each
    # leaves slack in their 8-element runs, so a set padding bit keeps the run lengths valid
    # and only the boundary check can catch it.
    w = torch.zeros(100, 130, dtype=torch.float16)
    w[70, 5], w[0, 128] = 1.0, 2.0
    enc = TCABME.from_dense(w)
    bm = enc.bitmap.clone()
    # word 3*64+49: GroupTile 3, TCTile 12, bottom-left tile -> global row 120 (>= 100);
    # word 2*64+0: GroupTile 2, top-left tile, bit 5 -> global column 133 (>= 130).
    bm[word] |= 1 << bit
    with pytest.raises(ValueError, match="outside the logical"):
        rebuild(enc, bitmap=bm)


@pytest.mark.parametrize(
    "field, bad, error, words",
    [
        ("bitmap", lambda e: e.bitmap[:-1], ValueError, "words"),
        ("bitmap", lambda e: e.bitmap.to(torch.int32), TypeError, "int64"),
        ("bitmap", lambda e: e.bitmap.reshape(1, -1), ValueError, "1-D"),
        ("values", lambda e: e.values.float(), TypeError, "float16 or torch.bfloat16"),
        ("values", lambda e: e.values[:-8], ValueError, "values has"),
        ("gtile_offset", lambda e: e.gtile_offset.long(), TypeError, "int32"),
        ("gtile_offset", lambda e: e.gtile_offset[:-1], ValueError, "NGT"),
        ("values", lambda e: e.values.to("meta"), ValueError, "different devices"),
        ("shape", lambda e: (0, 5), ValueError, "at least 1x1"),
        ("shape", lambda e: (1, 2, 3), ValueError, "pair"),
        ("values", lambda e: e.values.tolist(), TypeError, "torch.Tensor"),
    ],
)
def test_malformed_arrays(field, bad, error, words):
    enc = encoded()
    with pytest.raises(error, match=words):
        rebuild(enc, **{field: bad(enc)})


def test_state_dict_errors():
    enc = encoded()
    sd = enc.state_dict()
    with pytest.raises(ValueError, match="missing"):
        TCABME.from_state_dict({k: v for k, v in sd.items() if k != "values"})
    sd2 = dict(sd, meta=torch.tensor([99, 100, 130, 64, 64]))
    with pytest.raises(ValueError, match="version"):
        TCABME.from_state_dict(sd2)
    sd3 = dict(sd, meta=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="meta"):
        TCABME.from_state_dict(sd3)


def test_load_validates(tmp_path):
    from safetensors.torch import save_file

    enc = encoded()
    off = enc.gtile_offset.clone()
    off[1] += 8  # a crafted file: run lengths no longer match the bitmaps
    path = tmp_path / "bad.safetensors"
    save_file({"bitmap": enc.bitmap, "values": enc.values, "gtile_offset": off},
              str(path), metadata={"format": "tca-bme", "version": "1",
                                   "shape": "[100, 130]", "group_tile": "[64, 64]"})
    with pytest.raises(ValueError):
        TCABME.load(path)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")
    with pytest.raises(ValueError, match="safetensors"):
        TCABME.load(junk)
    other = tmp_path / "other.safetensors"
    save_file({"a": torch.ones(2)}, str(other))
    with pytest.raises(ValueError, match="not a TCA-BME file"):
        TCABME.load(other)
