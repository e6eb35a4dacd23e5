"""The end-to-end benchmark's glue on a GPU: the fused compiled kernels (residual add inside the
next norm, SwiGLU product, mask) give what torch's kernels give, in eager steps and in a replayed
CUDA graph, with the keys and values written to the shared cache. Skipped without a GPU."""

import copy

import pytest
import torch

import spinfer.bench.e2e as e2e
from tests.conftest import rel_err

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("fused", [False, True])
def test_fused_glue_equals_torch_kernels(monkeypatch, fused):
    torch.manual_seed(4)
    dev = torch.device("cuda")
    stack = e2e.Stack(2, 256, 512, 8, 2, 9, 3, fused).to(dev, torch.float16)
    for p in stack.parameters():  # norms' weights away from 1, so a dropped weight shows
        p.data.mul_(torch.rand_like(p) + 0.5)
    ref = copy.deepcopy(stack)
    x = torch.randn(3, 1, 256, device=dev, dtype=torch.float16)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    steps = []
    with torch.no_grad():
        monkeypatch.setattr(e2e, "_GLUE", {"mode": "eager"})
        h = x.clone()
        for step in range(4):
            h = ref(h, torch.tensor([step], device=dev))
            steps.append(h.clone())
        monkeypatch.setattr(e2e, "_GLUE", {"mode": "fused"})
        run, tokens = e2e.decode_runner(stack, 3, 256, 4, dev, graphs=True)  # compiles, captures
        assert tokens == 12 and e2e._GLUE["mode"] == "fused"
    # The runner's graph starts from its own random x; replay one from ours (capture's warm-up
    # steps move x on, so it is put back; they also write cache slots the replays rewrite first).
    x0 = x.clone()
    g = e2e.capture(stack, x, pos)
    x.copy_(x0)
    pos.zero_()
    for step in range(4):
        g.replay()
        assert rel_err(x, steps[step]) < 2e-3, step
    torch.testing.assert_close(stack.layers[0].kv_cache[:, :, :, :4], ref.layers[0].kv_cache[:, :, :, :4],
                               atol=2e-2, rtol=2e-2)
