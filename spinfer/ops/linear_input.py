"""Input handling shared by every linear-layer op (spmm, lowbit_mm): checks that name the
problem, and flattening of leading batch dimensions like ``torch.nn.functional.linear``."""

from __future__ import annotations

from typing import Optional

import torch


def check_op_inputs(x, weight_like: torch.Tensor, m: int, k: int, bias) -> None:
    """Checks shared by every implementation of an op; ``x`` is already ``[N, K]`` and
    ``weight_like`` is any weight array carrying the weight's dtype and device."""
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"expected x of shape [N, {k}], got {tuple(x.shape)}")
    if x.dtype != weight_like.dtype:
        raise TypeError(f"x is {x.dtype} but the weight is {weight_like.dtype}; cast x to {weight_like.dtype}")
    if x.device != weight_like.device:
        raise ValueError(f"x is on {x.device} but the weight is on {weight_like.device}")
    if bias is not None:
        if bias.shape != (m,):
            raise ValueError(f"bias must have shape ({m},), got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"bias is {bias.dtype} but x is {x.dtype}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")


def flatten_input(x, weight, weight_type: type, weight_like: torch.Tensor, bias, check: bool = True):
    """Validate a public wrapper's arguments; returns ``(x2 [N, K] contiguous, lead shape)``.
    ``check=False`` leaves check_op_inputs to an op that makes the same checks itself (the CUDA
    kernels' ops, in C++: bindings.cpp), so an eager call pays for them once."""
    if not isinstance(weight, weight_type):
        raise TypeError(f"weight must be a spinfer.{weight_type.__name__}, got {type(weight).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    m, k = weight.shape
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x must have shape [..., {k}] to match the weight {m}x{k}, got {tuple(x.shape)}")
    x2 = (x if x.dim() == 2 else x.reshape(-1, k)).contiguous()
    if check:
        check_op_inputs(x2, weight_like, m, k, bias)
    return x2, x.shape[:-1]


def check_out(out, x, m: int) -> None:
    """An ``out=`` buffer for an ``[N, K]`` input: a contiguous ``[N, m]`` tensor of x's dtype
    on x's device (the ``*_out`` ops and CUDA-graph users write into it)."""
    if not isinstance(out, torch.Tensor) or out.shape != (x.shape[0], m) or out.dtype != x.dtype:
        raise ValueError(f"out must be a [{x.shape[0]}, {m}] {x.dtype} tensor, got "
                         f"{tuple(getattr(out, 'shape', ()))} {getattr(out, 'dtype', type(out).__name__)}")
    if out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be contiguous and on {x.device}")


def check_splits(splits, balanced: bool = False):
    """A public wrapper's ``splits``: None (tuned, else the planner's choice) or an int >= 0
    (0: the planner's choice), or -1 where the kernel has a balanced schedule (``balanced``),
    checked here so no bad value reaches a kernel."""
    if splits is None:
        return None
    if isinstance(splits, bool) or not isinstance(splits, int):
        raise TypeError(f"splits must be an int or None, got {type(splits).__name__}")
    if balanced and splits < -1:
        raise ValueError(f"splits must be >= -1 (0: the planner's choice, -1: the balanced schedule), got {splits}")
    if not balanced and splits < 0:
        raise ValueError(f"splits must be >= 0 (0: the planner's choice), got {splits}")
    return splits


def needs_input_grad(x, bias) -> bool:
    """Whether autograd will differentiate a linear op's output: grad mode is on and x or the bias
    requires grad (the compressed weights never do, see refuse_weight_grad)."""
    return torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))


def direct_call_ok(x, bias, device_type: str = "cuda") -> bool:
    """Whether an eager call may run its CUDA kernel through the extension's Python entry points
    (``build.eager_module()``, spinfer/csrc/eager.h), past the dispatcher: x and bias plain tensors
    (no subclass to dispatch on), x on CUDA, no gradient for autograd to record, no torch.compile
    tracing, and no torch function or dispatch mode active (a mode sees the ops only through the
    dispatcher). The entry points make the CUDA ops' own checks of x, bias and the weight arrays.
    At batch 1 an eager decode step is bound by host time, and the dispatcher's matching of the
    arguments to the schema is a large part of a call's (docs/policy.md). ``device_type="cpu"``:
    the same for spmm's compiled CPU kernel (ops/spmm.py: spmm_on_cpu)."""
    return (type(x) is torch.Tensor and x.device.type == device_type and (bias is None or type(bias) is torch.Tensor)
            and not needs_input_grad(x, bias)
            and not torch.compiler.is_compiling() and not torch._C._is_torch_function_mode_enabled()
            and torch._C._len_torch_dispatch_stack() == 0)


def refuse_weight_grad(op: str, weight_like: torch.Tensor) -> None:
    """The ops differentiate x and bias only; a compressed weight that asks for gradients is refused
    at the forward call rather than left without them."""
    if weight_like.requires_grad:
        raise RuntimeError(f"spinfer.{op}: gradients with respect to the compressed weight are not supported; "
                           f"its arrays must not require grad (x and bias may)")


def wants_grad(ctx, index: int) -> bool:
    """``ctx.needs_input_grad[index]`` of a torch.library autograd context, where the dispatcher
    drops trailing arguments left at their defaults (a bias of None), so the tuple may be short."""
    needs = ctx.needs_input_grad
    return index < len(needs) and bool(needs[index])


# Backward decodes the frozen weight for grad_x = grad @ W: by default all of it at once, as
# bitsandbytes' 4-bit layers dequantize theirs, the fastest way. set_backward_band_bytes(n) bounds
# that transient instead: a large weight is decoded a band of whole 64-row tiles at a time (both
# formats store those contiguously, so a band is a slice of the arrays), at most n bytes of dense
# weight each. Each band costs Python and launches, so bounding the memory costs time: on a
# 28672x8192 fp16 layer (H100, docs/policy.md) 448 MiB in 0.51-0.61 ms whole, 129 MiB in
# 0.59-0.70 ms with 128 MiB bands.
_backward_band_bytes: Optional[int] = None


def set_backward_band_bytes(nbytes: Optional[int]) -> Optional[int]:
    """Bound the dense weight that backward through ``spmm`` / ``lowbit_mm`` decodes at once to
    ``nbytes`` (bands of whole row tiles, at least one tile each), or ``None`` (the default)
    to decode it whole. Returns the previous setting."""
    global _backward_band_bytes
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1):
        raise ValueError(f"nbytes must be a positive int or None, got {nbytes!r}")
    previous, _backward_band_bytes = _backward_band_bytes, nbytes
    return previous


# On the CPU, above the direct kernels' N, the weight is decoded a band of rows at a time and each
# band multiplied in float32 (float32_product): no layer needs its whole weight in float32 at once
# (28672x8192: 0.94 GB beside its 0.47 GB fp16 decode), and a band is still in cache when its
# product reads it. ~4 MB of float32 a band.
CPU_BAND_BYTES = 4 << 20


def cpu_band_rows(m: int, k: int, tile_rows: int) -> int:
    """Rows of each CPU forward band of a ``[m, k]`` weight: a multiple of ``tile_rows``."""
    return min(m, max(tile_rows, CPU_BAND_BYTES // (4 * k) // tile_rows * tile_rows))


def float32_product(x2: torch.Tensor, bands, m: int, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x2 [N, K] @ W.T + bias`` summed in float32 and rounded once to x2's dtype, from ``bands``:
    ``(r0, r1, W[r0:r1])`` covering W's M rows, in the K order of x2's columns."""
    xt = x2.float().t()
    yt = torch.empty((m, x2.shape[0]), dtype=torch.float32)
    for r0, r1, w in bands:
        torch.mm(w.float(), xt, out=yt[r0:r1])
    y = torch.empty((x2.shape[0], m), dtype=x2.dtype)
    return y.copy_(yt.t() if bias is None else yt.t() + bias.float())


def band_rows(m: int, k: int, tile_rows: int) -> int:
    """Rows of each backward band for a ``[m, k]`` weight: a multiple of ``tile_rows``, all of
    ``m`` when no bound is set or the weight fits in it (and under torch.compile, where the
    TCA-BME bands' bounds would be data-dependent)."""
    budget = _backward_band_bytes
    if budget is None or torch.compiler.is_compiling():
        return m
    rows = max(tile_rows, budget // (2 * k) // tile_rows * tile_rows)
    return min(rows, m)


def linear_input_grads(grad, decode_bands, needs_x: bool, needs_bias: bool):
    """``F.linear``'s input gradients for ``y = x @ W.T + bias`` with ``grad`` ``[N, M]``:
    ``grad_x = grad @ W``, made only when x needs it, from ``decode_bands()``, which yields
    ``(r0, r1, W[r0:r1])`` covering the M rows in order, and ``grad_bias``, the sum of ``grad``
    over tokens. With more than one band the products (cuBLAS, fp32 accumulation inside each) are
    summed in fp32, rounded once at the end."""
    grad_x = None
    if needs_x:
        acc = None
        for r0, r1, band in decode_bands():
            if r0 == 0 and r1 == grad.shape[1]:
                grad_x = grad @ band
                break
            part = grad[:, r0:r1] @ band
            acc = part.float() if acc is None else acc.add_(part)
            del band, part  # before the next band is decoded: one band alive at a time
        if grad_x is None:
            grad_x = acc.to(grad.dtype)
    grad_bias = grad.sum(0) if needs_bias else None
    return grad_x, grad_bias
