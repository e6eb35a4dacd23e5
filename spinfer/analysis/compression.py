"""Storage and compression ratio (paper eq. 1: CR = 2 B * M * K / bytes) of a sparse fp16 weight
in the formats a sparse kernel could use.

* Measured formats read their sizes off real objects: scipy.sparse CSR, CSC, COO and BSR are
  built from the weight's 16-bit patterns viewed as int16 (scipy refuses float16; int16 stores
  the same 2 bytes per value, and a zero is the all-zero pattern as in TCA-BME), and TCA-BME
  comes from the encoder. Their index arrays are scipy's own (int32).
* Closed forms: Tiled-CSL (Flash-LLM, paper eq. 2: 4 B per tile offset + 4 B per nonzero, value
  and in-tile index packed), TCA-BME (eq. 9: 4 B (NGT+1) + 8 B NBT + 2 B NNZ), SparTA (a 2:4
  part for sparse tensor cores with 2-bit indices plus a CSR remainder for what 2:4 cannot hold;
  expected for random sparsity and counted on the actual matrix) and the weight-only low-bit
  formats as LowBitWeight stores them (bits/8 per weight, an fp16 scale per group, and the zero
  as 4 bits at 1, 2 and 4 bits (integer zeros, as RTN and GPTQ give) or 16 at 8 bits).
"""

from __future__ import annotations

import csv
import math
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch

from ..format import TCABME
from ..format.tca_bme import Geometry

MEASURED = ("csr", "csc", "coo", "bsr", "tca-bme")
ANALYTIC = ("dense", "tiled-csl", "sparta", "sparta-expected", "tca-bme-eq9", "w8-g128", "w4-g128")


def _check_shape(m: int, k: int) -> None:
    if m < 1 or k < 1:
        raise ValueError(f"shape must be at least 1x1, got {(m, k)}")


def _check_sparsity(s: float) -> float:
    s = float(s)
    if not 0.0 <= s <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {s}")
    return s


def tiled_csl_bytes(m: int, k: int, nnz: int, tile=(64, 64)) -> int:
    """Paper eq. 2: 4 B per tile offset (NTile + 1) + 4 B per nonzero."""
    tiles = math.ceil(m / tile[0]) * math.ceil(k / tile[1])
    return 4 * (tiles + 1) + 4 * nnz


def tca_bme_eq9_bytes(m: int, k: int, nnz: int, group_tile=(64, 64)) -> int:
    g = Geometry(m, k, *group_tile)
    return 4 * (g.num_group_tiles + 1) + 8 * g.num_bitmap_tiles + 2 * nnz


def sparta_bytes(m: int, k: int, remainder_nnz: int) -> int:
    """2:4 part (M*K/2 fp16 values + 2-bit index each) + CSR remainder (2 B value + 4 B column
    per nonzero, 4 B row pointer per row + 1); K is padded to a multiple of 4."""
    k4 = math.ceil(k / 4) * 4
    return 2 * m * k4 // 2 + m * k4 // 2 // 4 + (6 * remainder_nnz + 4 * (m + 1))


def sparta_expected_remainder(m: int, k: int, sparsity: float) -> float:
    """Expected remainder nonzeros for i.i.d. sparsity: each group of 4 consecutive weights holds
    X ~ Binomial(4, 1-s) nonzeros, of which max(X-2, 0) do not fit the 2:4 part."""
    d = 1.0 - sparsity
    per_group = 1 * 4 * d**3 * (1 - d) + 2 * d**4  # P(X=3) * 1 + P(X=4) * 2
    return m * math.ceil(k / 4) * per_group


def sparta_counted_remainder(mask: np.ndarray) -> int:
    m, k = mask.shape
    pad = (-k) % 4
    groups = np.pad(mask, ((0, 0), (0, pad))).reshape(m, -1, 4).sum(-1)
    return int(np.clip(groups - 2, 0, None).sum())


def lowbit_bytes(m: int, k: int, bits: int, group: int = 128, integer_zeros: bool = True) -> int:
    """Bytes of a weight-only low-bit layer without row padding: packed integers, an fp16 scale a
    group, and its zero: 4 bits where the format keeps integer zeros so (1, 2 and 4 bits), else
    16 (8 bits, or fractional zeros such as HQQ's; spinfer/quant/lowbit.py, format 4)."""
    groups = m * math.ceil(k / group)
    zero_bits = 4 if integer_zeros and bits <= 4 else 16
    return m * k * bits // 8 + 2 * groups + groups * zero_bits // 8


def _scipy_bytes(mat) -> int:
    arrays = [mat.data] + [getattr(mat, a) for a in ("indices", "indptr", "row", "col") if hasattr(mat, a)]
    return int(sum(a.nbytes for a in arrays))


def format_bytes(weight: torch.Tensor, bsr_block: int = 16) -> Dict[str, int]:
    """Bytes of ``weight`` (2-D fp16/bf16) in every format, measured or closed-form."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("weight must be a 2-D tensor")
    if weight.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"weight must be float16 or bfloat16 (2-byte values), got {weight.dtype}")
    m, k = weight.shape
    _check_shape(m, k)
    bits = weight.detach().cpu().contiguous().view(torch.int16).numpy()
    mask = bits != 0
    nnz = int(mask.sum())
    csr = sp.csr_matrix(bits)
    bm, bk = -(-m // bsr_block) * bsr_block, -(-k // bsr_block) * bsr_block
    out = {
        "dense": 2 * m * k,
        "csr": _scipy_bytes(csr),
        "csc": _scipy_bytes(sp.csc_matrix(bits)),
        "coo": _scipy_bytes(sp.coo_matrix(bits)),
        "bsr": _scipy_bytes(sp.bsr_matrix(np.pad(bits, ((0, bm - m), (0, bk - k))), blocksize=(bsr_block, bsr_block))),
        "tiled-csl": tiled_csl_bytes(m, k, nnz),
        "sparta": sparta_bytes(m, k, sparta_counted_remainder(mask)),
        "sparta-expected": round(sparta_bytes(m, k, 0) + 6 * sparta_expected_remainder(m, k, 1 - nnz / (m * k))),
        "tca-bme-eq9": tca_bme_eq9_bytes(m, k, nnz),
        "tca-bme": TCABME.from_dense(weight.detach().cpu()).storage_bytes().total,
        "w8-g128": lowbit_bytes(m, k, 8),
        "w4-g128": lowbit_bytes(m, k, 4),
    }
    return out


def compression_ratios(weight: torch.Tensor, **kw) -> Dict[str, float]:
    m, k = weight.shape
    return {name: 2 * m * k / b for name, b in format_bytes(weight, **kw).items()}


def sweep(shape=(4096, 4096), sparsities: Sequence[float] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
          seed: int = 0, dtype=torch.float16, progress: bool = False) -> List[dict]:
    """One row per sparsity: the CR of every format for a random matrix of ``shape``."""
    m, k = (int(v) for v in shape)
    _check_shape(m, k)
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(m, k, generator=gen).to(dtype)
    base[base.view(torch.int16) == 0] = 1.0
    sparsities = [_check_sparsity(s) for s in sparsities]
    points = sparsities
    if progress:
        try:
            from tqdm.auto import tqdm

            points = tqdm(sparsities, desc=f"compression {m}x{k}", unit="point")
        except ImportError:
            pass
    rows = []
    for s in points:
        w = base.masked_fill(torch.rand(m, k, generator=gen) < s, 0.0)
        rows.append({"sparsity": s, **compression_ratios(w)})
    return rows


def crossover(rows: List[dict], against: str, ours: str = "tca-bme") -> Optional[float]:
    """Lowest swept sparsity from which ``ours`` has a higher CR than ``against`` (linear
    interpolation between sweep points); None if it never does."""
    prev = None  # (sparsity, diff) of the last row where ours was not ahead
    for r in rows:
        diff = r[ours] - r[against]
        if diff > 0:
            if prev is None:
                return r["sparsity"]  # ahead from the first point swept
            s0, d0 = prev
            return s0 + (r["sparsity"] - s0) * (-d0) / (diff - d0)
        prev = (r["sparsity"], diff)
    return None


def write_csv(rows: List[dict], path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def plot(rows: List[dict], path, formats: Iterable[str] = ("dense", "csr", "csc", "coo", "bsr", "tiled-csl", "sparta",
                                                            "tca-bme-eq9", "tca-bme", "w8-g128", "w4-g128"),
         title: str = "") -> List[str]:
    """CR against sparsity per format (the paper's Figure 3), written as a PNG; returns the formats
    drawn. The CR axis is logarithmic: the formats span 0.2x to ~50x, and on a linear axis
    everything below 90% sparsity, where the comparison matters, sits in the bottom tenth. A
    closed form drawn beside the measured size of the same format (TCA-BME eq. 9), and CSC where
    it coincides with CSR (square matrices), are dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter

    fig, ax = plt.subplots(figsize=(7.5, 5))
    xs = [r["sparsity"] for r in rows]
    drawn = [name for name in formats if all(name in r for r in rows)]
    # a colour a format family: CSC with CSR, eq. 9 with the encoder's TCA-BME
    colour = {"dense": "black", "csr": "C1", "csc": "C1", "coo": "C2", "bsr": "C4", "tiled-csl": "C5",
              "sparta": "C6", "tca-bme-eq9": "C3", "tca-bme": "C3", "w8-g128": "C9", "w4-g128": "C0"}
    for name in drawn:
        ys = [r[name] for r in rows]
        dashed = name == "tca-bme-eq9" or (name == "csc" and all(r["csc"] == r.get("csr") for r in rows))
        ax.plot(xs, ys, marker="" if dashed else "o", ms=3, label=name, ls="--" if dashed else "-",
                color=colour.get(name), lw=2.4 if name == "tca-bme" else 1.2, zorder=3 if dashed else 2)
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_locator(FixedLocator([2.0**e for e in range(-3, 8)]))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xlabel("sparsity")
    ax.set_ylabel("compression ratio vs dense fp16 (log scale)")
    ax.set_title(title or "Compression ratio by format")
    ax.legend(ncol=2, fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn
