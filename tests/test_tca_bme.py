"""TCA-BME encoder/decoder: exact round trip, layout, storage accounting, persistence."""

import math

import pytest
import torch

from spinfer.format import TCABME, VALUE_ALIGN, Geometry

DTYPES = [torch.float16, torch.bfloat16]


def random_sparse(shape, sparsity, dtype, device="cpu"):
    """Fresh random weights (never zeros) with about ``sparsity`` of them set to +0.0."""
    w = torch.randn(shape, device=device).to(dtype)
    w[w.view(torch.int16) == 0] = 1.0  # no accidental zeros: the pattern is the mask
    w[torch.rand(shape, device=device) < sparsity] = 0.0
    return w


def bits(t):
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (63, 65), (4097, 1000)])
@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.9, 0.999, 1.0])
def test_round_trip_is_bit_exact(shape, sparsity, dtype):
    w = random_sparse(shape, sparsity, dtype)
    enc = TCABME.from_dense(w)
    enc.validate()
    assert enc.shape == shape
    assert torch.equal(bits(enc.to_dense()), bits(w))
    assert enc.nnz == int((bits(w) != 0).sum())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_popcount_counts_every_bit_pattern(device):
    # The SWAR count against Python's, on random words of every sign and the extremes (the sign
    # bit is counted apart so that nothing overflows int64).
    from spinfer.format.bits import popcount64, popcount_int

    edges = [0, -1, 1, -(2**63), 2**63 - 1, 0x5555_5555_5555_5555, -0x5555_5555_5555_5556, (0xFF << 56) - 2**64]
    words = torch.cat([torch.tensor(edges, dtype=torch.int64),
                       torch.randint(-(2**63), 2**63 - 1, (4000,), dtype=torch.int64)])
    expected = torch.tensor([popcount_int(int(v)) for v in words], dtype=torch.int64)
    got = popcount64(words.to(device).reshape(8, -1))
    assert got.dtype == torch.int64 and got.shape == (8, words.numel() // 8)
    assert torch.equal(got.cpu().reshape(-1), expected)
    with pytest.raises(TypeError, match="int64"):
        popcount64(words.int())


@pytest.mark.parametrize("group_tile", [(16, 16), (32, 128), (128, 64)])
def test_round_trip_other_group_tiles(group_tile):
    w = random_sparse((200, 300), 0.6, torch.float16)
    enc = TCABME.from_dense(w, group_tile=group_tile)
    assert enc.group_tile == group_tile
    assert torch.equal(bits(enc.to_dense()), bits(w))


def test_negative_zero_nan_and_inf_survive():
    w = random_sparse((70, 90), 0.5, torch.float16)
    w[3, 4], w[10, 80], w[69, 0], w[0, 89] = -0.0, float("nan"), float("inf"), float("-inf")
    enc = TCABME.from_dense(w)
    assert torch.equal(bits(enc.to_dense()), bits(w))


def test_bit_positions_follow_the_spec():
    # One nonzero at a time; DESIGN.md §2 says where its bit must land.
    w = torch.zeros(128, 128, dtype=torch.float16)
    cases = {
        (0, 0): (0, 0),  # GroupTile 0, TCTile 0, TL tile, bit 0
        (9, 3): (1, 1 * 8 + 3),  # bottom-left BitmapTile is the 2nd word of the TCTile
        (2, 12): (2, 2 * 8 + 4),  # top-right is the 3rd
        (15, 15): (3, 7 * 8 + 7),  # bottom-right the 4th
        (0, 16): (4, 0),  # TCTile 1 (TCTiles row-major in the GroupTile)
        (16, 0): (16, 0),  # TCTile 4: second TCTile row of a 64-wide GroupTile
        (0, 64): (64, 0),  # GroupTile 1 (GroupTiles row-major): 64 words per GroupTile
        (64, 0): (128, 0),  # GroupTile 2 starts the second GroupTile row
    }
    for (r, c), (word, bit) in cases.items():
        w.zero_()
        w[r, c] = 1.5
        enc = TCABME.from_dense(w)
        nz = torch.nonzero(enc.bitmap).squeeze(1).tolist()
        assert nz == [word], (r, c, nz)
        assert (int(enc.bitmap[word]) & 0xFFFF_FFFF_FFFF_FFFF) == 1 << bit, (r, c)
        g = word // 64
        assert enc.values[int(enc.gtile_offset[g])] == 1.5


def test_values_follow_nested_order_and_runs_are_aligned():
    w = torch.zeros(16, 32, dtype=torch.float16)
    w[0, 1], w[8, 0], w[0, 9], w[1, 0], w[0, 16] = 1, 2, 3, 4, 5
    enc = TCABME.from_dense(w, group_tile=(16, 16))
    # GroupTile 0: TL tile (0,1)=1 then (1,0)=4; BL tile (8,0)=2; TR tile (0,9)=3; padded to 8.
    assert enc.values[:8].tolist() == [1, 4, 2, 3, 0, 0, 0, 0]
    assert enc.values[8:16].tolist() == [5, 0, 0, 0, 0, 0, 0, 0]
    assert enc.gtile_offset.tolist() == [0, 8, 16]
    assert bool((enc.gtile_offset % VALUE_ALIGN == 0).all())


@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 333)])
def test_storage_is_eq9_plus_padding(shape):
    w = random_sparse(shape, 0.5, torch.float16)
    enc = TCABME.from_dense(w)
    st = enc.storage_bytes()
    geom = Geometry(*shape, 64, 64)
    ngt, nbt, nnz = geom.num_group_tiles, geom.num_bitmap_tiles, int((bits(w) != 0).sum())
    assert st.eq9 == 4 * (ngt + 1) + 8 * nbt + 2 * nnz
    # ... and against the arrays' real sizes.
    assert st.offsets == enc.gtile_offset.numel() * enc.gtile_offset.element_size()
    assert st.bitmap == enc.bitmap.numel() * enc.bitmap.element_size()
    assert st.values + st.padding == enc.values.numel() * enc.values.element_size()
    assert 0 <= st.padding < 2 * VALUE_ALIGN * ngt
    assert st.total == st.eq9 + st.padding
    assert enc.compression_ratio == pytest.approx(2 * shape[0] * shape[1] / st.total)


def test_compression_ratio_at_half_sparsity_matches_the_ideal():
    w = random_sparse((4096, 4096), 0.5, torch.float16)
    enc = TCABME.from_dense(w)
    ideal = 2 / (1 + 1 / 8)
    assert abs(enc.compression_ratio - ideal) / ideal < 0.02
    assert enc.sparsity == pytest.approx(0.5, abs=0.01)


def test_state_dict_round_trip():
    w = random_sparse((130, 70), 0.7, torch.bfloat16)
    enc = TCABME.from_dense(w, group_tile=(32, 64))
    back = TCABME.from_state_dict(enc.state_dict())
    assert back.shape == enc.shape and back.group_tile == enc.group_tile
    assert torch.equal(bits(back.to_dense()), bits(w))


def test_save_load_round_trip(tmp_path):
    w = random_sparse((257, 129), 0.5, torch.float16)
    enc = TCABME.from_dense(w)
    path = tmp_path / "w.safetensors"
    enc.save(path)
    back = TCABME.load(path)
    assert torch.equal(bits(back.to_dense()), bits(w))
    assert back.storage_bytes() == enc.storage_bytes()


def test_to_keeps_arrays():
    w = random_sparse((64, 64), 0.5, torch.float16)
    enc = TCABME.from_dense(w)
    moved = enc.to("cpu")
    assert torch.equal(moved.bitmap, enc.bitmap) and moved.nnz == enc.nnz
    assert "TCABME(shape=(64, 64)" in repr(enc)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_encoding_gives_the_same_arrays(dtype):
    w = random_sparse((300, 500), 0.6, dtype)
    cpu = TCABME.from_dense(w)
    gpu = TCABME.from_dense(w.cuda())
    assert gpu.device.type == "cuda"
    for a, b in ((cpu.bitmap, gpu.bitmap), (cpu.gtile_offset, gpu.gtile_offset)):
        assert torch.equal(a, b.cpu())
    assert torch.equal(bits(cpu.values), bits(gpu.values.cpu()))
    assert torch.equal(bits(gpu.to_dense().cpu()), bits(w))
    gpu.validate()
    assert math.isclose(cpu.compression_ratio, gpu.compression_ratio)


@pytest.mark.parametrize("group_tile", [(64, 64), (128, 64)])
def test_row_table_counts_the_rows_above(group_tile):
    """TCABME.row_offset: for every GroupTile, the stored elements of its TCTile rows above each
    row, counted here from the dense pattern; made on construction, moved with the weight, not
    saved, and rebuilt on load."""
    w = random_sparse((300, 200), 0.6, torch.float16)
    w[5, :] = torch.randn(200).half()  # a dense row
    enc = TCABME.from_dense(w, group_tile)
    gt_h, gt_w = group_tile
    mp, kp = enc.geometry.padded_shape
    stored = torch.nn.functional.pad(w, (0, kp - 200, 0, mp - 300)).view(torch.int16) != 0
    per_row = stored.reshape(mp // gt_h, gt_h // 16, 16, kp // gt_w, gt_w).sum((2, 4))  # [gm, rows, gk]
    want = (per_row.cumsum(1) - per_row).permute(0, 2, 1).reshape(-1, gt_h // 16)
    assert enc.row_offset.dtype == torch.int16 and torch.equal(enc.row_offset.long(), want)
    assert torch.equal(enc.to("cpu").row_offset, enc.row_offset)
    assert "row_offset" not in enc.state_dict()
    assert torch.equal(TCABME.from_state_dict(enc.state_dict()).row_offset, enc.row_offset)
    args = (enc.bitmap, enc.values, enc.gtile_offset, (300, 200), group_tile)
    assert TCABME(*args, row_offset=enc.row_offset).row_offset is enc.row_offset  # a kept table is taken as is
    with pytest.raises(TypeError, match="int16"):
        TCABME(*args, row_offset=enc.row_offset.int())
    with pytest.raises(ValueError, match="shape"):
        TCABME(*args, row_offset=enc.row_offset[1:])


def test_row_table_widens_where_int16_overflows():
    """A dense 256x256 GroupTile has 61440 elements above its last TCTile row, past int16: the
    table is int32 there (int16 would have wrapped negative), and a kept table must match."""
    w = torch.randn(256, 512).half()  # dense: every row of a GroupTile full
    enc = TCABME.from_dense(w, (256, 256))
    assert enc.row_offset.dtype == torch.int32
    assert torch.equal(enc.row_offset, (torch.arange(16) * 16 * 256).int().expand(2, 16))
    args = (enc.bitmap, enc.values, enc.gtile_offset, (256, 512), (256, 256))
    with pytest.raises(TypeError, match="int32"):
        TCABME(*args, row_offset=enc.row_offset.to(torch.int16))
