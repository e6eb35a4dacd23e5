"""End-to-end greedy decoding, dense fp16 against sparsified and 4-bit; the implementation lives
in spinfer/bench/e2e.py.

    python benchmarks/bench_e2e.py [--layers 4] [--batches 1,8,16]     (same as: spinfer bench e2e)
"""

from spinfer.bench.e2e import main

if __name__ == "__main__":
    raise SystemExit(main())
