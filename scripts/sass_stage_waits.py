"""Checks, in the SASS of the low-bit GEMV kernels, that no step waits for the stage it has just
issued. ptxas counts all the weight loads (LDG.E.NA) on one scoreboard, so a wait on it after the
next stage's loads have gone out holds the compute until the stage ahead has landed, and the
pipeline is lost (lowbit_gemv.cuh, run; docs/quant.md, thirty-fourth session). A good loop waits,
then loads, then computes: between one stage's loads and the next's, every wait comes after the
compute, never before it (no WM). After the last loads in program order the last stage is waited
for and computed, so that stretch is not checked. The check reads the code in program order, a
proxy for what runs.

    python scripts/sass_stage_waits.py OBJ_OR_SO [...]   # cuobjdump from PATH or $CUOBJDUMP

Prints each GEMV kernel's sequence (L: a stage's loads, W: a wait on their scoreboard, M: the
compute) and exits 1 if a stretch between two loads has a wait before a compute."""

import os
import re
import subprocess
import sys


def control(word_hi):
    """Write scoreboard and wait mask of an sm_80 / sm_90 instruction's control bits."""
    ctrl = word_hi >> 41
    return (ctrl >> 5) & 7, (ctrl >> 11) & 0x3F


def events(sass):
    lines, seq, board = sass.split("\n"), [], None
    for i, line in enumerate(lines[:-1]):
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(.*?);\s*/\* 0x[0-9a-f]+ \*/", line)
        hi = re.search(r"/\* (0x[0-9a-f]+) \*/", lines[i + 1])
        if not m or not hi:
            continue
        write, wait = control(int(hi.group(1), 16))
        ins = m.group(1)
        if "LDG.E.NA" in ins:
            board = write
            if not seq or seq[-1] != "L":
                seq.append("L")
        elif board is not None and wait >> board & 1:
            seq.append("W")
        elif "HMMA" in ins and seq and seq[-1] != "M":
            seq.append("M")
    return "".join(seq)


def pipelined(seq):
    """No stretch between two stages' loads waits on them before its compute."""
    return not any("WM" in stretch for stretch in seq.split("L")[1:-1])


def main():
    tool = os.environ.get("CUOBJDUMP", "cuobjdump")
    bad = False
    for path in sys.argv[1:]:
        out = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
        for fn in re.split(r"\n\s*Function : ", out)[1:]:
            name = fn.split("\n")[0].strip()
            if "lowbit_gemv_kernel" not in name:
                continue
            seq = events(fn)
            ok = pipelined(seq)
            bad |= not ok
            print(("ok  " if ok else "FAIL"), name, seq)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
