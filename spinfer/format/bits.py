"""Bit packing helpers for 64-bit bitmaps held in torch tensors.

Torch has no unsigned 64-bit arithmetic worth relying on, so a bitmap word is stored as
``torch.int64`` holding the uint64 bit pattern.  Packing and unpacking go through the
word's 8 little-endian bytes: byte ``r`` holds bits ``8r .. 8r+7``, which is exactly row
``r`` of an 8x8 BitmapTile (bit ``r*8 + c``).  Everything here is vectorised and runs on
whatever device the input lives on.
"""

from __future__ import annotations

import sys

import torch

if sys.byteorder != "little":  # pragma: no cover - every CUDA host is little-endian
    raise ImportError("spinfer's bitmap packing assumes a little-endian host")

_INT64_MAX = 0x7FFF_FFFF_FFFF_FFFF
_M1, _M2, _M4 = 0x5555_5555_5555_5555, 0x3333_3333_3333_3333, 0x0F0F_0F0F_0F0F_0F0F


def pack_bitmaps(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean ``[..., 64]`` mask into int64 words, element ``i`` -> bit ``i``."""
    if mask.shape[-1] != 64:
        raise ValueError(f"pack_bitmaps needs a last dimension of 64, got {tuple(mask.shape)}")
    rows = mask.reshape(*mask.shape[:-1], 8, 8).to(torch.uint8)
    byte = rows[..., 0].clone()
    for c in range(1, 8):
        byte |= rows[..., c] << c
    return byte.contiguous().view(torch.int64).squeeze(-1)


def unpack_bitmaps(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_bitmaps`: int64 words ``[...]`` -> boolean ``[..., 64]``."""
    if words.dtype != torch.int64:
        raise TypeError(f"bitmap words must be torch.int64, got {words.dtype}")
    byte = words.contiguous().view(torch.uint8).reshape(*words.shape, 8, 1)
    shifts = torch.arange(8, dtype=torch.uint8, device=words.device)
    return ((byte >> shifts) & 1).bool().reshape(*words.shape, 64)


def popcount64(words: torch.Tensor) -> torch.Tensor:
    """Number of set bits of each int64 word, as int64.

    The SWAR count on the word itself (pairs, nibbles, bytes, then the bytes summed by shifts)
    instead of a 256-entry table indexed by each byte: the table widened every byte to an int64
    index, and on a 14336x4096 weight's bitmap it took 92 ms on the CPU where this takes ~18.
    Loading a layer counts its bitmap up to three times (validation, row table, nnz). The sign bit
    is counted apart, so that no intermediate overflows int64 (torch has no uint64 arithmetic)."""
    if words.dtype != torch.int64:
        raise TypeError(f"bitmap words must be torch.int64, got {words.dtype}")
    x = words & _INT64_MAX
    x = (x & _M1) + ((x >> 1) & _M1)
    x = (x & _M2) + ((x >> 2) & _M2)
    x = (x + (x >> 4)) & _M4
    x = x + (x >> 8)
    x = x + (x >> 16)
    x = (x + (x >> 32)) & 0x7F
    return x + (words < 0)


def popcount_int(word: int) -> int:
    """PopCount of a Python int interpreted as a uint64 (emulation helper)."""
    return bin(word & 0xFFFF_FFFF_FFFF_FFFF).count("1")
