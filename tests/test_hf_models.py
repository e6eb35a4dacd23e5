"""sparsify on a Hugging Face Llama built from a small config with random weights (no download)."""

import pytest
import torch

import spinfer
from tests.conftest import rel_err

transformers = pytest.importorskip("transformers")


def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
def test_sparsify_llama_matches_its_pruned_dense_twin(method):
    model = tiny_llama().float()
    ids = torch.randint(0, 128, (2, 16))
    calib = [{"input_ids": torch.randint(0, 128, (2, 16))} for _ in range(2)]
    twin = tiny_llama().float()
    twin.load_state_dict(model.state_dict())
    model = model.half()
    report = spinfer.sparsify(model, 0.5, method=method, calib=calib, progress=False)
    # 7 linear layers per decoder layer (q, k, v, o, gate, up, down); lm_head excluded
    assert len(report) == 14 and not any("lm_head" in r["layer"] for r in report)
    assert all(r["sparsity"] == pytest.approx(0.5, abs=1e-3) for r in report)
    # the twin gets exactly the pruned weights, in fp32: the wrapped model must match it
    for r in report:
        layer = model.get_submodule(r["layer"])
        w = layer.weight_object()
        w = w if isinstance(w, torch.Tensor) else w.to_dense()
        twin.get_submodule(r["layer"]).weight.data = w.float()
    with torch.no_grad():
        out = model(ids).logits.float()
        ref = twin.half()(ids).logits.float()
    assert rel_err(out, ref) < 1e-2
