"""Version counters as the marks of in-place writes, where a cache must see them. A tensor made
under ``torch.inference_mode`` keeps none (reading one raises), and in-place writes to it, which
only inference mode allows, cannot be seen: for such a tensor the callers keep None and compare
identities (and data pointers) only."""

from typing import Optional

import torch


def version_or_none(t: torch.Tensor) -> Optional[int]:
    return None if t.is_inference() else t._version


def changed(t: torch.Tensor, version: Optional[int]) -> bool:
    """Whether ``t`` was written in place since ``version_or_none(t)`` gave ``version``."""
    return version is not None and t._version != version
