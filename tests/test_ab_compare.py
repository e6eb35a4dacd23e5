"""benchmarks/ab_spmm.compare, the A/B harness of the planner's tuning runs, on the CPU: each
call keeps its least median over shuffled rounds (spinfer.timing.least_of_rounds), and each
configuration's environment is in force when its op runs; the --plans lines of ab_spmm and
ab_lowbit."""

import os
import sys
from pathlib import Path

import pytest
import torch

import spinfer.timing as timing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ab_lowbit  # noqa: E402
import ab_spmm  # noqa: E402


def test_rounds_reorder_the_calls_and_keep_the_least(monkeypatch, capsys):
    monkeypatch.delenv("SPINFER_X", raising=False)
    seen = []  # what each median ran: cuBLAS, or the op under a configuration's environment
    # round 0 in the given order: cuBLAS 10 us, the op under auto 6, under X=1 5; round 1 in
    # random.Random(1)'s order: auto 2 (undisturbed), X=1 5, cuBLAS 10.
    clock = iter([10e-6, 6e-6, 5e-6, 2e-6, 5e-6, 10e-6])

    def fake_median(fn, device, **kwargs):
        assert kwargs == {"reps": 40}
        out = fn()
        seen.append(out if isinstance(out, str) else out[1])
        return next(clock)

    monkeypatch.setattr(timing, "median_time", fake_median)
    cases = [("case", lambda: "cuBLAS", lambda: os.environ.get("SPINFER_X", "auto"))]
    ab_spmm.compare(["auto", "X=1"], cases, torch.device("cpu"), rounds=2)
    assert seen == ["cuBLAS", "auto", "1", "auto", "1", "cuBLAS"]
    row, summary = capsys.readouterr().out.splitlines()
    assert row == "case cuBLAS   10.0 | 5.00 (   2.0) | 2.00 (   5.0)"
    assert summary == "geomean x cuBLAS: auto: 5.000 | X=1: 2.000"
    assert "SPINFER_X" not in os.environ  # the planner's own choice is restored


@pytest.mark.parametrize("rounds", [1, 3])
def test_every_configuration_runs_once_per_round(monkeypatch, rounds):
    monkeypatch.setattr(timing, "median_time", lambda fn, device, **kw: fn() and 1e-6)
    runs = []
    cases = [("c", lambda: True, lambda: runs.append(os.environ.get("SPINFER_X", "auto")))]
    ab_spmm.compare(["auto", "X=1", "X=2"], cases, torch.device("cpu"), rounds=rounds)
    assert sorted(runs) == sorted(["auto", "1", "2"] * rounds)


def test_position_table_lines_up_the_steps_kernel_by_kernel():
    import ab_e2e  # imports spinfer.bench.e2e, which needs no GPU to import

    # two steps of three kernels (name, start, end in us); the second graph's middle kernel starts
    # 1 us before the one ahead of it ends (programmatic dependent launch)
    a = [("norm", 0, 2), ("gemm<1>(x)", 3, 13), ("silu", 14, 15), ("norm", 16, 18), ("gemm<1>(x)", 19, 31),
         ("silu", 32, 33)]
    b = [("norm", 0, 2), ("spmm", 1, 9), ("silu", 10, 11), ("norm", 12, 14), ("spmm", 13, 23), ("silu", 24, 25)]
    header, *rows = ab_e2e.position_table({"dense": a, "sparse": b}).splitlines()
    assert header.split() == ["pos", "dense", "sparse"]
    assert len(rows) == 3  # one per kernel of the step, not per launch
    assert rows[1].split() == ["1", "gemm", "11.00", "1.00", "spmm", "9.00", "-1.00"]
    assert rows[0].split() == ["0", "norm", "2.00", "1.00", "norm", "2.00", "1.00"]  # its gap: the step before


def test_plans_are_asked_under_each_configuration(monkeypatch, capsys):
    """ab_spmm --plans: one line per weight and N, each configuration's launch asked with its
    environment in force, and the planner's own choice restored after."""
    import spinfer.ops.spmm  # noqa: F401 (spinfer.ops binds the name spmm to the op, so take the module)

    spmm_ops = sys.modules["spinfer.ops.spmm"]
    monkeypatch.delenv("SPINFER_SPLITS", raising=False)

    def fake_plan(enc, n):
        splits = int(os.environ.get("SPINFER_SPLITS", "3"))
        return dict(bn=32, wgmma=5, rows=1, splits=splits, k_per_split=enc // splits, resident_blocks=4)

    monkeypatch.setattr(spmm_ops, "spmm_plan", fake_plan)
    ab_spmm.print_plans(["auto", "SPLITS=2"], [((128, 768), 12)], [24, 32])
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "plan   128x768   N=24  auto: bn 32 wg 5 rows 1 splits 3x4 res 4 | SPLITS=2: bn 32 wg 5 rows 1 splits 2x6 res 4",
        "plan   128x768   N=32  auto: bn 32 wg 5 rows 1 splits 3x4 res 4 | SPLITS=2: bn 32 wg 5 rows 1 splits 2x6 res 4",
    ]
    assert "SPINFER_SPLITS" not in os.environ  # the planner's own choice is restored


def test_lowbit_plans_are_asked_under_each_configuration(monkeypatch, capsys):
    """ab_lowbit --plans: one line per weight and N, each configuration's launch (the GEMV with its
    loader, the balanced schedule, or row tiles with their splits and split tail rows) asked with
    its environment and dtype in force, and the planner's own choice restored after."""
    lowbit_ops = sys.modules["spinfer.ops.lowbit_mm"]
    monkeypatch.delenv("SPINFER_LOWBIT_SPLITS", raising=False)
    asked = []

    def fake_plan(q, n, *, dtype):
        asked.append(dtype)
        splits = int(os.environ.get("SPINFER_LOWBIT_SPLITS", "0"))
        plan = dict(bn=8 if n <= 8 else 16, splits=1, iters_per_split=q, tail_splits=0, tail_iters=0, tile_rows=64,
                    gemv=n == 1 and splits == 0, gemv_ring=2, gemv_warps=4, balanced=splits < 0, resident_blocks=3)
        if splits > 1:
            plan.update(splits=splits, iters_per_split=q // splits)
        elif splits == 0 and n > 1:
            plan.update(tail_splits=3, tail_iters=q // 3)
        return plan

    monkeypatch.setattr(lowbit_ops, "lowbit_plan", fake_plan)
    ab_lowbit.print_plans(["auto", "LOWBIT_SPLITS=2", "LOWBIT_SPLITS=-1"], [((333, 2048), 12)], [1, 16],
                          torch.bfloat16)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "plan   333x2048  N=1   auto: gemv ring 2 warps 4 bn 8 splits 1x12 res 3 | "
        "LOWBIT_SPLITS=2: rows 64 bn 8 splits 2x6 res 3 | LOWBIT_SPLITS=-1: balanced bn 8 splits 1x12 res 3",
        "plan   333x2048  N=16  auto: rows 64 bn 16 splits 1x12 tail 3x4 res 3 | "
        "LOWBIT_SPLITS=2: rows 64 bn 16 splits 2x6 res 3 | LOWBIT_SPLITS=-1: balanced bn 16 splits 1x12 res 3",
    ]
    assert asked == [torch.bfloat16] * 6
    assert "SPINFER_LOWBIT_SPLITS" not in os.environ  # the planner's own choice is restored
