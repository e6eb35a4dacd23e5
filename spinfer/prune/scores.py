"""Pruning masks from importance scores: magnitude |W|, Wanda |W| * ||X_j||, and N:M patterns."""

from __future__ import annotations

from typing import Optional

import torch

from .magnitude import check_sparsity, magnitude_mask


def wanda_scores(weight: torch.Tensor, input_norms: torch.Tensor) -> torch.Tensor:
    """Wanda importance |W_ij| * ||X_j||_2 (Sun et al., 2023), ``input_norms`` per input feature."""
    if input_norms.shape != (weight.shape[1],):
        raise ValueError(
            f"calibration activations have width {input_norms.shape[0] if input_norms.dim() == 1 else tuple(input_norms.shape)}, "
            f"the layer takes {weight.shape[1]} input features"
        )
    return weight.detach().abs().float() * input_norms.float().to(weight.device)[None, :]


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the ``n`` highest scores of every ``m`` consecutive input features (N:M sparsity)."""
    if not (0 < n <= m):
        raise ValueError(f"N:M needs 0 < N <= M, got {n}:{m}")
    rows, cols = scores.shape
    if cols % m:
        raise ValueError(f"N:M with M={m} needs in_features divisible by {m}, got {cols}")
    blocks = scores.reshape(rows, cols // m, m)
    keep = torch.zeros_like(blocks, dtype=torch.bool)
    keep.scatter_(-1, blocks.topk(n, dim=-1).indices, True)
    return keep.reshape(rows, cols)


def score_mask(scores: torch.Tensor, sparsity: float, *, per_row: bool, nm: Optional[tuple] = None) -> torch.Tensor:
    """Keep-mask dropping the lowest scores: N:M when ``nm`` is given, else ``sparsity`` of each
    row (``per_row``) or of the whole matrix, with the count exact."""
    if nm is not None:
        return nm_mask(scores, *nm)
    check_sparsity(sparsity)
    return magnitude_mask(scores, sparsity, per_row=per_row)
