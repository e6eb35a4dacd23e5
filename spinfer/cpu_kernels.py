"""The compiled CPU codecs of compressed weights (``spinfer/csrc/cpu/codec.cpp``), loaded with
ctypes: TCA-BME (:func:`tca_bme_decode`, and its encoder :func:`tca_bme_encode`) and the low-bit
format (:func:`lowbit_dequantize`).

On the CPU a compressed layer decodes its weight and multiplies it densely. Decoding with torch
ops took ~170 ms for a 4096x4096 weight at 50% and ~160 ms at 4 bits on two cores, 70x
F.linear's time at one token; the compiled TCA-BME decoder spreads each BitmapTile row's values
into place with one shuffle, the dequantizer reads each row's packed words once.

The source is plain C++17 with a C interface and no torch headers, built on first use with the
system's C++ compiler (``CXX``, else ``c++``) in about a second, into the cache folder
(``$SPINFER_CACHE`` or ``~/.cache/spinfer``), and reused after that. Where no compiler works the
CPU path falls back to the torch-op reference decoders, with one warning that says why;
``SPINFER_CPU_KERNELS=0`` asks for the references. Both give the same bits (tests/test_cpu_kernels.py).
``python -m spinfer.build`` builds it ahead and reports. The same library encodes TCA-BME on the
CPU (:func:`tca_bme_encode`, which :func:`spinfer.format.tca_bme.encode` calls there).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Optional, Tuple

import torch

from .cache import cache_root

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu" / "codec.cpp"
HEADERS = (Path(__file__).resolve().parent / "csrc" / "record_layout.h",)  # what SOURCE includes of ours
BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread"]
ABI_VERSION = 7  # spinfer_cpu_abi_version() of the source above

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_failure: Optional[str] = None  # why the library is unavailable, once it is known


def enabled() -> bool:
    return os.environ.get("SPINFER_CPU_KERNELS", "1") != "0"


def compiler() -> Optional[str]:
    cxx = os.environ.get("CXX") or "c++"
    return shutil.which(cxx) or shutil.which("g++") or shutil.which("clang++")


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def flags() -> list:
    """The compiler flags: on x86, SSSE3's shuffle, the POPCNT instruction and F16C's float-to-half
    conversion where this CPU has them (every x86-64 CPU of the last ten years; without -mpopcnt
    each PopCount is a libgcc call, which made the TCA-BME decoder ~2x slower, and without F16C the
    fp16 dequantizer rounds in integer code, 2-4x slower; the source has a form for either), and
    AVX2 with FMA, whose 8-wide sums the low-bit direct kernel uses for its products."""
    extra = os.environ.get("SPINFER_CPU_CFLAGS", "").split()  # e.g. -fsanitize=address: scripts/asan_cpu.sh
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386"):
        return BASE_FLAGS + extra
    have = _cpu_flags()
    wide = ["-mavx2", "-mfma"] if {"avx2", "fma"} <= have else []
    return BASE_FLAGS + [f"-m{f}" for f in ("ssse3", "popcnt", "f16c") if f in have] + wide + extra


def library_path(cxx: str) -> Path:
    """Where the library built by ``cxx`` lives: keyed by the source and its headers, the compiler
    and its flags, and the machine, so a changed source or another compiler builds anew."""
    h = hashlib.sha256(SOURCE.read_bytes())
    for header in HEADERS:
        h.update(header.read_bytes())
    h.update("\0".join([cxx, *flags(), platform.machine(), sys.platform]).encode())
    return cache_root() / f"cpu-{h.hexdigest()[:16]}" / "libspinfer_cpu.so"


def _build(cxx: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        run = subprocess.run([cxx, *flags(), str(SOURCE), "-o", str(tmp)], capture_output=True, text=True,
                             timeout=600)
        if run.returncode != 0:
            raise RuntimeError(f"{cxx} failed on {SOURCE.name} (exit {run.returncode}):\n"
                               + (run.stderr or run.stdout)[-2000:])
        tmp.replace(path)  # atomic: a concurrent process loads the old file or the new one
    finally:
        tmp.unlink(missing_ok=True)


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    version = lib.spinfer_cpu_abi_version()
    if version != ABI_VERSION:
        raise RuntimeError(f"{path} reports interface version {version}, expected {ABI_VERSION}")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.spinfer_tca_bme_decode.argtypes = [ptr, ptr, i64, ptr, i64, i64, i64, i64, ptr, ctypes.c_int]
    lib.spinfer_tca_bme_decode.restype = ctypes.c_int
    lib.spinfer_lowbit_dequantize.argtypes = [ptr, ptr, i64, i64, ctypes.c_int, i64, ctypes.c_int, ctypes.c_int, ptr,
                                              ctypes.c_int]
    lib.spinfer_lowbit_dequantize.restype = ctypes.c_int
    lib.spinfer_tca_bme_count.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ctypes.c_int]
    lib.spinfer_tca_bme_count.restype = ctypes.c_int
    lib.spinfer_tca_bme_pack.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, ctypes.c_int]
    lib.spinfer_tca_bme_pack.restype = ctypes.c_int
    lib.spinfer_tca_bme_spmm.argtypes = [ptr, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_int, ptr, i64, ptr,
                                         ctypes.c_int]
    lib.spinfer_tca_bme_spmm.restype = ctypes.c_int
    lib.spinfer_lowbit_spmm.argtypes = [ptr, ptr, i64, i64, ctypes.c_int, i64, ctypes.c_int, ctypes.c_int, ptr, i64,
                                        ptr, ctypes.c_int]
    lib.spinfer_lowbit_spmm.restype = ctypes.c_int
    lib.spinfer_round_floats.argtypes = [ptr, i64, ctypes.c_int, ptr]
    lib.spinfer_round_floats.restype = None
    return lib


def library() -> Optional[ctypes.CDLL]:
    """The compiled library, built on first use; None where disabled or unbuildable (warned once)."""
    global _lib, _failure
    if not enabled():
        return None
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None or _failure is not None:
            return _lib
        cxx = compiler()
        try:
            if cxx is None:
                raise RuntimeError("no C++ compiler found (set CXX)")
            path = library_path(cxx)
            if not path.exists():
                _build(cxx, path)
            _lib = _load(path)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            _failure = str(exc)
            warnings.warn(f"spinfer: the compiled CPU decoders are unavailable, using the slower torch-op "
                          f"references: {_failure}", RuntimeWarning, stacklevel=2)
    return _lib


def unavailable_reason() -> Optional[str]:
    """Why :func:`library` returned None (None while it is available or not yet asked for)."""
    return "disabled by SPINFER_CPU_KERNELS=0" if not enabled() else _failure


def _threads() -> int:
    return max(1, torch.get_num_threads())


def tca_bme_decode(bitmap: torch.Tensor, values: torch.Tensor, gtile_offset: torch.Tensor, m: int, k: int,
                   group_tile) -> Optional[torch.Tensor]:
    """Dense ``[m, k]`` in the values' dtype from CPU TCA-BME arrays, bit-exact; None where the
    library is unavailable. The sizes are checked here and every run against the values array in
    C++, so no call reads outside the arrays; the bits' placement is the caller's to have checked
    (``validate_arrays``: a bitmap inconsistent with the offsets decodes to a wrong matrix)."""
    lib = library()
    if lib is None or values.device.type != "cpu":
        return None
    gt_h, gt_w = _check_tca_bme(bitmap, values, gtile_offset, m, k, group_tile)
    bitmap, values, gtile_offset = bitmap.contiguous(), values.contiguous(), gtile_offset.contiguous()
    out = torch.empty((m, k), dtype=values.dtype)
    rc = lib.spinfer_tca_bme_decode(bitmap.data_ptr(), values.data_ptr(), values.numel(), gtile_offset.data_ptr(),
                                    m, k, gt_h, gt_w, out.data_ptr(), _threads())
    _raise_for(rc, m, k, gt_h, gt_w)
    return out


def _check_tca_bme(bitmap, values, gtile_offset, m: int, k: int, group_tile) -> Tuple[int, int]:
    """The arrays' dtypes and sizes against an ``m x k`` weight (the C++ side reads exactly these
    sizes); the GroupTile shape."""
    gt_h, gt_w = (int(v) for v in group_tile)
    gm, gk = -(-m // gt_h), -(-k // gt_w)
    if (bitmap.dtype != torch.int64 or gtile_offset.dtype != torch.int32
            or values.dtype not in (torch.float16, torch.bfloat16)):
        raise TypeError(f"TCA-BME arrays must be int64 / fp16 or bf16 / int32, got {bitmap.dtype} / "
                        f"{values.dtype} / {gtile_offset.dtype}")
    if bitmap.numel() != gm * gk * gt_h * gt_w // 64 or gtile_offset.numel() != gm * gk + 1:
        raise ValueError(f"TCA-BME arrays of {bitmap.numel()} bitmap words and {gtile_offset.numel()} offsets do not "
                         f"fit a {m}x{k} weight in {gt_h}x{gt_w} GroupTiles")
    return gt_h, gt_w


def _raise_for(rc: int, m: int, k: int, gt_h: int, gt_w: int) -> None:
    if rc == 1:
        raise ValueError("a GroupTile's run reaches past the values array (corrupt gtile_offset or bitmap)")
    if rc != 0:
        raise ValueError(f"the CPU decoder refused a {m}x{k} weight in {gt_h}x{gt_w} GroupTiles (code {rc})")


def tca_bme_spmm(x: torch.Tensor, bitmap: torch.Tensor, values: torch.Tensor, gtile_offset: torch.Tensor, m: int,
                 k: int, group_tile) -> Optional[torch.Tensor]:
    """``x [N, k] @ W.T`` in float32 (``[N, m]``) straight from CPU TCA-BME arrays, without the
    dense weight: each stored value times the tokens' x, summed in float32; None where the library
    is unavailable. The arrays are checked as :func:`tca_bme_decode` checks them."""
    lib = library()
    if lib is None or values.device.type != "cpu":
        return None
    gt_h, gt_w = _check_tca_bme(bitmap, values, gtile_offset, m, k, group_tile)
    x = _check_x(x, k, values.dtype)
    bitmap, values, gtile_offset = bitmap.contiguous(), values.contiguous(), gtile_offset.contiguous()
    y = torch.empty((x.shape[0], m), dtype=torch.float32)
    rc = lib.spinfer_tca_bme_spmm(bitmap.data_ptr(), values.data_ptr(), values.numel(), gtile_offset.data_ptr(), m, k,
                                  gt_h, gt_w, int(values.dtype == torch.bfloat16), x.data_ptr(), x.shape[0],
                                  y.data_ptr(), _threads())
    _raise_for(rc, m, k, gt_h, gt_w)
    return y


def tca_bme_encode(weight: torch.Tensor, group_tile) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(bitmap, values, gtile_offset)`` of a CPU ``[M, K]`` fp16 / bf16 weight that
    ``check_weight`` accepted, as :func:`spinfer.format.tca_bme.encode_reference` makes them; None
    where the library is unavailable. Two passes: the bitmap and each GroupTile's count, then,
    with the offsets summed here, the runs."""
    from .format.tca_bme import VALUE_ALIGN, Geometry  # (the format module imports this one)

    lib = library()
    if lib is None or weight.device.type != "cpu":
        return None
    m, k = weight.shape
    geom = Geometry(m, k, *(int(v) for v in group_tile))
    w = weight.detach().contiguous()
    bitmap = torch.empty(geom.num_bitmap_tiles, dtype=torch.int64)
    counts = torch.empty(geom.num_group_tiles, dtype=torch.int64)
    rc = lib.spinfer_tca_bme_count(w.data_ptr(), m, k, geom.gt_h, geom.gt_w, bitmap.data_ptr(), counts.data_ptr(),
                                   _threads())
    if rc != 0:
        raise ValueError(f"the CPU encoder refused a {m}x{k} weight in {geom.gt_h}x{geom.gt_w} GroupTiles (code {rc})")
    ends = torch.cumsum(counts + (-counts) % VALUE_ALIGN, 0)
    total = int(ends[-1])
    if total > torch.iinfo(torch.int32).max:
        raise ValueError(f"weight has {total} stored values, more than int32 GroupTile offsets can address")
    offsets = torch.zeros(geom.num_group_tiles + 1, dtype=torch.int32)
    offsets[1:] = ends
    values = torch.empty(total, dtype=w.dtype)
    rc = lib.spinfer_tca_bme_pack(w.data_ptr(), m, k, geom.gt_h, geom.gt_w, offsets.data_ptr(), values.data_ptr(),
                                  total, _threads())
    if rc != 0:  # (pass 2 counts what pass 1 counted: only a weight changed in between lands here)
        raise RuntimeError(f"the CPU encoder's runs did not fit the offsets of its own counts (code {rc}); was the "
                           "weight written to while it was encoded?")
    return bitmap, values, offsets


def lowbit_dequantize(qweight: torch.Tensor, scale_zero: torch.Tensor, bits: int, group_size: int, m: int,
                      k: int) -> Optional[torch.Tensor]:
    """Dense ``[m, k]`` in ``scale_zero``'s dtype from a CPU low-bit weight's arrays, in the stored
    K order, bit-exact against :func:`spinfer.quant.lowbit.dequantize`; None where the library
    is unavailable. The arrays' dtypes and shapes are checked here, so no call reads outside them."""
    lib = library()
    if lib is None or qweight.device.type != "cpu":
        return None
    qweight, scale_zero, nibble = _check_lowbit(qweight, scale_zero, bits, group_size, m, k)
    out = torch.empty((m, k), dtype=scale_zero.dtype)
    rc = lib.spinfer_lowbit_dequantize(qweight.data_ptr(), scale_zero.data_ptr(), m, k, bits, group_size,
                                       int(scale_zero.dtype == torch.bfloat16), nibble,
                                       out.data_ptr(), _threads())
    if rc != 0:
        raise ValueError(f"the CPU dequantizer refused a {m}x{k} {bits}-bit weight (code {rc})")
    return out


def lowbit_spmm(x: torch.Tensor, qweight: torch.Tensor, scale_zero: torch.Tensor, bits: int, group_size: int,
                m: int, k: int) -> Optional[torch.Tensor]:
    """``x [N, k] @ W.T`` in float32 (``[N, m]``, W in the stored K order) straight from a CPU
    low-bit weight's arrays: each row dequantized chunk by chunk as the reference dequantizes it and
    multiplied by the tokens' x, summed in float32, without the dense weight; None where the
    library is unavailable. The arrays are checked as :func:`lowbit_dequantize` checks them."""
    lib = library()
    if lib is None or qweight.device.type != "cpu":
        return None
    qweight, scale_zero, nibble = _check_lowbit(qweight, scale_zero, bits, group_size, m, k)
    x = _check_x(x, k, scale_zero.dtype)
    y = torch.empty((x.shape[0], m), dtype=torch.float32)
    rc = lib.spinfer_lowbit_spmm(qweight.data_ptr(), scale_zero.data_ptr(), m, k, bits, group_size,
                                 int(scale_zero.dtype == torch.bfloat16), nibble, x.data_ptr(),
                                 x.shape[0], y.data_ptr(), _threads())
    if rc != 0:
        raise ValueError(f"the CPU low-bit kernel refused a {m}x{k} {bits}-bit weight (code {rc})")
    return y


def _check_x(x: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """x as the direct kernels read it: ``[N, k]`` in the weight's dtype, contiguous. (They widen it
    to float32 themselves: a torch copy of more than 32768 elements leaves torch's OpenMP threads
    spinning on the cores these kernels' threads need; codec.cpp, widen_rows.)"""
    if x.dim() != 2 or x.shape[1] != k or x.shape[0] < 1:
        raise ValueError(f"x must be [N >= 1, {k}], got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise TypeError(f"x is {x.dtype}, the weight {dtype}")
    return x.contiguous()


def _check_lowbit(qweight, scale_zero, bits: int, group_size: int, m: int, k: int):
    """The arrays' dtypes and shapes against an ``m x k`` weight (the C++ side reads exactly these
    sizes); the arrays, contiguous, and 1 where the records hold 4-bit zeros (else 0)."""
    # (imported here: the quant package imports the ops, which import this module)
    from .quant.lowbit import RECORD_DTYPE_ZEROS, RECORD_NIBBLE_ZEROS, qweight_shape

    if bits not in (1, 2, 4, 8) or group_size < 1 or k % group_size:
        raise ValueError(f"cannot dequantize {bits}-bit weights in groups of {group_size} over K = {k}")
    if qweight.dtype != torch.int32 or scale_zero.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"qweight must be int32 and scale_zero fp16 or bf16, got {qweight.dtype} and "
                        f"{scale_zero.dtype}")
    widths = (RECORD_NIBBLE_ZEROS, RECORD_DTYPE_ZEROS) if bits <= 4 else (RECORD_DTYPE_ZEROS,)
    if (tuple(qweight.shape) != qweight_shape(m, k, bits) or scale_zero.dim() != 3
            or tuple(scale_zero.shape[:2]) != (-(-m // 64), k // group_size) or scale_zero.shape[2] not in widths):
        raise ValueError(f"qweight {tuple(qweight.shape)} and scale_zero {tuple(scale_zero.shape)} do not fit a "
                         f"{m}x{k} {bits}-bit weight in groups of {group_size}")
    return qweight.contiguous(), scale_zero.contiguous(), int(scale_zero.shape[2] == RECORD_NIBBLE_ZEROS)
