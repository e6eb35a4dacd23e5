"""The weight-to-dense kernels (TCA-BME and low-bit to dense fp16) and the N from which decode +
cuBLAS overtakes the fused kernels; the implementation lives in spinfer/bench/to_dense.py.

    python benchmarks/bench_to_dense.py [--quick] [--csv out.csv]     (same as: spinfer bench to_dense)
"""

from spinfer.bench.to_dense import main

if __name__ == "__main__":
    raise SystemExit(main())
