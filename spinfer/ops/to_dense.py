"""``spinfer::tca_bme_to_dense`` and ``spinfer::lowbit_to_dense``: a compressed weight as a dense
``[M, K]`` matrix in its dtype.

CPU: the compiled decoders (spinfer/cpu_kernels.py), else the references. CUDA: one streaming
kernel each (spinfer/csrc/to_dense.cu). Both bit-exact against the references. :meth:`TCABME.to_dense
<spinfer.format.TCABME.to_dense>` and :meth:`LowBitWeight.dequantize
<spinfer.quant.LowBitWeight.dequantize>` call them; at large N the layers decode once and run
one dense GEMM (the ``decode+dense`` kernel of a TCA-BME layer, and ``lowbit_mm`` above
``fused_max_n(bits)``).
"""

from __future__ import annotations

import torch

from .. import build, cpu_kernels
from ..format.tca_bme import Geometry, decode, validate_arrays
from ..quant.lowbit import LowBitWeight, dequantize, restore_k_order
from . import library  # noqa: F401  (defines the schemas)


@torch.library.register_fake("spinfer::tca_bme_to_dense")
def _tca_bme_to_dense_fake(bitmap, values, gtile_offset, m, k, gt_h, gt_w):
    return values.new_empty((m, k))


def decode_on_cpu(bitmap, values, gtile_offset, m: int, k: int, group_tile) -> torch.Tensor:
    """Dense ``[m, k]`` of validated CPU TCA-BME arrays: the compiled decoder, or the reference
    :func:`~spinfer.format.tca_bme.decode` where it is unavailable. Bit-exact either way."""
    w = cpu_kernels.tca_bme_decode(bitmap, values, gtile_offset, m, k, group_tile)
    return decode(bitmap, values, gtile_offset, (m, k), group_tile) if w is None else w


def _tca_bme_to_dense_cpu(bitmap, values, gtile_offset, m, k, gt_h, gt_w):
    # The arrays may come from anywhere when the op is called directly: check them fully.
    validate_arrays(bitmap, values, gtile_offset, Geometry(m, k, gt_h, gt_w))
    return decode_on_cpu(bitmap, values, gtile_offset, m, k, (gt_h, gt_w))


@torch.library.register_fake("spinfer::lowbit_to_dense")
def _lowbit_to_dense_fake(qweight, scale_zero, bits, group_size, m, k):
    return scale_zero.new_empty((m, k))


def dequantize_on_cpu(qweight, scale_zero, bits: int, group_size: int, m: int, k: int, perm=None) -> torch.Tensor:
    """Dense ``[m, k]`` of a checked CPU low-bit weight's arrays, in the original K order: the
    compiled dequantizer, or the reference :func:`~spinfer.quant.lowbit.dequantize` where it is
    unavailable. Bit-exact either way."""
    w = cpu_kernels.lowbit_dequantize(qweight, scale_zero, bits, group_size, m, k)
    if w is None:
        return dequantize(qweight, scale_zero, bits, group_size, (m, k), perm)
    return w if perm is None else restore_k_order(w, perm)


def _lowbit_to_dense_cpu(qweight, scale_zero, bits, group_size, m, k):
    LowBitWeight(qweight, None, None, bits, group_size, (m, k), scale_zero=scale_zero)  # validates
    return dequantize_on_cpu(qweight, scale_zero, bits, group_size, m, k)


torch.library.impl("spinfer::tca_bme_to_dense", "CPU")(_tca_bme_to_dense_cpu)
torch.library.impl("spinfer::lowbit_to_dense", "CPU")(_lowbit_to_dense_cpu)


def tca_bme_to_dense(weight) -> torch.Tensor:
    """Dense ``[M, K]`` of a :class:`~spinfer.format.TCABME` (CUDA kernel for GroupTile 64x64 on a
    GPU, the compiled CPU decoder on the CPU, the reference decoder otherwise)."""
    m, k = weight.shape
    if build.load_for(weight.bitmap) and tuple(weight.group_tile) == (64, 64):
        return torch.ops.spinfer.tca_bme_to_dense(weight.bitmap, weight.values, weight.gtile_offset, m, k, 64, 64)
    if weight.bitmap.device.type == "cpu":
        return decode_on_cpu(weight.bitmap, weight.values, weight.gtile_offset, m, k, weight.group_tile)
    return decode(weight.bitmap, weight.values, weight.gtile_offset, (m, k), weight.group_tile)


def lowbit_to_dense(weight: LowBitWeight) -> torch.Tensor:
    """Dense ``[M, K]`` of a :class:`~spinfer.quant.LowBitWeight`, in the original K order."""
    m, k = weight.shape
    if build.load_for(weight.qweight):
        w = torch.ops.spinfer.lowbit_to_dense(weight.qweight, weight.scale_zero, weight.bits, weight.group_size, m, k)
    elif weight.qweight.device.type == "cpu":
        w = dequantize_on_cpu(weight.qweight, weight.scale_zero, weight.bits, weight.group_size, m, k)
    else:
        w = dequantize(weight.qweight, weight.scale_zero, weight.bits, weight.group_size, (m, k))
    return w if weight.perm is None else restore_k_order(w, weight.perm)
