#!/usr/bin/env bash
# The CPU codecs (spinfer/csrc/cpu/codec.cpp) under AddressSanitizer: builds them with
# -fsanitize=address into a scratch cache and runs their tests and the corrupt-array fuzz tests,
# so that an out-of-bounds read or write stops the run. (compute-sanitizer's counterpart for the
# CPU code; needs gcc's libasan.)   scripts/asan_cpu.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
asan=$(${CXX:-c++} -print-file-name=libasan.so)
[ -e "$asan" ] || { echo "libasan not found (${CXX:-c++} -print-file-name=libasan.so)"; exit 1; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
SPINFER_CACHE="$scratch" SPINFER_CPU_CFLAGS="-fsanitize=address -fno-omit-frame-pointer -g" \
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 LD_PRELOAD="$asan" \
    "$python" -m pytest -q -p no:cacheprovider tests/test_cpu_kernels.py tests/test_tca_bme_fuzz.py tests/test_tca_bme.py \
    tests/test_lowbit.py "$@"
