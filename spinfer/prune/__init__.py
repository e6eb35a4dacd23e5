"""Pruning: choose which weights become zero before encoding."""

from .magnitude import magnitude_mask, magnitude_prune

__all__ = ["magnitude_mask", "magnitude_prune"]
