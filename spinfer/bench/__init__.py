"""Benchmarks and studies behind ``spinfer bench`` (``python -m spinfer.bench``)."""
