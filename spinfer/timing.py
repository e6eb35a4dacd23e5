"""One way to time an op, shared by the demo and the benchmarks.

CPU: host clock around each call.  CUDA: events around each call after warm-up, with an
optional L2 flush (reading a buffer larger than L2) before every timed call so weights that
would fit in L2 are read from HBM as they are in a real model.  Median of the repeats.

CUDA times are device times: after the flush a short spin kernel (~100 us) gives the host time
to enqueue the call before the start event runs, so Python and launch overhead (which CUDA
graphs remove in serving) never shows up as idle GPU time inside the measurement. Host
overhead per call is a separate figure (``host_overhead``).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

_FLUSH: dict = {}
_HEADROOM_CYCLES = 200_000  # ~100 us at H100 clocks


def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    key = str(device)
    if key not in _FLUSH:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
        _FLUSH[key] = torch.empty(max(2 * l2, 128 << 20), dtype=torch.uint8, device=device)
    return _FLUSH[key]


def _flush_l2(buf: torch.Tensor) -> None:
    # Read, not write: a written buffer leaves L2 full of dirty lines whose write-back then
    # competes with the timed call's reads.
    torch.sum(buf, dtype=torch.int32)


def median_time(
    fn: Callable[[], object],
    device: torch.device,
    *,
    reps: int = 50,
    warmup: int = 5,
    flush_l2: bool = True,
    max_seconds: Optional[float] = 10.0,
) -> float:
    """Median seconds of ``fn()`` on ``device``; stops early after ``max_seconds``."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    deadline = time.perf_counter() + max_seconds if max_seconds else None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        flush = _l2_flush_buffer(device) if flush_l2 else None
        for _ in range(reps):
            if flush is not None:
                _flush_l2(flush)
            torch.cuda._sleep(_HEADROOM_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
            if deadline and time.perf_counter() > deadline:
                break
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if deadline and time.perf_counter() > deadline:
                break
    return statistics.median(times)


# Rounds of least_of_rounds. One 10-rep median can come out several times its true value: in each
# of two H100 runs of `spinfer bench policy` one candidate measured 3-5x its time in the other run
# (14336x4096 at 50%, N = 1: SpMM 159.8 against 35.1 us; 1024x4096 at 50%, N = 256: decode + dense
# 113.0 against 19.8 us, docs/policy-crossover-bulk-h100-2026-11-23.log), and each such cell alone
# broke issue 5's "never more than 10% slower".
ROUNDS = 3


def least_of_rounds(fns: Dict[str, Callable[[], object]], device: torch.device, *, rounds: int = ROUNDS,
                    shuffle: bool = False, **kwargs) -> Dict[str, float]:
    """The least of ``rounds`` medians (:func:`median_time`, ``kwargs`` as there) of each of
    ``fns``, measured round by round with the calls interleaved (:func:`rounds_of`): a disturbance
    that slows one stretch of time lands on one round of one call, and the comparison of the calls
    keeps the undisturbed rounds. The A/B scripts (benchmarks/ab_spmm.py) use it with
    ``shuffle``: on H100 a median is now and then ~1 us slower than its call's others, and with a
    fixed or rotated order one call could take that in every round (docs/quant.md, twenty-sixth
    session)."""
    return {name: min(ts) for name, ts in rounds_of(fns, device, rounds=rounds, shuffle=shuffle, **kwargs).items()}


def rounds_of(fns: Dict[str, Callable[[], object]], device: torch.device, *, rounds: int = ROUNDS,
              shuffle: bool = False, **kwargs) -> Dict[str, List[float]]:
    """Each of ``fns``'s :func:`median_time` (``kwargs`` as there) in every one of ``rounds``
    rounds, the calls interleaved round by round: every call is timed in the same stretches of
    the machine's state, whatever its place in the dict. ``shuffle``: round r > 0 runs the calls in
    an order shuffled by a generator seeded with r (reproducible)."""
    times: Dict[str, List[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        order = names[:]
        if shuffle and r:
            random.Random(r).shuffle(order)
        for name in order:
            times[name].append(median_time(fns[name], device, **kwargs))
    return times


def copy_bandwidth(device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Bytes read + written per second by a device-to-device copy of ``nbytes`` (median): the
    bandwidth ceiling every benchmark reports against."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / median_time(lambda: dst.copy_(src), device, reps=reps, flush_l2=False)


def host_overhead(fn: Callable[[], object], device, reps: int = 200) -> float:
    """Host seconds per call of ``fn()`` when calls are issued back to back (the GPU queue
    absorbs them): the Python + dispatch + launch cost a caller pays without CUDA graphs."""
    fn()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize(device)
    return (t1 - t0) / reps


def profiled_kernels(fn: Callable[[], object], reps: int) -> list:
    """The GPU kernels of ``reps`` calls of ``fn()`` in start order (torch.profiler's CUDA activity;
    each has ``.name`` and ``.time_range.start`` / ``.end`` in us). The calls are issued back to
    back; ``fn`` synchronizes itself where the gaps between calls must not count."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)
