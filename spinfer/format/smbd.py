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


def prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` default mode: byte ``i`` of the result is byte ``sel`` nibble ``i`` of
    the 8 bytes ``b:a`` (a is bytes 0-3); a nibble's bit 3 replicates that byte's sign."""
    src = (b << 32) | a
    out = 0
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (n & 7))) & 0xFF
        if n & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def smbd_fragment_prmt(words, values: np.ndarray, sel_mul: int, sel_add: int, sel_table: int) -> np.ndarray:
    """Decode one TCTile with the kernel's v8 word arithmetic (``decode_gt`` in
    ``spinfer/csrc/spmm_smbd.cuh``): per lane and word, ``kept = half << (30 - lp)`` keeps the
    bits up to the lane's pair, ``e = popc(kept)`` is one past the pair's last value, the
    candidates are ``values[e - 2]`` and ``values[e - 1]`` (zero-extended; before the run they
    read whatever precedes it, here a poison value); ``f`` = the pair's two bits, the selector is
    ``prmt(0, sel_table, sel_mul * f + sel_add)`` and ``prmt(u0, u1, selector)`` builds the
    register. Returns ``[32 lanes, 4 registers, 2 halves]``."""
    words = [int(w) & 0xFFFF_FFFF_FFFF_FFFF for w in words]
    bits16 = values.view(np.uint16).astype(np.int64)
    frag = np.zeros((LANES, 4), dtype=np.uint32)
    base = 0
    poison = 0xBEEF  # what lies before the run in shared memory: never selected
    for j, word in enumerate(words):
        for lane in range(LANES):
            half = (word >> (32 * (lane >> 4))) & 0xFFFF_FFFF
            lp = 2 * (lane & 15)
            kept = (half * (1 << (30 - lp))) & 0xFFFF_FFFF
            below_half = popcount_int(word & 0xFFFF_FFFF) if lane >= 16 else 0  # the half-word prefix
            e = base + below_half + popcount_int(kept)
            u0 = int(bits16[e - 2]) if e - 2 >= 0 else poison
            u1 = int(bits16[e - 1]) if e - 1 >= 0 else poison
            f = (kept * 4) >> 32
            sel = prmt(0, sel_table, (f * sel_mul + sel_add) & 0xFFFF_FFFF)
            frag[lane, j] = prmt(u0, u1, sel)
        base += popcount_int(word)
    return frag.view(np.uint16).reshape(LANES, 4, 2).view(values.dtype)
