"""The ``spinfer`` torch.library namespace: every op's schema is defined here, once.

Device implementations register beside their definitions (CPU in Python, CUDA from the
compiled extension, ``spinfer/csrc/bindings.cpp``), and each op carries a fake
implementation so it traces under ``torch.compile`` and records into CUDA graphs.
"""

import torch

LIB = torch.library.Library("spinfer", "DEF")

_SPMM_ARGS = (
    "Tensor x, Tensor bitmap, Tensor values, Tensor gtile_offset, "
    "int m, int k, int gt_h, int gt_w, Tensor? bias=None"
)
LIB.define(f"spmm({_SPMM_ARGS}) -> Tensor")
# Writes into a caller-provided [N, M] buffer: static buffers for CUDA graphs, and tests that
# poison the output before the launch.
LIB.define(f"spmm_out({_SPMM_ARGS}, *, Tensor(a!) out) -> ()")
