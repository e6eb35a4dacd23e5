"""SMBD SpMM against cuBLAS fp16; the implementation lives in spinfer/bench/spmm.py.

    python benchmarks/bench_spmm.py [--quick] [--csv out.csv]     (same as: spinfer bench spmm)
"""

from spinfer.bench.spmm import main

if __name__ == "__main__":
    raise SystemExit(main())
