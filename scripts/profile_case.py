"""One SpMM case launched a few times, for ncu:  python scripts/profile_case.py M K N SPARSITY"""

import sys

import torch

import spinfer
from spinfer.format import TCABME

m, k, n, s = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
spinfer.build.load_extension()
w = torch.randn(m, k, device="cuda").half()
w[torch.rand(m, k, device="cuda") < s] = 0
enc = TCABME.from_dense(w)
x = torch.randn(n, k, device="cuda").half()
for _ in range(4):
    y = spinfer.spmm(x, enc)
torch.cuda.synchronize()
print("profiled", m, k, n, s, float(y.float().norm()))
