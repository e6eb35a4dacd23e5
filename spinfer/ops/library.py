"""The ``spinfer`` torch.library namespace: every op's schema is defined here, once.

Device implementations register beside their definitions (CPU in Python, CUDA from the
compiled extension, ``spinfer/csrc/bindings.cpp``), and each op carries a fake
implementation so it traces under ``torch.compile`` and records into CUDA graphs.
"""

import torch

LIB = torch.library.Library("spinfer", "DEF")

_SPMM_ARGS = (
    "Tensor x, Tensor bitmap, Tensor values, Tensor gtile_offset, "
    "int m, int k, int gt_h, int gt_w, int max_run, Tensor? bias=None, int splits=0, Tensor? row_offset=None"
)
# max_run: the longest GroupTile value run (TCABME.max_run); the CUDA kernel sizes its
# shared-memory value buffers by it. A value below the true maximum is refused on the CPU and,
# on CUDA, truncates runs (wrong results, never an out-of-bounds access).
# splits: the CUDA kernel's split-K factor, 0 for its planner's choice (spinfer/tuning.py tunes
# it per shape and N); the result is the same up to fp32 summation order. The CPU ignores it.
# row_offset: the weight's row table (TCABME.row_offset, int16 [NGT, gt_h / 16] up to 128x128 GroupTiles, int32 beyond); the CUDA kernel
# reads each warp's start in a GroupTile's run from it instead of counting (without it, it counts).
# Wrong values give wrong results on CUDA, never an out-of-range read; the CPU checks its shape.
LIB.define(f"spmm({_SPMM_ARGS}) -> Tensor")
# Writes into a caller-provided [N, M] buffer: static buffers for CUDA graphs, and tests that
# poison the output before the launch. Not differentiable (spmm is, in x and bias).
LIB.define(f"spmm_out({_SPMM_ARGS}, *, Tensor(a!) out) -> ()")
# The CUDA planner's launch configuration for x's N, dtype and device (spinfer.ops.spmm.spmm_plan):
# a host-side query with no fake implementation, not meant for compiled graphs.
LIB.define("spmm_plan(Tensor x, int m, int k, int max_run, int splits=0) -> int[]")

# Weight-only low-bit matmul: y = x @ dequantize(W).T + bias (spinfer/quant/lowbit.py layout).
_LOWBIT_ARGS = (
    "Tensor x, Tensor qweight, Tensor scale_zero, int bits, int group_size, "
    "int m, int k, Tensor? perm=None, Tensor? bias=None, int splits=0, bool integer_zeros=False"
)
# Picks the fused kernel or dequantize-then-cuBLAS by N (spinfer/ops/lowbit_mm.py). splits: the
# fused kernel's split-K factor, as for spmm. integer_zeros: the caller has checked that every zero
# point is one the fused kernel decodes exactly without its per-segment check
# (LowBitWeight.integer_zeros); False is always correct.
LIB.define(f"lowbit_mm({_LOWBIT_ARGS}) -> Tensor")
# Always the fused kernel on CUDA, into a caller-provided [N, M] buffer. Not differentiable
# (lowbit_mm is, in x and bias).
LIB.define(f"lowbit_mm_out({_LOWBIT_ARGS}, *, Tensor(a!) out) -> ()")
# The fused kernel's launch configuration for x's N, dtype and device (spinfer.ops.lowbit_mm.lowbit_plan):
# a host-side query with no fake implementation, like spmm_plan.
LIB.define("lowbit_plan(Tensor x, int m, int k, int bits, int group_size, int splits=0) -> int[]")

# A compressed weight as a dense [m, k] matrix in its dtype (spinfer/ops/to_dense.py): what the
# layers multiply with one dense GEMM at large N. Bit-exact against the formats' reference
# decoders (TCA-BME: every stored pattern; low-bit: (q - zero) * scale in fp32, rounded once,
# without the act-order permutation, which callers apply to x).
LIB.define("tca_bme_to_dense(Tensor bitmap, Tensor values, Tensor gtile_offset, int m, int k, int gt_h, int gt_w) "
           "-> Tensor")
LIB.define("lowbit_to_dense(Tensor qweight, Tensor scale_zero, int bits, int group_size, int m, int k) -> Tensor")


# The _out ops record no gradient. torch's own out= ops refuse inputs that require one, and so
# do these. Before, nothing refused them: on CUDA out came back detached from the graph, so x got
# no gradient through it and nothing said so (fifty-eighth session, on the H100); on the CPU the
# reference's own torch ops happened to record one.
# This is the CPU kernel of that check; spinfer/csrc/bindings.cpp registers the same check for
# every other backend in C++, where a Python kernel would add host time to every call of the _out
# ops (CUDA-graph buffers, the benchmarks).
def _out_grad_message(qualname: str, arg: str) -> str:
    return (f"{qualname}: functions with out=... arguments don't support automatic differentiation, but "
            f"'{arg}' requires grad; call the differentiable op (spinfer.spmm / spinfer.lowbit_mm) or run "
            f"under torch.no_grad()")


def _refuse_grad_through_out(name: str) -> None:
    op = getattr(torch.ops.spinfer, name).default
    arg_names = [a.name for a in op._schema.arguments]

    def kernel(keyset, *args, **kwargs):
        if torch.is_grad_enabled():
            for arg, value in zip(arg_names, (*args, *(kwargs.get(a) for a in arg_names[len(args):]))):
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    raise RuntimeError(_out_grad_message(f"spinfer::{name}", arg))
        with torch._C._AutoDispatchBelowADInplaceOrView():
            op.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args, **kwargs)
        torch.autograd.graph.increment_version(kwargs["out"])

    LIB.impl(name, kernel, "AutogradCPU", with_keyset=True)


for _name in ("spmm_out", "lowbit_mm_out"):
    _refuse_grad_through_out(_name)
