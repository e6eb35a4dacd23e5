"""The low-bit GEMV kernel (spinfer/csrc/lowbit_gemv.cuh: one token, 1, 2, 4 and 8 bits, blocks of
16 rows) against the exact float64 reference: odd M and K, every group size it takes, both loaders
(registers and the shared-memory ring, with 8 or 4 warps a block), bias, fp16 and bf16, integer,
fractional and out-of-range zero points, NaN-poisoned outputs, the planner's rules, determinism and
CUDA graphs. SPINFER_LOWBIT_GEMV=1 forces it where it exists, SPINFER_LOWBIT_RING=0 / 2 either
loader, SPINFER_GEMV_WARPS=8 / 4 the ring's warps a block. Skipped without a GPU."""

import pytest
import torch

import spinfer
from spinfer.ops.lowbit_mm import PLAN_FIELDS, lowbit_plan
from spinfer.quant import LowBitWeight
from tests.conftest import rel_err
from tests.test_lowbit_cuda import TOL, fused, reference

pytestmark = pytest.mark.cuda

# Group sizes the GEMV takes per width (lowbit_gemv.cuh, gemv_supported: a stage in 20 registers);
# None is per-channel.
GROUPS = {1: (None, 256, 128, 64), 2: (None, 256, 128, 64), 4: (None, 256, 128), 8: (None, 256, 128, 64)}
UNSUPPORTED = ((1, 32), (2, 32), (4, 64), (4, 32), (8, 32))


@pytest.fixture(params=[("0", 8), ("2", 8), ("2", 4)], ids=["registers", "ring", "ring-4-warps"])
def loader(request, monkeypatch):
    """Each of the GEMV's loaders, forced: a stage's words straight into registers (0) or through
    each warp's ring of two shared-memory slots (2), the ring with blocks of 8 warps or of 4 (each
    warp taking twice the stages). Returns (ring slots, warps a block)."""
    ring, warps = request.param
    monkeypatch.setenv("SPINFER_LOWBIT_RING", ring)
    monkeypatch.setenv("SPINFER_GEMV_WARPS", str(warps))
    return int(ring), warps


def row_err(out, ref, x, w):
    """The worst output row's error against the scale of its dot product, ||w_row|| ||x|| / sqrt(K)
    (the size of a sum of K products of random signs), plus |ref|: one token makes one value per
    row, whose relative error alone is unbounded where the sum cancels."""
    x, w = x.double(), w.double().to(x.device)
    scale = w.norm(dim=1) * x.norm() / w.shape[1] ** 0.5
    err, den = (out.double() - ref).abs()[0], ref.abs()[0] + scale
    # a row of zeros (1-bit per-channel rounding makes some) has den 0: its error is absolute
    return float(torch.where(den > 0, err / den, err).max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_gemv_matches_the_reference(bits, dtype, loader, monkeypatch):
    monkeypatch.setenv("SPINFER_LOWBIT_GEMV", "1")
    # M: one row, under a block, one block, not a multiple of 16 or 64, past 4096; K: one stage,
    # not a multiple of 256 (zero-padded x), several stages per warp and one warp left idle; every
    # group size the width takes. 1152 and 1088 end on a stage whose padding columns lie past the
    # last group (their scale index clamps), 1088 at 8 bits too (128-column stages).
    g = GROUPS[bits]
    last = (40, 1088, 64) if 64 in g else (40, 1152, 128)
    for m, k, group in ((1, 256, g[-1]), (15, 1000, None), (16, 512, 256), (333, 1152, g[-1]), (4097, 4096, 128),
                        (100, 2560, g[-2]), (64, 6144, None), (70, 1280, g[-1]), last):
        q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").to(dtype), bits, group)
        plan = lowbit_plan(q, 1, dtype=dtype)
        assert plan["gemv"] and (plan["gemv_ring"], plan["gemv_warps"]) == loader, (m, k, group, plan)
        bias = torch.randn(m, device="cuda").to(dtype)
        x = torch.randn(1, k, device="cuda").to(dtype)
        w = q.to("cpu").dequantize()
        for b in (None, bias):
            ref = reference(x, q, b)
            out = fused(x, q, b)
            assert row_err(out, ref, x, w) <= TOL[dtype], (m, k, group, b is None)
            if m >= 16:
                assert rel_err(out, ref) <= TOL[dtype], (m, k, group, b is None)
        y = spinfer.lowbit_mm(x[0], q, bias)  # a 1-D input: one token
        assert y.shape == (m,) and row_err(y[None], reference(x, q, bias), x, w) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_gemv_zero_points_integer_fractional_and_out_of_range(bits, dtype, loader, monkeypatch):
    """As the fused kernel: q - zi in the A fragments, z - zi through the segment's sum of x. Rows
    mix integer zeros, fractional ones and zeros past the exact range; every row is checked on its
    own (row_err), with and without SPINFER_LOWBIT_XSUM=1 (every segment through the sum). The
    reference is the exact product of the stored values (no rounding of the weights)."""
    monkeypatch.setenv("SPINFER_LOWBIT_GEMV", "1")
    lo, hi = (-1024, 1023) if dtype == torch.float16 else (0, 255) if bits == 8 else (-128, 127)  # exact zeros
    m, k, levels = 80, 1024, (1 << bits) - 1
    gs = min(GROUPS[bits][1:])  # several groups a chunk where the width takes them
    w_q = torch.randint(0, levels + 1, (m, k), device="cuda")
    scale = torch.rand(m, k // gs, device="cuda") * 0.02 + 0.001
    zero = torch.randint(0, levels + 1, (m, k // gs), device="cuda").float()
    zero[3] += 0.25
    zero[20:28] = torch.rand(8, k // gs, device="cuda") * levels
    zero[40, 0], zero[41, 1], zero[42, 2] = hi + 1, lo - 1, 3 * (hi + 1)
    zero[43, 0], zero[44, 1], zero[45, 2], zero[46, 3] = hi, lo, 127.5, 128.0
    q = LowBitWeight.from_hqq(w_q, scale.to(dtype), zero.to(dtype), bits, gs, (m, k))
    assert lowbit_plan(q, 1, dtype=dtype)["gemv"]
    w = ((w_q.double() - zero.to(dtype).double().repeat_interleave(gs, 1))
         * scale.to(dtype).double().repeat_interleave(gs, 1))
    for xsum in ("0", "1"):
        monkeypatch.setenv("SPINFER_LOWBIT_XSUM", xsum)
        x = torch.randn(1, k, device="cuda").to(dtype)
        ref = x.double() @ w.t()
        out = fused(x, q)
        assert row_err(out, ref, x, w) <= TOL[dtype], xsum
        assert rel_err(out, ref) <= TOL[dtype], xsum


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_gemv_takes_any_k(bits, loader, monkeypatch):
    """x is copied a stage at a time into each warp's two buffers, so K has no limit: K past the
    32768 that x in shared memory allowed before, with the smallest group the width takes and
    per-channel at a K that is not a multiple of a stage, each warp's buffers refilled many times,
    on the planner's own choice; the zero points' sums are taken per warp and stage from those
    buffers (SPINFER_LOWBIT_XSUM=1 puts every segment through them)."""
    for m, k, group in ((40, 33024, GROUPS[bits][-1]), (24, 33000, None)):
        q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").half(), bits, group)
        assert lowbit_plan(q, 1)["gemv"], (k, group)
        w = q.to("cpu").dequantize()
        for xsum in ("0", "1"):
            monkeypatch.setenv("SPINFER_LOWBIT_XSUM", xsum)
            x = torch.randn(1, k, device="cuda").half()
            ref = reference(x, q)
            out = fused(x, q)
            assert row_err(out, ref, x, w) <= TOL[torch.float16], (k, group, xsum)
            assert rel_err(out, ref) <= TOL[torch.float16], (k, group, xsum)


def test_gemv_runs_only_where_it_exists(monkeypatch):
    """Forced or not, the planner keeps the fused kernel for N > 1, the group sizes whose stage
    would not fit 20 registers (4-bit under 128, 8-bit and 2-bit under 64) or that measured slower
    (1-bit g32) and a split factor from the caller."""
    monkeypatch.setenv("SPINFER_LOWBIT_GEMV", "1")
    q4 = LowBitWeight.quantize(torch.randn(64, 512, device="cuda").half(), 4, 128)
    assert lowbit_plan(q4, 1)["gemv"] and lowbit_plan(q4, 1)["tile_rows"] == 16
    assert not lowbit_plan(q4, 2)["gemv"]
    for bits, group in UNSUPPORTED:
        assert not lowbit_plan(LowBitWeight.quantize(torch.randn(64, 512, device="cuda").half(), bits, group), 1)["gemv"]
    monkeypatch.delenv("SPINFER_LOWBIT_GEMV")
    assert not lowbit_plan(q4, 1, splits=2)["gemv"]
    monkeypatch.setenv("SPINFER_LOWBIT_SPLITS", "2")
    assert not lowbit_plan(q4, 1)["gemv"]
    monkeypatch.delenv("SPINFER_LOWBIT_SPLITS")
    monkeypatch.setenv("SPINFER_LOWBIT_GEMV", "0")
    assert not lowbit_plan(q4, 1)["gemv"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_planner_takes_the_gemv_for_one_token(bits, dtype, monkeypatch):
    """The rule (lowbit_mm.cu, use_gemv): N = 1 runs the GEMV wherever it exists, a block per 16
    rows, as many resident blocks as CUDA's occupancy calculator gives (any K), the rows past the
    last whole wave split by tail_rule; the fused kernel's own overrides keep the fused kernel."""
    for m, k, group in ((1, 256, 128), (4097, 1000, None), (28672, 4096, 128), (1024, 28672, 256)):
        q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").to(dtype), bits, group)
        plan = lowbit_plan(q, 1, dtype=dtype)
        assert plan["gemv"] and plan["row_blocks"] == -(-m // 16), (m, k, plan)
        assert plan["resident_blocks"] >= 1 and not plan["bulk_weights"], (m, k, plan)
        tail = tail_rule(plan["row_blocks"], plan["resident_blocks"], k, bits)
        assert (plan["tail_first"], plan["tail_splits"], plan["tail_iters"]) == tail, (m, k, plan)
        rows = plan["row_blocks"]
        assert plan["grid_blocks"] == (tail[0] + (rows - tail[0]) * tail[1] if tail[1] else rows), (m, k, plan)
        assert plan["splits"] == max(1, tail[1]), (m, k, plan)
        x = torch.randn(1, k, device="cuda").to(dtype)
        assert row_err(fused(x, q), reference(x, q), x, q.to("cpu").dequantize()) <= TOL[dtype], (m, k)
        for env, value in (("SPINFER_LOWBIT_BN", "8"), ("SPINFER_LOWBIT_PAIRS", "0"), ("SPINFER_LOWBIT_SPLITS", "1")):
            monkeypatch.setenv(env, value)
            assert not lowbit_plan(q, 1, dtype=dtype)["gemv"], env
            monkeypatch.delenv(env)
        del q


def tail_rule(row_blocks, resident, k, bits, wanted=0):
    """lowbit_mm.cu's GEMV tail (gemv_tail_pays, schedule.cuh's tail_split): where a row block's
    weights (16 rows x K) are at least 80 KiB (128 KiB at 8 bits), or `wanted` ways are asked for,
    the row blocks past the last whole wave of resident slots (SMs x resident blocks) split
    slots // tail ways (or `wanted`), each split at least a stage a warp (8), no empty split;
    (tail_first, splits, stages a split) or zeros."""
    slots = torch.cuda.get_device_properties(0).multi_processor_count * resident
    stages = -(-k // (128 if bits == 8 else 256))
    if not wanted and stages * 16 * (128 if bits == 8 else 256) * bits // 8 < (128 if bits == 8 else 80) * 1024:
        return (0, 0, 0)
    waves, tail = divmod(row_blocks, slots)
    if waves < 1 or tail == 0:
        return (0, 0, 0)
    s = min(wanted or slots // tail, stages // 8)
    if s < 2:
        return (0, 0, 0)
    per = -(-stages // s)
    return (waves * slots, -(-stages // per), per)


@pytest.mark.parametrize("bits,dtype", [(1, torch.float16), (2, torch.float16), (4, torch.float16),
                                        (4, torch.bfloat16), (8, torch.float16)])
def test_gemv_splits_the_rows_past_the_last_wave(bits, dtype, monkeypatch):
    """A layer whose 16-row blocks fill one wave of resident slots and a quarter of the next:
    SPINFER_LOWBIT_TAIL forces its tail rows split 2 or 3 ways (a short last split) or not, and the
    plan follows tail_rule without it (no split: 12-50 KiB a row block, 98 KiB at 8 bits). The
    splits meet in the workspace and the last to arrive sums them in a fixed order: NaN-poisoned
    outputs all written, the exact reference with bias, integer and forced-sum zero points,
    deterministic, and in a CUDA graph."""
    monkeypatch.setenv("SPINFER_LOWBIT_GEMV", "1")
    monkeypatch.setenv("SPINFER_LOWBIT_RING", "0")  # the register loader: the ring never splits its tail
    k, group = 6272, 128  # 24.5 stages of 256 columns (49 of 128 at 8 bits): a short last split
    probe = lowbit_plan(LowBitWeight.quantize(torch.randn(16, k, device="cuda").to(dtype), bits, group), 1, dtype=dtype)
    slots = torch.cuda.get_device_properties(0).multi_processor_count * probe["resident_blocks"]
    m = 16 * (slots + slots // 4 + 1) - 5
    q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").to(dtype), bits, group)
    w = q.to("cpu").dequantize()
    bias = torch.randn(m, device="cuda").to(dtype)
    for tail, xsum in ((None, "0"), (None, "1"), ("0", "0"), ("2", "0"), ("3", "1")):
        if tail is None:
            monkeypatch.delenv("SPINFER_LOWBIT_TAIL", raising=False)
        else:
            monkeypatch.setenv("SPINFER_LOWBIT_TAIL", tail)
        monkeypatch.setenv("SPINFER_LOWBIT_XSUM", xsum)
        plan = lowbit_plan(q, 1, dtype=dtype)
        expected = (0, 0, 0) if tail == "0" else tail_rule(plan["row_blocks"], plan["resident_blocks"], k, bits,
                                                           int(tail or 0))
        assert plan["gemv"] and (plan["tail_first"], plan["tail_splits"], plan["tail_iters"]) == expected, plan
        assert expected[1] >= 2 or tail in ("0", None), f"the layer should split its tail: {plan}"
        assert expected[1] == 0 or tail is not None, f"no split unforced: {plan}"
        x = torch.randn(1, k, device="cuda").to(dtype)
        out = fused(x, q, bias)
        assert row_err(out, reference(x, q, bias), x, w) <= TOL[dtype], (tail, xsum)
        assert torch.equal(out, fused(x, q, bias)), "the splits are summed in a fixed order"
    monkeypatch.delenv("SPINFER_LOWBIT_TAIL")
    monkeypatch.setenv("SPINFER_LOWBIT_XSUM", "0")
    x = torch.randn(1, k, device="cuda").to(dtype)
    spinfer.lowbit_mm(x, q, bias)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = spinfer.lowbit_mm(x, q, bias)
    for _ in range(2):
        x.copy_(torch.randn(1, k, device="cuda").to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, spinfer.lowbit_mm(x, q, bias)), "graph replays match eager runs"


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_gemv_tail_rule_on_large_layers(bits):
    """The planner splits the tail rows of long row blocks only (lowbit_mm.cu, gemv_tail_pays):
    8192x28672 (1.29 waves of the register loader's slots on an H100) at 2 and 8 bits but not 1, and
    at 4 bits only with the register loader (the ring's 4 resident blocks take its 512 row blocks in
    one wave); the 4096-wide layers never. Plans only: no weights are built."""
    spinfer.build.load_extension()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.empty((1, 1), dtype=torch.float16, device="cuda")
    for m, k in ((8192, 28672), (8192, 14336), (8192, 8192), (14336, 4096), (28672, 8192), (28672 + 16, 4096)):
        plan = dict(zip(PLAN_FIELDS, torch.ops.spinfer.lowbit_plan(x.expand(1, k), m, k, bits, 128, 0)))
        assert plan["gemv"], plan
        expected = tail_rule(plan["row_blocks"], plan["resident_blocks"], k, bits)
        assert (plan["tail_first"], plan["tail_splits"], plan["tail_iters"]) == expected, (m, k, plan)
        if k == 4096:
            assert plan["tail_splits"] == 0, (m, k, plan)
        slots = sms * plan["resident_blocks"]
        # 512 row blocks: one wave and a tail that splits at least 2 ways (an H100: 396 slots, 3 ways)
        if (m, k) == (8192, 28672) and slots < 512 and slots // (512 - slots) >= 2:
            assert (plan["tail_splits"] >= 2) == (bits > 1) and plan["gemv_ring"] == 0, plan


def ring_plan(monkeypatch, m, k, bits, group, ring=None, warps=None):
    """The planner's one-token plan for an m x k layer, with SPINFER_LOWBIT_RING / SPINFER_GEMV_WARPS
    forced where given and cleared where None. Plans only: no weights are built."""
    for key, value in (("SPINFER_LOWBIT_RING", ring), ("SPINFER_GEMV_WARPS", warps)):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    x = torch.empty((1, 1), dtype=torch.float16, device="cuda")
    return dict(zip(PLAN_FIELDS, torch.ops.spinfer.lowbit_plan(x.expand(1, k), m, k, bits, group, 0)))


def ring_rule(bits):
    """lowbit_mm.cu's gemv_ring_slots: the shared-memory ring (2 slots a warp) at 1, 2 and 4 bits,
    the registers at 8 bits (the planner then keeps the registers where the ring would leave tail
    rows to split)."""
    return 0 if bits == 8 else 2


def short_rows(k, bits):
    """lowbit_mm.cu's gemv_short_rows: 8 warps would take at most 2 stages each (256 columns below 8
    bits, 128 at 8)."""
    return (k + 255) // 256 * 256 <= 2 * 8 * (128 if bits == 8 else 256)


def warps_rule(k, bits, row_blocks, slots4):
    """lowbit_mm.cu's gemv_warps on the ring: 4 warps a block on short rows, and on longer ones unless
    the 4-warp blocks' grid fills under 3/4 of a wave of their slots or runs a second wave of under a
    quarter of them; 8 otherwise."""
    if short_rows(k, bits):
        return 4
    under_filled = 4 * row_blocks < 3 * slots4
    short_second_wave = slots4 < row_blocks and 4 * row_blocks < 5 * slots4
    return 8 if under_filled or short_second_wave else 4


@pytest.mark.parametrize("bits,group", [(1, 64), (1, 128), (2, 64), (2, 128), (4, 128), (4, 256), (8, 64), (8, 128)])
def test_gemv_ring_rule(bits, group, monkeypatch):
    """The planner's loader (gemv_ring_slots) on the issue's and Llama-8B's layers, two of 8192
    columns (one filling a wave and one under it) and short rows of 2048-4096 columns: the ring by
    ring_rule unless its own resident blocks would leave tail rows to split (then the registers and
    their split tail), reported with its resident blocks; SPINFER_LOWBIT_RING=0 / 2 forces either,
    the forced ring without a split. The ring's blocks have 4 warps on short rows and on longer ones
    whose grid fills their slots well (warps_rule), 8 elsewhere, twice as many of the 4-warp blocks
    resident at 4 bits; SPINFER_GEMV_WARPS=8 / 4 forces either on the ring and leaves
    the registers at 8. Plans only."""
    spinfer.build.load_extension()
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def plan(m, k, ring=None, warps=None):
        return ring_plan(monkeypatch, m, k, bits, group, ring, warps)

    for m, k in ((28672, 8192), (8192, 28672), (14336, 4096), (4096, 14336), (4096, 4096), (6144, 4096), (8192, 8192),
                 (2048, 8192), (11008, 2048), (4096, 4000), (4096, 4200), (16384, 8192), (57344, 8192), (14336, 5120)):
        registers, ring, auto = plan(m, k, "0"), plan(m, k, "2"), plan(m, k)
        assert registers["gemv_ring"] == 0 and ring["gemv_ring"] == 2 and ring["tail_splits"] == 0, (m, k, ring)
        assert plan(m, k, "0", "4")["gemv_warps"] == 8, (m, k)  # the registers have no 4-warp blocks
        ring8, ring4 = plan(m, k, "2", "8"), plan(m, k, "2", "4")
        assert (ring8["gemv_warps"], ring4["gemv_warps"]) == (8, 4), (m, k)
        warps = warps_rule(k, bits, ring["row_blocks"], sms * ring4["resident_blocks"])
        assert registers["gemv_warps"] == 8 and ring["gemv_warps"] == warps, (m, k, ring, ring4, ring8)
        assert ring["resident_blocks"] == (ring4 if warps == 4 else ring8)["resident_blocks"], (m, k)
        if bits == 4:  # blocks of 4 warps take half the registers and shared memory
            assert ring4["resident_blocks"] == 2 * ring8["resident_blocks"], (m, k, ring4, ring8)
        assert ring["resident_blocks"] >= 1 and registers["resident_blocks"] >= 1
        want = ring_rule(bits)
        if want and tail_rule(ring["row_blocks"], ring["resident_blocks"], k, bits)[1] >= 2:
            want = 0  # the ring would leave tail rows to split
        assert auto["gemv_ring"] == want, (m, k, auto)
        same = ring if want else registers
        assert all(auto[f] == same[f] for f in ("resident_blocks", "tail_first", "tail_splits", "grid_blocks",
                                                "gemv_warps")), (m, k)
        if bits == 4:  # the ring keeps no stage in registers: more blocks fit
            assert ring["resident_blocks"] >= registers["resident_blocks"], (ring, registers)


@pytest.mark.parametrize("bits", [1, 2])
def test_gemv_ring_resident_blocks_with_groups_of_64(bits, monkeypatch):
    """lowbit_gemv.cuh's kGemvMinBlocksFor: the ring at 1 and 2 bits with groups of 64 is capped to
    72 registers with 4 warps a block and 64 with 8, so an SM with 64K registers and room for the
    blocks' shared memory (sm_80, sm_90) holds 7 and 4 of them at 2 bits (2-bit g64 took 79 registers
    without the caps: 6 and 3), 8 and 4 at 1 bit (sm_90). Then 8192x28672's 512 row blocks fit one
    wave of an H100's 528 slots: the planner takes the ring, with no tail rows to split (2 bits split
    them on the registers before). Plans only."""
    spinfer.build.load_extension()
    for key in ("SPINFER_LOWBIT_TAIL", "SPINFER_LOWBIT_GEMV"):
        monkeypatch.delenv(key, raising=False)
    ring4 = ring_plan(monkeypatch, 14336, 4096, bits, 64, "2", "4")
    ring8 = ring_plan(monkeypatch, 8192, 28672, bits, 64, "2", "8")
    assert (ring4["gemv_warps"], ring8["gemv_warps"]) == (4, 8)
    if torch.cuda.get_device_capability() in ((8, 0), (9, 0)):
        resident = (ring4["resident_blocks"], ring8["resident_blocks"])
        if bits == 2 or torch.cuda.get_device_capability() == (9, 0):
            # 1-bit g64 compiles to 60 registers under either cap since format 4 (sm_90a ptxas;
            # sm_80's count not seen): 64 a thread as allocated, so 8 blocks of 4 warps and 4 of 8
            assert resident == {1: (8, 4), 2: (7, 4)}[bits], (ring4, ring8)
        else:
            assert resident[0] >= 7 and resident[1] >= 4, (ring4, ring8)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    auto = ring_plan(monkeypatch, 8192, 28672, bits, 64)
    if sms * ring8["resident_blocks"] >= 512:
        assert auto["gemv_ring"] == 2 and auto["tail_splits"] == 0 and auto["grid_blocks"] == 512, auto


def test_gemv_warps_on_long_rows_of_an_h100(monkeypatch):
    """The warps a block that the rule gives the layers the seventy-first session measured on an H100
    (132 SMs of sm_90, as an H200; docs/quant.md): 4-warp blocks where their grid fills the slots,
    8-warp ones where it would fill under 3/4 of a wave (8192x28672, 4096x14336) or run a short
    second wave (2-bit g64 16384x8192: 1024 blocks, 1.11 waves of 924 slots). Other GPUs have other
    slot counts."""
    spinfer.build.load_extension()
    if torch.cuda.get_device_properties(0).multi_processor_count != 132 or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the slot counts of 132 SMs of sm_90 (H100 SXM, H200)")
    want = {(2, 64): {(28672, 8192): 4, (57344, 8192): 4, (27648, 5120): 4, (14336, 8192): 4, (14336, 5120): 4,
                      (16384, 8192): 8, (8192, 28672): 8, (4096, 14336): 8},
            (2, 128): {(28672, 8192): 4, (16384, 8192): 4, (14336, 5120): 4, (8192, 28672): 8},
            (4, 128): {(28672, 8192): 4, (27648, 5120): 4, (14336, 5120): 4, (57344, 8192): 4, (8192, 28672): 8,
                       (4096, 14336): 8}}
    for (bits, group), layers in want.items():
        for (m, k), warps in layers.items():
            plan = ring_plan(monkeypatch, m, k, bits, group)
            assert plan["gemv_ring"] == 2 and plan["gemv_warps"] == warps, (bits, group, m, k, plan)


def test_gemv_is_deterministic_and_captures_in_a_cuda_graph(monkeypatch):
    """Two layers back to back (the second launch waits on the first through programmatic
    dependent launch on sm_90), replayed with new inputs: the same bits as eager runs."""
    monkeypatch.setenv("SPINFER_LOWBIT_GEMV", "1")
    q1 = LowBitWeight.quantize(torch.randn(1024, 4096, device="cuda").half(), 4, 128)
    q2 = LowBitWeight.quantize(torch.randn(4096, 1024, device="cuda").half(), 8, 128)
    x = torch.randn(1, 4096, device="cuda").half()

    def step():
        return spinfer.lowbit_mm(spinfer.lowbit_mm(x, q1), q2)

    eager = step()
    assert torch.equal(step(), eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up off the default stream, as torch's graph docs ask
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        x.copy_(torch.randn(1, 4096, device="cuda").half())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())
        h = spinfer.lowbit_mm(x, q1).double()
        assert rel_err(out, reference(h.half(), q2)) <= 2e-3
