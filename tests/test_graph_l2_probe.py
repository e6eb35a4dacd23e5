"""scripts/graph_l2_probe.py on a small layer: a row for every variant with the columns it
promises, and the profile by position. Skipped without a GPU."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "graph_l2_probe.py"
pytestmark = pytest.mark.cuda


def test_runs_every_variant(capsys):
    spec = importlib.util.spec_from_file_location("graph_l2_probe", SCRIPT)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.main(["--m", "640", "--k", "1024", "--small", "20", "--rounds", "1", "--replays", "2",
                       "--profile"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.startswith("variant") and "extra" in line)
    w = probe.NAME_W
    rows = {line[:w].strip(): line[w:].split() for line in out[header + 1:header + 1 + len(probe.VARIANTS)]}
    assert set(rows) == set(probe.VARIANTS)
    for name, cells in rows.items():
        graph, less_plain, alone, extra, per = (float(c) for c in cells)
        assert graph > 0 and (alone > 0) == (name not in ("plain", "after flush"))
        assert extra == pytest.approx(less_plain - alone, abs=0.02) and per == pytest.approx(extra / 20, abs=0.01)
    profiled = [line for line in out if line[:w].strip() in probe.VARIANTS]
    assert len(profiled) == 2 * len(probe.VARIANTS)  # the timing table's rows and the profile's
