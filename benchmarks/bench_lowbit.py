"""Weight-only low-bit kernels against cuBLAS fp16 and torch's int4 kernel; the implementation
lives in spinfer/bench/lowbit.py.

    python benchmarks/bench_lowbit.py [--quick] [--csv out.csv]     (same as: spinfer bench lowbit)
"""

from spinfer.bench.lowbit import main

if __name__ == "__main__":
    raise SystemExit(main())
