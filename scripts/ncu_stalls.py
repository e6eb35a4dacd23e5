"""Warp-stall breakdown of one kernel from `ncu --page raw --csv` (stdin): each
smsp__pcsamp_warps_issue_stalled_* sample count as a share of all samples, largest first, and the
throughput headline metrics.

    ncu -i report.ncu-rep --page raw --csv | python3 scripts/ncu_stalls.py
"""

import csv
import sys


def main() -> int:
    rows = list(csv.reader(sys.stdin))
    header = next((r for r in rows if "Kernel Name" in r), None)
    if header is None:
        print("ncu_stalls: no kernel row in the input")
        return 1
    data = [r for r in rows[rows.index(header) + 1:] if len(r) == len(header) and r[0].strip().isdigit()]
    if not data:
        print("ncu_stalls: no data row")
        return 1
    row = data[-1]

    def num(v):
        try:
            return float(v.replace(",", ""))
        except ValueError:
            return None

    prefix = "smsp__pcsamp_warps_issue_stalled_"
    stalls = {h[len(prefix):]: num(v) for h, v in zip(header, row)
              if h.startswith(prefix) and not h.endswith("_not_issued") and num(v) is not None}
    total = sum(stalls.values())
    if total:
        top = sorted(stalls.items(), key=lambda kv: -kv[1])[:10]
        print("stalls (share of samples): " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in top if v))
    for key in ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "lts__t_sectors.avg.pct_of_peak_sustained_elapsed",
                "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed",
                "sm__warps_active.avg.per_cycle_active", "smsp__issue_active.avg.pct_of_peak_sustained_active",
                "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", "gpu__time_duration.sum"):
        if key in header:
            print(f"  {key}: {row[header.index(key)]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
