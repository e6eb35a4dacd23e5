"""The end-to-end benchmark's glue on a GPU: the fused compiled kernels (residual add inside the
next norm, SwiGLU product, mask) and the Triton kernels that trigger programmatic dependent launch
(pdl_glue.py, sm_90+) give what torch's kernels give, in eager steps and in a replayed CUDA graph,
with the keys and values written to the shared cache. Skipped without a GPU."""

import copy

import pytest
import torch

import spinfer.bench.e2e as e2e
from spinfer.bench import pdl_glue
from tests.conftest import rel_err

pytestmark = pytest.mark.cuda


# Relative error of a glue against torch's kernels: one rounding per kernel boundary apart.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("glue", ["fused", "pdl"])
@pytest.mark.parametrize("fused", [False, True])
def test_fused_glue_equals_torch_kernels(monkeypatch, fused, glue, dtype):
    if glue == "pdl" and not pdl_glue.available("cuda"):
        pytest.skip("needs Triton and compute capability 9.0+")
    torch.manual_seed(4)
    dev = torch.device("cuda")
    stack = e2e.Stack(2, 256, 512, 8, 2, 9, 3, fused).to(dev, dtype)
    for p in stack.parameters():  # norms' weights away from 1, so a dropped weight shows
        p.data.mul_(torch.rand_like(p) + 0.5)
    ref = copy.deepcopy(stack)
    x = torch.randn(3, 1, 256, device=dev, dtype=dtype)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    steps = []
    with torch.no_grad():
        monkeypatch.setattr(e2e, "_GLUE", {"mode": "eager"})
        h = x.clone()
        for step in range(4):
            h = ref(h, torch.tensor([step], device=dev))
            steps.append(h.clone())
        monkeypatch.setattr(e2e, "_GLUE", {"mode": glue})
        run, tokens = e2e.decode_runner(stack, 3, 256, 4, dev, graphs=True)  # compiles, captures
        assert tokens == 12 and e2e._GLUE["mode"] == glue
    # The runner's graph starts from its own random x; replay one from ours (capture's warm-up
    # steps move x on, so it is put back; they also write cache slots the replays rewrite first).
    x0 = x.clone()
    g = e2e.capture(stack, x, pos)
    x.copy_(x0)
    pos.zero_()
    for step in range(4):
        g.replay()
        assert rel_err(x, steps[step]) < TOL[dtype], step
    torch.testing.assert_close(stack.layers[0].kv_cache[:, :, :, :4], ref.layers[0].kv_cache[:, :, :, :4],
                               atol=2e-2, rtol=2e-2 if dtype == torch.float16 else 5e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pdl_glue_kernels_match_torch(dtype):
    """Each PDL glue kernel against torch on odd widths, rows and a strided SwiGLU input (eager;
    the graph test above covers capture)."""
    if not pdl_glue.available("cuda"):
        pytest.skip("needs Triton and compute capability 9.0+")
    torch.manual_seed(5)
    dev = torch.device("cuda")
    for d, rows in ((4096, 1), (1000, 7), (256, 16)):
        x = torch.randn(rows, 1, d, device=dev, dtype=dtype)
        r = torch.randn_like(x)
        w = (torch.rand(d, device=dev) + 0.5).to(dtype)
        poison = (torch.full_like(x, float("nan")), torch.full_like(x, float("nan")))
        s, y = pdl_glue.add_rms_norm(x, r, w, out=poison)
        assert s.data_ptr() == poison[0].data_ptr() and y.data_ptr() == poison[1].data_ptr()
        s_ref = x + r
        torch.testing.assert_close(s, s_ref, atol=0, rtol=0)  # the sum is rounded as torch rounds it
        assert rel_err(y, e2e.rms_norm(s_ref.float(), w.float())) < TOL[dtype]
        assert rel_err(pdl_glue.rms_norm(x, w), e2e.rms_norm(x.float(), w.float())) < TOL[dtype]
        gu = torch.randn(rows, 1, 2 * d + 6, device=dev, dtype=dtype)[..., : 2 * d]  # rows strided
        gate, up = gu.chunk(2, dim=-1)
        out = pdl_glue.silu_mul(gate, up, out=torch.full(gate.shape, float("nan"), device=dev, dtype=gate.dtype))
        assert out.shape == gate.shape and out.is_contiguous()
        assert rel_err(out, e2e.silu_mul(gate.float(), up.float())) < TOL[dtype]


@pytest.mark.parametrize("batch, heads, kv_heads, hd, max_len, dtype", [
    (1, 32, 8, 128, 72, torch.float16), (3, 8, 2, 32, 9, torch.float16), (2, 6, 2, 16, 40, torch.float16),
    (16, 32, 8, 128, 100, torch.float16), (2, 8, 2, 64, 300, torch.float16), (1, 32, 8, 128, 72, torch.bfloat16),
    (2, 8, 2, 64, 300, torch.bfloat16)])
def test_pdl_decode_attention_matches_sdpa(batch, heads, kv_heads, hd, max_len, dtype):
    """The attention step's kernel against e2e's reference (index_copy_ and SDPA) in float64 on the
    CPU: strided q, k and v views of one projection row, a random (not zero) cache, positions at
    the start, inside and at the end of it, the output poisoned; the cache gets exactly the new keys
    and values at pos and nothing else changes. A pos past the cache writes nothing."""
    if not pdl_glue.available("cuda"):
        pytest.skip("needs Triton and compute capability 9.0+")
    torch.manual_seed(6)
    dev = torch.device("cuda")
    dq, dkv = heads * hd, kv_heads * hd
    for pos in sorted({0, 1, max_len // 2, max_len - 1}):
        qkv = torch.randn(batch, 1, dq + 2 * dkv + 8, device=dev, dtype=dtype)[..., : dq + 2 * dkv]
        q, k, v = qkv[..., :dq], qkv[..., dq:dq + dkv], qkv[..., dq + dkv:]
        cache = torch.randn(2, batch, kv_heads, max_len, hd, device=dev, dtype=dtype)
        ref_cache = cache.double().cpu()
        p = torch.tensor([pos], device=dev)
        out = torch.full((batch, 1, dq), float("nan"), device=dev, dtype=dtype)
        a = pdl_glue.decode_attention(q, k, v, cache, p, out=out, pdl=pos % 2 == 0)  # both launch forms
        ref = e2e.decode_attention(*(t.double().cpu() for t in (q, k, v)), ref_cache, p.cpu())
        assert a.data_ptr() == out.data_ptr() and not a.isnan().any()
        assert rel_err(a.double().cpu(), ref) < (2e-3 if dtype == torch.float16 else 1e-2), pos
        assert torch.equal(cache.double().cpu(), ref_cache), pos  # the new keys and values, bitwise, at pos only
    before = cache.clone()
    a = pdl_glue.decode_attention(q, k, v, cache, torch.tensor([max_len], device=dev))
    assert torch.equal(cache, before) and a.isfinite().all()  # nothing written past the cache (its reads stop at L)
    with pytest.raises(ValueError, match="kv_cache must be"):
        pdl_glue.decode_attention(q, k, v, cache[:, :, :, :-1], p)
    with pytest.raises(ValueError, match="do not match"):
        pdl_glue.decode_attention(q, k[..., :-hd], v, cache, p)
    with pytest.raises(ValueError, match="share a dtype"):
        pdl_glue.decode_attention(q, k, v, cache.float(), p)
    with pytest.raises(ValueError, match="one position on their device"):
        pdl_glue.decode_attention(q, k, v, cache, p.cpu())
