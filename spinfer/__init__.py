"""spinfer: pruned and low-bit LLM weights, faster than dense fp16 on NVIDIA GPUs."""

from .format import TCABME
from .ops import spmm
from .prune import magnitude_prune

__version__ = "0.1.0"

__all__ = ["TCABME", "spmm", "magnitude_prune", "__version__"]
