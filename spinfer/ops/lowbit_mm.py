"""``spinfer::lowbit_mm``: ``y = x @ W.T + bias`` with ``W`` a weight-only low-bit
:class:`~spinfer.quant.LowBitWeight`.

CPU: the reference in fp32 (up to CPU_DIRECT_MAX_N tokens the compiled kernel of
spinfer/cpu_kernels.py straight from the arrays; above, its dequantizer, then torch multiplies). CUDA: for ``N <= fused_max_n(bits)`` the fused kernel (``spinfer::lowbit_mm_out``,
spinfer/csrc/lowbit_mm.cuh), which dequantizes in registers straight into tensor-core fragments,
once per token tile; above it, the weight is dequantized once (``spinfer::lowbit_to_dense``, one
streaming kernel) and cuBLAS multiplies (docs/quant.md has the measured crossover).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import build, cpu_kernels, tuning
from ..quant.lowbit import ROW_BLOCK, LowBitWeight, check_bits
from . import library  # noqa: F401  (defines the schemas)
from .to_dense import dequantize_on_cpu
from .linear_input import (band_rows, check_op_inputs, check_out, check_splits, cpu_band_rows, direct_call_ok,
                           flatten_input, float32_product, linear_input_grads, needs_input_grad, refuse_weight_grad,
                           wants_grad)

# Largest N served by the fused kernel, by bit width; above it the weight is decoded once
# (lowbit_to_dense) and cuBLAS multiplies. The fused kernel decodes the weight again for every
# 32-token tile, so its time grows with N, while decode + cuBLAS costs one pass over the weight
# (0.40-0.50x cuBLAS at N = 64-256). Measured crossover on H100, four issue shapes (`spinfer bench
# to_dense`, docs/quant.md), with row pairs at N > 16 (twenty-first session): decode + cuBLAS
# stays ahead from N = 160-192 at 1, 2 and 4 bits (4-bit at N = 128: fused 0.50-0.60x cuBLAS,
# decoded 0.44-0.48x; at 160: 0.34-0.47x against 0.44-0.47x) and from N = 128-160 at 8 bits (N =
# 128: fused 0.40-0.47x, decoded 0.40-0.44x; at 160: 0.27-0.35x against 0.41-0.44x). Never
# below 32 (issue 4).
FUSED_MAX_N = {1: 128, 2: 128, 4: 128, 8: 128}


def fused_max_n(bits: int) -> int:
    """The largest N at which ``lowbit_mm`` runs the fused kernel for a ``bits``-wide weight."""
    return FUSED_MAX_N[check_bits(bits)]


# Tokens up to which the CPU multiplies straight from the low-bit arrays (cpu_kernels.lowbit_spmm)
# rather than dequantizing the weight and multiplying in float32. 2-core development VM, 4096x4096
# in groups of 128, 2 / 4 / 8 bits, fp16 and bf16, two runs: N = 8 took 34-43 ms that way against
# 56-79 ms dequantized; N = 16 51-65 against 53-82 (docs/quant.md).
CPU_DIRECT_MAX_N = 16


def _reference(x, qweight, scale_zero, bits, group_size, m, k, perm, bias):
    check_op_inputs(x, scale_zero, m, k, bias)
    if 0 < x.shape[0] <= CPU_DIRECT_MAX_N:
        # each stored column j is original column perm[j]: the kernel takes x's columns in that order
        y = cpu_kernels.lowbit_spmm(x if perm is None else x.index_select(1, perm), qweight, scale_zero, bits,
                                    group_size, m, k)
        if y is not None:
            if bias is not None:
                y += bias.float()
            return y.to(x.dtype)
    # in the stored K order, as the direct kernel: x's columns follow it
    bands = ((r0, r1, dequantize_on_cpu(qw, sz, bits, group_size, r1 - r0, k))
             for r0, r1, qw, sz in _lowbit_band_arrays(qweight, scale_zero, m, cpu_band_rows(m, k, ROW_BLOCK)))
    return float32_product(x if perm is None else x.index_select(1, perm), bands, m, bias)


@torch.library.register_fake("spinfer::lowbit_mm")
def _lowbit_mm_fake(x, qweight, scale_zero, bits, group_size, m, k, perm=None, bias=None, splits=0,
                    integer_zeros=False):
    check_op_inputs(x, scale_zero, m, k, bias)
    if x.device.type == "cuda" and x.shape[0] <= fused_max_n(bits):
        build.load_extension()  # a compiled graph calls the op directly: have its kernel ready
    return x.new_empty((x.shape[0], m))


def _lowbit_mm_cpu(x, qweight, scale_zero, bits, group_size, m, k, perm=None, bias=None, splits=0,
                   integer_zeros=False):
    LowBitWeight(qweight, None, None, bits, group_size, (m, k), perm, scale_zero=scale_zero)  # validates
    return _reference(x, qweight, scale_zero, bits, group_size, m, k, perm, bias)


def _lowbit_mm_cuda(x, qweight, scale_zero, bits, group_size, m, k, perm=None, bias=None, splits=0,
                    integer_zeros=False):
    # O(1) checks only: the permutation check would sync the device on every call. A perm that
    # is not a permutation gathers wrong columns but never reads out of bounds (index_select).
    LowBitWeight(qweight, None, None, bits, group_size, (m, k), perm, validate=False, scale_zero=scale_zero)
    if x.shape[0] > fused_max_n(bits):
        # One dense GEMM on the weight decoded once (to_dense.cu); act-order gathers x instead of
        # scattering the weight's columns.
        check_op_inputs(x, scale_zero, m, k, bias)
        w = torch.ops.spinfer.lowbit_to_dense(qweight, scale_zero, bits, group_size, m, k)
        return F.linear(x if perm is None else x.index_select(1, perm), w, bias)
    check_op_inputs(x, scale_zero, m, k, bias)
    out = x.new_empty((x.shape[0], m))
    torch.ops.spinfer.lowbit_mm_out(x, qweight, scale_zero, bits, group_size, m, k, perm, bias, splits, integer_zeros,
                                    out=out)
    return out


@torch.library.register_fake("spinfer::lowbit_mm_out")
def _lowbit_mm_out_fake(x, qweight, scale_zero, bits, group_size, m, k, perm=None, bias=None, splits=0,
                        integer_zeros=False, *, out):
    check_op_inputs(x, scale_zero, m, k, bias)
    check_out(out, x, m)


def _lowbit_mm_out_cpu(x, qweight, scale_zero, bits, group_size, m, k, perm=None, bias=None, splits=0,
                       integer_zeros=False, *, out):
    check_out(out, x, m)
    out.copy_(_lowbit_mm_cpu(x, qweight, scale_zero, bits, group_size, m, k, perm, bias))


# The decorator form would rebind these names to None; register them explicitly so the
# implementations can call each other.
torch.library.impl("spinfer::lowbit_mm", "CPU")(_lowbit_mm_cpu)
torch.library.impl("spinfer::lowbit_mm", "CUDA")(_lowbit_mm_cuda)
torch.library.impl("spinfer::lowbit_mm_out", "CPU")(_lowbit_mm_out_cpu)


# Gradients flow to x and bias as through F.linear; the weight is frozen (spmm's op does the same).
# Backward dequantizes it (spinfer::lowbit_to_dense, in the stored column order; under
# set_backward_band_bytes a large weight in bands of 64-row tiles) for grad_x = grad_y @ W, and puts
# the act-order columns back where forward gathered them.
def _lowbit_mm_setup_context(ctx, inputs, output):
    x, qweight, scale_zero, bits, group_size, m, k, perm, bias, _splits, _integer_zeros = inputs
    refuse_weight_grad("lowbit_mm", scale_zero)
    ctx.save_for_backward(qweight, scale_zero, perm)
    ctx.spec = (bits, group_size, m, k)


def _lowbit_band_arrays(qweight, scale_zero, m, rows):
    """(r0, r1, qweight, scale_zero) of W[r0:r1] for bands of ``rows`` rows (whole 64-row tiles,
    the leading dimension of both arrays)."""
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        t0, t1 = r0 // ROW_BLOCK, -(-r1 // ROW_BLOCK)
        yield r0, r1, qweight[t0:t1], scale_zero[t0:t1]


def _lowbit_bands(qweight, scale_zero, bits, group_size, m, k):
    """(r0, r1, W[r0:r1]) over the weight's rows for backward (stored K order), in bands of
    band_rows rows."""
    for r0, r1, qw, sz in _lowbit_band_arrays(qweight, scale_zero, m, band_rows(m, k, ROW_BLOCK)):
        yield r0, r1, torch.ops.spinfer.lowbit_to_dense(qw, sz, bits, group_size, r1 - r0, k)


def _lowbit_mm_backward(ctx, grad):
    qweight, scale_zero, perm = ctx.saved_tensors
    needs_x, needs_bias = wants_grad(ctx, 0), wants_grad(ctx, 8)
    grad_x, grad_bias = linear_input_grads(grad, lambda: _lowbit_bands(qweight, scale_zero, *ctx.spec), needs_x,
                                           needs_bias)
    if grad_x is not None and perm is not None:  # forward read x.index_select(1, perm)
        grad_x = torch.zeros_like(grad_x).index_add_(1, perm, grad_x)
    return grad_x, None, None, None, None, None, None, None, grad_bias, None, None


torch.library.register_autograd("spinfer::lowbit_mm", _lowbit_mm_backward, setup_context=_lowbit_mm_setup_context)


def lowbit_mm(x: torch.Tensor, weight: LowBitWeight, bias: Optional[torch.Tensor] = None,
              *, out: Optional[torch.Tensor] = None, splits: Optional[int] = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x [..., K]`` and a :class:`LowBitWeight` ``W [M, K]``; like
    ``torch.nn.functional.linear``. Output dtype is ``x.dtype`` (fp32 accumulation).
    Differentiable in ``x`` and ``bias`` (backward dequantizes the weight once, or in bands of rows
    under :func:`spinfer.set_backward_band_bytes`; not with ``out``); the weight itself is frozen.

    One token (1 and 2 bits at group sizes >= 64, 4 bits at >= 128, 8 bits at >= 64; any K) runs
    the GEMV kernel instead of the fused one (``lowbit_plan(weight, 1)["gemv"]``; docs/quant.md).

    With ``out`` (a contiguous ``[N, M]`` tensor, ``N`` the product of the leading dims), the
    fused kernel writes into it at any N: static buffers for CUDA graphs.

    ``splits`` sets the fused kernel's schedule: a split-K factor (1: one block per 64 output
    rows), or -1 for the balanced schedule (two blocks per SM, each an equal run of the layer's
    stages across row blocks); by default it is the one :func:`spinfer.tuning.tune_lowbit`
    measured best for this shape and N, or the planner's rule where none was tuned."""
    splits = check_splits(splits, balanced=True)
    if out is None and isinstance(weight, LowBitWeight) and direct_call_ok(x, bias):
        n = x.numel() // weight.shape[1]
        if 0 < n <= fused_max_n(weight.bits):
            # Eager, nothing to differentiate: the fused kernel's entry point, past the dispatcher
            # (its checks of x and bias are the op's, in C++; the weight was checked when it was
            # built); decode at batch 1 is host-bound.
            if splits is None:
                splits = tuning.lowbit_splits(weight, n, x.device)
            return build.eager_module().lowbit_mm(x, bias, *entry_args(weight, splits))
    x2, lead = flatten_input(x, weight, LowBitWeight, weight.scale_zero, bias)
    m, k = weight.shape
    grad = needs_input_grad(x2, bias)
    build.load_for(x2)  # JIT-compiles the kernels on first use, then cached
    if splits is None:
        splits = tuning.lowbit_splits(weight, x2.shape[0], x2.device) if x2.is_cuda else 0
    integer_zeros = x2.is_cuda and not torch.compiler.is_compiling() and _integer_zeros(weight)
    args = (x2, weight.qweight, weight.scale_zero, weight.bits, weight.group_size, m, k, weight.perm, bias, splits,
            integer_zeros)
    if out is not None:
        if grad:  # as torch's own out= functions
            raise RuntimeError("lowbit_mm(): out= does not support automatic differentiation, but x or bias "
                               "requires grad; call it under torch.no_grad() or without out=")
        check_out(out, x2, m)
        if x2.shape[0]:
            torch.ops.spinfer.lowbit_mm_out(*args, out=out)
        return out.view(*lead, m)
    if x2.shape[0] == 0 and not grad:  # (an empty batch that autograd follows goes through the op)
        return x.new_empty((*lead, m))
    return torch.ops.spinfer.lowbit_mm(*args).reshape(*lead, m)


def _integer_zeros(weight: LowBitWeight) -> bool:
    """Whether the fused kernel may skip its zero-point check for an eager CUDA call: computed at
    the weight's first such call (one sync) and cached until scale_zero changes. A CUDA graph
    captured before then (or after a change) takes the checked path, which is as exact, rather
    than sync there. So does torch.compile (the callers pass False while tracing): dynamo cannot
    read the version counter that keeps the cache honest, and a flag baked into a compiled graph
    would outlive an in-place edit of the zeros."""
    if torch.cuda.is_current_stream_capturing():
        return bool(weight.cached_integer_zeros())
    return weight.integer_zeros


def entry_args(weight: LowBitWeight, splits: int) -> tuple:
    """The arguments after x and bias of the extension's ``lowbit_mm`` entry point (csrc/eager.h,
    the fused kernel) for ``weight``, the integer-zeros flag as it is now: what SparseLinear keeps
    between eager calls, while ``scale_zero`` keeps its version."""
    m, k = weight.shape
    return (weight.qweight, weight.scale_zero, weight.bits, weight.group_size, m, k, weight.perm, splits,
            _integer_zeros(weight))


# Field names of spinfer::lowbit_plan's result, in order (spinfer/csrc/lowbit_mm.h, LowbitPlan).
PLAN_FIELDS = ("bn", "n_tiles", "row_blocks", "grid_blocks", "splits", "iters_per_split", "resident_blocks",
               "balanced", "tail_first", "tail_splits", "tail_iters", "tile_rows", "bulk_weights", "gemv",
               "gemv_ring", "gemv_warps")


def lowbit_plan(weight: LowBitWeight, n: int, *, dtype: torch.dtype = torch.float16, device="cuda",
                splits: int = 0) -> dict:
    """The launch the fused kernel's planner picks for ``weight`` at ``n`` tokens of ``dtype`` on
    ``device``: token tile ``bn`` and ``n_tiles``, ``row_blocks`` (``tile_rows`` output rows each:
    64, or 128 where two 64-row blocks share a block's activation slices),
    ``grid_blocks`` per token tile, ``splits`` (the most blocks that share a row block's tile) and
    ``iters_per_split`` (stages per split-K block), ``resident_blocks`` per SM (CUDA's occupancy
    calculator), whether it is the ``balanced`` schedule, the split tail rows (``tail_first``:
    the first split row block, ``tail_splits`` ways of ``tail_iters`` stages; 0 when none), and
    whether the bulk loader runs (``bulk_weights``: each stage's weight tiles in one bulk copy and
    its activation slice in tensor copies; sm_90 at 4 bits with ``bn`` 32, unless
    ``SPINFER_LOADER=cp_async``), and whether one token runs on the GEMV kernel instead (``gemv``:
    blocks of 16 rows, ``tile_rows`` 16, its tail rows split where a row block's weights are at least
    80 KiB (128 KiB at 8 bits); 1 and 2 bits at group sizes >= 64, 4 bits at >= 128, 8 bits at >= 64;
    ``SPINFER_LOWBIT_GEMV=1|0`` forces it), and the GEMV's loader (``gemv_ring``: 0, each lane's
    words of a stage straight into registers; 2, each warp's ring of two shared-memory slots, at 1, 2
    and 4 bits wherever its resident blocks leave no tail rows to split; never at 8 bits or with
    split tail rows; ``SPINFER_LOWBIT_RING=0|2`` forces it), and the GEMV's warps a
    block (``gemv_warps``: 4 on the ring on short rows, where each warp then takes twice the stages
    and more blocks fit an SM, and on longer rows unless the grid of 4-warp blocks would fill under
    3/4 of a wave of the device's slots for them or run a second wave of under a quarter; 8
    elsewhere; ``SPINFER_GEMV_WARPS=8|4`` forces either on the ring; 0 for the fused kernel).
    ``splits`` as for :func:`lowbit_mm` (0: the planner's rule); the environment overrides
    (``SPINFER_LOWBIT_SPLITS``, ``SPINFER_LOWBIT_TAIL``, ...) apply as they do to a launch."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"lowbit_plan describes the CUDA kernel; got device {device}")
    if not isinstance(weight, LowBitWeight):
        raise TypeError(f"weight must be a LowBitWeight, got {type(weight).__name__}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    splits = check_splits(splits, balanced=True) or 0
    build.load_extension()
    m, k = weight.shape
    x = torch.empty((n, 1), dtype=dtype, device=device).expand(n, k)  # only N, dtype and device are read
    plan = dict(zip(PLAN_FIELDS, torch.ops.spinfer.lowbit_plan(x, m, k, weight.bits, weight.group_size, splits)))
    for key in ("balanced", "bulk_weights", "gemv"):
        plan[key] = bool(plan[key])
    return plan
