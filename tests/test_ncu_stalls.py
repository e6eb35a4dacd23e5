"""scripts/ncu_stalls.py on a synthetic `ncu --page raw --csv` export (no GPU needed)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ncu_stalls.py"


def run(text):
    return subprocess.run([sys.executable, str(SCRIPT)], input=text, capture_output=True, text=True)


def test_stall_shares_largest_first_and_headline_metrics():
    header = ['"ID"', '"Kernel Name"', '"smsp__pcsamp_warps_issue_stalled_barrier"',
              '"smsp__pcsamp_warps_issue_stalled_barrier_not_issued"', '"smsp__pcsamp_warps_issue_stalled_wait"',
              '"smsp__pcsamp_warps_issue_stalled_long_scoreboard"', '"gpu__time_duration.sum"']
    units = ['""', '""', '""', '""', '""', '""', '"us"']
    row = ['"0"', '"spmm_smbd_kernel"', '"1,500"', '"999"', '"500"', '"3,000"', '"68.1"']
    out = run("\n".join(",".join(r) for r in (header, units, row)) + "\n")
    assert out.returncode == 0, out.stderr
    # 3000 / 1500 / 500 of 5000 samples; the _not_issued column is not a stall reason of its own
    assert "stalls (share of samples): long_scoreboard 60%, barrier 30%, wait 10%" in out.stdout
    assert "gpu__time_duration.sum: 68.1" in out.stdout


def test_input_without_a_kernel_row_fails():
    out = run('"ID","Process"\n"0","python3"\n')
    assert out.returncode == 1
    assert "no kernel row" in out.stdout
