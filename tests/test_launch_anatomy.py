"""scripts/launch_anatomy.py: its least-squares fit of time against K (no GPU needed) and its
refusal to run without one."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "launch_anatomy.py"


def load():
    spec = importlib.util.spec_from_file_location("launch_anatomy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fit_recovers_slope_and_fixed_cost():
    ks = [512, 1024, 2048, 4096, 8192, 16384]
    slope, fixed = load().fit(ks, [3.0 * k / 1024 + 6.4 for k in ks])
    assert slope == pytest.approx(3.0) and fixed == pytest.approx(6.4)
    noisy = [3.0 * k / 1024 + 6.4 + (0.2 if i % 2 else -0.2) for i, k in enumerate(ks)]
    slope, fixed = load().fit(ks, noisy)
    assert abs(slope - 3.0) < 0.05 and abs(fixed - 6.4) < 0.3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_it_says_so():
    out = subprocess.run([sys.executable, str(SCRIPT), "--ks", "none"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "GPU" in out.stderr
