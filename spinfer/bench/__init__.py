"""Benchmarks and studies behind ``spinfer bench`` (``python -m spinfer.bench``)."""

import csv as _csv
import sys as _sys


def parse_shapes(text):
    """``"28672x8192,4096x4096"`` -> ``[(28672, 8192), (4096, 4096)]``."""
    try:
        return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"shapes must look like 28672x8192,4096x4096, got {text!r}") from None


def parse_quants(text):
    """``"1:128,4:64"`` -> ``[(1, 128), (4, 64)]``: (bits, group size) pairs."""
    out = []
    for item in filter(None, text.split(",")):
        bits, _, group = item.partition(":")
        try:
            out.append((int(bits), int(group)))
        except ValueError:
            raise SystemExit(f"low-bit configs must look like 4:128,2:64 (BITS:GROUP), got {item!r}") from None
    return out


def require_cuda(bench: str) -> bool:
    """Whether a CUDA GPU is there; if not, says so for ``spinfer bench <bench>`` (exit code 2)."""
    import torch

    if torch.cuda.is_available():
        return True
    print(f"spinfer bench {bench}: needs a CUDA GPU", file=_sys.stderr)
    return False


def write_rows(rows, path) -> None:
    """The benchmark rows (dicts with the same keys) as a CSV file."""
    with open(path, "w", newline="") as f:
        wr = _csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
