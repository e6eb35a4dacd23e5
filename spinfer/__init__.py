"""spinfer: pruned and low-bit LLM weights, faster than dense fp16 on NVIDIA GPUs."""

from .format import TCABME
from .ops import lowbit_mm, set_backward_band_bytes, spmm
from .nn import SparseLinear, calibrate, load, save
from .prune import magnitude_prune, sparsify
from .quant import LowBitWeight
from . import tuning  # spinfer.tuning.tune_spmm / tune_lowbit

__version__ = "0.1.0"

__all__ = [
    "TCABME", "LowBitWeight", "SparseLinear", "calibrate", "load", "lowbit_mm", "save", "spmm", "magnitude_prune",
    "set_backward_band_bytes", "sparsify", "tuning",
    "__version__",
]
