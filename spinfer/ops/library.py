"""The ``spinfer`` torch.library namespace: every op's schema is defined here, once.

Device implementations register beside their definitions (CPU in Python, CUDA from the
compiled extension), and each op carries a fake implementation so it traces under
``torch.compile`` and records into CUDA graphs.
"""

import torch

LIB = torch.library.Library("spinfer", "DEF")

LIB.define(
    "spmm(Tensor x, Tensor bitmap, Tensor values, Tensor gtile_offset, "
    "int m, int k, int gt_h, int gt_w, Tensor? bias=None) -> Tensor"
)
