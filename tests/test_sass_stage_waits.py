"""scripts/sass_stage_waits.py on hand-made SASS: it reads the loads' scoreboard from their control
bits, finds waits on it, and flags a wait that falls between the next stage's loads and the
compute (the pipeline lost), but not one before the loads or after the last ones."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "sass_stage_waits", Path(__file__).resolve().parents[1] / "scripts" / "sass_stage_waits.py")
sass = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass)


def line(addr, ins, write=7, wait=0):
    """One instruction as cuobjdump prints it: text and low word, then the word with the control
    bits (write scoreboard at bit 46, wait mask at bit 52 of the second word)."""
    hi = ((write << 5) | (wait << 11)) << 41
    return f"        /*{addr:04x}*/                   {ins} ;  /* 0x0000000000000000 */\n" \
           f"                                                 /* 0x{hi:016x} */"


def kernel(body):
    return "\n".join(line(16 * i, ins, w, m) for i, (ins, w, m) in enumerate(body))


LOAD = ("LDG.E.NA.128.CONSTANT R8, desc[UR8][R6.64]", 5, 0)
WAIT = ("PRMT R40, R4, 0x7632, R5", 7, 1 << 5)  # waits on scoreboard 5
OTHER_WAIT = ("LDS.64 R44, [R63]", 7, 1 << 3)  # scoreboard 3: not the loads'
MMA = ("HMMA.16816.F32 R40, R40, R44, RZ", 7, 0)


def test_a_pipelined_loop_passes():
    seq = sass.events(kernel([LOAD, WAIT, LOAD, MMA, OTHER_WAIT, MMA, WAIT, LOAD, MMA, WAIT]))
    assert seq == "LWLMWLMW" and sass.pipelined(seq)


def test_a_wait_after_the_next_loads_fails():
    seq = sass.events(kernel([LOAD, LOAD, MMA, WAIT, MMA, LOAD, MMA]))
    assert seq == "LMWML" + "M" and not sass.pipelined(seq)
    assert not sass.pipelined(sass.events(kernel([LOAD, WAIT, LOAD, WAIT, MMA, LOAD, MMA])))


def test_the_last_stage_is_not_checked():
    # after the last loads in program order the last stage is waited for and computed
    assert sass.pipelined(sass.events(kernel([LOAD, WAIT, LOAD, MMA, WAIT, MMA, WAIT])))
