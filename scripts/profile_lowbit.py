"""Where the time of spinfer.lowbit_mm goes, on a GPU: host time per call, device time
(spinfer.timing.median_time) against cuBLAS and against a plain read of the same bytes (the
ceiling for any kernel that streams the weight once), the zero-point paths A/B (integer zeros
in the A fragments vs every zero through sum(x), SPINFER_LOWBIT_XSUM=1) at N = 1/8/16/32, and a
split-K sweep of the kernel alone.

    python scripts/profile_lowbit.py [BITS GROUP] [--quick]     (--quick: device times only)
"""

import os
import sys

import torch
import torch.nn.functional as F

import spinfer
from spinfer.quant import LowBitWeight
from spinfer.timing import host_overhead, median_time

args = [a for a in sys.argv[1:] if a != "--quick"]
quick = "--quick" in sys.argv
bits, group = (int(args[0]), int(args[1])) if len(args) > 1 else (4, 128)
spinfer.build.load_extension()
dev = torch.device("cuda")


def event_time(fn):
    return median_time(fn, dev, reps=30) * 1e6


def host_time(fn):
    return host_overhead(fn, dev) * 1e6


for m, k in [(28672, 8192), (8192, 28672), (14336, 4096), (4096, 14336)]:
    w = torch.randn(m, k, device=dev).half()
    q = LowBitWeight.quantize(w, bits, group)
    x = torch.randn(1, k, device=dev).half()
    out = torch.empty(1, m, device=dev).half()
    wrapper = lambda: spinfer.lowbit_mm(x, q)  # noqa: E731
    direct = lambda: torch.ops.spinfer.lowbit_mm_out(x, q.qweight, q.scale_zero, bits, q.group_size, m, k,  # noqa
                                                     None, None, 0, q.integer_zeros, out=out)
    dense = lambda: F.linear(x, w)  # noqa: E731
    if not quick:
        print(f"{m}x{k} {bits}-bit g{group} N=1: host us/call wrapper {host_time(wrapper):.1f}, direct op "
              f"{host_time(direct):.1f}, F.linear {host_time(dense):.1f}")
    wbytes = q.storage_bytes().total
    buf = torch.empty(wbytes // 4, dtype=torch.int32, device=dev)
    read = lambda: torch.sum(buf, dtype=torch.int32)  # noqa: E731
    print(f"{m}x{k} device us: lowbit {event_time(direct):.1f}; cuBLAS {event_time(dense):.1f}; "
          f"torch.sum over the same {wbytes / 1e6:.0f} MB (the read ceiling) {event_time(read):.1f}")
    ab = []
    for n in (1, 8, 16, 32):
        xn = torch.randn(n, k, device=dev).half()
        on = torch.empty(n, m, device=dev).half()
        run = lambda: torch.ops.spinfer.lowbit_mm_out(xn, q.qweight, q.scale_zero, bits, q.group_size, m, k,  # noqa
                                                      None, None, 0, q.integer_zeros, out=on)
        t = {}
        for flag in ("0", "1", "0", "1"):  # interleaved, last of each kept: same process, warm
            os.environ["SPINFER_LOWBIT_XSUM"] = flag
            t[flag] = event_time(run)
        os.environ.pop("SPINFER_LOWBIT_XSUM")
        ab.append(f"N={n}: {t['0']:.1f} vs {t['1']:.1f} (cuBLAS {event_time(lambda: F.linear(xn, w)):.1f})")
    print("  zero in A vs sum(x) forced, us: " + "; ".join(ab))
    if quick:
        continue
    sweep = []
    for s in (1, 2, 3, 4, 6, 8, 12, 16):
        os.environ["SPINFER_LOWBIT_SPLITS"] = str(s)
        sweep.append(f"{s}:{event_time(direct):.1f}")
    os.environ.pop("SPINFER_LOWBIT_SPLITS")
    print("  splits sweep (direct): " + " ".join(sweep), flush=True)
