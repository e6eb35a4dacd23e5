"""Benchmarks and studies behind ``spinfer bench`` (``python -m spinfer.bench``)."""

import csv as _csv


def parse_shapes(text):
    """``"28672x8192,4096x4096"`` -> ``[(28672, 8192), (4096, 4096)]``."""
    try:
        return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"shapes must look like 28672x8192,4096x4096, got {text!r}") from None


def write_rows(rows, path) -> None:
    """The benchmark rows (dicts with the same keys) as a CSV file."""
    with open(path, "w", newline="") as f:
        wr = _csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
