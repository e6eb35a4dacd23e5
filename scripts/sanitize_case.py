"""Small and odd SpMM launches for compute-sanitizer (memcheck, racecheck): split-K on and
off, a corrupt offsets array, fp16 and bf16."""

import os

import torch

import spinfer
from spinfer.format import TCABME

spinfer.build.load_extension()
for m, k, n, splits in [(64, 64, 1, "1"), (4097, 1000, 7, "1"), (4097, 1000, 9, "3"), (200, 700, 33, "2")]:
    os.environ["SPINFER_SPLITS"] = splits  # N >= 8 runs two GroupTile rows per block
    for dt in (torch.float16, torch.bfloat16):
        w = torch.randn(m, k, device="cuda").to(dt)
        w[torch.rand(m, k, device="cuda") < 0.5] = 0
        enc = TCABME.from_dense(w)
        x = torch.randn(n, k, device="cuda").to(dt)
        y = spinfer.spmm(x, enc, torch.randn(m, device="cuda").to(dt))
        off = enc.gtile_offset.clone()
        off[1] = 2**31 - 1  # corrupt on purpose: must stay in bounds
        torch.ops.spinfer.spmm(x, enc.bitmap, enc.values, off, m, k, 64, 64, enc.max_run)
        torch.ops.spinfer.spmm(x, enc.bitmap, enc.values, enc.gtile_offset, m, k, 64, 64, 8)  # too small
torch.cuda.synchronize()
print("sanitize cases ran")
