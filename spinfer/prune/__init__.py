"""Pruning: choose which weights become zero before encoding, per layer or per model."""

from .magnitude import magnitude_mask, magnitude_prune
from .model import sparsify
from .scores import nm_mask, score_mask, wanda_scores

__all__ = ["magnitude_mask", "magnitude_prune", "nm_mask", "score_mask", "sparsify", "wanda_scores"]
