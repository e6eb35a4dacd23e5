"""The main job on an embedded default: prune a layer, encode it, multiply, report."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from . import build
from .format import TCABME
from .ops import spmm
from .prune import magnitude_prune
from .timing import median_time

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:8.2f} MiB"


def run_demo(m=4096, k=4096, n=16, sparsity=0.5, dtype="fp16", device="auto", seed=0, out=print):
    """Prune a random ``[m, k]`` layer, encode it in TCA-BME, multiply ``n`` tokens through
    it on the best device available and compare with dense.  Returns the figures."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    dt = DTYPES[dtype]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(m, k, generator=gen) * 0.02).to(dt)
    x = torch.randn(n, k, generator=gen).to(dt)

    pruned = magnitude_prune(weight, sparsity)
    t0 = time.perf_counter()
    enc = TCABME.from_dense(pruned)
    encode_s = time.perf_counter() - t0
    st = enc.storage_bytes()
    dense_bytes = 2 * m * k
    out(f"spinfer demo: {m}x{k} {dtype} layer, magnitude-pruned to {sparsity:.0%}, N={n} tokens")
    out(f"  encode (CPU)        {encode_s * 1e3:8.1f} ms")
    out(f"  dense fp16          {_mb(dense_bytes)}")
    out(f"  TCA-BME total       {_mb(st.total)}  (bitmap {_mb(st.bitmap).strip()}, values "
        f"{_mb(st.values).strip()}, offsets {_mb(st.offsets).strip()}, padding {_mb(st.padding).strip()})")
    out(f"  compression ratio   {enc.compression_ratio:8.3f}x   (fp16 ideal at this sparsity "
        f"{2 / (2 * (1 - enc.sparsity) + 1 / 8):.3f}x)")

    if dev.type == "cuda":
        try:
            build.load_extension()
        except RuntimeError as exc:  # no CUDA toolkit, or a failed build: say so, use the CPU
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            out(f"  the CUDA kernel could not be built ({first}); running on the CPU instead")
            dev = torch.device("cpu")
    enc_d, w_d, x_d = enc.to(dev), pruned.to(dev), x.to(dev)
    y = spmm(x_d, enc_d)
    ref = x.double() @ pruned.double().t()
    rel_err = float((y.double().cpu() - ref).norm() / ref.norm())
    t_dense = median_time(lambda: F.linear(x_d, w_d), dev, reps=20, max_seconds=5)
    t_sparse = median_time(lambda: spmm(x_d, enc_d), dev, reps=20, max_seconds=5)
    out(f"  device              {dev.type}" + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""))
    out(f"  rel. error vs fp64  {rel_err:8.2e}")
    out(f"  dense F.linear      {t_dense * 1e6:10.1f} us")
    out(f"  spinfer.spmm        {t_sparse * 1e6:10.1f} us   ({t_dense / t_sparse:.2f}x dense)")
    if dev.type == "cpu":
        out("  (on the CPU the weight is decoded, or read straight from its arrays for up to 8 tokens: the format is "
            "built for the GPU kernel)")
    return {
        "compression_ratio": enc.compression_ratio,
        "storage_bytes": st.total,
        "rel_err": rel_err,
        "dense_s": t_dense,
        "spmm_s": t_sparse,
        "device": dev.type,
    }
