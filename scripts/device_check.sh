#!/usr/bin/env bash
# On a GPU machine: build the extension, run the GPU tests, the sanitizers and the SpMM
# benchmark; logs under $OUT (default /tmp/spinfer-out); a short table is printed last.
#   scripts/device_check.sh [tests-wgmma] [ab-spmm] [ab-lowbit] [tests] [tests-cp-async] [sanitize] [bench] [bench-full] [bench-lowbit]
#                           [bench-to-dense] [e2e] [host] [ncu-spmm] [ncu-lowbit]
#   (default: tests tests-cp-async sanitize bench bench-lowbit bench-to-dense; the build always runs)
#   The sanitize step runs three tools on scripts/sanitize_case.py with both loaders: more than one
#   call's 10 minutes (racecheck of every part took over 5 minutes a loader). Narrow it with
#   SANITIZE_TOOLS="racecheck", SANITIZE_LOADERS="bulk", SANITIZE_PARTS=lowbit,gemv and SANITIZE_BITS=2,8
#   (sanitize_case.py), and run the pieces in their own calls.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/spinfer-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SPINFER_CACHE="${SPINFER_CACHE:-/tmp/spinfer-cache}"
steps="${*:-tests tests-cp-async sanitize bench bench-lowbit bench-to-dense}"
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.txt"

if true; then  # every step needs the extension
    python3 -m spinfer.build -v >"$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
    tail -1 "$OUT/build.log"
fi
if [[ " $steps " == *" tests-wgmma "* ]]; then
    # the warp-group MMA variant alone, before anything is timed: a wrong descriptor or layout
    # shows here (float64 reference and mma.sync, fp16 and bf16, BN = 32 and 64)
    python3 -m pytest -x -q -m cuda -p no:cacheprovider tests/test_spmm_cuda.py -k warp_group \
        >"$OUT/tests-wgmma.log" 2>&1 && tail -1 "$OUT/tests-wgmma.log" || { tail -40 "$OUT/tests-wgmma.log"; status=1; }
fi
if [[ " $steps " == *" ab-spmm "* ]]; then
    # planner overrides against each other in one process (benchmarks/ab_spmm.py), one process a
    # sparsity: AB_CONFIGS, AB_SHAPES, AB_NS, AB_SPARSITIES (defaults: the wgmma group sizes and
    # mma.sync at the N where BN is 32 and 64); AB_PLANS=1 prints each configuration's launch first
    for s in ${AB_SPARSITIES:-0.5 0.7}; do
        python3 benchmarks/ab_spmm.py ${AB_PLANS:+--plans} --configs "${AB_CONFIGS:-WGMMA=0,WGMMA=1,WGMMA=3,WGMMA=4}" --rounds 2 --sparsity "$s" \
            --shapes "${AB_SHAPES:-28672x8192,8192x28672,14336x4096,4096x14336}" --ns "${AB_NS:-24,32,64}" \
            >"$OUT/ab-spmm-$s.log" 2>&1 || status=1
        tail -n 16 "$OUT/ab-spmm-$s.log"
    done
fi
if [[ " $steps " == *" ab-lowbit "* ]]; then
    # the fused low-bit kernel's overrides against each other in one process (benchmarks/ab_lowbit.py),
    # one process a width: AB_LOWBIT_CONFIGS, AB_LOWBIT_QUANTS (bits:group, space-separated),
    # AB_LOWBIT_SHAPES, AB_LOWBIT_NS; each case's launch is printed first
    for q in ${AB_LOWBIT_QUANTS:-4:128}; do
        python3 benchmarks/ab_lowbit.py --plans --configs "${AB_LOWBIT_CONFIGS:-auto,LOWBIT_SPLITS=1}" --rounds 2 --quant "$q" \
            --shapes "${AB_LOWBIT_SHAPES:-28672x8192,8192x28672,14336x4096,4096x14336}" --ns "${AB_LOWBIT_NS:-8,16,32}" \
            >"$OUT/ab-lowbit-${q/:/g}.log" 2>&1 || status=1
        tail -n 16 "$OUT/ab-lowbit-${q/:/g}.log"
    done
fi
if [[ " $steps " == *" tests "* ]]; then
    python3 -m pytest -q -m cuda -p no:cacheprovider tests >"$OUT/tests.log" 2>&1 || status=1
    tail -15 "$OUT/tests.log"
fi
if [[ " $steps " == *" tests-cp-async "* ]]; then
    # the sm_80 loaders (SMBD, and the low-bit kernel at 4 and 8 bits), forced on this GPU so they are exercised too
    SPINFER_LOADER=cp_async python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_spmm_cuda.py tests/test_lowbit_cuda.py tests/test_random_shapes_cuda.py \
        >"$OUT/tests-cp-async.log" 2>&1 || status=1
    tail -3 "$OUT/tests-cp-async.log"
fi
if [[ " $steps " == *" sanitize "* ]]; then
    for loader in ${SANITIZE_LOADERS:-bulk cp_async}; do
        for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
            SPINFER_LOADER=$loader compute-sanitizer --tool "$tool" --error-exitcode 3 python3 scripts/sanitize_case.py \
                >"$OUT/sanitize-$tool-$loader.log" 2>&1 && echo "compute-sanitizer $tool ($loader): clean" \
                || { echo "compute-sanitizer $tool ($loader): FAILED"; tail -30 "$OUT/sanitize-$tool-$loader.log"; status=1; }
        done
    done
    # shapes nobody chose: a few freshly drawn cases of every path (their seeds are in the log)
    SPINFER_TEST_CASES=6 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q -p no:cacheprovider \
        tests/test_random_shapes_cuda.py >"$OUT/sanitize-memcheck-random.log" 2>&1 \
        && echo "compute-sanitizer memcheck (random shapes): clean" \
        || { echo "compute-sanitizer memcheck (random shapes): FAILED"; tail -30 "$OUT/sanitize-memcheck-random.log"; status=1; }
fi
if [[ " $steps " == *" bench-full "* ]]; then
    python3 benchmarks/bench_spmm.py --csv "$OUT/spmm.csv" 2>&1 | tee "$OUT/bench.log"
elif [[ " $steps " == *" bench "* ]]; then
    python3 benchmarks/bench_spmm.py --quick --csv "$OUT/spmm.csv" 2>&1 | tee "$OUT/bench.log"
fi
if [[ " $steps " == *" bench-lowbit "* ]]; then
    python3 benchmarks/bench_lowbit.py --quick --csv "$OUT/lowbit.csv" >"$OUT/bench-lowbit.log" 2>&1 || status=1
    sed -n '/^summary/,$p' "$OUT/bench-lowbit.log"
fi
if [[ " $steps " == *" bench-to-dense "* ]]; then
    # the decode-to-dense kernels' bandwidth and the N where decode + cuBLAS overtakes the fused kernels
    python3 benchmarks/bench_to_dense.py --quick --csv "$OUT/to_dense.csv" >"$OUT/bench-to-dense.log" 2>&1 || status=1
    sed -n '/^crossover/,$p' "$OUT/bench-to-dense.log"
fi
if [[ " $steps " == *" e2e "* ]]; then
    # decode through 4 Llama-shaped layers, dense against 50% / 70% sparse and 4-bit, batch 1 (the default glue: pdl on sm_90)
    python3 -m spinfer.bench e2e --fused --variants dense,sparse50,sparse70,w4 --batches 1 >"$OUT/e2e.log" 2>&1 || status=1
    grep -E "^(variant|dense|sparse[0-9]+|w4) " "$OUT/e2e.log"
fi
if [[ " $steps " == *" host "* ]]; then
    # host time of one eager call (what eager decode at batch 1 is bound by), against F.linear
    python3 -m spinfer.bench host >"$OUT/host.log" 2>&1 || status=1
    tail -n 10 "$OUT/host.log"
fi
# One launch under Nsight Compute: the details page and the per-SASS-instruction source page
# (executed instructions, stall samples) as CSV, and the headline metrics.
ncu_case() {  # name kernel-regex script args...
    local name=$1 regex=$2
    shift 2
    ncu --clock-control none --set full --import-source no -k "regex:$regex" --launch-skip 2 --launch-count 1 -f -o "$OUT/$name" \
        python3 "$@" >"$OUT/ncu-$name.log" 2>&1 || { tail -20 "$OUT/ncu-$name.log"; status=1; }
    ncu -i "$OUT/$name.ncu-rep" --page details --csv >"$OUT/ncu-$name-details.csv" 2>>"$OUT/ncu-$name.log"
    ncu -i "$OUT/$name.ncu-rep" --page source --print-source sass --csv >"$OUT/ncu-$name-source.csv" 2>>"$OUT/ncu-$name.log"
    ncu -i "$OUT/$name.ncu-rep" --page raw --csv >"$OUT/ncu-$name-raw.csv" 2>>"$OUT/ncu-$name.log"
    python3 scripts/ncu_stalls.py <"$OUT/ncu-$name-raw.csv"
    rm -f "$OUT/$name.ncu-rep"
    grep -E '"(Duration|Achieved Occupancy|Theoretical Occupancy|Issued Warp Per Scheduler|No Eligible|Active Warps Per Scheduler|Eligible Warps Per Scheduler|Registers Per Thread|Block Limit [A-Za-z ]+|Executed Ipc Active|Memory Throughput|DRAM Throughput)"' \
        "$OUT/ncu-$name-details.csv" | awk -F'","' '{print $(NF-2)": "$NF" "$(NF-1)}' | tr -d '"' | sort -u
}
if [[ " $steps " == *" ncu-spmm "* ]]; then
    # SPMM_CASES="M K N SPARSITY[;M K N SPARSITY...]": one profile each, named spmm-M-K-N-SPARSITY
    IFS=';' read -ra cases <<<"${SPMM_CASES:-28672 8192 1 0.5}"
    for c in "${cases[@]}"; do
        echo "== ncu spmm $c"
        ncu_case "spmm-${c// /-}" spmm_smbd scripts/profile_case.py $c
    done
fi
if [[ " $steps " == *" ncu-lowbit "* ]]; then
    # LOWBIT_CASES="M K N BITS GROUP[;...]": one profile each, named lowbit-M-K-N-BITS-GROUP
    IFS=';' read -ra cases <<<"${LOWBIT_CASES:-28672 8192 1 4 128}"
    for c in "${cases[@]}"; do
        echo "== ncu lowbit $c"
        ncu_case "lowbit-${c// /-}" lowbit_mm scripts/profile_lowbit_case.py $c
    done
fi
exit $status
