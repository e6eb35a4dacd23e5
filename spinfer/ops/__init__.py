"""torch.library op definitions, fake implementations and CPU implementations."""

from .linear_input import set_backward_band_bytes
from .lowbit_mm import lowbit_mm
from .spmm import spmm
from .to_dense import lowbit_to_dense, tca_bme_to_dense

__all__ = ["lowbit_mm", "lowbit_to_dense", "set_backward_band_bytes", "spmm", "tca_bme_to_dense"]
