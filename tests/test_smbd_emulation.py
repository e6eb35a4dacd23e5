"""Pins the TCA-BME bit order to the mma.m16n8k16 A-fragment layout: decoding a TCTile with
PopCount / masked PopCount, lane by lane, must give every lane exactly the registers the PTX
layout assigns it."""

import numpy as np
import pytest
import torch

from spinfer.format import TCABME
from spinfer.format.bits import popcount_int
from spinfer.format.smbd import mma_a_fragment, smbd_fragment


def tctiles_of(dense16):
    """Encode a 16x16 tile; return its 4 words and its packed values."""
    enc = TCABME.from_dense(torch.from_numpy(dense16), group_tile=(16, 16))
    words = enc.bitmap.tolist()
    n = sum(popcount_int(w) for w in words)
    return words, enc.values[:n].numpy()


def check(dense16):
    words, values = tctiles_of(dense16)
    np.testing.assert_array_equal(
        smbd_fragment(words, values).view(np.int16), mma_a_fragment(dense16).view(np.int16)
    )


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
