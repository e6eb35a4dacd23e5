"""Measured split-K factors for the CUDA kernels, per device, weight shape and token tile.

The kernels' planners pick a split-K factor by rule (spinfer/csrc/spmm_smbd.cu,
lowbit_mm.cu). Same-process sweeps on an H100 found the rule up to 10-17% off on some layers
(docs/kernels.md, "The split rule"), and no single rule that wins everywhere: the best factor
moves with the shape, the token count and, for TCA-BME, the sparsity (through shared memory
and so resident blocks). So this module measures it: :func:`tune_spmm` / :func:`tune_lowbit`
time the candidate factors for a weight at the token counts asked for and keep the fastest
where it beats the planner, in memory and in ``splits.json`` under the spinfer cache folder.
:func:`spinfer.spmm` and :func:`spinfer.lowbit_mm` look the factor up on every call (a dict
lookup) and fall back to the planner; ``SparseLinear(policy="autotune")`` tunes its layer.

Entries are keyed by what sets a launch's shape: the device, the weight's shape, for TCA-BME
its longest GroupTile run (it sizes shared memory) and for low-bit its width and group, and
the kernel's token tile and tile count at N (the planners' tile rule, mirrored below).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Dict, Iterable, Optional, Tuple

import torch

from . import build
from .cache import cache_root, read_all, write_entry

_FILE = "splits.json"
SPMM_CANDIDATES = (1, 2, 3, 4, 6, 8, 12)
LOWBIT_CANDIDATES = (-1, 1, 2, 3, 4, 6)  # -1: the low-bit kernel's balanced schedule
# A factor is kept only if it beats the planner's own choice by this much: closer than that,
# the difference is within run-to-run noise and the planner's rule stays in charge.
MIN_GAIN = 0.02

_table: Dict[str, int] = {}
_loaded_from: Optional[str] = None  # the $SPINFER_CACHE value the table was read under ("" unset)
_generation = 0  # bumped whenever the table may have changed (see generation)
_device_keys: Dict[int, str] = {}


@functools.lru_cache(maxsize=None)
def kernel_revision() -> str:
    """The kernels' revision, part of every stored figure's key: the hash the extension's build is
    named by (its sources, torch, the flags). A split factor, a calibrated device profile or an
    autotuned time measured one build's kernels, and a kernel or planner change makes it wrong
    (SMBD v21 runs N = 65-256 11-15% faster than v20), so figures another build stored are not
    used, and the planners' rules and the defaults stand until they are measured again."""
    return build._source_hash()


def device_key(device: torch.device) -> str:
    """What identifies a GPU for tuned figures: name, compute capability and SM count, and the
    kernels' revision (kernel_revision)."""
    props = torch.cuda.get_device_properties(device)
    return f"{props.name}|sm{props.major}{props.minor}|{props.multi_processor_count}|{kernel_revision()}"


def _device_key_cached(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _device_keys:
        _device_keys[index] = device_key(torch.device("cuda", index))
    return _device_keys[index]


def spmm_tile(n: int) -> Tuple[int, int]:
    """(token tile, tiles) of the SMBD kernel at N (spmm_smbd_plan). Past 64 tokens the sm_90 wgmma
    kernel takes 128-token tiles and the others two 64-token tiles each: both group N alike."""
    bn = 8 if n <= 8 else 16 if n <= 16 else 32 if n <= 32 else 64 if n <= 64 else 128
    return bn, math.ceil(n / bn)


def lowbit_tile(n: int) -> Tuple[int, int]:
    """(token tile, tiles) of the fused low-bit kernel at N (lowbit_mm_plan)."""
    bn = 8 if n <= 8 else 16 if n <= 16 else 32
    return bn, math.ceil(n / bn)


def _spmm_key(device, weight, n: int) -> str:
    m, k = weight.shape
    bn, tiles = spmm_tile(n)
    return f"{_device_key_cached(device)}|spmm|{m}x{k}|run{weight.max_run}|T{bn}x{tiles}"


def _lowbit_key(device, weight, n: int) -> str:
    m, k = weight.shape
    bn, tiles = lowbit_tile(n)
    return f"{_device_key_cached(device)}|lowbit{weight.bits}g{weight.group_size}|{m}x{k}|T{bn}x{tiles}"


def generation() -> int:
    """A number that changes whenever the table may have: a factor tuned, the table cleared or read
    again. SparseLinear keeps each token count's launch between calls and looks the factor up again
    when this moves."""
    return _generation


def _table_now() -> Dict[str, int]:
    """The table, read from the cache folder on first use and again when $SPINFER_CACHE changes.
    Called on every spmm / lowbit_mm call: an environment lookup, no path or file work. Empty while
    torch.compile traces, which cannot follow the file read (with fullgraph=True a model compiled
    before any eager call failed there): compiled graphs take the kernels' split rule."""
    global _loaded_from, _generation
    if torch.compiler.is_compiling():
        return {}
    where = os.environ.get("SPINFER_CACHE", "")
    if _loaded_from != where:
        _generation += 1
        _table.clear()
        _table.update({k: v for k, v in read_all(_FILE).items()
                       if isinstance(v, int) and not isinstance(v, bool) and v >= (-1 if "|lowbit" in k else 0)})
        _loaded_from = where
    return _table


def spmm_splits(weight, n: int, device: torch.device) -> int:
    """The tuned split-K factor for ``spinfer.spmm(x, weight)`` with N tokens, 0 if none (and
    while torch.compile traces: see _table_now)."""
    table = _table_now()
    return table.get(_spmm_key(device, weight, n), 0) if table else 0


def lowbit_splits(weight, n: int, device: torch.device) -> int:
    """The tuned schedule for ``spinfer.lowbit_mm(x, weight)`` with N tokens: a split-K factor,
    -1 for the balanced schedule, 0 if none (and while torch.compile traces: see _table_now)."""
    table = _table_now()
    return table.get(_lowbit_key(device, weight, n), 0) if table else 0


def _record(key: str, splits: int, save: bool) -> None:
    global _generation
    _table_now()[key] = splits
    _generation += 1
    if save:
        write_entry(_FILE, key, splits)


def _tune(run, key_of, ns: Iterable[int], candidates, k: int, device, dtype, reps: int, save: bool
          ) -> Dict[int, dict]:
    from .timing import median_time

    if torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():
        raise RuntimeError("split-K tuning times the kernels: call it before CUDA graph capture or torch.compile")
    report = {}
    for n in ns:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"token counts must be ints >= 1, got {n!r}")
        x = torch.randn(n, k, device=device, dtype=dtype)
        times = {s: median_time(lambda s=s: run(x, s), device, reps=reps, max_seconds=2.0) for s in (0, *candidates)}
        best = min(times, key=times.get)
        chosen = best if times[best] < (1 - MIN_GAIN) * times[0] else 0
        _record(key_of(n), chosen, save)
        report[n] = {"splits": chosen, "times": times}
    return report


def tune_spmm(weight, ns: Iterable[int] = (1, 8, 16, 32), *, candidates=SPMM_CANDIDATES, reps: int = 20,
              save: bool = True) -> Dict[int, dict]:
    """Time ``spinfer.spmm`` on ``weight`` (a CUDA :class:`~spinfer.TCABME`) with each split-K
    factor in ``candidates`` and the planner's own (0), at each N in ``ns``; keep the fastest
    for later calls where it beats the planner by more than 2%. Returns, per N, the kept
    factor (0: the planner's) and every candidate's median seconds."""
    from .format import TCABME
    from .ops.spmm import spmm

    if not isinstance(weight, TCABME) or weight.values.device.type != "cuda":
        raise TypeError("tune_spmm needs a TCABME weight on a CUDA device")
    device = weight.values.device
    return _tune(lambda x, s: spmm(x, weight, splits=s), lambda n: _spmm_key(device, weight, n), ns,
                 candidates, weight.shape[1], device, weight.values.dtype, reps, save)


def tune_lowbit(weight, ns: Iterable[int] = (1, 8, 16, 32), *, candidates=LOWBIT_CANDIDATES, reps: int = 20,
                save: bool = True) -> Dict[int, dict]:
    """:func:`tune_spmm` for ``spinfer.lowbit_mm`` and a CUDA :class:`~spinfer.LowBitWeight`
    (the fused kernel, N <= fused_max_n(bits): where lowbit_mm runs it)."""
    from .ops.lowbit_mm import fused_max_n, lowbit_mm
    from .quant import LowBitWeight

    if not isinstance(weight, LowBitWeight) or weight.qweight.device.type != "cuda":
        raise TypeError("tune_lowbit needs a LowBitWeight on a CUDA device")
    ns = list(ns)
    if any(isinstance(n, int) and n > fused_max_n(weight.bits) for n in ns):
        raise ValueError(f"lowbit_mm runs the fused kernel for N <= {fused_max_n(weight.bits)} at {weight.bits} bits; "
                         f"got {ns}")
    device = weight.qweight.device
    return _tune(lambda x, s: lowbit_mm(x, weight, splits=s), lambda n: _lowbit_key(device, weight, n), ns,
                 candidates, weight.shape[1], device, weight.scale_zero.dtype, reps, save)


def clear(*, saved: bool = False) -> None:
    """Forget the tuned factors of this process (and with ``saved=True`` the cache file's)."""
    global _loaded_from, _generation
    _table.clear()
    _generation += 1
    _loaded_from = os.environ.get("SPINFER_CACHE", "")  # do not re-read the file
    if saved:
        (cache_root() / _FILE).unlink(missing_ok=True)
