"""Roofline model of a linear layer ``[M, K] x [K, N]`` (paper Figure 4).

Computational intensity counts the dense-equivalent work, 2 M K N FLOPs, over the bytes that
must move:

* dense GEMM: 2 M K + 2 K N + 2 M N bytes (fp16);
* SpMM with a format of compression ratio CR (eq. 7): 2 M K / CR + 2 K N + 2 M N;
* the index-free optimum (eq. 8): only the nonzero values, 2 M K (1 - s) + 2 K N + 2 M N;
* weight-only low-bit: M K bits / 8 + 2.5 M ceil(K / group) at 1, 2 and 4 bits, 4 M ceil(K / group)
  at 8 (an fp16 scale per group, and a 4-bit or fp16 zero: compression.lowbit_bytes)
  + 2 K N + 2 M N.

Attainable FLOP/s = min(tensor rate, intensity x bandwidth). Ceilings are measured on the GPU
(:func:`measure_ceilings`, cached per device), given by the user, or the H100 80GB HBM3 figures
measured on 2026-11-22 (DESIGN.md §6).
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass
from typing import List, Optional

import torch

from ..cache import read_entry, write_entry
from ..quant.lowbit import check_bits
from .compression import lowbit_bytes


@dataclass
class Ceilings:
    bandwidth: float = 3007e9  # bytes/s, device-to-device copy, read + write
    flops: float = 773e12  # dense fp16 tensor-core FLOP/s
    name: str = "NVIDIA H100 80GB HBM3 (measured 2026-11-22)"
    measured: bool = False

    def __post_init__(self):
        if not (self.bandwidth > 0 and self.flops > 0):
            raise ValueError(f"ceilings must be positive, got bandwidth={self.bandwidth}, flops={self.flops}")


_CEILINGS_FILE = "roofline_ceilings.json"


def measure_ceilings(device="cuda", save: bool = True) -> Ceilings:
    """Copy bandwidth (2 GiB device-to-device, read + write) and an 8192^3 fp16 matmul."""
    from ..timing import copy_bandwidth, median_time

    if not torch.cuda.is_available():
        raise RuntimeError("measuring ceilings needs a CUDA GPU; pass bandwidth/flops for a device you do not have")
    dev = torch.device(device)
    bw = copy_bandwidth(dev, nbytes=1 << 31, reps=10)
    a = torch.randn(8192, 8192, device=dev).half()
    fl = 2 * 8192**3 / median_time(lambda: a @ a, dev, reps=10, flush_l2=False)
    c = Ceilings(bandwidth=bw, flops=fl, name=torch.cuda.get_device_name(dev), measured=True)
    if save:
        write_entry(_CEILINGS_FILE, c.name, asdict(c))
    return c


def cached_ceilings(name: str) -> Optional[Ceilings]:
    stored = read_entry(_CEILINGS_FILE, name)
    return Ceilings(**stored) if stored else None


def _check(m, k, n):
    if min(m, k, n) < 1:
        raise ValueError(f"M, K, N must be >= 1, got {(m, k, n)}")


def intensity_dense(m: int, k: int, n: int) -> float:
    _check(m, k, n)
    return 2.0 * m * k * n / (2 * m * k + 2 * k * n + 2 * m * n)


def intensity_spmm(m: int, k: int, n: int, cr: float) -> float:
    """Eq. 7: dense-equivalent FLOPs over the bytes of a format with compression ratio ``cr``."""
    _check(m, k, n)
    if cr <= 0:
        raise ValueError(f"compression ratio must be positive, got {cr}")
    return 2.0 * m * k * n / (2 * m * k / cr + 2 * k * n + 2 * m * n)


def intensity_optimal(m: int, k: int, n: int, sparsity: float) -> float:
    """Eq. 8: the index-free optimum, only the nonzero values move."""
    _check(m, k, n)
    if not 0 <= sparsity < 1:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    return 2.0 * m * k * n / (2 * m * k * (1 - sparsity) + 2 * k * n + 2 * m * n)


def intensity_lowbit(m: int, k: int, n: int, bits: int, group: int = 128) -> float:
    """Dense-equivalent FLOPs over the bytes of a weight-only low-bit layer (packed integers plus
    one fp16 scale and a zero per group, compression.lowbit_bytes; ``group`` = K for per-channel)."""
    _check(m, k, n)
    check_bits(bits)
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    return 2.0 * m * k * n / (lowbit_bytes(m, k, bits, group) + 2 * k * n + 2 * m * n)


def attainable(intensity: float, c: Ceilings) -> float:
    return min(c.flops, intensity * c.bandwidth)


def points_from_bench_csv(path, max_n: Optional[int] = None) -> List[dict]:
    """Measured points from a ``bench_spmm`` CSV: cuBLAS and spmm per case, achieved
    dense-equivalent FLOP/s at their intensity, and the device the CSV names (None if none)."""
    pts = []
    with open(path) as f:
        for r in csv.DictReader(f):
            m, k, n, s = int(r["M"]), int(r["K"]), int(r["N"]), float(r["sparsity"])
            if max_n is not None and n > max_n:
                continue
            flops = 2.0 * m * k * n
            dev = r.get("device") or None
            pts.append({"kind": "cuBLAS", "M": m, "K": k, "N": n, "sparsity": s, "device": dev,
                        "intensity": intensity_dense(m, k, n), "flops": flops / (float(r["cublas_us"]) * 1e-6)})
            pts.append({"kind": f"spmm {int(round(s * 100))}%", "M": m, "K": k, "N": n, "sparsity": s, "device": dev,
                        "intensity": intensity_spmm(m, k, n, float(r["cr"])),
                        "flops": flops / (float(r["spmm_us"]) * 1e-6)})
    return pts


def points_from_lowbit_csv(path, max_n: Optional[int] = None) -> List[dict]:
    """Measured points from a ``bench_lowbit`` CSV: one low-bit point per case, labelled
    ``w<bits> g<group>``. cuBLAS is left to the SpMM CSV (same method, same device)."""
    pts = []
    with open(path) as f:
        for r in csv.DictReader(f):
            m, k, n, bits = int(r["M"]), int(r["K"]), int(r["N"]), int(r["bits"])
            group = int(r["group"]) if r["group"] not in ("", "None", "-1", "0") else k
            if max_n is not None and n > max_n:
                continue
            pts.append({"kind": f"w{bits} g{'ch' if group == k else group}", "M": m, "K": k, "N": n,
                        "device": r.get("device") or None,
                        "intensity": intensity_lowbit(m, k, n, bits, group),
                        "flops": 2.0 * m * k * n / (float(r["lowbit_us"]) * 1e-6)})
    return pts


def roof_fraction(point: dict, c: Ceilings) -> float:
    """Achieved / attainable at the point's intensity."""
    return point["flops"] / attainable(point["intensity"], c)


def roof_summary(points: List[dict], c: Ceilings, max_n: int = 16) -> dict:
    """Per series (kind): (min, median, max) of :func:`roof_fraction` over its points with
    N <= max_n."""
    out = {}
    for kind in sorted({p["kind"] for p in points}):
        fr = sorted(roof_fraction(p, c) for p in points if p["kind"] == kind and p["N"] <= max_n)
        if fr:
            mid = len(fr) // 2
            med = fr[mid] if len(fr) % 2 else 0.5 * (fr[mid - 1] + fr[mid])
            out[kind] = (fr[0], med, fr[-1])
    return out


def _group_labels(points: List[dict]) -> List[tuple]:
    """One label per series and N: (kind, N, the group's highest point). A series' points at one N
    (one per shape) share its intensity within a few percent and differ in speed, so they stack;
    a label for each would print the same text on top of itself."""
    groups = {}
    for p in points:
        key = (p["kind"], p["N"])
        if key not in groups or p["flops"] > groups[key]["flops"]:
            groups[key] = p
    return [(kind, n, p) for (kind, n), p in sorted(groups.items())]  # (keys are unique)


def plot(c: Ceilings, points: List[dict], path, title: str = "", label_points: bool = True) -> List[tuple]:
    """The roofline (paper Figure 4) with the measured points, a series a colour and marker, each
    series' points labelled with their token count N: one label per series and N, beside the
    group's highest point, moved around it where it would cover a label already placed. The axes
    span the points and the ridge, not decades of empty roof. Returns the labels placed: (kind, N,
    x, y) in data coordinates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    ridge = c.flops / c.bandwidth
    lo_x = min([p["intensity"] for p in points] + [ridge]) / 2
    hi_x = max([p["intensity"] for p in points] + [ridge]) * 3
    xs = [lo_x, ridge, hi_x]
    ax.loglog(xs, [attainable(x, c) / 1e12 for x in xs], color="black", lw=1.5,
              label=f"roof: {c.bandwidth / 1e9:.0f} GB/s, {c.flops / 1e12:.0f} TFLOP/s")
    colours = {}
    for kind in sorted({p["kind"] for p in points}):
        sel = [p for p in points if p["kind"] == kind]
        marker = "^" if kind.startswith("w") else ("s" if kind == "cuBLAS" else "o")  # low-bit, dense, sparse
        dots = ax.scatter([p["intensity"] for p in sel], [p["flops"] / 1e12 for p in sel], s=16, label=kind,
                          zorder=3, marker=marker)
        colours[kind] = dots.get_facecolor()[0]
    ax.set_xlim(lo_x, hi_x)
    ax.set_ylim(min(attainable(lo_x, c), min(p["flops"] for p in points)) / 1e12 / 1.5, c.flops / 1e12 * 1.5)
    ax.set_xlabel("computational intensity (dense-equivalent FLOP / byte)")
    ax.set_ylabel("TFLOP/s (dense-equivalent)")
    devices = sorted({p["device"] for p in points if p.get("device")})
    roof = "measured" if c.measured else ("given" if c.name == "user-given" else f"of {c.name}")
    ax.set_title(title or (f"Roofline, {devices[0]} (roof {roof})" if len(devices) == 1 else f"Roofline (roof {roof})"))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()  # before the labels: it moves the axes, and with them the boxes compared below
    placed = []
    if label_points:
        fig.canvas.draw()  # fixes the transforms the overlap test reads
        renderer = fig.canvas.get_renderer()
        boxes = []
        places = ((3, 2), (3, -8), (-3, 2), (-3, -8), (3, 8), (-3, 8), (3, -14), (-3, -14))  # points off xy
        for kind, n, p in _group_labels(points):
            xy = (p["intensity"], p["flops"] / 1e12)

            def put(dx, dy):
                text = ax.annotate(f"N={n}", xy, fontsize=6, color=colours[kind], xytext=(dx, dy),
                                   textcoords="offset points", ha="left" if dx > 0 else "right")
                return text, text.get_window_extent(renderer).expanded(1.05, 1.1)

            for dx, dy in places:
                text, box = put(dx, dy)
                if not any(box.overlaps(b) for b in boxes):
                    break
                text.remove()
            else:  # crowded on every side: the first place, over its neighbour
                text, box = put(*places[0])
            boxes.append(box)
            placed.append((kind, n, *xy))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return placed
