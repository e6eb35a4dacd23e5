"""Pins the TCA-BME bit order to the mma.m16n8k16 A-fragment layout: decoding a TCTile with
PopCount / masked PopCount, lane by lane, must give every lane exactly the registers the PTX
layout assigns it."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from spinfer.format import TCABME
from spinfer.format.bits import popcount_int
from spinfer.format.smbd import mma_a_fragment, prmt, smbd_fragment, smbd_fragment_prmt

HEADER = Path(__file__).resolve().parents[1] / "spinfer" / "csrc" / "spmm_smbd.cuh"


def pair_selector():
    """The kernel's selector constants (index multiplier, index offset, table), read from their
    one definition in the CUDA header."""
    text = HEADER.read_text()
    return tuple(int(re.search(rf"constexpr uint32_t {name} = (0x[0-9a-fA-F]+)u;", text).group(1), 16)
                 for name in ("kSelMul", "kSelAdd", "kSelTable"))


def tctiles_of(dense16):
    """Encode a 16x16 tile; return its 4 words and its packed values."""
    enc = TCABME.from_dense(torch.from_numpy(dense16), group_tile=(16, 16))
    words = enc.bitmap.tolist()
    n = sum(popcount_int(w) for w in words)
    return words, enc.values[:n].numpy()


def check(dense16):
    """Both emulations (the offsets, and the kernel's word arithmetic with its selector
    constants) give every lane the registers the PTX layout assigns it."""
    words, values = tctiles_of(dense16)
    want = mma_a_fragment(dense16).view(np.int16)
    np.testing.assert_array_equal(smbd_fragment(words, values).view(np.int16), want)
    np.testing.assert_array_equal(smbd_fragment_prmt(words, values, *pair_selector()).view(np.int16), want)


def random_tile(density, rng):
    t = rng.standard_normal((16, 16)).astype(np.float16)
    t[t == 0] = 1
    t[rng.random((16, 16)) >= density] = 0
    return t


@pytest.mark.parametrize("density", [0.05, 0.3, 0.5, 0.7, 0.95])
def test_random_tctiles(density):
    rng = np.random.default_rng()
    for _ in range(20):
        check(random_tile(density, rng))


def test_empty_and_full_tctiles():
    rng = np.random.default_rng()
    check(np.zeros((16, 16), np.float16))
    check(random_tile(1.0, rng))


@pytest.mark.parametrize("r", range(16))
def test_every_single_bit(r):
    for c in range(16):
        t = np.zeros((16, 16), np.float16)
        t[r, c] = 1 + r * 16 + c
        check(t)


def test_one_dense_row_and_column():
    rng = np.random.default_rng()
    t = np.zeros((16, 16), np.float16)
    t[5] = rng.standard_normal(16) + 10
    check(t)
    t = np.zeros((16, 16), np.float16)
    t[:, 11] = rng.standard_normal(16) + 10
    check(t)


def test_tctiles_inside_a_group_tile():
    """Every TCTile of a 64x64 GroupTile decodes from its slice of the GroupTile's run,
    starting at the PopCount of all preceding words (what each warp computes)."""
    rng = np.random.default_rng()
    dense = rng.standard_normal((64, 64)).astype(np.float16)
    dense[rng.random((64, 64)) < 0.5] = 0
    enc = TCABME.from_dense(torch.from_numpy(dense))
    words, values = enc.bitmap.tolist(), enc.values.numpy()
    for t in range(16):
        tr, tc = divmod(t, 4)
        start = sum(popcount_int(w) for w in words[: 4 * t])
        frag = smbd_fragment(words[4 * t: 4 * t + 4], values[start:])
        tile = dense[16 * tr: 16 * tr + 16, 16 * tc: 16 * tc + 16]
        np.testing.assert_array_equal(frag.view(np.int16), mma_a_fragment(tile).view(np.int16))


def test_prmt_emulation_follows_the_ptx_definition():
    assert prmt(0x33221100, 0x77665544, 0x3210) == 0x33221100
    assert prmt(0x33221100, 0x77665544, 0x5410) == 0x55441100
    assert prmt(0x000000F0, 0, 0x4448) == 0x000000FF  # bit 3: replicate the byte's sign
    assert prmt(0x00000070, 0, 0x4448) == 0x00000000


def test_a_wrong_selector_table_is_caught():
    """The check of the kernel's arithmetic can fail: with one table byte changed (byte 6, the
    selector of u1 for a pair whose first bit alone is set) a half-dense tile decodes wrongly."""
    mul, add, table = pair_selector()
    tile = random_tile(0.5, np.random.default_rng())
    words, values = tctiles_of(tile)
    bad = smbd_fragment_prmt(words, values, mul, add, table ^ 0x00FF0000)
    assert not np.array_equal(bad.view(np.int16), mma_a_fragment(tile).view(np.int16))
