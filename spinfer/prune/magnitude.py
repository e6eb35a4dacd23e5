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
        mask = torch.ones_like(score, dtype=torch.bool)
        if drop:
            idx = torch.argsort(score, dim=1, stable=True)[:, :drop]
            mask.scatter_(1, idx, False)
        return mask
    flat = score.reshape(-1)
    drop = round(s * flat.numel())
    mask = torch.ones_like(flat, dtype=torch.bool)
    if drop:
        thr = flat.kthvalue(drop).values
        below = flat < thr
        ties = (flat == thr).nonzero().squeeze(1)
        mask[below] = False
        mask[ties[: drop - int(below.sum())]] = False
    return mask.reshape(weight.shape)


def magnitude_prune(weight: torch.Tensor, sparsity: float, *, per_row: bool = False) -> torch.Tensor:
    """A pruned copy of ``weight`` (see :func:`magnitude_mask`).  Pruned entries are +0.0
    (``w * 0`` would leave -0.0 behind, which TCA-BME keeps as a stored value)."""
    return weight.masked_fill(~magnitude_mask(weight, sparsity, per_row=per_row), 0.0)
