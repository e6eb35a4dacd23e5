"""benchmarks/target_floors.py on a synthetic benchmark CSV (no GPU needed)."""

import csv
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "target_floors.py"
FIELDS = ["M", "K", "N", "bits", "group", "cublas_us", "lowbit_us", "gbps", "pct_copy"]


def test_floor_is_bytes_at_copy_bandwidth_plus_the_event_floor(tmp_path):
    # 100 us at 1000 GB/s moved 100 MB; at a 2000 GB/s copy (50%) that is 50 us + 3 us of event
    # floor, so against cuBLAS's 212 us: measured 2.12x, floor 4.00x, 53% of it. N = 8 runs at
    # the floor. A shape outside --shapes and an N outside --ns are left out.
    rows = [(64, 128, 1, 4, 128, 212.0, 100.0, 1000.0, 50.0),
            (64, 128, 8, 4, 128, 212.0, 53.0, 1886.792, 94.33962),
            (64, 256, 1, 4, 128, 1.0, 1.0, 1.0, 1.0),
            (64, 128, 2, 4, 128, 1.0, 1.0, 1.0, 1.0)]
    path = tmp_path / "lowbit.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        w.writerows(rows)
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), "--shapes", "64x128", "--ns", "1,8",
                          "--event-us", "3"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].split() == ["4-bit", "g128", "1", "2.12x", "4.00x", "53%", "1"]
    assert lines[2].split() == ["4-bit", "g128", "8", "4.00x", "4.00x", "100%", "1"]
    assert lines[3].split() == ["4-bit", "g128", "all", "2.91x", "4.00x", "73%", "2"]
    assert len(lines) == 4
