"""Does SparseLinear's policy pick the fastest kernel? For each shape, format and N bucket: the
kernel the policy chooses (cost model; after ``spinfer.calibrate()`` with ``--calibrate``)
against the candidates' measured times (the same timing ``policy="autotune"`` uses: the least of
three interleaved medians per candidate, spinfer.timing.least_of_rounds).

    spinfer bench policy [--calibrate] [--shapes 28672x8192,...]     (needs a CUDA GPU)
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch

import spinfer
from spinfer.bench import parse_shapes, require_cuda
from spinfer.nn import SparseLinear
from spinfer.nn import policy as P
from spinfer.timing import least_of_rounds

SHAPES = [(28672, 8192), (8192, 28672), (14336, 4096), (4096, 14336), (4096, 4096), (1024, 4096)]
NS = [1, 8, 16, 32, 64, 128, 256, 1024]
# (label, sparsity, quant): TCA-BME layers choose per N between SpMM and decode+dense. (A 4-bit
# layer has one kernel; lowbit_mm switches to dequantize+cuBLAS above fused_max_n(bits) itself.)
FORMATS = [("tca-bme 30%", 0.3, None), ("tca-bme 50%", 0.5, None), ("tca-bme 70%", 0.7, None)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="spinfer bench policy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibrate", action="store_true", help="measure the device constants first")
    p.add_argument("--shapes", default=None)
    a = p.parse_args(argv)
    if not require_cuda("policy"):
        return 2
    dev = torch.device("cuda")
    spinfer.build.load_extension()
    shapes = parse_shapes(a.shapes) if a.shapes else SHAPES
    prof = P.calibrate(dev) if a.calibrate else P.profile_for(dev)
    print(f"device {torch.cuda.get_device_name(dev)}; profile: {prof.name} (measured={prof.measured})")
    print("constants: " + ", ".join(f"{k}={v}" for k, v in asdict(prof).items() if k not in ("name", "measured")))
    print(f"{'M':>6} {'K':>6} {'format':<12} {'N':>4} {'chosen':<13} {'fastest':<13} {'slowdown':>8}  measured us")
    cases = hits = 0
    worst = 1.0
    stored_cases = stored_hits = 0
    stored_lines = []
    for m, k in shapes:
        gen = torch.Generator(device=dev).manual_seed(m + k)
        dense = torch.randn(m, k, device=dev, generator=gen).half()
        for label, sparsity, quant in FORMATS:
            w = dense.masked_fill(torch.rand(m, k, device=dev, generator=gen) < sparsity, 0.0)
            policy = "lowbit" if quant else "sparse"  # the format under test; kernels chosen per N
            layer = SparseLinear.from_weight(w, quant=quant, policy=policy)
            layer.policy = "auto"
            # The storage decision (one format per layer, made for decode, N = 1): dense or TCA-BME.
            auto_format = SparseLinear.from_weight(w, policy="auto").format
            x1 = torch.randn(1, k, device=dev, dtype=w.dtype)
            t = least_of_rounds({"dense": lambda: torch.nn.functional.linear(x1, w),
                                 "spmm": lambda: spinfer.spmm(x1, layer.weight_object())}, dev, reps=20)
            t_dense, t_sparse = t["dense"], t["spmm"]
            best_format = "dense" if t_dense < t_sparse else "tca-bme"
            stored_cases += 1
            stored_hits += auto_format == best_format
            stored_lines.append(f"  {m}x{k} {label}: stored {auto_format}, N=1 dense {t_dense * 1e6:.1f} us, "
                                f"spmm {t_sparse * 1e6:.1f} us -> {'ok' if auto_format == best_format else 'MISS'}")
            for n in NS:
                chosen = min((pred := layer.predicted(n, dev)), key=pred.get)
                times = layer._time_candidates(n)
                fastest = min(times, key=times.get)
                slow = times[chosen] / times[fastest]
                cases += 1
                hits += chosen == fastest
                worst = max(worst, slow)
                meas = ", ".join(f"{kern} {t * 1e6:.1f}" for kern, t in times.items())
                print(f"{m:>6} {k:>6} {label:<12} {n:>4} {chosen:<13} {fastest:<13} {slow:>8.2f}  {meas}", flush=True)
    print(f"\npolicy picked the measured-fastest kernel in {hits}/{cases} cases ({100 * hits / cases:.0f}%); "
          f"worst slowdown where it missed {worst:.2f}x (issue 5: >= 90%, <= 1.10x)")
    print("storage format chosen by policy='auto' against the faster of dense and SpMM at N = 1:")
    print("\n".join(stored_lines))
    print(f"policy stored the faster format for {stored_hits}/{stored_cases} layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
