"""scripts/sass_stage_count.py on hand-made SASS: it finds the innermost loop holding a block
barrier and an HMMA, walks it from head to back-branch along forward edges only, takes the path
that passes the stage's wait with the most HMMAs (then the fewest instructions), counts a wait's
out-of-line retry once, and reports no path where nothing waits."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "sass_stage_count", Path(__file__).resolve().parents[1] / "scripts" / "sass_stage_count.py")
count = importlib.util.module_from_spec(spec)
spec.loader.exec_module(count)

WAIT = "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R12+URZ], R9"


def listing(body):
    """(address, text) pairs as the script parses them from cuobjdump, 16 bytes apart."""
    return [(16 * i, t) for i, t in enumerate(body)]


def stage(wait=WAIT):
    return listing([
        "MOV R1, RZ",                       # 0x00 before the loop
        "BAR.SYNC.DEFER_BLOCKING 0x0",      # 0x10 loop head
        wait,                               # 0x20
        "@!P0 BRA 0xc0",                    # 0x30 retry, out of line (past the loop)
        "HMMA.16816.F32 R16, R8, R4, R16",  # 0x40
        "@P1 BRA 0x70",                     # 0x50 skips the second GroupTile
        "HMMA.16816.F32 R16, R8, R6, R16",  # 0x60
        "IADD3 R2, R2, 0x1, RZ",            # 0x70
        "@!P2 BRA 0x10",                    # 0x80 back-branch
        "EXIT",                             # 0x90
        "NOP",                              # 0xa0
        "NOP",                              # 0xb0
        "BRA 0x20",                         # 0xc0 the retry goes back to the wait
    ])


def test_counts_the_path_with_both_mmas():
    assert count.count_stage(stage()) == (8, 2)  # 0x10 .. 0x80, the skip not taken


def test_a_cp_async_wait_counts_as_the_stage_wait():
    assert count.count_stage(stage("DEPBAR.LE SB0, 0x0")) == (8, 2)


def test_no_wait_no_path():
    assert count.count_stage(stage("NOP")) is None


def test_no_loop():
    assert count.count_stage(listing(["BAR.SYNC.DEFER_BLOCKING 0x0", "HMMA.16816.F32 R16, R8, R4, R16", "EXIT"])) is None
