"""A/B of SpMM launch configurations in one process (interleaved, L2 flushed), for tuning the
planner: GroupTile rows per block (SPINFER_ROWS) and split-K (SPINFER_SPLITS) against the
planner's own choice, with cuBLAS timed alongside.

    python benchmarks/ab_spmm.py [--shapes 28672x8192,4096x14336] [--ns 1,8,16,32] [--sparsity 0.5]
"""

import argparse
import os

import torch
import torch.nn.functional as F

import spinfer
from spinfer.format import TCABME
from spinfer.timing import median_time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="28672x8192,4096x14336")
    p.add_argument("--ns", default="1,8,16,32")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--splits", default="auto,1,2,4,8")
    a = p.parse_args()
    spinfer.build.load_extension()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}: us per call (x cuBLAS), sparsity {a.sparsity}")
    for shape in a.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        w = torch.randn(m, k, device=dev).half()
        w[torch.rand(m, k, device=dev) < a.sparsity] = 0
        enc = TCABME.from_dense(w)
        for n in (int(v) for v in a.ns.split(",")):
            x = torch.randn(n, k, device=dev).half()
            t_ref = median_time(lambda: F.linear(x, w), dev, reps=40)
            cells = []
            for rows in ("1", "2"):
                for sp in a.splits.split(","):
                    os.environ["SPINFER_ROWS"] = rows
                    if sp == "auto":
                        os.environ.pop("SPINFER_SPLITS", None)
                    else:
                        os.environ["SPINFER_SPLITS"] = sp
                    t = median_time(lambda: spinfer.spmm(x, enc), dev, reps=40)
                    cells.append(f"r{rows}/s{sp}:{t * 1e6:6.1f}({t_ref / t:4.2f})")
            os.environ.pop("SPINFER_ROWS", None)
            os.environ.pop("SPINFER_SPLITS", None)
            print(f"{m}x{k} N={n:<3} cuBLAS {t_ref * 1e6:6.1f} | " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
