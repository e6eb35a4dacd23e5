"""Decode+dense taken apart, for the policy's cost model (docs/policy.md, nineteenth session).

For layers from 1024x4096 to 16384x8192 at 50% and 70%: the decode to dense alone (dec), F.linear
on the dense weight alone (dense1, dense128: N = 1, 128), the two in one call (dd1, dd128, dd256)
and SpMM by N; microseconds, L2 flushed before each call. dd - dec against dense shows what the
second launch costs behind the first and what a decoded weight smaller than L2 saves.

    python scripts/decode_dense_parts.py      (needs a CUDA GPU)
"""
import torch
import torch.nn.functional as F

import spinfer
from spinfer.format import TCABME
from spinfer.timing import median_time

SHAPES = [(1024, 4096), (2048, 4096), (4096, 4096), (6144, 4096), (8192, 4096), (14336, 4096), (4096, 14336),
          (28672, 4096), (16384, 8192)]
NS = [1, 8, 16, 32, 64, 128, 256]


def main() -> None:
    dev = torch.device("cuda")
    spinfer.build.load_extension()

    def us(fn):
        return median_time(fn, dev, reps=30) * 1e6

    print(f"{torch.cuda.get_device_name(dev)}; L2 {torch.cuda.get_device_properties(dev).L2_cache_size} bytes")
    print(f"{'shape':>12} sp  {'dec':>6} {'dense1':>6} {'dense128':>8} {'dd1':>6} {'dd128':>6} {'dd256':>6} | spmm "
          + " ".join(f"{n:>6}" for n in NS))
    for m, k in SHAPES:
        w = torch.randn(m, k, device=dev).half()
        for sp in (0.5, 0.7):
            ws = w.masked_fill(torch.rand(m, k, device=dev) < sp, 0)
            enc = TCABME.from_dense(ws)
            xs = {n: torch.randn(n, k, device=dev).half() for n in NS}
            dec = us(enc.to_dense)
            d1, d128 = us(lambda: F.linear(xs[1], ws)), us(lambda: F.linear(xs[128], ws))
            dd = {n: us(lambda: F.linear(xs[n], enc.to_dense())) for n in (1, 128, 256)}
            spmm = [us(lambda: spinfer.spmm(xs[n], enc)) for n in NS]
            print(f"{m:>5}x{k:<6} {int(sp * 100)} {dec:6.1f} {d1:6.1f} {d128:8.1f} {dd[1]:6.1f} {dd[128]:6.1f} "
                  f"{dd[256]:6.1f} | " + " ".join(f"{t:6.1f}" for t in spmm)
                  + f"  bytes {enc.storage_bytes().total / 1e6:.1f}MB", flush=True)


if __name__ == "__main__":
    main()
