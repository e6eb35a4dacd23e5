"""torch.library op definitions, fake implementations and CPU implementations."""

from .lowbit_mm import lowbit_mm
from .spmm import spmm

__all__ = ["lowbit_mm", "spmm"]
