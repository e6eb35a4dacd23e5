"""The CPU path of a TCA-BME layer: the compiled decoder against the torch-op reference, and a
SparseLinear call against F.linear; the implementation lives in spinfer/bench/cpu.py.

    python benchmarks/bench_cpu.py [--quick] [--csv out.csv]     (same as: spinfer bench cpu)
"""

from spinfer.bench.cpu import main

if __name__ == "__main__":
    raise SystemExit(main())
