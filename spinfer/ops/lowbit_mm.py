"""``spinfer::lowbit_mm``: ``y = x @ W.T + bias`` with ``W`` a weight-only low-bit
:class:`~spinfer.quant.LowBitWeight`.

CPU: the reference (dequantize, multiply in fp32). CUDA: for ``N <= FUSED_MAX_N`` the fused
kernel (``spinfer::lowbit_mm_out``, spinfer/csrc/lowbit_mm.cuh), which dequantizes in
registers straight into tensor-core fragments; above it, dequantize on the GPU and call cuBLAS.
The dequantization is torch ops today (4.7 ms for 28672x8192 on H100), so the fused kernel
wins at every N measured (970 us at N = 256); the crossover waits for a CUDA dequantize
kernel (docs/quant.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import build, tuning
from ..quant.lowbit import LowBitWeight, dequantize
from . import library  # noqa: F401  (defines the schemas)
from .linear_input import check_op_inputs, check_out, check_splits, flatten_input

# Largest N served by the fused kernel; dequantize + cuBLAS above. Never below 32 (issue 4);
# 256 is the largest N measured (benchmarks/bench_lowbit.py), where fused still won 5x.
FUSED_MAX_N = 256


def _reference(x, qweight, scale_zero, bits, group_size, m, k, perm, bias, accumulate=torch.float32):
    check_op_inputs(x, scale_zero, m, k, bias)
    w = dequantize(qweight, scale_zero, bits, group_size, (m, k), perm)
    if accumulate == torch.float32:
        y = x.float() @ w.float().t()
        if bias is not None:
            y += bias.float()
        return y.to(x.dtype)
    return F.linear(x, w, bias)  # cuBLAS: fp16/bf16 inputs, fp32 accumulation


@torch.library.register_fake("spinfer::lowbit_mm")
def _lowbit_mm_fake(x, qweight, scale_zero, bits, group_size, m, k, perm=None, bias=None, splits=0):
    check_op_inputs(x, scale_zero, m, k, bias)
    if x.device.type == "cuda" and x.shape[0] <= FUSED_MAX_N:
        build.load_extension()  # a compiled graph calls the op directly: have its kernel ready
    return x.new_empty((x.shape[0], m))


def _lowbit_mm_cpu(x, qweight, scale_zero, bits, group_size, m, k, perm=None, bias=None, splits=0):
    LowBitWeight(qweight, None, None, bits, group_size, (m, k), perm, scale_zero=scale_zero)  # validates
    return _reference(x, qweight, scale_zero, bits, group_size, m, k, perm, bias)


def _lowbit_mm_cuda(x, qweight, scale_zero, bits, group_size, m, k, perm=None, bias=None, splits=0):
    # O(1) checks only: the permutation check would sync the device on every call. A perm that
    # is not a permutation gathers wrong columns but never reads out of bounds (index_select).
    LowBitWeight(qweight, None, None, bits, group_size, (m, k), perm, validate=False, scale_zero=scale_zero)
    if x.shape[0] > FUSED_MAX_N:
        return _reference(x, qweight, scale_zero, bits, group_size, m, k, perm, bias, accumulate=None)
    check_op_inputs(x, scale_zero, m, k, bias)
    out = x.new_empty((x.shape[0], m))
    torch.ops.spinfer.lowbit_mm_out(x, qweight, scale_zero, bits, group_size, m, k, perm, bias, splits, out=out)
    return out


@torch.library.register_fake("spinfer::lowbit_mm_out")
def _lowbit_mm_out_fake(x, qweight, scale_zero, bits, group_size, m, k, perm=None, bias=None, splits=0, *, out):
    check_op_inputs(x, scale_zero, m, k, bias)
    check_out(out, x, m)


def _lowbit_mm_out_cpu(x, qweight, scale_zero, bits, group_size, m, k, perm=None, bias=None, splits=0, *, out):
    check_out(out, x, m)
    out.copy_(_lowbit_mm_cpu(x, qweight, scale_zero, bits, group_size, m, k, perm, bias))


# The decorator form would rebind these names to None; register them explicitly so the
# implementations can call each other.
torch.library.impl("spinfer::lowbit_mm", "CPU")(_lowbit_mm_cpu)
torch.library.impl("spinfer::lowbit_mm", "CUDA")(_lowbit_mm_cuda)
torch.library.impl("spinfer::lowbit_mm_out", "CPU")(_lowbit_mm_out_cpu)


def lowbit_mm(x: torch.Tensor, weight: LowBitWeight, bias: Optional[torch.Tensor] = None,
              *, out: Optional[torch.Tensor] = None, splits: Optional[int] = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x [..., K]`` and a :class:`LowBitWeight` ``W [M, K]``; like
    ``torch.nn.functional.linear``. Output dtype is ``x.dtype`` (fp32 accumulation).

    With ``out`` (a contiguous ``[N, M]`` tensor, ``N`` the product of the leading dims), the
    fused kernel writes into it at any N: static buffers for CUDA graphs.

    ``splits`` sets the fused kernel's schedule: a split-K factor (1: one block per 64 output
    rows), or -1 for the balanced schedule (two blocks per SM, each an equal run of the layer's
    stages across row blocks); by default it is the one :func:`spinfer.tuning.tune_lowbit`
    measured best for this shape and N, or the planner's rule where none was tuned."""
    x2, lead = flatten_input(x, weight, LowBitWeight, weight.scale_zero, bias)
    splits = check_splits(splits, balanced=True)
    m, k = weight.shape
    if x2.is_cuda and not build.is_loaded() and not torch.compiler.is_compiling():
        build.load_extension()  # JIT-compiles the kernels on first use, then cached
    if splits is None:
        splits = tuning.lowbit_splits(weight, x2.shape[0], x2.device) if x2.is_cuda else 0
    args = (x2, weight.qweight, weight.scale_zero, weight.bits, weight.group_size, m, k, weight.perm, bias, splits)
    if out is not None:
        check_out(out, x2, m)
        if x2.shape[0]:
            torch.ops.spinfer.lowbit_mm_out(*args, out=out)
        return out.view(*lead, m)
    if x2.shape[0] == 0:
        return x.new_empty((*lead, m))
    if x2.is_cuda and x2.shape[0] <= FUSED_MAX_N and not torch.compiler.is_compiling():
        # Eager fast path: the weight was checked when it was built and flatten_input checked
        # x and bias, so go straight to the kernel (one dispatch instead of two, ~40 us less
        # host time per call). Compiled graphs keep the lowbit_mm op.
        out = x2.new_empty((x2.shape[0], m))
        torch.ops.spinfer.lowbit_mm_out(*args, out=out)
        return out.view(*lead, m)
    return torch.ops.spinfer.lowbit_mm(*args).reshape(*lead, m)
