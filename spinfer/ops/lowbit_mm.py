"""``spinfer::lowbit_mm``: ``y = x @ W.T + bias`` with ``W`` a weight-only low-bit
:class:`~spinfer.quant.LowBitWeight`.

CPU: the reference (dequantize, multiply in fp32). CUDA: dequantize on the GPU, then cuBLAS,
the path for large N; the fused GEMV and tensor-core kernels for small N are not written yet.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..quant.lowbit import LowBitWeight, dequantize
from . import library  # noqa: F401  (defines the schemas)
from .linear_input import check_op_inputs, flatten_input


def _reference(x, qweight, scales, zeros, bits, group_size, m, k, perm, bias, accumulate=torch.float32):
    check_op_inputs(x, scales, m, k, bias)
    w = dequantize(qweight, scales, zeros, bits, group_size, (m, k), perm)
    if accumulate == torch.float32:
        y = x.float() @ w.float().t()
        if bias is not None:
            y += bias.float()
        return y.to(x.dtype)
    return F.linear(x, w, bias)  # cuBLAS: fp16/bf16 inputs, fp32 accumulation


@torch.library.register_fake("spinfer::lowbit_mm")
def _lowbit_mm_fake(x, qweight, scales, zeros, bits, group_size, m, k, perm=None, bias=None):
    check_op_inputs(x, scales, m, k, bias)
    return x.new_empty((x.shape[0], m))


@torch.library.impl("spinfer::lowbit_mm", "CPU")
def _lowbit_mm_cpu(x, qweight, scales, zeros, bits, group_size, m, k, perm=None, bias=None):
    LowBitWeight(qweight, scales, zeros, bits, group_size, (m, k), perm)  # validates the arrays
    return _reference(x, qweight, scales, zeros, bits, group_size, m, k, perm, bias)


@torch.library.impl("spinfer::lowbit_mm", "CUDA")
def _lowbit_mm_cuda(x, qweight, scales, zeros, bits, group_size, m, k, perm=None, bias=None):
    # O(1) checks only: the permutation check would sync the device on every call. A perm that
    # is not a permutation gathers wrong columns but never reads out of bounds (index_put).
    LowBitWeight(qweight, scales, zeros, bits, group_size, (m, k), perm, validate=False)
    return _reference(x, qweight, scales, zeros, bits, group_size, m, k, perm, bias, accumulate=None)


def lowbit_mm(x: torch.Tensor, weight: LowBitWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x [..., K]`` and a :class:`LowBitWeight` ``W [M, K]``; like
    ``torch.nn.functional.linear``. Output dtype is ``x.dtype`` (fp32 accumulation)."""
    x2, lead = flatten_input(x, weight, LowBitWeight, weight.scales, bias)
    m, k = weight.shape
    if x2.shape[0] == 0:
        return x.new_empty((*lead, m))
    y = torch.ops.spinfer.lowbit_mm(x2, weight.qweight, weight.scales, weight.zeros, weight.bits,
                                    weight.group_size, m, k, weight.perm, bias)
    return y.reshape(*lead, m)
