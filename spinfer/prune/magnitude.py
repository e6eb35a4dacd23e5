"""Unstructured magnitude pruning: zero the smallest-|w| fraction of a weight."""

from __future__ import annotations

import torch


def check_sparsity(sparsity) -> float:
    try:
        s = float(sparsity)
    except (TypeError, ValueError):
        raise TypeError(f"sparsity must be a number in [0, 1), got {sparsity!r}") from None
    if not 0.0 <= s < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {s}")
    return s


def magnitude_mask(weight: torch.Tensor, sparsity: float, *, per_row: bool = False) -> torch.Tensor:
    """Boolean keep-mask that drops exactly ``round(sparsity * n)`` smallest-magnitude
    entries (over the whole matrix, or of each row with ``per_row``).  Ties are broken by
    position, so the count is exact even for fp16 weights, which have many equal values."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(weight.shape)}")
    s = check_sparsity(sparsity)
    score = weight.detach().abs().float()
    if per_row:
        drop = round(s * weight.shape[1])
        if not drop:
            return torch.ones_like(score, dtype=torch.bool)
        # Each row's drop-th smallest, then its ties in position order: ~4x a stable argsort of
        # every row (4096x4096 on two CPU cores: ~0.3 s against ~1.0 s).
        thr = score.kthvalue(drop, dim=1, keepdim=True).values
        below = score < thr
        ties = score == thr
        dropped = below | (ties & (ties.cumsum(1) <= drop - below.sum(1, keepdim=True)))
        return ~dropped
    flat = score.reshape(-1)
    drop = round(s * flat.numel())
    mask = torch.ones_like(flat, dtype=torch.bool)
    if drop:
        key, thr, n_below = _kth_smallest_key(flat, drop)
        mask = key >= thr
        ties = (key == thr).nonzero().squeeze(1)
        mask[ties[: drop - n_below]] = False
    return mask.reshape(weight.shape)


def _kth_smallest_key(score: torch.Tensor, k: int):
    """``(key, thr, n_below)``: the float32 ``score`` (>= 0 or NaN) as int32 keys, which sort as the
    scores do (NaN last), the k-th smallest key (1-based) and how many keys are below it. A radix
    select by two 16-bit histograms: on 16M scores ~3x faster on the CPU than ``kthvalue``, which
    sorts."""
    key = score.view(torch.int32) & 0x7FFFFFFF  # (a NaN's sign bit: its key stays non-negative)
    high = key >> 16
    cum = torch.bincount(high, minlength=1 << 15).cumsum(0)
    hb = int(torch.searchsorted(cum, k))  # the first bin whose cumulative count reaches k
    below_high = int(cum[hb - 1]) if hb else 0
    low = key[high == hb] & 0xFFFF
    cum_low = torch.bincount(low, minlength=1 << 16).cumsum(0)
    lb = int(torch.searchsorted(cum_low, k - below_high))
    n_below = below_high + (int(cum_low[lb - 1]) if lb else 0)
    return key, (hb << 16) | lb, n_below


def magnitude_prune(weight: torch.Tensor, sparsity: float, *, per_row: bool = False) -> torch.Tensor:
    """A pruned copy of ``weight`` (see :func:`magnitude_mask`).  Pruned entries are +0.0
    (``w * 0`` would leave -0.0 behind, which TCA-BME keeps as a stored value)."""
    return weight.masked_fill(~magnitude_mask(weight, sparsity, per_row=per_row), 0.0)
