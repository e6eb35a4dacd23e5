"""The CPU path of a compressed layer: the compiled decoders (spinfer/cpu_kernels.py) against the
torch-op reference decoders they replaced, and a SparseLinear call (decode, then F.linear) against
F.linear on the dense weight, in one process: TCA-BME at each ``--sparsities`` and low-bit at each
``--quants`` (RTN, groups of 128). Median of ``--reps`` wall-clock runs each, on the threads torch
uses (``--threads`` to set them). Every call allocates its output, as a layer's does, so the times
include the OS's page faults on fresh memory.

    spinfer bench cpu [--shapes 4096x4096,4096x14336] [--sparsities 0.5,0.7] [--quants 4,8] [--n 1] [--csv out.csv]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import spinfer
from spinfer import cpu_kernels
from spinfer.bench import parse_shapes, write_rows
from spinfer.format.tca_bme import decode
from spinfer.quant.lowbit import dequantize
from spinfer.timing import median_time

SHAPES = [(4096, 4096), (4096, 14336)]
QUICK_SHAPES = [(1024, 4096)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="spinfer bench cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None, help="e.g. 4096x4096,1024x4096")
    p.add_argument("--sparsities", default="0.5,0.7")
    p.add_argument("--quants", default="4,8", help="bit widths of the low-bit rows (groups of 128); '' for none")
    p.add_argument("--n", type=int, default=1, help="tokens per SparseLinear call")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="one 1024x4096 layer")
    p.add_argument("--csv", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    shapes = parse_shapes(a.shapes) if a.shapes else (QUICK_SHAPES if a.quick else SHAPES)
    sparsities = [float(v) for v in a.sparsities.split(",") if v]
    quants = [int(v) for v in a.quants.split(",") if v]
    if cpu_kernels.library() is None:
        print(f"the compiled CPU decoders are unavailable: {cpu_kernels.unavailable_reason()}")
        return 1
    cpu = torch.device("cpu")
    print(f"CPU, {torch.get_num_threads()} threads; torch {torch.__version__}; fp16; median of {a.reps}; "
          f"compiler flags {' '.join(cpu_kernels.flags())}")
    print(f"{'M':>6} {'K':>6} {'format':>14} {'ref decode ms':>14} {'decode ms':>10} {'x ref':>6} "
          f"{'SparseLinear ms':>16} {'F.linear ms':>12} {'x F.linear':>10}")

    def timed(fn):
        return median_time(fn, cpu, reps=a.reps, warmup=1, max_seconds=None) * 1e3

    rows = []
    for m, k in shapes:
        w = torch.randn(m, k, dtype=torch.float16)
        x = torch.randn(a.n, k, dtype=torch.float16)
        cases = []
        for sparsity in sparsities:
            dense = spinfer.magnitude_prune(w, sparsity)
            enc = spinfer.TCABME.from_dense(dense)
            cases.append((f"tca-bme {sparsity:.0%}", dense, enc, enc.to_dense,
                          lambda enc=enc: decode(enc.bitmap, enc.values, enc.gtile_offset, enc.shape)))
        for bits in quants:
            q = spinfer.LowBitWeight.quantize(w, bits, 128)
            cases.append((f"w{bits} g128", q.dequantize(), q, q.dequantize,
                          lambda q=q: dequantize(q.qweight, q.scale_zero, q.bits, q.group_size, q.shape)))
        for name, dense, weight, fast, reference in cases:
            layer = spinfer.SparseLinear(weight, None, policy="auto")
            t_ref, t_dec = timed(reference), timed(fast)
            t_layer, t_dense = timed(lambda: layer(x)), timed(lambda: F.linear(x, dense))
            rows.append({"M": m, "K": k, "format": name, "N": a.n, "threads": torch.get_num_threads(),
                         "ref_decode_ms": t_ref, "decode_ms": t_dec, "sparse_linear_ms": t_layer,
                         "f_linear_ms": t_dense})
            print(f"{m:>6} {k:>6} {name:>14} {t_ref:>14.1f} {t_dec:>10.1f} {t_ref / t_dec:>5.1f}x "
                  f"{t_layer:>16.1f} {t_dense:>12.2f} {t_layer / t_dense:>9.1f}x", flush=True)
    if a.csv:
        write_rows(rows, a.csv)
        print(f"wrote {a.csv}")
    return 0
