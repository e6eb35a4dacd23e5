"""One fused low-bit launch repeated a few times, for ncu:
    python scripts/profile_lowbit_case.py M K N BITS GROUP"""

import sys

import torch

import spinfer
from spinfer.quant import LowBitWeight

m, k, n, bits, group = (int(v) for v in sys.argv[1:6])
spinfer.build.load_extension()
q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").half(), bits, group)
x = torch.randn(n, k, device="cuda").half()
out = torch.empty(n, m, device="cuda").half()
for _ in range(3):
    spinfer.lowbit_mm(x, q, out=out)
torch.cuda.synchronize()
print("profiled", m, k, n, bits, group, float(out.float().norm()))
