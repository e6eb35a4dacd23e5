"""Command line: ``spinfer demo`` and ``spinfer bench ...`` (also ``python -m spinfer ...``)."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="spinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="prune, encode and multiply a 4096x4096 layer; report")
    demo.add_argument("--m", type=int, default=4096, help="out_features (rows of W)")
    demo.add_argument("--k", type=int, default=4096, help="in_features (columns of W)")
    demo.add_argument("--n", type=int, default=16, help="tokens in the batch")
    demo.add_argument("--sparsity", type=float, default=0.5)
    demo.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    demo.add_argument("--device", default="auto", help="auto, cpu or cuda")
    demo.add_argument("--seed", type=int, default=0)
    sub.add_parser("bench", help="run a study: spmm, compression or roofline (spinfer bench --help)",
                   add_help=False)
    argv = list(argv) if argv is not None else sys.argv[1:]
    if argv and argv[0] == "bench":
        from .bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)

    if args.command == "demo":
        from .demo import run_demo

        try:
            run_demo(args.m, args.k, args.n, args.sparsity, args.dtype, args.device, args.seed)
        except (ValueError, TypeError) as exc:
            print(f"spinfer demo: error: {exc}", file=sys.stderr)
            return 2
    return 0
