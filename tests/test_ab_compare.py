"""benchmarks/ab_spmm.compare, the A/B harness of the planner's tuning runs, on the CPU: rounds
rotate the configurations' order and each call keeps its least median."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ab_spmm  # noqa: E402


def test_rounds_reorder_the_configurations_and_keep_the_least(monkeypatch, capsys):
    monkeypatch.delenv("SPINFER_X", raising=False)
    seen = []  # (config the op ran under) per median
    # cuBLAS 10 us; the op under a: 6, then 2 (a later round is undisturbed); under b: 5, 5.
    clock = iter([10e-6, 6e-6, 5e-6, 10e-6, 5e-6, 2e-6])

    def fake_median(fn, device, **kwargs):
        seen.append(fn())
        return next(clock)

    monkeypatch.setattr(ab_spmm, "median_time", fake_median)
    cases = [("case", lambda: "cuBLAS", lambda: os.environ.get("SPINFER_X", "auto"))]
    ab_spmm.compare(["auto", "X=1"], cases, torch.device("cpu"), rounds=2)
    assert seen == ["cuBLAS", "auto", "1", "cuBLAS", "1", "auto"]  # round 1: random.Random(1)'s order
    row, summary = capsys.readouterr().out.splitlines()
    assert row == "case cuBLAS   10.0 | 5.00 (   2.0) | 2.00 (   5.0)"
    assert summary == "geomean x cuBLAS: auto: 5.000 | X=1: 2.000"
    assert "SPINFER_X" not in os.environ  # the planner's own choice is restored


@pytest.mark.parametrize("rounds", [1, 3])
def test_every_configuration_runs_once_per_round(monkeypatch, rounds):
    monkeypatch.setattr(ab_spmm, "median_time", lambda fn, device, **kw: fn() or 1e-6)
    runs = []
    cases = [("c", lambda: None, lambda: runs.append(os.environ.get("SPINFER_X", "auto")))]
    ab_spmm.compare(["auto", "X=1", "X=2"], cases, torch.device("cpu"), rounds=rounds)
    assert sorted(runs) == sorted(["auto", "1", "2"] * rounds)
