"""SparseLinear (storage, dispatch, persistence, module behaviour) and whole-model sparsify."""

import dataclasses
import io
import math
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spinfer
from spinfer.nn import SparseLinear
from spinfer.nn import policy as P
from spinfer.prune import nm_mask, wanda_scores
from spinfer.quant import LowBitWeight
from tests.conftest import count_entry_point_calls, rel_err, seen_ops


def pruned_linear(m, k, sparsity, dtype=torch.float16, bias=True):
    lin = nn.Linear(k, m, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(spinfer.magnitude_prune(torch.randn(m, k).to(dtype), sparsity))
        if bias:
            lin.bias.copy_(torch.randn(m).to(dtype))
    return lin


@pytest.mark.parametrize("policy", ["auto", "dense", "sparse"])
def test_output_equals_the_pruned_dense_layer(policy):
    lin = pruned_linear(1024, 768, 0.5)
    layer = SparseLinear.from_linear(lin, policy=policy)
    for n in (1, 5, 16, 128, 1000):
        x = torch.randn(n, 768).half()
        ref = x.double() @ lin.weight.double().t() + lin.bias.double()
        assert rel_err(layer(x), ref) <= 2e-3, (policy, n)


def test_lowbit_policy_equals_its_dequantized_weight():
    lin = pruned_linear(256, 512, 0.0)
    layer = SparseLinear.from_linear(lin, quant="w4", group_size=64, policy="lowbit")
    assert layer.format == "lowbit"
    w = layer.weight_object().dequantize()
    x = torch.randn(7, 512).half()
    assert rel_err(layer(x), x.double() @ w.double().t() + lin.bias.double()) <= 2e-3


def test_auto_picks_by_predicted_cost_and_stores_one_format():
    big = SparseLinear.from_linear(pruned_linear(16384, 8192, 0.5))
    assert big.format == "tca-bme"
    # measured on H100 (spinfer bench policy, SMBD v9): at 70% a 4096x4096 layer runs 15.1 us as
    # SpMM and 17.6 us dense, a 1024x4096 one 11.1 and 9.8 us, and the model stores each in the
    # faster format
    assert SparseLinear.from_linear(pruned_linear(4096, 4096, 0.7)).format == "tca-bme"
    assert SparseLinear.from_linear(pruned_linear(1024, 4096, 0.7)).format == "dense"
    # the row table is derived from the bitmap: held (8 B a GroupTile, counted in the memory) but not saved
    assert {n for n, _ in big.named_buffers()} == {"bitmap", "values", "gtile_offset", "row_offset", "bias"}
    assert "row_offset" not in big.state_dict()
    assert big.compression_ratio == pytest.approx(1.77, abs=0.02)
    dense = SparseLinear.from_linear(pruned_linear(1024, 1024, 0.0))
    assert dense.format == "dense"  # no sparsity: the bitmap would only add bytes
    report = big.policy_report(print_it=False)
    assert "spmm" in report and "decode+dense" in report and report.count("\n") == 1 + len(spinfer.nn.policy.N_BUCKETS)
    # the model: for 50% at N=1 SpMM is predicted faster, for a 4096-token prompt decode+dense
    pred1, pred4096 = big.predicted(1, "cuda"), big.predicted(4096, "cuda")
    assert pred1["spmm"] < pred1["decode+dense"] and pred4096["decode+dense"] < pred4096["spmm"]
    assert P.n_bucket(5000) == 8192 and P.n_bucket(3000) == 4096 and P.n_bucket(10**6) == 8192


def test_bad_input():
    with pytest.raises(TypeError, match="nn.Linear"):
        SparseLinear.from_linear(nn.Conv1d(3, 3, 1))
    with pytest.raises(ValueError, match="policy"):
        SparseLinear.from_linear(pruned_linear(8, 16, 0.5), policy="fastest")
    with pytest.raises(ValueError, match="quant"):
        SparseLinear.from_linear(pruned_linear(8, 16, 0.5), quant="w3")
    with pytest.raises(ValueError, match="needs quant"):
        SparseLinear.from_linear(pruned_linear(8, 16, 0.5), policy="lowbit")
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        SparseLinear.from_weight(torch.randn(8, 16))
    layer = SparseLinear.from_linear(pruned_linear(8, 16, 0.5))
    with pytest.raises(ValueError, match=r"\[\.\.\., 16\]"):
        layer(torch.randn(2, 15).half())
    with pytest.raises(TypeError, match="float32"):
        layer(torch.randn(2, 16))


def test_state_dict_round_trip_and_mismatch():
    a = SparseLinear.from_linear(pruned_linear(300, 500, 0.5), policy="sparse")
    b = SparseLinear.from_linear(pruned_linear(300, 500, 0.7), policy="sparse")  # other nnz
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 500).half()
    assert torch.equal(a(x), b(x))
    assert torch.equal(b.row_offset, a.row_offset)  # the row table follows the loaded bitmap
    c = SparseLinear.from_linear(pruned_linear(300, 500, 0.5), policy="dense")
    with pytest.raises(ValueError, match="tca-bme 300x500"):
        c.load_state_dict(a.state_dict())
    d = SparseLinear.from_linear(pruned_linear(200, 500, 0.5), policy="sparse")
    with pytest.raises(ValueError, match="300x500"):
        d.load_state_dict(a.state_dict())
    sd = a.state_dict()
    sd["gtile_offset"] = sd["gtile_offset"].clone()
    sd["gtile_offset"][1] += 8
    with pytest.raises(ValueError):
        b.load_state_dict(sd)  # untrusted arrays are validated
    sd = a.state_dict()
    sd["spinfer_meta"] = sd["spinfer_meta"].clone()
    sd["spinfer_meta"][6] -= 8  # a max_run below the longest run would truncate runs on CUDA
    with pytest.raises(ValueError, match="max_run"):
        b.load_state_dict(sd)


def test_a_loaded_state_keeps_the_layers_dtype():
    # As load_state_dict keeps any module's dtype: a TCA-BME layer takes the incoming arrays'
    # lengths (they follow the nonzeros) but keeps its values and bias in its own dtype. Before,
    # its values took the incoming dtype and its bias did not, which no input could then run.
    a = SparseLinear.from_linear(pruned_linear(128, 256, 0.5), policy="sparse")  # float16
    b = SparseLinear.from_linear(pruned_linear(128, 256, 0.7), policy="sparse").bfloat16()
    b(torch.randn(2, 256).bfloat16())  # dtype and device now kept between calls
    b.load_state_dict(a.state_dict())
    assert b.values.dtype == b.bias.dtype == b.weight_dtype == torch.bfloat16
    assert torch.equal(b.bitmap, a.bitmap) and b.values.numel() == a.values.numel()
    x = torch.randn(3, 256)
    assert rel_err(b(x.bfloat16()), a(x.half()).float()) < 1e-2
    with pytest.raises(TypeError, match="float16 but the layer is torch.bfloat16"):
        b(x.half())


def saved_and_loaded(obj):
    """``obj`` through torch.save and torch.load (whole-object pickling, as torch.save(model) does)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _expected(layer, x):
    """The float64 product with the weight rebuilt from the layer's buffers as they are now."""
    shape = (layer.out_features, layer.in_features)
    if layer.format == "dense":
        w = layer.weight
    elif layer.format == "tca-bme":
        w = spinfer.TCABME(layer.bitmap, layer.values, layer.gtile_offset, shape).to_dense()
    else:
        w = spinfer.LowBitWeight(layer.qweight, None, None, layer.weight_object().bits,
                                 layer.weight_object().group_size, shape, layer.perm,
                                 scale_zero=layer.scale_zero).dequantize()
    out = x.double() @ w.double().t()
    return out if layer.bias is None else out + layer.bias.double()


@pytest.mark.parametrize("policy", ["dense", "sparse", "lowbit"])
def test_a_replaced_buffer_is_what_the_next_call_reads(policy):
    # The layer caches the format object, its device and dtype, and its kernel choices between
    # calls. Before, a buffer assigned after the first call (layer.values = t, or through
    # _buffers as accelerate does) was not seen: the layer went on reading the old tensor.
    quant = "w4" if policy == "lowbit" else None
    layer = SparseLinear.from_linear(pruned_linear(128, 256, 0.5), policy=policy, quant=quant, group_size=64)
    x = torch.randn(3, 256).half()
    first = layer(x)
    name = {"dense": "weight", "sparse": "values", "lowbit": "scale_zero"}[policy]
    doubled = getattr(layer, name) * 2  # scales and zeros both doubled: (q - 2z) * 2s
    setattr(layer, name, doubled)
    assert getattr(layer, name) is doubled
    out = layer(x)
    assert rel_err(out, _expected(layer, x)) <= 2e-3
    assert not torch.allclose(out, first)
    layer._buffers["bias"] = torch.zeros_like(layer.bias)
    layer._buffers[name] = doubled.clone()  # through the dict, bypassing nn.Module.__setattr__
    assert rel_err(layer(x), _expected(layer, x)) <= 2e-3


def test_a_replaced_bitmap_is_validated_and_its_row_table_remade():
    a = SparseLinear.from_linear(pruned_linear(128, 256, 0.5, bias=False), policy="sparse")
    b = SparseLinear.from_linear(pruned_linear(128, 256, 0.8, bias=False), policy="sparse")
    x = torch.randn(2, 256).half()
    a(x)
    # The kernels trust the structure arrays: a bitmap that does not match the values and
    # offsets would make them read out of bounds, so a change the layer did not make is
    # validated before any kernel runs, and the error names the problem.
    a.bitmap = b.bitmap.clone()
    with pytest.raises(ValueError, match="popcount|GroupTile|values"):
        a(x)
    a.values, a.gtile_offset = b.values.clone(), b.gtile_offset.clone()
    assert rel_err(a(x), b(x).double()) <= 1e-3
    assert torch.equal(a.row_offset, b.row_offset) and a.sparsity == pytest.approx(b.sparsity)
    # An in-place edit of a structure array is seen too (its version counter moves).
    kept = a.bitmap[0].clone()
    a.bitmap[0] = -1  # all 64 bits of one 8x8 tile: more nonzeros than its GroupTile's run
    with pytest.raises(ValueError, match="GroupTile 0"):
        a(x)
    a.bitmap[0] = kept
    assert rel_err(a(x), b(x).double()) <= 1e-3
    a.values = None
    with pytest.raises(TypeError, match="values must be a tensor"):
        a(x)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_bitmap_swapped_in_through_data_is_validated(device):
    # .data = other moves no version counter, only the data pointer. (The kernels, CUDA's and the
    # CPU's direct one, trust what the layer checked.) All-ones words: every GroupTile's PopCount
    # is 4096, far from its run. (The bitmap rolled by one word, which this test swapped in before,
    # kept every run's PopCount within its rounding to 8 in ~0.3-2% of random weights: then it is a
    # valid structure, and decodes to another matrix without reading out of bounds.)
    a = SparseLinear.from_linear(pruned_linear(128, 256, 0.5, bias=False), policy="sparse").to(device)
    x = torch.randn(2, 256, device=device).half()
    with torch.no_grad():
        ref = a(x)
        original = a.bitmap.data
        a.bitmap.data = torch.full_like(original, -1)
        with pytest.raises(ValueError, match="popcount|GroupTile|values"):
            a(x)
        a.bitmap.data = original
        assert torch.equal(a(x), ref)


def test_a_replaced_buffer_of_another_dtype_changes_the_layers_dtype():
    layer = SparseLinear.from_linear(pruned_linear(128, 256, 0.5, bias=False), policy="sparse")
    x = torch.randn(2, 256)
    ref = layer(x.half()).double()
    layer.values = layer.values.bfloat16()
    assert layer.weight_dtype == torch.bfloat16
    assert rel_err(layer(x.bfloat16()), ref) < 1e-2
    with pytest.raises(TypeError, match="float16 but the layer is torch.bfloat16"):
        layer(x.half())


def test_a_replaced_lowbit_permutation_is_validated():
    w = torch.randn(64, 128).half()
    layer = SparseLinear(spinfer.LowBitWeight.quantize(w, 4, 32))
    x = torch.randn(2, 128).half()
    layer(x)
    perm = torch.randperm(128)
    layer.perm = perm
    assert rel_err(layer(x), _expected(layer, x)) <= 2e-3
    perm[0] = perm[1]  # in place: no longer a permutation, which would index x out of range
    with pytest.raises(ValueError, match="permutation"):
        layer(x)


def test_a_layer_pickled_before_the_cache_existed_still_runs():
    import pickle

    layer = SparseLinear.from_linear(pruned_linear(64, 128, 0.5), policy="sparse")
    x = torch.randn(2, 128).half()
    y = layer(x)
    del layer.__dict__["_held"], layer.__dict__["_trusted"]  # as a layer pickled before them
    old = pickle.loads(pickle.dumps(layer))
    assert torch.equal(old(x), y) and old.sparsity == pytest.approx(0.5, abs=0.01)


def test_dtype_and_device_conversions():
    layer = SparseLinear.from_linear(pruned_linear(256, 512, 0.5), policy="sparse")
    x = torch.randn(3, 512)
    ref = layer(x.half()).float()
    bf = layer.bfloat16()
    assert bf.values.dtype == torch.bfloat16 and bf.bitmap.dtype == torch.int64
    assert rel_err(bf(x.bfloat16()), ref) < 1e-2
    assert layer.half().to("cpu")(x.half()).dtype == torch.float16
    assert "format=tca-bme" in repr(layer) and "compression_ratio" in repr(layer)


@pytest.mark.parametrize("policy", ["sparse", "lowbit"])
def test_compressed_layers_refuse_float32_before_changing(policy):
    layer = SparseLinear.from_linear(pruned_linear(64, 128, 0.5), policy=policy,
                                     quant="w4" if policy == "lowbit" else None)
    before = {name: b.clone() for name, b in layer.named_buffers() if b is not None}
    for convert in (lambda m: m.float(), lambda m: m.double(), lambda m: m.to(torch.float32)):
        with pytest.raises(TypeError, match="cannot become torch.float"):
            convert(layer)
    with pytest.raises(TypeError, match="integer arrays"):
        layer.type(torch.float16)  # nn.Module.type casts every buffer, the bitmap and offsets too
    after = dict(layer.named_buffers())
    assert all(torch.equal(b, after[name]) and b.dtype == after[name].dtype for name, b in before.items())
    assert layer(torch.randn(2, 128).half()).dtype == torch.float16


def test_dense_layers_take_any_float_dtype_and_keep_their_sparsity():
    layer = SparseLinear.from_linear(pruned_linear(64, 128, 0.5), policy="dense")
    x = torch.randn(3, 128)
    ref = layer(x.half()).double()
    for dtype in (torch.float32, torch.float64):
        layer = layer.to(dtype)
        assert layer.sparsity == pytest.approx(0.5, abs=0.01), dtype
        assert rel_err(layer(x.to(dtype)), ref) < 2e-3


def test_compile_fullgraph():
    model = nn.Sequential(SparseLinear.from_linear(pruned_linear(128, 64, 0.5), policy="sparse"), nn.ReLU())
    x = torch.randn(4, 64).half()
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), eager)


@pytest.mark.parametrize("policy", ["sparse", "lowbit", "dense"])
def test_compiled_before_the_first_eager_call(policy):
    # A layer compiled before any eager call traces (Geometry's counts once took a lock there,
    # which broke the full graph on Python <= 3.11), and its graph does not guard on state the
    # first eager call makes (it guarded on `_held is None`, so that call cost a recompile).
    lin = pruned_linear(96, 256, 0.5)
    layer = SparseLinear.from_linear(lin, policy=policy, quant="w4" if policy == "lowbit" else None)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    xs = [torch.randn(3, 256).half() for _ in range(3)]
    with torch.no_grad():
        ys = [compiled(xs[0])]  # (nothing has touched the layer before)
        with torch._dynamo.config.patch(error_on_recompile=True):
            ys.append(compiled(xs[1]))
            layer(torch.randn(5, 256).half())
            ys.append(compiled(xs[2]))
    for x, y in zip(xs, ys):
        assert rel_err(y, _expected(layer, x)) <= 2e-3


@pytest.mark.parametrize("policy", ["sparse", "lowbit", "dense"])
def test_pickles_and_deep_copies_after_calls(policy):
    # What a layer derives, and the eager launches it keeps on CUDA (the extension's entry points,
    # which do not pickle), stay out of torch.save(module) and copy.deepcopy; the copy derives again.
    import copy

    from spinfer.nn.sparse_linear import _Launch

    lin = pruned_linear(64, 256, 0.5)
    layer = SparseLinear.from_linear(lin, policy=policy, quant="w4" if policy == "lowbit" else None)
    x = torch.randn(3, 256).half()
    y = layer(x)

    def unpicklable(*args):
        raise AssertionError("a copy called the original's kept launch")

    layer._held.launches[3] = _Launch(unpicklable, ())  # as a CUDA call keeps one
    for twin in (saved_and_loaded(layer), copy.deepcopy(layer)):
        assert twin._held is not None and not twin._held.launches
        assert torch.equal(twin(x), y)


@pytest.mark.parametrize("policy", ["sparse", "lowbit"])
def test_copies_trust_what_the_original_trusted(policy, monkeypatch):
    # A copy of arrays the layer made or checked is not checked again (that cost a 14336x4096
    # layer's deepcopy 0.2 s); arrays edited in place after their check are, when unpickled.
    import copy

    from spinfer.format import tca_bme
    from spinfer.quant import LowBitWeight

    lin = pruned_linear(64, 256, 0.5)
    layer = SparseLinear.from_linear(lin, policy=policy, quant="w4" if policy == "lowbit" else None)
    if policy == "lowbit":
        layer.perm = torch.randperm(256)  # a structure array (act order), checked by the next call
    x = torch.randn(3, 256).half()
    y = layer(x)
    checks = []
    monkeypatch.setattr(tca_bme, "validate_arrays", lambda *a: checks.append("tca-bme"))
    monkeypatch.setattr(LowBitWeight, "validate", lambda self: checks.append("lowbit"))
    twins = [saved_and_loaded(layer), copy.deepcopy(layer)]
    assert checks == []
    monkeypatch.undo()  # (the CPU op checks its arguments every call)
    for twin in twins:
        assert torch.equal(twin(x), y)
    monkeypatch.setattr(tca_bme, "validate_arrays", lambda *a: checks.append("tca-bme"))
    monkeypatch.setattr(LowBitWeight, "validate", lambda self: checks.append("lowbit"))
    if policy == "sparse":
        layer.bitmap[:4] = -1  # in place, after the check: GroupTile 0 now holds more than its run
    else:
        layer.perm = torch.arange(256).flip(0)  # a new (valid) permutation the layer never checked
    copy.deepcopy(layer)
    assert checks == ["tca-bme" if policy == "sparse" else "lowbit"]
    monkeypatch.undo()
    if policy == "sparse":
        with pytest.raises(ValueError, match="GroupTile 0"):
            copy.deepcopy(layer)


def _autocast_case(device, autocast_dtype, layer_dtype, policy, x_dtype=torch.float32):
    lin = pruned_linear(64, 256, 0.5, dtype=layer_dtype).to(device)
    layer = SparseLinear.from_linear(lin, policy=policy, quant="w8" if policy == "lowbit" else None)
    x = torch.randn(3, 5, 256, device=device).to(x_dtype)  # float32: as in a model kept in float32
    with torch.autocast(device, dtype=autocast_dtype), torch.no_grad():
        y = layer(x)
    assert y.dtype == autocast_dtype  # as nn.Linear's under autocast
    # x rounded to the dtype the product ran in: the layer's (compressed) or autocast's (dense)
    xr = x.to(layer_dtype if policy != "dense" else autocast_dtype)
    assert rel_err(y, _expected(layer, xr)) <= 1e-2, (policy, layer_dtype)
    if x_dtype == layer_dtype:
        assert layer(x).dtype == layer_dtype  # outside autocast, the layer's own
    else:
        with pytest.raises(TypeError, match="float32 but the layer is"):
            layer(x)  # outside autocast a dtype mismatch is an error, as before


@pytest.mark.parametrize("layer_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("policy", ["sparse", "lowbit", "dense"])
def test_runs_under_autocast(policy, layer_dtype):
    # A model kept in float32 and run under autocast feeds float32 activations: nn.Linear casts
    # them, and so does a SparseLinear (to its own dtype; it returns autocast's, as nn.Linear).
    _autocast_case("cpu", torch.bfloat16, layer_dtype, policy)


@pytest.mark.parametrize("policy", ["sparse", "lowbit", "dense"])
def test_autocast_to_another_half_dtype_returns_it(policy):
    # x in the layer's dtype, autocast in the other 16-bit one: nn.Linear computes and returns
    # autocast's dtype, and so does a SparseLinear (a compressed one computes in its own).
    _autocast_case("cpu", torch.float16, torch.bfloat16, policy, x_dtype=torch.bfloat16)


def _inference_mode_case(device):
    from tests.test_lowbit import random_gptq

    lin = pruned_linear(72, 512, 0.5).to(device)
    qweight, scales, qzeros, g_idx, w_gptq = random_gptq(512, 72, 4, 128, act_order=True)  # a perm
    cases = [("sparse", lambda: SparseLinear.from_linear(lin, policy="sparse"), lin.weight),
             ("dense", lambda: SparseLinear.from_linear(lin, policy="dense"), lin.weight),
             ("gptq act-order", lambda: SparseLinear(spinfer.LowBitWeight.from_gptq(
                 qweight, scales, qzeros, 4, 128, g_idx).to(device), lin.bias), w_gptq.to(device))]
    for name, make, w in cases:
        ref = lambda x: x.double() @ w.double().t() + lin.bias.double()
        with torch.inference_mode():  # every buffer an inference tensor, which keeps no version counter
            layer = make()
            for n in (1, 1, 3):
                x = torch.randn(n, 512, device=device).half()
                assert rel_err(layer(x), ref(x)) <= 2e-3, name
        x = torch.randn(2, 512, device=device).half()
        with torch.no_grad():
            assert rel_err(layer(x), ref(x)) <= 2e-3, name
        layer.bias = torch.zeros_like(lin.bias)  # a replaced buffer is still seen
        with torch.no_grad():
            assert rel_err(layer(x), ref(x) - lin.bias.double()) <= 2e-3, name


def test_built_and_run_under_inference_mode():
    # Tensors made under torch.inference_mode keep no version counter, and reading one raised: a
    # TCA-BME layer (or one with a perm) built there failed on its first call.
    _inference_mode_case("cpu")


def test_low_bit_weight_pickles_after_its_zeros_were_checked():
    q = spinfer.LowBitWeight.quantize(torch.randn(64, 256).half(), 4, 128)
    assert q.integer_zeros  # cached, with a weak reference that does not pickle
    back = saved_and_loaded(q)
    assert torch.equal(back.dequantize(), q.dequantize()) and back.integer_zeros


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(256, 512)
        self.down = nn.Linear(512, 256)
        self.lm_head = nn.Linear(256, 100)

    def forward(self, x):
        return self.lm_head(self.down(torch.relu(self.up(x))))


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
def test_sparsify_prunes_wraps_and_reports(method):
    torch.manual_seed(0)
    model = MLP().half()
    calib = [torch.randn(8, 256).half() for _ in range(3)]
    dense = MLP().half()
    dense.load_state_dict(model.state_dict())
    report = spinfer.sparsify(model, 0.5, method=method, calib=calib, progress=False)
    assert [r["layer"] for r in report] == ["up", "down"]  # lm_head excluded by default
    assert isinstance(model.up, SparseLinear) and isinstance(model.lm_head, nn.Linear)
    for r in report:
        assert r["sparsity"] == pytest.approx(0.5, abs=1e-3)
        assert r["memory_after"] <= r["memory_before"]
    # the wrapped model computes the pruned dense model exactly
    for name in ("up", "down"):
        w = getattr(model, name).weight_object()
        w = w if isinstance(w, torch.Tensor) else w.to_dense()
        getattr(dense, name).weight.data = w
    x = torch.randn(5, 256).half()
    assert rel_err(model(x), dense(x).double()) <= 2e-3


def test_wanda_keeps_the_highest_scores_per_row_and_nm():
    w = torch.randn(16, 64).half()
    norms = torch.rand(64) * 3
    s = wanda_scores(w, norms)
    model = nn.Sequential(nn.Linear(64, 16).half())
    model[0].weight.data = w.clone()
    spinfer.sparsify(model, 0.25, method="wanda", calib=[torch.randn(4, 64).half()], exclude=(), progress=False)
    keep = model[0].weight_object()
    keep = (keep if isinstance(keep, torch.Tensor) else keep.to_dense()) != 0
    assert bool((keep.sum(1) == 48).all())
    m = nm_mask(s, 2, 4)
    assert bool((m.reshape(16, 16, 4).sum(-1) == 2).all())
    model = nn.Sequential(nn.Linear(64, 16).half())
    spinfer.sparsify(model, method="magnitude", nm=(2, 4), exclude=(), progress=False)
    w2 = model[0].weight_object()
    w2 = w2 if isinstance(w2, torch.Tensor) else w2.to_dense()
    assert bool(((w2 != 0).reshape(16, 16, 4).sum(-1) <= 2).all())


def test_sparsify_bad_input():
    model = MLP().half()
    with pytest.raises(ValueError, match="sparsity"):
        spinfer.sparsify(model, 1.0, method="magnitude")
    with pytest.raises(ValueError, match="calib"):
        spinfer.sparsify(model, 0.5, method="wanda")
    with pytest.raises(ValueError, match="width 128"):
        spinfer.sparsify(MLP().half(), 0.5, method="wanda", calib=[torch.randn(2, 128).half()], progress=False)
    with pytest.raises(ValueError, match="method"):
        spinfer.sparsify(model, 0.5, method="random")
    mixed = MLP().half()
    mixed.down.to("meta")
    with pytest.raises(ValueError, match="'down'"):
        spinfer.sparsify(mixed, 0.5, method="magnitude", progress=False)
    with pytest.raises(ValueError, match="no nn.Linear"):
        spinfer.sparsify(MLP().half(), 0.5, method="magnitude", include=["nothing"], progress=False)


@pytest.mark.cuda
def test_compile_reduce_overhead_decodes_in_cuda_graphs(monkeypatch):
    # The README advises decoding in CUDA graphs, torch.compile(mode="reduce-overhead") being one
    # way: every format through Inductor and its CUDA-graph trees, with a split-K SMBD layer (whose
    # arrival counters come from the capture reserve), against the same model run eagerly. The
    # model is compiled before any eager call, with the tuning table not yet read (as in a fresh
    # process), which dynamo could not trace.
    from spinfer import tuning
    monkeypatch.setattr(tuning, "_loaded_from", None)
    torch.manual_seed(0)

    def scaled(m, k, sparsity):  # unit-variance outputs, so three layers stay far from fp16's range
        lin = pruned_linear(m, k, sparsity)
        with torch.no_grad():
            lin.weight.div_(k ** 0.5)
        return lin

    model = nn.Sequential(
        SparseLinear.from_linear(scaled(4096, 1024, 0.5), policy="sparse"), nn.ReLU(),
        SparseLinear.from_linear(scaled(1024, 4096, 0.0), quant="w4", policy="lowbit"), nn.ReLU(),
        SparseLinear.from_linear(scaled(1000, 1024, 0.0), policy="dense"),
    ).cuda()
    from spinfer.ops.spmm import spmm_plan
    assert spmm_plan(model[0].weight_object(), 1)["splits"] > 1
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for step in range(5):  # warm-up, recording, then replays
            x = torch.randn(1, 1, 1024, device="cuda").half()
            y = compiled(x).clone()  # (a replay's output is overwritten by the next)
            eager = model(x)
            assert y.shape == (1, 1, 1000) and rel_err(y, eager) <= 1e-3, step


@pytest.mark.cuda
def test_cuda_dispatch_graphs_and_exactness():
    lin = pruned_linear(2048, 1024, 0.6).cuda()
    layer = SparseLinear.from_linear(lin, policy="auto").cuda()
    for n in (1, 5, 16, 128, 1000):
        x = torch.randn(n, 1024, device="cuda").half()
        assert rel_err(layer(x), x.double() @ lin.weight.double().t() + lin.bias.double()) <= 2e-3
    x = torch.randn(4, 1024, device="cuda").half()
    layer(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = layer(x)
    x.copy_(torch.randn(4, 1024, device="cuda").half())
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(y, x.double() @ lin.weight.double().t() + lin.bias.double()) <= 2e-3


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["sparse", "lowbit"])
def test_eager_launches_are_kept_per_token_count_and_made_again_when_stale(policy, monkeypatch):
    """An eager call keeps its N's kernel call (entry point and arguments) and goes straight to the
    kernel on the next; a tuned split-K factor, and for low-bit an in-place edit of the zeros (the
    unchecked integer-zero decode would then be wrong), make it again. The bias is read on every call."""
    from spinfer import tuning
    from tests.test_lowbit_cuda import reference

    lin = pruned_linear(300, 512, 0.5).cuda()
    # (8 bits: 4-bit weights keep their zeros as 4-bit integers, which no in-place edit makes fractional)
    layer = SparseLinear.from_linear(lin, quant="w8" if policy == "lowbit" else None, policy=policy).cuda()
    w = layer.weight_object()
    splits_at = 6 if policy == "sparse" else 7  # in the launch's arguments

    def expected(x):
        if policy == "lowbit":
            return reference(x, w, layer.bias)
        return x.double() @ lin.weight.double().t() + layer.bias.double()

    counting = count_entry_point_calls(monkeypatch)
    entry = "spmm" if policy == "sparse" else "lowbit_mm"
    with torch.no_grad():
        for n in (1, 5, 1):
            x = torch.randn(n, 512, device="cuda").half()
            assert rel_err(layer(x), expected(x)) <= 2e-3, n
        launches = layer._held.launches
        assert counting.calls == [entry] * 3 and set(launches) == {1, 5}
        first = launches[1]
        layer.bias = torch.randn(300, device="cuda").half()  # a new bias, the same launch
        assert rel_err(layer(x), expected(x)) <= 2e-3 and layer._held.launches[1] is first

        key = (tuning._spmm_key if policy == "sparse" else tuning._lowbit_key)(x.device, w, 1)
        try:
            tuning._record(key, 2, save=False)
            assert rel_err(layer(x), expected(x)) <= 2e-3
            assert layer._held.launches[1] is not first and layer._held.launches[1].args[splits_at] == 2
        finally:
            tuning.clear()
        assert rel_err(layer(x), expected(x)) <= 2e-3 and layer._held.launches[1].args[splits_at] == 0

        if policy == "lowbit":
            assert layer._held.launches[1].args[-1] is True  # RTN zeros are integers
            layer.scale_zero[..., 64:].add_(0.375)  # the zeros, fractional, in place
            assert rel_err(layer(x), expected(x)) <= 2e-3 and layer._held.launches[1].args[-1] is False
            big = torch.randn(200, 512, device="cuda").half()  # above the fused kernel: decode + cuBLAS
            assert rel_err(layer(big), expected(big)) <= 2e-3 and layer._held.launches[200] is None
        many = torch.randn(300, 512, device="cuda").half()  # too many tokens for host time to count
        assert rel_err(layer(many), expected(many)) <= 2e-3 and 300 not in layer._held.launches

        names, y = seen_ops(lambda: layer(x))  # a dispatch mode sees the op
        assert f"spinfer.{entry}.default" in names and rel_err(y, expected(x)) <= 2e-3
    calls = len(counting.calls)
    xg = x.clone().requires_grad_()
    y = layer(xg)
    y.float().sum().backward()
    assert len(counting.calls) == calls and xg.grad is not None and rel_err(y, expected(x)) <= 2e-3


@pytest.mark.cuda
def test_eager_calls_between_compiled_ones_cause_no_recompile():
    # dynamo must not guard its graph on the eager launches a layer keeps, which eager calls add to,
    # nor on the state the first eager call derives (the graph is traced before it).
    lin = pruned_linear(300, 512, 0.5).cuda()
    layer = SparseLinear.from_linear(lin, policy="sparse").cuda()
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(2, 512, device="cuda").half()
    ref = x.double() @ lin.weight.double().t() + lin.bias.double()
    with torch.no_grad():
        assert rel_err(compiled(x), ref) <= 2e-3
        with torch._dynamo.config.patch(error_on_recompile=True):
            for n in (1, 2, 3, 4):
                layer(torch.randn(n, 512, device="cuda").half())
            assert set(layer._held.launches) == {1, 2, 3, 4}
            assert rel_err(compiled(x), ref) <= 2e-3


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["sparse", "lowbit"])
def test_a_model_saves_whole_after_eager_cuda_calls(policy):
    # torch.save(model) pickles each module: a layer that kept an eager launch (an entry point of
    # the extension) failed there until the sixtieth session.
    lin = pruned_linear(300, 512, 0.5).cuda()
    model = nn.Sequential(SparseLinear.from_linear(lin, policy=policy, quant="w4" if policy == "lowbit" else None),
                          nn.ReLU())
    x = torch.randn(1, 512, device="cuda").half()
    with torch.no_grad():
        y = model(x)
        assert model[0]._held.launches[1] is not None
        assert torch.equal(saved_and_loaded(model)(x), y)


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["sparse", "lowbit", "dense"])
def test_runs_under_cuda_autocast(policy):
    _autocast_case("cuda", torch.float16, torch.float16, policy)
    _autocast_case("cuda", torch.bfloat16, torch.float16, policy, x_dtype=torch.float16)


@pytest.mark.cuda
def test_built_and_run_under_inference_mode_cuda():
    _inference_mode_case("cuda")  # (with the kept launches and the low-bit zeros check)


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["sparse", "lowbit", "dense"])
def test_empty_batches_cuda(policy):
    # no tokens, through the kept launches too (N = 0 is a token count like any other)
    lin = pruned_linear(96, 256, 0.5).cuda()
    layer = SparseLinear.from_linear(lin, policy=policy, quant="w4" if policy == "lowbit" else None)
    with torch.no_grad():
        for shape in ((0, 256), (2, 0, 256), (0, 3, 256), (0, 256)):
            y = layer(torch.randn(*shape, device="cuda").half())
            assert y.shape == (*shape[:-1], 96) and y.dtype == torch.float16
        x = torch.randn(2, 256, device="cuda").half()  # and the layer still computes
        assert rel_err(layer(x), _expected(layer, x)) <= 2e-3


@pytest.mark.cuda
def test_a_dense_layer_keeps_no_launch_and_reads_its_buffers_on_every_call():
    lin = pruned_linear(300, 512, 0.0).cuda()
    layer = SparseLinear.from_linear(lin, policy="dense").cuda()
    x = torch.randn(3, 512, device="cuda").half()
    with torch.no_grad():
        assert torch.equal(layer(x), lin(x)) and not layer._held.launches
        layer.bias = torch.randn(300, device="cuda").half()
        assert torch.equal(layer(x), F.linear(x, lin.weight, layer.bias))
        layer.weight.mul_(2)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_save_load_whole_model(tmp_path):
    model = MLP().half()
    spinfer.sparsify(model, 0.6, method="magnitude", progress=False)
    model.down = SparseLinear.from_linear(nn.Linear(512, 256).half(), quant="w4", policy="lowbit")
    path = tmp_path / "model.safetensors"
    spinfer.save(model, path)
    fresh = MLP().half()  # dense, as a user would build it again
    spinfer.load(fresh, path)
    assert isinstance(fresh.up, SparseLinear) and fresh.up.format == model.up.format
    assert fresh.down.format == "lowbit"
    x = torch.randn(3, 256).half()
    assert torch.equal(fresh(x), model(x))
    other = nn.Sequential()
    other.up = nn.Linear(256, 100)
    with pytest.raises(ValueError, match="'up' is 100x256"):
        spinfer.load(other, path)
    plain = tmp_path / "plain.safetensors"
    from safetensors.torch import save_file

    save_file({"a": torch.ones(1)}, str(plain))
    with pytest.raises(ValueError, match="not written by spinfer.save"):
        spinfer.load(MLP(), plain)


class ThreeFormats(nn.Sequential):
    """One layer of each stored format, and a module of plain parameters between them."""

    def __init__(self, device=None):
        super().__init__()
        with torch.device(device or "cpu"):
            self.sparse = nn.Linear(256, 128, dtype=torch.float16)
            self.norm = nn.LayerNorm(128, dtype=torch.float16)
            self.w4 = nn.Linear(128, 96, dtype=torch.float16)
            self.dense = nn.Linear(96, 64, bias=False, dtype=torch.float16)

    def sparsified(self):
        nn.init.normal_(self.norm.weight)
        self.sparse = SparseLinear.from_linear(pruned_linear(128, 256, 0.6), policy="sparse")
        self.w4 = SparseLinear.from_linear(pruned_linear(96, 128, 0.0), quant="w4", policy="lowbit")
        self.dense = SparseLinear.from_linear(pruned_linear(64, 96, 0.0, bias=False), policy="dense")
        return self


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_load_builds_placeholders_as_stored_and_fills_a_meta_model(tmp_path, monkeypatch, device):
    # spinfer.load's placeholder layers are made as their arrays are stored (encoding or
    # quantizing a zero matrix took most of a large layer's load), and a model built on the meta
    # device, which holds no weights, gets the file's tensors assigned instead of copies that
    # would do nothing (torch only warns about those).
    from spinfer.quant import LowBitWeight

    model = ThreeFormats().sparsified()
    path = tmp_path / "model.safetensors"
    spinfer.save(model, path)

    def refuse(*args, **kwargs):
        raise AssertionError("a placeholder was encoded or quantized")

    monkeypatch.setattr(spinfer.TCABME, "from_dense", refuse)
    monkeypatch.setattr(LowBitWeight, "quantize", refuse)
    fresh = spinfer.load(ThreeFormats(device), path)
    assert [fresh.sparse.format, fresh.w4.format, fresh.dense.format] == ["tca-bme", "lowbit", "dense"]
    assert not any(t.is_meta for t in (*fresh.parameters(), *fresh.buffers()))
    x = torch.randn(3, 256).half()
    assert torch.equal(fresh(x), model(x))


def test_a_loaded_low_bit_state_sets_the_permutation(tmp_path):
    # Act order (a GPTQ g_idx) is part of the weight: a state with a perm loads into a layer built
    # without one (by load_state_dict and by spinfer.load), and one without drops the layer's.
    lin = pruned_linear(64, 256, 0.0)
    with_perm = SparseLinear.from_linear(lin, quant="w4", policy="lowbit")
    with_perm.perm = torch.randperm(256)
    plain = SparseLinear.from_linear(lin, quant="w4", policy="lowbit")
    x = torch.randn(3, 256).half()
    y_perm, y_plain = with_perm(x), plain(x)
    assert not torch.equal(y_perm, y_plain)
    fresh = SparseLinear.from_linear(lin, quant="w4", policy="lowbit")
    fresh.load_state_dict(with_perm.state_dict())
    assert torch.equal(fresh.perm, with_perm.perm) and torch.equal(fresh(x), y_perm)
    fresh.load_state_dict(plain.state_dict())
    assert fresh.perm is None and torch.equal(fresh(x), y_plain)
    bad = with_perm.state_dict()
    bad["perm"] = torch.zeros(256, dtype=torch.int64)
    with pytest.raises(ValueError, match="permutation"):
        fresh.load_state_dict(bad)
    path = tmp_path / "perm.safetensors"
    spinfer.save(nn.Sequential(with_perm), path)
    assert torch.equal(spinfer.load(nn.Sequential(nn.Linear(256, 64).half()), path)(x), y_perm)


def test_autotune_measures_once_and_persists(tmp_path, monkeypatch):
    monkeypatch.setenv("SPINFER_CACHE", str(tmp_path))
    lin = pruned_linear(256, 512, 0.5)
    calls = []

    def fake_timer(self, n):
        calls.append(n)
        return {"spmm": 1e-3, "decode+dense": 2e-3}  # spmm "measured" faster

    monkeypatch.setattr(SparseLinear, "_time_candidates", fake_timer)
    a = SparseLinear.from_linear(lin, policy="sparse")  # TCA-BME, then tune its dispatch
    a.policy = "autotune"
    x = torch.randn(3, 512).half()
    assert a.choose(3) == "spmm" and calls == [8]
    a(x), a.choose(5)
    assert calls == [8]  # same bucket: decided once
    b = SparseLinear.from_linear(lin, policy="sparse")  # another layer, same weight
    b.policy = "autotune"
    assert b.choose(2) == "spmm" and calls == [8]  # read from the persistent cache
    assert (tmp_path / "autotune.json").exists()
    assert "1000.0" in b.policy_report(print_it=False)  # measured column filled (1e-3 s in us)
    ref = x.double() @ lin.weight.double().t() + lin.bias.double()
    assert rel_err(b(x), ref) <= 2e-3


def test_autotune_really_times_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SPINFER_CACHE", str(tmp_path))
    layer = SparseLinear.from_weight(spinfer.magnitude_prune(torch.randn(512, 512).half(), 0.5), policy="sparse")
    layer.policy = "autotune"
    kernel = layer.choose(1)
    times = layer._measured[("cpu", 1)]
    assert set(times) == {"spmm", "decode+dense"} and all(t > 0 for t in times.values())
    assert kernel == min(times, key=times.get)


def test_dense_sparsity_counts_positive_zeros_only():
    w = torch.ones(4, 8).half()
    w[0, :4] = 0.0
    w[1, :2] = -0.0  # stored by TCA-BME, so not sparsity
    assert SparseLinear(w).sparsity == pytest.approx(4 / 32)


def test_decode_dense_model_counts_one_chained_launch_and_l2_reuse():
    """decode+dense is the decode's stream and fixed cost, then the dense stream behind it for
    chain_launch, less what of a decoded weight smaller than L2 is read back from L2."""
    prof = P.DeviceProfile()
    wb = 10 << 20
    for m, k in [(4096, 4096), (16384, 8192)]:
        decoded = 2 * m * k
        no_reuse = P.DeviceProfile(l2_reuse=0.0)
        base = (wb + decoded) / prof.decode_bandwidth + prof.decode_launch + (decoded + 2 * (m + k)) / prof.dense_bandwidth
        assert P.predict(P.DECODE_DENSE, m, k, 1, wb, no_reuse) == pytest.approx(base + prof.chain_launch)
        saved = P.predict(P.DECODE_DENSE, m, k, 1, wb, no_reuse) - P.predict(P.DECODE_DENSE, m, k, 1, wb, prof)
        expect = prof.l2_reuse * decoded * max(0.0, 1 - decoded / prof.l2_bytes) / prof.dense_bandwidth
        assert saved == pytest.approx(expect)
        assert (saved > 0) == (decoded < prof.l2_bytes)  # 33.5 MB decoded fits an H100's L2; 268 MB does not
    # a low-bit layer above fused_max_n is predicted as the same decode + dense
    assert P.predict(P.LOWBIT, 4096, 4096, 1024, wb, prof, bits=4) == P.predict(P.DECODE_DENSE, 4096, 4096, 1024, wb, prof)


def test_spmm_model_by_token_tile():
    """SpMM is its token tile's fixed cost plus the larger of the bytes' stream and the GroupTiles'
    decode at that tile; past 128 tokens each tile of 128 pays the BN = 128 decode term again."""
    prof = P.DeviceProfile()
    m, k, wb, ngt = 28672, 8192, 10 << 20, 57344  # few bytes: the decode term decides
    for n, bn in ((1, 8), (8, 8), (9, 16), (16, 16), (17, 32), (32, 32), (33, 64), (64, 64), (65, 128), (128, 128)):
        assert P.predict(P.SPMM, m, k, n, wb, prof, ngt) == pytest.approx(prof.spmm_fixed[bn] + ngt * prof.gt_cost[bn])
    for n, tiles in ((129, 2), (256, 2), (257, 3), (1024, 8)):
        expect = prof.spmm_fixed[128] + ngt * prof.gt_cost[128] * tiles
        assert P.predict(P.SPMM, m, k, n, wb, prof, ngt) == pytest.approx(expect)
    big = 10 << 30  # bytes that take longer than the decode
    assert P.predict(P.SPMM, m, k, 1, big, prof, ngt) == pytest.approx(
        prof.spmm_fixed[8] + (big + 2 * (m + k)) / prof.sparse_bandwidth)
    # every token tile has its two constants, at 50% and at 70% sparsity
    for fixed, per_gt in ((prof.spmm_fixed, prof.gt_cost), (prof.spmm_fixed_70, prof.gt_cost_70)):
        assert list(fixed) == list(P.TOKEN_TILES) == list(per_gt)
        assert all(fixed[b] > 0 and per_gt[b] > 0 for b in P.TOKEN_TILES)


def test_spmm_model_by_sparsity():
    """The SpMM terms are the 50% constants up to 50% sparsity, the 70% ones from 70%, and linear
    between; the other kernels do not depend on it."""
    prof = P.DeviceProfile(spmm_fixed_70={b: 2e-6 * i for i, b in enumerate(P.TOKEN_TILES, 1)},
                           gt_cost_70={b: 1e-10 * i for i, b in enumerate(P.TOKEN_TILES, 1)})
    m, k, wb, ngt = 28672, 8192, 10 << 20, 57344
    for n, bn in ((1, 8), (16, 16), (32, 32), (64, 64), (128, 128)):
        at50 = prof.spmm_fixed[bn] + ngt * prof.gt_cost[bn]
        at70 = prof.spmm_fixed_70[bn] + ngt * prof.gt_cost_70[bn]
        assert at50 != pytest.approx(at70)
        for sparsity, expect in ((0.0, at50), (0.3, at50), (0.5, at50), (0.6, (at50 + at70) / 2), (0.7, at70),
                                 (0.999, at70)):
            assert P.predict(P.SPMM, m, k, n, wb, prof, ngt, sparsity=sparsity) == pytest.approx(expect), (n, sparsity)
    n = 300  # past 128 tokens the GroupTile term is paid per 128-token tile, at the sparsity's rate
    assert P.predict(P.SPMM, m, k, n, wb, prof, ngt, sparsity=0.7) == pytest.approx(
        prof.spmm_fixed_70[128] + 3 * ngt * prof.gt_cost_70[128])
    for kern in (P.DENSE, P.DECODE_DENSE):
        assert P.predict(kern, m, k, 8, wb, prof, sparsity=0.9) == P.predict(kern, m, k, 8, wb, prof, sparsity=0.1)


def test_a_profile_stored_by_another_model_is_not_used(monkeypatch, tmp_path):
    """A calibration cached under other constants (an earlier model's spmm_launch, no spmm_fixed) is
    left alone: the defaults describe the device until calibrate() runs again."""
    from spinfer.cache import write_entry

    monkeypatch.setenv("SPINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(P, "_PROFILES", {})
    monkeypatch.setattr(P, "device_key", lambda device: "gpu-x")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    stale = {k: v for k, v in dataclasses.asdict(P.DeviceProfile()).items() if k not in ("spmm_fixed", "decode_launch")}
    stale.update(spmm_launch=8.7e-6, dense_bandwidth=1.0e12)
    write_entry(P._PROFILE_FILE, "gpu-x", stale)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(L2_cache_size=1 << 20))
    prof = P.profile_for(torch.device("cuda"))
    assert prof.dense_bandwidth == P.DeviceProfile().dense_bandwidth and not prof.measured
    current = dataclasses.asdict(P.DeviceProfile(dense_bandwidth=1.5e12, measured=True))
    write_entry(P._PROFILE_FILE, "gpu-x", current)
    monkeypatch.setattr(P, "_PROFILES", {})
    prof = P.profile_for(torch.device("cuda"))
    assert prof.dense_bandwidth == 1.5e12 and prof.measured and prof.spmm_fixed == P.DeviceProfile().spmm_fixed
    # one calibrated before the 128-token tile (no figures for it) is left alone too
    for name in ("spmm_fixed", "gt_cost"):
        del current[name][128]
    write_entry(P._PROFILE_FILE, "gpu-x", current)
    monkeypatch.setattr(P, "_PROFILES", {})
    prof = P.profile_for(torch.device("cuda"))
    assert prof.dense_bandwidth == P.DeviceProfile().dense_bandwidth and not prof.measured
    # and one calibrated at 50% only (no 70% constants)
    current = dataclasses.asdict(P.DeviceProfile(dense_bandwidth=1.5e12, measured=True))
    for name in ("spmm_fixed_70", "gt_cost_70"):
        del current[name]
    write_entry(P._PROFILE_FILE, "gpu-x", current)
    monkeypatch.setattr(P, "_PROFILES", {})
    prof = P.profile_for(torch.device("cuda"))
    assert prof.dense_bandwidth == P.DeviceProfile().dense_bandwidth and not prof.measured


@pytest.mark.cuda
def test_uncalibrated_profile_takes_the_devices_l2_size(monkeypatch, tmp_path):
    monkeypatch.setenv("SPINFER_CACHE", str(tmp_path))  # no stored calibration
    monkeypatch.setattr(P, "_PROFILES", {})
    prof = P.profile_for(torch.device("cuda"))
    assert not prof.measured
    assert prof.l2_bytes == torch.cuda.get_device_properties(0).L2_cache_size


def test_autotune_timing_survives_one_disturbed_median(monkeypatch):
    """The candidates are timed in interleaved rounds (spinfer.timing.least_of_rounds): a first
    median disturbed to 1 s does not make its kernel look slow, and each candidate runs once a
    round."""
    import spinfer.timing as timing

    layer = SparseLinear.from_weight(spinfer.magnitude_prune(torch.randn(256, 512).half(), 0.5), policy="sparse")
    ran, clock = [], iter([1.0] + [1e-4] * (2 * timing.ROUNDS - 1))

    def fake_median(fn, device, **kwargs):
        fn()
        return next(clock)

    monkeypatch.setattr(timing, "median_time", fake_median)
    monkeypatch.setattr(SparseLinear, "_run", lambda self, kern, x, w, bias: ran.append(kern))
    times = layer._time_candidates(4)
    assert ran == list(layer.candidates()) * timing.ROUNDS
    assert times == {kern: 1e-4 for kern in layer.candidates()}


def test_sparsify_passes_the_quant_group_size():
    model = MLP().half()
    report = spinfer.sparsify(model, 0.0, method="magnitude", quant="w2", group_size=64, policy="lowbit",
                              progress=False)
    assert [r["format"] for r in report] == ["lowbit", "lowbit"]
    for name in ("up", "down"):
        q = getattr(model, name).weight_object()
        assert (q.bits, q.group_size) == (2, 64)


def test_lowbit_records_survive_dtype_conversions_and_loads_of_either_width(tmp_path):
    """4-bit zeros are bits inside the records, which a cast would convert as numbers: .bfloat16()
    and .half() rebuild them, and the weight stays the same up to the scales' rounding. A saved
    layer whose zeros are fractional (records of the dtype's zeros) loads into the placeholder
    spinfer.load builds (4-bit zeros)."""
    lin = nn.Linear(256, 70).half()
    layer = SparseLinear.from_linear(lin, quant="w4", policy="lowbit")
    w = layer.weight_object()
    assert layer.scale_zero.shape[-1] == 80
    bf = layer.bfloat16()
    wb = bf.weight_object()
    assert wb.dtype == torch.bfloat16 and bf.scale_zero.shape[-1] == 80
    assert torch.equal(wb.zeros.float(), w.zeros.float()) and torch.equal(wb.scales, w.scales.bfloat16())
    x = torch.randn(3, 256).bfloat16()
    assert rel_err(bf(x), x.double() @ wb.dequantize().double().t() + bf.bias.double()) <= 1e-2
    back = bf.half().weight_object()  # (the same module, in place)
    assert back.dtype == torch.float16 and torch.equal(back.zeros, w.zeros)

    frac = LowBitWeight.from_hqq(torch.randint(0, 16, (70, 256)), torch.rand(70, 2).half() * 0.01,
                                 (torch.rand(70, 2) * 15).half(), 4, 128, (70, 256))
    model = nn.Sequential(SparseLinear(frac, None, policy="lowbit"))
    spinfer.save(model, tmp_path / "m.safetensors")
    fresh = spinfer.load(nn.Sequential(nn.Linear(256, 70, bias=False).half()), tmp_path / "m.safetensors")
    got = fresh[0].weight_object()
    assert fresh[0].scale_zero.shape[-1] == 128 and torch.equal(got.dequantize(), frac.dequantize())


@pytest.mark.cuda
def test_calibrate_measures_each_tile_at_both_sparsities(monkeypatch, tmp_path):
    """calibrate() measures every token tile's SpMM constants at 50% and at 70% sparsity, and the 70%
    layers' GroupTiles (fewer values) cost no more than the 50% ones' at one token."""
    monkeypatch.setenv("SPINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(P, "_PROFILES", {})
    prof = P.calibrate(save=False)
    assert prof.measured
    for consts in (prof.spmm_fixed, prof.gt_cost, prof.spmm_fixed_70, prof.gt_cost_70):
        assert set(consts) == set(P.TOKEN_TILES)
        assert all(math.isfinite(v) and v >= 0 for v in consts.values()), consts
    assert all(prof.gt_cost[b] > 0 and prof.gt_cost_70[b] > 0 for b in P.TOKEN_TILES)
    assert prof.gt_cost_70[8] < 1.1 * prof.gt_cost[8], (prof.gt_cost, prof.gt_cost_70)
