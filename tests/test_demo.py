import subprocess
import sys

from spinfer.cli import main
from spinfer.demo import run_demo


def test_demo_reports_and_checks():
    lines = []
    r = run_demo(m=200, k=320, n=3, sparsity=0.7, device="cpu", out=lines.append)
    text = "\n".join(lines)
    for word in ("compression ratio", "rel. error", "dense F.linear", "spinfer.spmm"):
        assert word in text
    assert r["rel_err"] < 2e-3
    assert 2.0 < r["compression_ratio"] < 2.76 + 0.01
    assert r["storage_bytes"] < 2 * 200 * 320


def test_cli_exit_codes(capsys):
    assert main(["demo", "--m", "64", "--k", "96", "--n", "2", "--device", "cpu"]) == 0
    assert "compression ratio" in capsys.readouterr().out
    assert main(["demo", "--m", "64", "--k", "96", "--sparsity", "1.5"]) == 2
    assert "sparsity" in capsys.readouterr().err


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "spinfer", "demo", "--m", "64", "--k", "64",
                          "--n", "1", "--device", "cpu"], capture_output=True, text=True, check=True)
    assert "compression ratio" in out.stdout


def test_demo_falls_back_to_cpu_when_the_kernel_cannot_be_built(monkeypatch):
    from spinfer import build

    def fail(verbose=False):
        raise RuntimeError("Error building extension 'spinfer_cuda': nvcc not found")

    monkeypatch.setattr(build, "load_extension", fail)
    lines = []
    r = run_demo(m=96, k=128, n=2, device="cuda", out=lines.append)
    assert r["device"] == "cpu" and r["rel_err"] < 2e-3
    assert any("could not be built (Error building extension" in line for line in lines)
