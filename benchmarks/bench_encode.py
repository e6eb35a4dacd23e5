"""Encode/decode time of TCA-BME on the CPU (or a GPU with --device cuda). On the CPU the compiled
encoder and decoder (spinfer/cpu_kernels.py) run, and the torch-op references are timed beside them.

    python benchmarks/bench_encode.py [--m 28672 --k 8192 --sparsity 0.5 --device cpu]
"""

import argparse
import time

import torch

from spinfer.format import TCABME
from spinfer.format.tca_bme import decode, encode_reference


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=28672)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    dt = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    w = torch.randn(a.m, a.k, device=a.device).to(dt)
    w[torch.rand(a.m, a.k, device=a.device) < a.sparsity] = 0

    def timed(fn):
        best = float("inf")
        for _ in range(a.reps):
            if a.device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            if a.device != "cpu":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best, out

    t_enc, enc = timed(lambda: TCABME.from_dense(w))
    t_dec, dense = timed(enc.to_dense)
    t_val, _ = timed(enc.validate)
    assert torch.equal(dense.view(torch.int16), w.view(torch.int16)), "round trip differs"
    print(f"TCA-BME {a.m}x{a.k} {a.dtype} sparsity {a.sparsity} on {a.device} "
          f"({torch.get_num_threads()} threads), best of {a.reps}")
    print(f"  encode   {t_enc:7.2f} s")
    print(f"  decode   {t_dec:7.2f} s")
    print(f"  validate {t_val:7.2f} s")
    print(f"  compression ratio {enc.compression_ratio:.3f}x")
    if a.device == "cpu":
        t_enc_ref, _ = timed(lambda: encode_reference(w))
        t_dec_ref, _ = timed(lambda: decode(enc.bitmap, enc.values, enc.gtile_offset, enc.shape))
        print(f"  encode, torch-op reference {t_enc_ref:7.2f} s")
        print(f"  decode, torch-op reference {t_dec_ref:7.2f} s")


if __name__ == "__main__":
    main()
