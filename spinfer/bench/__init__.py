"""Benchmarks and studies behind ``spinfer bench`` (``python -m spinfer.bench``)."""

import csv as _csv
import sys as _sys


def parse_shapes(text):
    """``"28672x8192,4096x4096"`` -> ``[(28672, 8192), (4096, 4096)]``."""
    try:
        return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"shapes must look like 28672x8192,4096x4096, got {text!r}") from None


def parse_quants(text):
    """``"1:128,4:64"`` -> ``[(1, 128), (4, 64)]``: (bits, group size) pairs."""
    out = []
    for item in filter(None, text.split(",")):
        bits, _, group = item.partition(":")
        try:
            out.append((int(bits), int(group)))
        except ValueError:
            raise SystemExit(f"low-bit configs must look like 4:128,2:64 (BITS:GROUP), got {item!r}") from None
    return out


def require_cuda(bench: str) -> bool:
    """Whether a CUDA GPU is there; if not, says so for ``spinfer bench <bench>`` (exit code 2)."""
    import torch

    if torch.cuda.is_available():
        return True
    print(f"spinfer bench {bench}: needs a CUDA GPU", file=_sys.stderr)
    return False


# Twice in this project's sweeps one cuBLAS median came out ~10x its neighbours' (447 and 400 µs
# against ~45), and one such cell alone turned a missed geomean target into a met one; a
# low-bit median once did the same (242 µs against ~19). Below ~64 tokens both kinds of call
# stream the weight, so a cell can be held against its neighbours: cuBLAS's time for one weight
# barely moves with N (H100: 44-46 µs for every N <= 32 on 14336x4096), and the kernels' times
# grow by less than 2x from one benchmarked N to the next.
STEADY_MAX_N = 64
# x the weight's cuBLAS time at N = 1. 2.0 until the sixtieth session, whose bench_spmm --quick
# kept a cuBLAS median of 297.7 µs on 28672x8192 at N = 8 (1.79x its N = 1 time; 164-172 µs at
# every other N <= 32) and printed the 30% cell as 2.29x, the 30% geomean as 1.18x instead of ~1.14x.
CUBLAS_SUSPECT = 1.3
# x the op's time at the previous, smaller N: 2.0 up to N = 32, the decode sizes the issue targets
# judge, where no kernel's time has grown by more than ~1.6x from one benchmarked N to the next in
# the sweeps so far (docs/*.csv since the seventh session); 3.0 at N = 64, where the fused low-bit
# kernels turn compute-bound and grew by up to 2.05x from N = 32. 3.0 everywhere until the
# sixty-first session, whose bench_lowbit --quick kept a median of 57.9 µs for 8-bit 14336x4096 at
# N = 16 (2.15x its N = 8 time; 26.7 µs in three runs after it) and printed that geomean as 1.45x
# instead of ~1.75x.
OP_SUSPECT = {32: 2.0, STEADY_MAX_N: 3.0}  # up to this N: the bound


def steady_time(measure, bound=None, retries=2, tries=1):
    """The least of ``tries`` calls of ``measure()`` (seconds), measured again up to ``retries``
    times while it exceeds ``bound`` (None: no bound). Returns ``(seconds, suspect)``: suspect
    when every measurement stayed above; the benchmarks print such rows with a warning and leave
    them out of the targets' geomeans. A row's first N has no previous time to be held against,
    so the benchmarks take the least of two there."""
    t = min(measure() for _ in range(tries))
    for _ in range(retries if bound else 0):
        if t <= bound:
            break
        t = min(t, measure())
    return t, bool(bound) and t > bound


def cublas_flat_time(weight, device, reps):
    """cuBLAS's time (seconds) for ``weight`` at N = 1, the least of two medians: the reference
    that time_against_cublas holds a row's cuBLAS time against."""
    import torch
    import torch.nn.functional as F

    from spinfer.timing import median_time

    x1 = torch.randn(1, weight.shape[1], device=device, dtype=weight.dtype)
    return min(median_time(lambda: F.linear(x1, weight), device, reps=reps) for _ in range(2))


def op_bound(n: int) -> float:
    """OP_SUSPECT's bound for a row at N = ``n`` (<= STEADY_MAX_N)."""
    return next(bound for top, bound in sorted(OP_SUSPECT.items()) if n <= top)


def time_against_cublas(cublas, op, device, reps, n, flat, prev, name):
    """The medians (seconds) of one benchmark row's cuBLAS call and op call at N = ``n``, each
    measured again where it looks disturbed (steady_time): cuBLAS against CUBLAS_SUSPECT x ``flat`` (the
    weight's time at N = 1), the op against op_bound(n) x its time at the previous, smaller N (``prev``, an
    (N, seconds) pair or None). Returns ``(t_cublas, t_op, warnings)``; a row with warnings is
    printed with them and left out of the summaries."""
    from spinfer.timing import median_time

    steady = n <= STEADY_MAX_N
    t_ref, ref_bad = steady_time(lambda: median_time(cublas, device, reps=reps),
                                 CUBLAS_SUSPECT * flat if steady else None)
    t_op, op_bad = steady_time(lambda: median_time(op, device, reps=reps),
                               op_bound(n) * prev[1] if steady and prev and prev[0] < n else None,
                               tries=1 if prev else 2)
    warnings = []
    if ref_bad:
        warnings.append(f"cuBLAS took {t_ref * 1e6:.1f} us here against {flat * 1e6:.1f} at N = 1, "
                        "measured three times: left out of the summary")
    if op_bad:
        warnings.append(f"{name} took {t_op * 1e6:.1f} us here, over {op_bound(n):.0f}x its time at the previous N, "
                        "measured three times: left out of the summary")
    return t_ref, t_op, warnings


def write_rows(rows, path) -> None:
    """The benchmark rows (dicts with the same keys) as a CSV file."""
    with open(path, "w", newline="") as f:
        wr = _csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
