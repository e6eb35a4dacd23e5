"""``spinfer::spmm``: ``y = x @ W.T + bias`` with ``W`` in TCA-BME.

The public wrapper :func:`spmm` checks its inputs (naming what is wrong) and flattens
leading batch dimensions; the op itself takes a contiguous ``x [N, K]`` and the three
TCA-BME arrays.  The CPU implementation is the reference, in fp32: for up to CPU_DIRECT_MAX_N
tokens the compiled kernel of spinfer/cpu_kernels.py multiplies straight from the arrays, above
that the compiled decoder decodes and torch multiplies; the CUDA one is the SMBD kernel
(spinfer/csrc), registered when the extension loads.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import build, cpu_kernels, tuning
from ..format.tca_bme import TCABME, Geometry, check_row_table, check_structure, longest_run, validate_arrays
from . import library  # noqa: F401  (defines the schemas)
from .to_dense import decode_on_cpu
from .linear_input import (band_rows, check_op_inputs, check_out, check_splits, cpu_band_rows, direct_call_ok,
                           flatten_input, float32_product, linear_input_grads, needs_input_grad, refuse_weight_grad,
                           wants_grad)


@torch.library.register_fake("spinfer::spmm")
def _spmm_fake(x, bitmap, values, gtile_offset, m, k, gt_h, gt_w, max_run, bias=None, splits=0, row_offset=None):
    check_op_inputs(x, values, m, k, bias)
    if x.device.type == "cuda":
        build.load_extension()  # a compiled graph calls the op directly: have its kernel ready
    return x.new_empty((x.shape[0], m))


def _spmm_cpu(x, bitmap, values, gtile_offset, m, k, gt_h, gt_w, max_run, bias=None, splits=0, row_offset=None):
    geom = Geometry(m, k, gt_h, gt_w)
    # The arrays may come from anywhere when the op is called directly: check them fully.
    validate_arrays(bitmap, values, gtile_offset, geom)
    check_row_table(row_offset, geom, bitmap.device)
    longest = longest_run(gtile_offset)
    if max_run < longest:
        raise ValueError(f"max_run={max_run} is below the longest GroupTile run ({longest})")
    check_op_inputs(x, values, m, k, bias)
    y = spmm_on_cpu(x, bitmap, values, gtile_offset, m, k, (gt_h, gt_w), bias)
    if y is not None:
        return y
    bands = ((r0, r1, decode_on_cpu(b, v, off, r1 - r0, k, (gt_h, gt_w)))
             for r0, r1, b, v, off in _tca_bme_band_arrays(bitmap, values, gtile_offset, m, k, gt_h, gt_w,
                                                          cpu_band_rows(m, k, gt_h)))
    return float32_product(x, bands, m, bias)


@torch.library.register_fake("spinfer::spmm_out")
def _spmm_out_fake(x, bitmap, values, gtile_offset, m, k, gt_h, gt_w, max_run, bias=None, splits=0, row_offset=None,
                   *, out):
    check_op_inputs(x, values, m, k, bias)
    check_out(out, x, m)


def _spmm_out_cpu(x, bitmap, values, gtile_offset, m, k, gt_h, gt_w, max_run, bias=None, splits=0, row_offset=None,
                  *, out):
    check_out(out, x, m)
    out.copy_(_spmm_cpu(x, bitmap, values, gtile_offset, m, k, gt_h, gt_w, max_run, bias, splits, row_offset))


# The decorator form would rebind these names to None; register them explicitly so the
# implementations can call each other.
torch.library.impl("spinfer::spmm", "CPU")(_spmm_cpu)
torch.library.impl("spinfer::spmm_out", "CPU")(_spmm_out_cpu)


# Gradients flow to x and bias as through F.linear; the weight is frozen. Backward decodes it to
# dense (spinfer::tca_bme_to_dense) for grad_x = grad_y @ W, as bitsandbytes' 4-bit layers
# dequantize theirs: adapters trained over a pruned base model need nothing more. Under
# set_backward_band_bytes a large weight is decoded in bands of GroupTile rows, slices of the arrays.
def _spmm_setup_context(ctx, inputs, output):
    x, bitmap, values, gtile_offset, m, k, gt_h, gt_w, _max_run, bias, _splits, _row_offset = inputs
    refuse_weight_grad("spmm", values)
    ctx.save_for_backward(bitmap, values, gtile_offset)
    ctx.geometry = (m, k, gt_h, gt_w)


def _tca_bme_band_arrays(bitmap, values, gtile_offset, m, k, gt_h, gt_w, rows):
    """(r0, r1, bitmap, values, offsets) of W[r0:r1] for bands of ``rows`` rows (whole GroupTile
    rows): GroupTiles are stored row-major, so a band's bitmap words and offsets are contiguous
    slices. The CUDA decoder reads each run at its offset into ``values`` as given (clamped to its
    length), so a band passes all of ``values`` and its own offsets, with no sync; the CPU decoder
    wants runs that start at 0, so there a band's values are sliced and its offsets rebased."""
    per_row = -(-k // gt_w)  # GroupTiles in one GroupTile row
    words = gt_h * gt_w // 64  # bitmap words in one GroupTile
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        g0, g1 = r0 // gt_h * per_row, -(-r1 // gt_h) * per_row
        if rows >= m:
            yield r0, r1, bitmap, values, gtile_offset
        elif values.is_cuda:
            yield r0, r1, bitmap[g0 * words:g1 * words], values, gtile_offset[g0:g1 + 1]
        else:
            v0, v1 = int(gtile_offset[g0]), int(gtile_offset[g1])
            yield r0, r1, bitmap[g0 * words:g1 * words], values[v0:v1], gtile_offset[g0:g1 + 1] - v0


def _tca_bme_bands(bitmap, values, gtile_offset, m, k, gt_h, gt_w):
    """(r0, r1, W[r0:r1]) over the weight's rows for backward, in bands of band_rows rows."""
    for r0, r1, b, v, off in _tca_bme_band_arrays(bitmap, values, gtile_offset, m, k, gt_h, gt_w,
                                                  band_rows(m, k, gt_h)):
        yield r0, r1, torch.ops.spinfer.tca_bme_to_dense(b, v, off, r1 - r0, k, gt_h, gt_w)


def _spmm_backward(ctx, grad):
    needs_x, needs_bias = wants_grad(ctx, 0), wants_grad(ctx, 9)
    grad_x, grad_bias = linear_input_grads(grad, lambda: _tca_bme_bands(*ctx.saved_tensors, *ctx.geometry),
                                           needs_x, needs_bias)
    return grad_x, None, None, None, None, None, None, None, None, grad_bias, None, None


torch.library.register_autograd("spinfer::spmm", _spmm_backward, setup_context=_spmm_setup_context)


# Tokens up to which the CPU multiplies straight from the TCA-BME arrays (cpu_kernels.tca_bme_spmm)
# rather than decoding the weight and multiplying densely. 2-core development VM, 4096x4096 at 50%,
# fp16, one process: N = 1 / 8 / 16 took 7.7 / 17.3 / 42.9 ms that way against 27.1 / 29.0 / 28.4
# ms decoded then F.linear (docs/format.md).
CPU_DIRECT_MAX_N = 8


def spmm_on_cpu(x2: torch.Tensor, bitmap, values, gtile_offset, m: int, k: int, group_tile,
                bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``x2 [N, K] @ W.T + bias`` in x's dtype by the compiled CPU kernel, summed in float32, for
    ``N <= CPU_DIRECT_MAX_N`` on checked arrays; None where it does not apply (more tokens, or no
    compiled library)."""
    if not 0 < x2.shape[0] <= CPU_DIRECT_MAX_N:
        return None
    y = cpu_kernels.tca_bme_spmm(x2, bitmap, values, gtile_offset, m, k, group_tile)
    if y is None:
        return None
    if bias is not None:
        y += bias.float()
    return y.to(x2.dtype)


def spmm(x: torch.Tensor, weight: TCABME, bias: Optional[torch.Tensor] = None, *,
         splits: Optional[int] = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x [..., K]`` and a TCA-BME weight ``W [M, K]``; like
    ``torch.nn.functional.linear``.  Output dtype is ``x.dtype`` (fp32 accumulation).
    Differentiable in ``x`` and ``bias`` (backward decodes the weight to dense once, or in bands
    of rows under :func:`spinfer.set_backward_band_bytes`); the weight itself is frozen.

    ``splits`` sets the CUDA kernel's split-K factor; by default it is the one
    :func:`spinfer.tuning.tune_spmm` measured best for this shape and N, or the planner's rule
    where none was tuned."""
    splits = check_splits(splits)
    if isinstance(weight, TCABME) and weight.group_tile == (64, 64) and direct_call_ok(x, bias):
        # Eager, nothing to differentiate: the kernel's entry point, past the dispatcher (its checks
        # of x, bias and the arrays are the op's, in C++); decode at batch 1 is host-bound.
        if splits is None:
            splits = tuning.spmm_splits(weight, x.numel() // weight.shape[1], x.device)
        return build.eager_module().spmm(x, bias, *entry_args(weight, splits))
    if (isinstance(weight, TCABME) and direct_call_ok(x, bias, "cpu") and x.dim() > 0 and x.shape[-1] == weight.shape[1]
            and 0 < x.numel() // weight.shape[1] <= CPU_DIRECT_MAX_N):
        # Eager on the CPU, nothing to differentiate, a few tokens: the compiled kernel on the arrays
        # TCABME checked when it was built (the op would validate them in full every call, ~4 ms
        # on 4096x4096; the kernel checks every run against the values array itself).
        x2, lead = flatten_input(x, weight, TCABME, weight.values, bias)
        y = spmm_on_cpu(x2, weight.bitmap, weight.values, weight.gtile_offset, *weight.shape, weight.group_tile,
                        bias)
        if y is not None:
            return y.reshape(*lead, weight.shape[0])
    # The ops check x, bias and the arrays themselves (CUDA: check_and_prepare in bindings.cpp, the
    # same checks as check_op_inputs and check_structure; CPU: the reference, in full), so a CUDA
    # call makes them once.
    x2, lead = flatten_input(x, weight, TCABME, weight.values, bias, check=not x.is_cuda)
    m, k = weight.shape
    grad = needs_input_grad(x2, bias)
    if x2.shape[0] == 0 and not grad:  # (an empty batch that autograd follows goes through the op)
        check_op_inputs(x2, weight.values, m, k, bias)
        check_structure(weight.bitmap, weight.values, weight.gtile_offset, weight.geometry)
        return x.new_empty((*lead, m))
    if x2.is_cuda and weight.group_tile != (64, 64):
        raise ValueError(
            f"the CUDA kernel supports GroupTile (64, 64), this weight uses {weight.group_tile}; "
            "re-encode it with TCABME.from_dense(w, group_tile=(64, 64))"
        )
    build.load_for(x2)  # JIT-compiles the SMBD kernel on first use, then cached
    gt_h, gt_w = weight.group_tile
    if splits is None:
        splits = tuning.spmm_splits(weight, x2.shape[0], x2.device) if x2.is_cuda else 0
    args = (x2, weight.bitmap, weight.values, weight.gtile_offset, m, k, gt_h, gt_w, weight.max_run, bias, splits,
            weight.row_offset)
    return torch.ops.spinfer.spmm(*args).reshape(*lead, m)


def entry_args(weight: TCABME, splits: int) -> tuple:
    """The arguments after x and bias of the extension's ``spmm`` entry point (csrc/eager.h) for
    ``weight``: what SparseLinear keeps between eager calls."""
    m, k = weight.shape
    return weight.bitmap, weight.values, weight.gtile_offset, m, k, weight.max_run, splits, weight.row_offset


# Field names of spinfer::spmm_plan's result, in order (spinfer/csrc/spmm_smbd.h, SpmmPlan).
PLAN_FIELDS = ("bn", "n_tiles", "grid_m", "grid_k", "splits", "k_per_split", "stages", "value_cap", "smem_bytes",
               "resident_blocks", "min_blocks", "lean", "bulk", "x_l1", "count_rows", "stagger", "row_table",
               "wgmma", "rows", "ticket")


def spmm_plan(weight: TCABME, n: int, *, dtype: torch.dtype = torch.float16, device="cuda",
              splits: int = 0) -> dict:
    """The launch configuration the CUDA kernel's planner picks for ``weight`` at ``n`` tokens of
    ``dtype`` on ``device``: token tile ``bn`` (8, 16, 32 or 64 up to that many tokens; past 64, 128
    where the sm_90 kernel runs wgmma groups of 4, else 64) and ``n_tiles``, the GroupTile grid, ``splits``
    (``splits=0``: the planner's rule, else that factor) and ``k_per_split``, pipeline
    ``stages``, the value buffer, shared memory per block, ``resident_blocks`` per SM (CUDA's
    occupancy calculator; 0 if unknown), the register budget (``min_blocks``: 9, 8 or 7 resident
    blocks' worth of registers for the sm_90 kernel at ``bn`` <= 16, else 0), the decode and
    loader variants, ``x_l1``: whether the sm_90 loader copies the activations through L1, and
    ``count_rows``: whether its producer warp counts the bitmap rows above each decoding warp's,
    and ``stagger``: whether it requests the ring's last stage only once a block's first has landed
    (at ``bn`` = 8 where it does not count rows), and ``row_table``: whether the decoding warps read
    the rows above their own from the weight's row table (``TCABME.row_offset``) instead, and
    ``wgmma``: the TCTiles of one warp-group MMA group in the sm_90 kernel at ``bn`` >= 32
    (4 by default; 5 at ``bn`` = 128, at 64 where a block holds one GroupTile row and at 32 where the split
    rule splits the grid of that kernel: groups of 4 where a stage's second GroupTile is decoded while the
    first one's group multiplies; 1, 2, or 3 for groups
    of 1 with one left in flight, or 4 or 5 forced, through ``SPINFER_WGMMA``), or 0 where it runs
    ``mma.sync``; at ``bn`` = 8 and 16 it is 4 at the default register budget (``min_blocks`` 7) unless
    ``SPINFER_WGMMA_SMALL=0`` or ``SPINFER_WGMMA=0``, else 0; ``rows``: the
    GroupTile rows a block (1, or 2 where wgmma runs groups of 4 or 5 at ``bn`` >= 32: the two rows' warp
    groups share each stage's activation slice; the planner takes 2 at ``bn`` >= 64 where that keeps
    more rows resident, ``SPINFER_SMBD_ROWS=1|2`` forces one); ``ticket``: whether a split grid's
    reducer is the block that takes a tile's last ticket as its last stage starts (the sm_90 loader at
    the default register budgets; ``SPINFER_SPLIT_TICKET=0`` keeps the last block to arrive).
    Environment overrides (``SPINFER_SPLITS``, ``SPINFER_STAGES``, ...) apply as they do to a
    launch."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"spmm_plan describes the CUDA kernel; got device {device}")
    if not isinstance(weight, TCABME):
        raise TypeError(f"weight must be a TCABME, got {type(weight).__name__}")
    if weight.group_tile != (64, 64):
        raise ValueError(f"the CUDA kernel supports GroupTile (64, 64), this weight uses {weight.group_tile}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    splits = check_splits(splits) or 0
    build.load_extension()
    m, k = weight.shape
    x = torch.empty((n, 1), dtype=dtype, device=device).expand(n, k)  # only N, dtype and device are read
    values = torch.ops.spinfer.spmm_plan(x, m, k, weight.max_run, splits)
    plan = dict(zip(PLAN_FIELDS, values))
    for flag in ("lean", "bulk", "x_l1", "count_rows", "stagger", "row_table", "ticket"):
        plan[flag] = bool(plan[flag])
    return plan
