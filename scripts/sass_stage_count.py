"""Instructions a decoding warp executes per pipeline stage in each SMBD kernel variant, counted
statically from the SASS: the path through the stage loop (from its head to its back-branch,
forward edges only) that passes the stage's wait (an mbarrier TRYWAIT or a cp.async DEPBAR) with
the most HMMAs, the shortest such path. A wait's retry loop counts once. No GPU needed:

    nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -cubin -o smbd.cubin \\
        spinfer/csrc/spmm_smbd_fp16.cu
    python scripts/sass_stage_count.py smbd.cubin ["BN=8 bulk=1"]

cuobjdump comes with the CUDA toolkit, or from PyPI (pip install nvidia-cuda-cuobjdump); set
CUOBJDUMP to its path where it is not on PATH. The forty-third session (docs/kernels.md) used it to
find what a stage spends besides the decode.
"""

import os
import re
import shutil
import subprocess
import sys
from functools import lru_cache

KERNEL = re.compile(
    r"_ZN7spinfer4smbd16spmm_smbd_kernelILb(\d)ELi(\d+)ELb(\d)ELb(\d)ELi(\d+)ELb(\d)ELb(\d)EL[bi](\d)E(?:Li(\d)E)?")
MMA = re.compile(r"\bH(?:G)?MMA\b")  # mma.sync (HMMA) or wgmma (HGMMA)
BRANCH = re.compile(r"BRA (?:\S+, )?(0x[0-9a-f]+)")


def stage_loop(ins):
    """(head, tail) indices of the innermost loop whose body holds a block barrier and an HMMA."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    loop = None
    for i, (a, t) in enumerate(ins):
        m = BRANCH.search(t)
        if not m or "BRA.DIV" in t or int(m.group(1), 16) >= a:
            continue
        j = index[int(m.group(1), 16)]
        body = " ".join(x for _, x in ins[j:i + 1])
        if "BAR.SYNC" in body and MMA.search(body) and (loop is None or i - j < loop[1] - loop[0]):
            loop = (j, i)
    return loop, index


def count_stage(ins):
    """(instructions, HMMAs) on the decoding warps' path through one stage, or None."""
    loop, index = stage_loop(ins)
    if loop is None:
        return None
    head, tail = loop

    def successors(i):
        t = ins[i][1]
        if t.startswith("EXIT"):
            return []
        m = BRANCH.search(t)
        if not m:
            return [i + 1] if i < tail else []
        out = []
        target = index.get(int(m.group(1), 16))
        if target is not None and i < target <= tail:
            out.append(target)
        if t.startswith("@") and i < tail:  # predicated: may fall through
            out.append(i + 1)
        return out

    @lru_cache(None)
    def best(i, waited):  # (waited, HMMAs, -instructions) of the best path from i to the tail
        t = ins[i][1]
        waited = waited or "TRYWAIT" in t or "DEPBAR" in t
        if i == tail:
            return (int(waited), int(bool(MMA.search(t))), -1)
        options = [o for o in (best(j, waited) for j in successors(i)) if o is not None]
        if not options:
            return None
        w, h, n = max(options)
        return (w, h + bool(MMA.search(t)), n - 1)

    sys.setrecursionlimit(max(10000, 4 * len(ins)))
    r = best(head, False)
    return None if r is None or not r[0] else (-r[2], r[1])


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if tool is None:
        raise SystemExit("sass_stage_count: cuobjdump not found (CUDA toolkit, or pip install nvidia-cuda-cuobjdump; "
                         "CUOBJDUMP=path)")
    sass = subprocess.run([tool, "-sass", sys.argv[1]], capture_output=True, text=True, check=True).stdout
    want = sys.argv[2] if len(sys.argv) > 2 else ""
    for func in re.split(r"\n\s+Function : ", sass)[1:]:
        m = KERNEL.match(func.split("\n", 1)[0].strip())
        if not m:
            continue
        tag = (f"{'bf16' if m.group(1) == '1' else 'fp16'} BN={m.group(2)} bulk={m.group(3)} lean={m.group(4)} "
               f"minb={m.group(5)} count={m.group(6)} table={m.group(7)} wgmma={m.group(8)} rows={m.group(9) or 1}")
        if want not in tag:
            continue
        ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", func)]
        r = count_stage(ins)
        print(f"{tag}: " + ("no stage loop found" if r is None else f"{r[0]} instructions a stage, {r[1]} HMMA or HGMMA"))


if __name__ == "__main__":
    main()
