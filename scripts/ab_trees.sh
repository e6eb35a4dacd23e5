#!/usr/bin/env bash
# On a GPU machine: build the working tree and an older tree side by side and compare them in
# separate processes, alternated (same machine, same lease): the way to measure a change that moves
# the format or the kernels, which an in-process A/B (benchmarks/ab_lowbit.py) cannot.
#
# Before the device call, put the older tree where it travels with the working tree (untracked,
# not ignored), and delete it after:
#     mkdir old_tree && git archive <ref> | tar -x -C old_tree
# Then, on the device:
#     OUT=$OUT bash scripts/ab_trees.sh [tests] [memcheck] [bench N] [ab "ab_lowbit args"]
#   tests     the GPU tests of the working tree (low-bit, GEMV, to-dense, SparseLinear)
#   memcheck  compute-sanitizer memcheck on scripts/sanitize_case.py, both loaders
#   bench N   N alternated rounds of bench_lowbit --quick in each tree (summaries printed)
#   ab ARGS   benchmarks/ab_lowbit.py ARGS in each tree
#   tests-spmm  the SpMM GPU tests of the working tree (test_spmm_cuda, test_random_shapes_cuda)
#   spmm N "ARGS"  N alternated rounds (old, new) of benchmarks/ab_spmm.py ARGS in each tree, e.g.
#             spmm 2 "--configs auto --rounds 1 --sparsity 0.7 --ns 1,8,16,32"; its geomean lines printed.
#             In one process identical plans read 0.97-1.06x apart per case and 0.996-1.006x as a
#             geomean over 12-18 cases (docs/kernels.md, seventy-ninth session): less is no difference.
# Logs and CSVs go to $OUT/ab.tgz (one file: the device returns a limited number).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/spinfer-out}"
[ -d old_tree ] || { echo "no old_tree/ (see the header)"; exit 2; }
export PYTHONUNBUFFERED=1
log="$OUT/ab"
mkdir -p "$log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
(cd old_tree && SPINFER_CACHE=/tmp/ab-old PYTHONPATH=$PWD python3 -m spinfer.build >"$log/build-old.log" 2>&1; echo "old build rc=$?") &
SPINFER_CACHE=/tmp/ab-new PYTHONPATH=$PWD python3 -m spinfer.build >"$log/build-new.log" 2>&1; echo "new build rc=$?"
wait
tree() { [ "$1" = new ] && echo "$PWD" || echo "$PWD/old_tree"; }
while [ $# -gt 0 ]; do
  case "$1" in
    tests)
      SPINFER_CACHE=/tmp/ab-new PYTHONPATH=$PWD python3 -m pytest -q -m cuda -p no:cacheprovider \
        tests/test_lowbit_cuda.py tests/test_lowbit_gemv_cuda.py tests/test_to_dense_cuda.py tests/test_sparse_linear.py \
        >"$log/tests.log" 2>&1; echo "tests rc=$?"; tail -1 "$log/tests.log"; grep FAILED "$log/tests.log" | head ;;
    memcheck)
      for loader in bulk cp_async; do
        SPINFER_CACHE=/tmp/ab-new PYTHONPATH=$PWD SPINFER_LOADER=$loader compute-sanitizer --tool memcheck --error-exitcode 3 \
          python3 scripts/sanitize_case.py >"$log/memcheck-$loader.log" 2>&1; echo "memcheck $loader rc=$?"
      done ;;
    bench)
      rounds=$2; shift
      for r in $(seq 1 "$rounds"); do
        for t in new old; do
          d=$(tree $t)
          (cd "$d" && SPINFER_CACHE=/tmp/ab-$t PYTHONPATH=$d python3 benchmarks/bench_lowbit.py --quick \
            --csv "$log/lowbit-$t-$r.csv" >"$log/bench-$t-$r.log" 2>&1)
          echo "== $t round $r"; sed -n '/^summary/,$p' "$log/bench-$t-$r.log" | grep -v torch
        done
      done ;;
    tests-spmm)
      SPINFER_CACHE=/tmp/ab-new PYTHONPATH=$PWD python3 -m pytest -q -m cuda -p no:cacheprovider \
        tests/test_spmm_cuda.py tests/test_random_shapes_cuda.py >"$log/tests-spmm.log" 2>&1
      echo "tests-spmm rc=$?"; tail -1 "$log/tests-spmm.log"; grep FAILED "$log/tests-spmm.log" | head ;;
    spmm)
      rounds=$2 args=$3; shift 2
      for r in $(seq 1 "$rounds"); do
        for t in old new; do
          d=$(tree $t)
          # shellcheck disable=SC2086
          (cd "$d" && SPINFER_CACHE=/tmp/ab-$t PYTHONPATH=$d python3 benchmarks/ab_spmm.py $args >"$log/spmm-$t-$r.log" 2>&1)
          echo "$t round $r: $(grep geomean "$log/spmm-$t-$r.log")"
        done
      done ;;
    ab)
      args=$2; shift
      for t in new old; do
        d=$(tree $t)
        echo "=== ab $t"
        # shellcheck disable=SC2086
        (cd "$d" && SPINFER_CACHE=/tmp/ab-$t PYTHONPATH=$d:$d/benchmarks python3 benchmarks/ab_lowbit.py $args 2>&1 | tail -12)
      done ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
  shift
done
tar -C "$OUT" -czf "$OUT/ab.tgz" ab && rm -rf "$log"
