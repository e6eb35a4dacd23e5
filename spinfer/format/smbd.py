"""Lane-exact CPU emulation of Shared-Memory Bitmap Decoding (SMBD).

The CUDA kernel turns one TCTile (4 BitmapTile words + its packed values) into the
mma.m16n8k16 A fragment of each of the 32 lanes using only PopCount and masked PopCount.
This module does the same arithmetic in Python, lane by lane, so tests can pin the bit
order against the PTX fragment layout before (and independently of) any CUDA code.

A-fragment layout of mma.m16n8k16 (.row, 16-bit types; PTX ISA "Matrix Fragments for
mma.m16n8k16"): lane ``l`` has groupID ``g = l // 4`` and ``t = l % 4``; register
``Ra{j}`` holds two 16-bit elements:

    Ra0: (row g,     cols 2t, 2t+1)        Ra1: (row g + 8, cols 2t, 2t+1)
    Ra2: (row g,     cols 2t+8, 2t+9)      Ra3: (row g + 8, cols 2t+8, 2t+9)

so ``Ra{j}`` reads BitmapTile ``j`` in column-major order (TL, BL, TR, BR), and within it
row ``g``, columns ``2t`` and ``2t+1``: bits ``2l`` and ``2l+1`` of that BitmapTile's word.
"""

from __future__ import annotations

import numpy as np

from .bits import popcount_int

LANES = 32


def mma_a_fragment(tile: np.ndarray) -> np.ndarray:
    """Reference: registers of each lane for a dense 16x16 A tile, straight from the PTX
    layout table.  Returns ``[32 lanes, 4 registers, 2 halves]``."""
    if tile.shape != (16, 16):
        raise ValueError(f"a TCTile is 16x16, got {tile.shape}")
    frag = np.zeros((LANES, 4, 2), dtype=tile.dtype)
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        for j, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
            frag[lane, j, 0] = tile[g + dr, 2 * t + dc]
            frag[lane, j, 1] = tile[g + dr, 2 * t + 1 + dc]
    return frag


def smbd_fragment(words, values: np.ndarray) -> np.ndarray:
    """Decode one TCTile the way the kernel does.

    ``words``: the TCTile's 4 BitmapTile words (uint64 bit patterns, TL, BL, TR, BR);
    ``values``: the TCTile's packed values (PopCount of all 4 words long).
    Each lane uses PopCount of the preceding words plus the masked PopCount of the bits
    below ``2*lane`` to find its offset; the pair's second value sits one further on if the
    first was stored.  Returns ``[32 lanes, 4 registers, 2 halves]``.
    """
    words = [int(w) & 0xFFFF_FFFF_FFFF_FFFF for w in words]
    if len(words) != 4:
        raise ValueError(f"a TCTile has 4 BitmapTile words, got {len(words)}")
    frag = np.zeros((LANES, 4, 2), dtype=values.dtype)
    base = 0
    for j, word in enumerate(words):
        for lane in range(LANES):
            below = word & ((1 << (2 * lane)) - 1)  # masked PopCount: bits under this lane
            off = base + popcount_int(below)
            lo_set = (word >> (2 * lane)) & 1
            hi_set = (word >> (2 * lane + 1)) & 1
            if lo_set:
                frag[lane, j, 0] = values[off]
            if hi_set:
                frag[lane, j, 1] = values[off + lo_set]
        base += popcount_int(word)
    return frag
