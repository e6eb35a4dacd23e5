"""torch.library op definitions, fake implementations and CPU implementations."""

from .spmm import spmm

__all__ = ["spmm"]
