"""Modules users put in their models: SparseLinear and the dispatch policy."""

from .policy import DeviceProfile, calibrate, profile_for
from .sparse_linear import SparseLinear

__all__ = ["DeviceProfile", "SparseLinear", "calibrate", "profile_for"]
