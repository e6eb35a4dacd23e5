"""Modules users put in their models: SparseLinear and the dispatch policy."""

from .policy import DeviceProfile, calibrate, profile_for
from .serialization import load, save
from .sparse_linear import SparseLinear

__all__ = ["DeviceProfile", "SparseLinear", "calibrate", "load", "profile_for", "save"]
