"""The fused low-bit kernel (spinfer::lowbit_mm_out) and the CUDA dispatch of lowbit_mm against
the exact dequantized reference in float64: every width, group size and N, odd shapes, split-K,
act-order, HQQ fractional zeros, bias, NaN-poisoned outputs, CUDA graphs and torch.compile.
Skipped without a GPU."""

import pytest
import torch

import spinfer
from spinfer.ops.lowbit_mm import fused_max_n, lowbit_plan
from spinfer.quant import LowBitWeight
from spinfer.quant.lowbit import restore_k_order, tile_scale_zero, unpack, untile_scale_zero
from tests.conftest import count_entry_point_calls, rel_err, seen_ops
from tests.test_lowbit import random_gptq

pytestmark = pytest.mark.cuda

BITS = [1, 2, 4, 8]
# (K, group): groups that divide K; 1152 and 1280 make the chunk count odd / not a multiple of
# the kernel's chunks per iteration; 1000 (per-channel) is not a multiple of 128.
GEOMETRIES = [(1152, 32), (1280, 64), (1152, 128), (1280, 256), (1000, None)]
NS = [1, 3, 8, 16, 64, 300]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def fused(x, q, bias=None):
    """The fused kernel at any N, into a NaN-poisoned output: every element must be written."""
    out = torch.full((x.shape[0], q.shape[0]), float("nan"), device=x.device, dtype=x.dtype)
    spinfer.lowbit_mm(x, q, bias, out=out)
    assert not bool(out.isnan().any()), "the kernel left elements unwritten"
    return out


def reference(x, q, bias=None):
    """x @ W.T with W the CPU dequantizer's weight, (q - zero) * scale rounded once to the weight's
    dtype: what the decode + cuBLAS path multiplies (N above fused_max_n). The CPU dequantizer is
    independent of the CUDA one (tests/test_to_dense_cuda.py checks both agree)."""
    y = x.double() @ q.to("cpu").dequantize().double().to(x.device).t()
    return y if bias is None else y + bias.double()


def exact_reference(x, q, bias=None):
    """x @ W.T with W = (q - zero) * scale in float64, never rounded to the weight's dtype: what the
    fused and GEMV kernels compute (fp32 sums of x (q - zi), scaled per segment). Where an output is
    much smaller than its terms (M = 1, a few tokens), the two references differ by up to the
    dtype's rounding of the terms (2^-9 of each in bf16), a large part of that output: seed
    912403391 of test_random_shapes_cuda (M=1 K=160 N=2, 4-bit g32, bf16) measured 0.021 against
    `reference`, over the 1e-2 tolerance, and within it against this one."""
    m, k = q.shape
    sz = untile_scale_zero(q.scale_zero.cpu(), m).double()
    w = unpack(q.qweight.cpu(), q.bits, m)[:, :k].double().reshape(m, k // q.group_size, q.group_size)
    w = ((w - sz[..., 1:2]) * sz[..., 0:1]).reshape(m, k)
    if q.perm is not None:
        w = restore_k_order(w, q.perm.cpu())
    y = x.double() @ w.to(x.device).t()
    return y if bias is None else y + bias.double()


def rule_splits(blocks, stages, sms, resident=None):
    """lowbit_mm.cu's choose_splits: unsplit with a block per SM; else round(2 SMs / blocks)
    splits of >= 4 stages with every block resident, or one more where that spreads the blocks
    more evenly over the SMs (blocks / (SMs x ceil(blocks / SMs)) larger). resident=None: the
    occupancy does not bind."""
    if blocks >= sms:
        return 1
    cap = max(1, min(stages // 4, resident * sms // blocks if resident else stages))
    want = min((4 * sms + blocks) // (2 * blocks), cap)

    def spread(s):  # splits of ceil(stages / s) stages, none empty
        per = -(-stages // s)
        b = blocks * -(-stages // per)
        return b / (sms * -(-b // sms))

    return want + 1 if want < cap and spread(want + 1) > spread(want) else want


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"K{g[0]}-g{g[1]}")
@pytest.mark.parametrize("bits", BITS)
def test_fused_kernel_matches_dequantized_reference(bits, geometry, dtype, monkeypatch):
    k, group = geometry
    m = 333  # not a multiple of the 64-row block nor of 16
    q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").to(dtype), bits, group)
    for n in NS:
        x = torch.randn(n, k, device="cuda").to(dtype)
        ref = reference(x, q)
        assert rel_err(fused(x, q), ref) <= TOL[dtype], f"N={n}"
        assert rel_err(spinfer.lowbit_mm(x, q), ref) <= TOL[dtype], f"N={n} (dispatch)"
    # N = 1 takes the GEMV kernel where it exists (tests/test_lowbit_gemv_cuda.py): the fused one too
    monkeypatch.setenv("SPINFER_LOWBIT_GEMV", "0")
    x = torch.randn(1, k, device="cuda").to(dtype)
    assert rel_err(fused(x, q), reference(x, q)) <= TOL[dtype], "N=1, fused kernel"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_l2_window_changes_no_result(dtype, monkeypatch):
    """The launches that carry an L2 access-policy window over the packed weight (launch.cuh,
    StreamWindow: the GEMV's ring and the fused kernel, with its bulk and its cp.async loaders)
    and the same launches without one (SPINFER_L2_EVICT_FIRST=0): both match the reference, bit
    for bit, split and not. The window is a cache policy; it must move no result."""
    cases = [({"SPINFER_LOWBIT_GEMV": "1", "SPINFER_LOWBIT_RING": "2"}, 1),  # the ring
             ({}, 8), ({"SPINFER_LOWBIT_SPLITS": "3"}, 16),                  # fused, cp.async
             ({}, 32), ({"SPINFER_LOADER": "cp_async"}, 32)]                 # bulk (sm_90) / cp.async
    for bits, group in ((4, 128), (2, 64)):
        q = LowBitWeight.quantize(torch.randn(4097, 1792, device="cuda").to(dtype), bits, group)
        b = torch.randn(4097, device="cuda").to(dtype)
        for env, n in cases:
            x = torch.randn(n, 1792, device="cuda").to(dtype)
            outs = []
            for evict_first in ("0", "1"):
                monkeypatch.setenv("SPINFER_L2_EVICT_FIRST", evict_first)
                for key, value in env.items():
                    monkeypatch.setenv(key, value)
                if "SPINFER_LOWBIT_RING" in env:
                    assert lowbit_plan(q, 1, dtype=dtype)["gemv_ring"] == 2
                outs.append(fused(x, q, b))
                for key in env:
                    monkeypatch.delenv(key)
            err = rel_err(outs[1], reference(x, q, b))
            assert err <= TOL[dtype], (bits, env, n, err)
            assert torch.equal(outs[0], outs[1]), (bits, env, n)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", BITS)
def test_bulk_loader_equals_the_cp_async_loader(bits, dtype, monkeypatch):
    """On sm_90 the bulk loader (LowbitPlan::bulk_weights: 4 bits with 32-token tiles) takes each
    stage's weight tiles in one bulk copy and reads them unswizzled, and its activation slice in
    one tensor copy per chunk, zeros past N and K; SPINFER_LOADER=cp_async keeps the 16-byte
    copies of both, the loader sm_80 runs. Same accumulation order, so the outputs must be equal
    bit for bit, on every schedule: one block per row block with the split tail rows, split-K,
    row pairs (odd count), the balanced schedule; with the tile forced to 32 tokens
    (SPINFER_LOWBIT_BN) at N that fills no tile (1, 7, 9), one and a row (33), and K padded to
    whole stages (1000); and both match the reference. The planner's own tiles take the bulk
    loader at 4 bits and N = 17-32 only (lowbit_mm.cuh, bulk_loader). At 1, 2 and 8 bits both
    runs are the cp.async loader: there the test holds the plan's loader flag and the forced
    32-token tiles against the reference, and the equality is no check."""
    bulk_device = torch.cuda.get_device_capability()[0] >= 9
    for m, k, group in ((4097, 1792, 128), (333, 1280, 64), (130, 1000, None)):
        q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").to(dtype), bits, group)
        b = torch.randn(m, device="cuda").to(dtype)
        monkeypatch.delenv("SPINFER_LOADER", raising=False)
        for n in (1, 8, 16, 32, 33):
            bn = lowbit_plan(q, n, dtype=dtype)["bn"]
            assert lowbit_plan(q, n, dtype=dtype)["bulk_weights"] == (bulk_device and bits == 4 and bn == 32), n
        monkeypatch.setenv("SPINFER_LOWBIT_BN", "32")
        for splits, pairs in (("0", None), ("3", "0"), ("1", "1"), ("-1", "0")):
            monkeypatch.setenv("SPINFER_LOWBIT_SPLITS", splits)
            if pairs is None:
                monkeypatch.delenv("SPINFER_LOWBIT_PAIRS", raising=False)
            else:
                monkeypatch.setenv("SPINFER_LOWBIT_PAIRS", pairs)
            for n in (1, 7, 9, 32, 33):
                x = torch.randn(n, k, device="cuda").to(dtype)
                outs = {}
                for loader in ("bulk", "cp_async"):
                    monkeypatch.setenv("SPINFER_LOADER", loader)
                    plan = lowbit_plan(q, n, dtype=dtype)
                    assert plan["bn"] == 32 and plan["bulk_weights"] == (bulk_device and bits == 4 and loader == "bulk")
                    outs[loader] = fused(x, q, b)
                label = f"M={m} splits={splits} pairs={pairs} N={n}"
                assert torch.equal(outs["bulk"], outs["cp_async"]), label
                assert rel_err(outs["bulk"], reference(x, q, b)) <= TOL[dtype], label
        monkeypatch.delenv("SPINFER_LOWBIT_BN")


@pytest.mark.parametrize("splits", ["1", "2", "7"])
def test_forced_split_k_and_large_m(splits, monkeypatch):
    monkeypatch.setenv("SPINFER_LOWBIT_SPLITS", splits)
    q = LowBitWeight.quantize(torch.randn(4097, 2048, device="cuda").half(), 4, 128)
    b = torch.randn(4097, device="cuda").half()
    for n in (1, 16, 33):
        x = torch.randn(n, 2048, device="cuda").half()
        assert rel_err(fused(x, q, b), reference(x, q, b)) <= 2e-3


@pytest.mark.parametrize("bits", [1, 2, 8])
@pytest.mark.parametrize("splits", ["1", "2", "3"])
def test_forced_split_k_at_other_widths_and_odd_stage_counts(bits, splits, monkeypatch):
    """Split-K at 1, 2 and 8 bits, where K=1792 (and 1700, padded to it) gives 7 stages (14 at 8
    bits), so splits of 3 leave the last split short."""
    monkeypatch.setenv("SPINFER_LOWBIT_SPLITS", splits)
    for k in (1792, 1700):
        q = LowBitWeight.quantize(torch.randn(200, k, device="cuda").half(), bits, 64 if k == 1792 else None)
        b = torch.randn(200, device="cuda").half()
        for n in (1, 5, 8, 20):
            x = torch.randn(n, k, device="cuda").half()
            assert rel_err(fused(x, q, b), reference(x, q, b)) <= 2e-3, f"K={k} N={n}"


@pytest.mark.parametrize("rotate", ["0", "1", "5"])
def test_stage_order_rotation(rotate, monkeypatch):
    """Blocks start at stage (row block x rotate) % stages of their range and wrap (0: off). K =
    1792 gives 7 stages at 4 bits (14 at 8), so splits of 3 leave a short last split, and M =
    4097 gives 65 row blocks, so every start offset and the wrap after each are taken."""
    monkeypatch.setenv("SPINFER_LOWBIT_ROTATE", rotate)
    for bits in (4, 8):
        q = LowBitWeight.quantize(torch.randn(4097, 1792, device="cuda").half(), bits, 128)
        b = torch.randn(4097, device="cuda").half()
        for splits in ("1", "3"):
            monkeypatch.setenv("SPINFER_LOWBIT_SPLITS", splits)
            for n in (1, 8, 20):
                x = torch.randn(n, 1792, device="cuda").half()
                err = rel_err(fused(x, q, b), reference(x, q, b))
                assert err <= 2e-3, f"bits={bits} splits={splits} N={n}: {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bn", ["8", "16", "32"])
def test_forced_token_tile_with_split_k_and_bias(bn, dtype, monkeypatch):
    """Every token tile at N that leaves several tiles and a partial last one, unsplit and split
    (the split-K sum reads float4 runs of rows; M=333 ends inside one)."""
    monkeypatch.setenv("SPINFER_LOWBIT_BN", bn)
    q = LowBitWeight.quantize(torch.randn(333, 2048, device="cuda").to(dtype), 4, 128)
    b = torch.randn(333, device="cuda").to(dtype)
    for splits in ("1", "3"):
        monkeypatch.setenv("SPINFER_LOWBIT_SPLITS", splits)
        for n in (1, 9, 17, 40):
            x = torch.randn(n, 2048, device="cuda").to(dtype)
            assert rel_err(fused(x, q, b), reference(x, q, b)) <= TOL[dtype], f"splits={splits} N={n}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", BITS)
def test_row_pairs(bits, dtype, monkeypatch):
    """Row pairs (SPINFER_LOWBIT_PAIRS=1): a block of 128 rows, two 64-row blocks sharing each
    activation slice. M = 4097 gives 65 row blocks, so the last pair has no second block (its
    copies read the first block again and its rows are never stored) and ends one row into it;
    M = 200 has four blocks, the last partial. Every token tile, unsplit and split (the split-K
    partial tiles are 128 rows), with bias, both zero-point paths (SPINFER_LOWBIT_XSUM), group
    sizes that split a chunk (32) or not (128), every element written; the planner's query
    reports the 128-row tiles."""
    monkeypatch.setenv("SPINFER_LOWBIT_PAIRS", "1")
    for m, k, group in ((4097, 1792, 128), (200, 1280, 32)):
        q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").to(dtype), bits, group)
        b = torch.randn(m, device="cuda").to(dtype)
        for splits, xsum in (("1", "0"), ("3", "1"), ("0", "0")):
            monkeypatch.setenv("SPINFER_LOWBIT_SPLITS", splits)
            monkeypatch.setenv("SPINFER_LOWBIT_XSUM", xsum)
            for n in (1, 8, 13, 32, 40):
                plan = lowbit_plan(q, n, dtype=dtype)
                assert plan["tile_rows"] == 128 and plan["row_blocks"] == -(-m // 128), plan
                x = torch.randn(n, k, device="cuda").to(dtype)
                err = rel_err(fused(x, q, b), reference(x, q, b))
                assert err <= TOL[dtype], f"M={m} splits={splits} xsum={xsum} N={n}: {err:.2e}"
    monkeypatch.setenv("SPINFER_LOWBIT_SPLITS", "-1")  # the balanced schedule has no row pairs
    assert lowbit_plan(q, 16, dtype=dtype)["tile_rows"] == 64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", BITS)
def test_balanced_schedule_ranges_across_row_blocks(bits, dtype, monkeypatch):
    """The balanced schedule (SMs x 2 blocks, each an equal run of the layer's (row block,
    stage) units, lowbit_mm.cuh Schedule): ranges start and end inside row blocks and cross
    them, and a tile shared by several blocks is summed by the last to arrive. M=4097 with K=1000
    gives 65 row blocks of 4 stages (8 at 8 bits), so blocks hold one or two stages and every
    tile has several; M=300 with K=4096 puts several blocks in every row; M=20000 with
    K=512 gives blocks of two to five rows' worth. Odd N, two token tiles (N=33), bias, every
    element written, deterministic, and splits=-1 asks for the same schedule."""
    monkeypatch.setenv("SPINFER_LOWBIT_SPLITS", "-1")
    for m, k, group in ((4097, 1000, None), (300, 4096, 128), (20000, 512, 64)):
        q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").to(dtype), bits, group)
        b = torch.randn(m, device="cuda").to(dtype)
        for n in (1, 7, 16, 33):
            x = torch.randn(n, k, device="cuda").to(dtype)
            y = fused(x, q, b)
            assert rel_err(y, reference(x, q, b)) <= TOL[dtype], f"M={m} K={k} N={n}"
            assert torch.equal(y, fused(x, q, b)), "the sum of shared tiles is deterministic"
            monkeypatch.delenv("SPINFER_LOWBIT_SPLITS")
            assert torch.equal(y, spinfer.lowbit_mm(x, q, b, splits=-1))
            monkeypatch.setenv("SPINFER_LOWBIT_SPLITS", "-1")


@pytest.mark.parametrize("bits", BITS)
def test_split_tail_rows(bits, monkeypatch):
    """A layer with more row blocks than SMs, but not a whole number of waves, has the row blocks
    past the last whole wave split (schedule.cuh, tail_split): here SMs + SMs/4 + 1 row blocks
    (M odd), whose tail the rule splits 3 ways on an H100 (9 stages of 256 columns at K = 2304,
    18 at 8 bits); forced (SPINFER_LOWBIT_TAIL) 2 ways, leaving a short last split, and 4 ways,
    more tail blocks than SMs; 0 turns it off. N = 1, 7 and 16 (token tiles of 8 and 16), bias,
    every element written, deterministic. The planner's query (lowbit_plan) shows the grid that
    ran: the rule's split count, no more than half the stages a split, and no empty split. Row
    pairs off: their 128-row tiles are a different count (test_row_pairs)."""
    monkeypatch.setenv("SPINFER_LOWBIT_PAIRS", "0")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m, k = 64 * (sms + sms // 4) + 13, 2304
    q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").half(), bits, 64)
    b = torch.randn(m, device="cuda").half()
    stages = k // (128 if bits == 8 else 256)
    for tail in (None, "0", "2", "4"):
        if tail is None:
            monkeypatch.delenv("SPINFER_LOWBIT_TAIL", raising=False)
        else:
            monkeypatch.setenv("SPINFER_LOWBIT_TAIL", tail)
        for n in (1, 7, 16):
            plan = lowbit_plan(q, n)
            waves, tail_rows = divmod(plan["row_blocks"], sms)
            assert waves == 1 and tail_rows == sms // 4 + 1 and plan["n_tiles"] == 1
            asked = min(sms // tail_rows if tail is None else int(tail), stages // 2)
            if asked >= 2 and waves + 1 <= plan["resident_blocks"]:
                per = -(-stages // asked)
                assert (plan["tail_first"], plan["tail_splits"], plan["tail_iters"]) == (sms, -(-stages // per), per)
                assert plan["grid_blocks"] == sms + tail_rows * plan["tail_splits"]
            else:
                assert plan["tail_splits"] == 0 and plan["grid_blocks"] == plan["row_blocks"], f"tail={tail}"
            x = torch.randn(n, k, device="cuda").half()
            y = fused(x, q, b)
            assert rel_err(y, reference(x, q, b)) <= 2e-3, f"tail={tail} N={n}"
            assert torch.equal(y, fused(x, q, b)), "split tail rows are summed in a fixed order"


def test_planner_picks_its_schedules_exactly():
    """The planner's own choice on layers with more row blocks than two per SM (M = 28672, 24000)
    and fewer (split-K or one block per row block), against the reference. Its row-pair rule at
    4 bits (lowbit_mm.cu, use_row_pairs): 64-row tiles at N = 2-8 (N = 1 is the GEMV kernel's); at
    N = 9-32, 128-row tiles where
    the pairs fill the SMs (M = 28672, 24000), and where the split they need keeps >= 16 stages,
    except with the bulk loader (sm_90 at N = 17-32): M = 8192 with K = 16384 is 64 pairs split
    round(2 SMs / 64) ways, 16 stages each on an H100; M = 3000 with K = 2048 has 8 stages."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bulk_device = torch.cuda.get_device_capability()[0] >= 9
    for m, k in ((28672, 512), (24000, 768), (3000, 2048), (8192, 16384)):
        q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").half(), 4, 128)
        pairs, stages = -(-m // 128), k // 256
        splits = rule_splits(pairs, stages, sms)
        for n in (1, 8, 16, 32):
            x = torch.randn(n, k, device="cuda").half()
            assert rel_err(fused(x, q), reference(x, q)) <= 2e-3, f"M={m} N={n}"
            paired = n > 8 and (pairs >= sms or (not (bulk_device and n > 16) and -(-stages // splits) >= 16))
            # one token: the GEMV kernel's 16-row blocks (tests/test_lowbit_gemv_cuda.py)
            assert lowbit_plan(q, n)["tile_rows"] == (16 if n == 1 else 128 if paired else 64), f"M={m} N={n}"
        del q


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_split_rule_spreads_blocks_evenly(bits, monkeypatch):
    """Layers with fewer row blocks than SMs split round(2 SMs / blocks) ways, or one way more
    where the blocks then spread more evenly over the SMs (rule_splits): on an H100 (132 SMs)
    6144x4096's 96 row blocks split 4 ways (384 blocks, 120 SMs holding 3) instead of 3 (288, 24
    SMs holding 3), 4096x4096's 64 stay at 4. Against the reference, with the split count the
    plan reports. The fused kernel at N = 1 too (SPINFER_LOWBIT_GEMV=0)."""
    monkeypatch.setenv("SPINFER_LOWBIT_GEMV", "0")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m, k in ((6144, 4096), (4096, 4096), (3584, 7168), (2560, 8192), (5120, 2048)):
        q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").half(), bits, 128)
        stages = k // (128 if bits == 8 else 256)
        for n in (1, 16):
            plan = lowbit_plan(q, n)
            assert plan["tile_rows"] == 64 and not plan["balanced"] and plan["tail_splits"] == 0, plan
            want = rule_splits(plan["row_blocks"], stages, sms, plan["resident_blocks"])
            per = -(-stages // want)
            assert (plan["splits"], plan["iters_per_split"]) == (-(-stages // per), per), f"{m}x{k} N={n}: {plan}"
            if sms == 132 and (m, k) == (6144, 4096):
                assert plan["splits"] == 4
            x = torch.randn(n, k, device="cuda").half()
            assert rel_err(fused(x, q), reference(x, q)) <= 2e-3, f"{m}x{k} N={n}"
        del q


@pytest.mark.parametrize("bits", [1, 2])
def test_row_pairs_of_narrow_widths_at_eight_tokens(bits):
    """At N = 2-8, 1- and 2-bit layers run row pairs only where the paired grid is split anyway
    (under 3/4 of a wave of pairs) into splits of >= 16 stages (lowbit_mm.cu, use_row_pairs); N = 1
    runs the GEMV kernel (16-row blocks) at g64 since the thirty-second session.
    M = 8192 (64 pairs): with K = 16384 (64 stages) the split rule's round(2 SMs / 64) splits
    keep 16 stages on an H100, with K = 8192 half that; M = 128 x SMs is a wave of pairs. Then a
    caller's split factor: 2 splits of 16 stages pair, and the result matches the reference."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m, k in ((8192, 16384), (8192, 8192), (128 * sms, 4096)):
        q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").half(), bits, 64)
        pairs, stages = -(-m // 128), k // 256
        splits = rule_splits(pairs, stages, sms)
        want = 4 * pairs < 3 * sms and -(-stages // splits) >= 16
        for n in (2, 8):
            assert (lowbit_plan(q, n)["tile_rows"] == 128) == want, f"M={m} K={k} N={n}"
        assert lowbit_plan(q, 1)["gemv"] and lowbit_plan(q, 1)["tile_rows"] == 16
        del q
    q = LowBitWeight.quantize(torch.randn(1000, 8192, device="cuda").half(), bits, 64)
    assert lowbit_plan(q, 8, splits=2)["tile_rows"] == 128 and lowbit_plan(q, 8, splits=3)["tile_rows"] == 64
    assert lowbit_plan(q, 8, splits=1)["tile_rows"] == 64  # unsplit: never paired at N <= 8
    for n in (1, 8):
        x = torch.randn(n, 8192, device="cuda").half()
        out = torch.full((n, 1000), float("nan"), device="cuda", dtype=torch.half)
        spinfer.lowbit_mm(x, q, out=out, splits=2)
        assert rel_err(out, reference(x, q)) <= 2e-3, f"N={n}"


def test_row_pairs_near_a_wave_run_unsplit(monkeypatch):
    """Row pairs that make at least 3/4 of a wave run unsplit (lowbit_mm.cu); half a wave is
    split. 4 bits at N = 16, paired (SPINFER_LOWBIT_PAIRS=1: the rule pairs none of these short
    layers), against the reference."""
    monkeypatch.setenv("SPINFER_LOWBIT_PAIRS", "1")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for pairs, unsplit in ((sms - 1, True), (-(-3 * sms // 4), True), (sms // 2, False)):
        m = 128 * pairs - 7
        q = LowBitWeight.quantize(torch.randn(m, 2048, device="cuda").half(), 4, 128)
        plan = lowbit_plan(q, 16)
        assert plan["tile_rows"] == 128 and plan["row_blocks"] == pairs
        assert (plan["splits"] == 1) == unsplit, (pairs, plan)
        x = torch.randn(16, 2048, device="cuda").half()
        assert rel_err(fused(x, q), reference(x, q)) <= 2e-3, f"pairs={pairs}"


def test_split_counters_shared_across_calls_and_streams(monkeypatch):
    """Split launches share one arrival-counter buffer per stream that each launch leaves zero:
    split factors and tile counts changing back to back, queued without a sync, on the default
    stream and on a side stream."""
    qs = [LowBitWeight.quantize(torch.randn(m, 2048, device="cuda").half(), 4, 128) for m in (333, 1000)]
    xs = [torch.randn(n, 2048, device="cuda").half() for n in (1, 20)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    runs = []
    for splits in ["2", "7", "-1", "3", "5"]:
        monkeypatch.setenv("SPINFER_LOWBIT_SPLITS", splits)
        for q in qs:
            for x in xs:
                runs.append((q, x, spinfer.lowbit_mm(x, q)))
                with torch.cuda.stream(side):
                    runs.append((q, x, spinfer.lowbit_mm(x, q)))
    torch.cuda.synchronize()
    for i, (q, x, y) in enumerate(runs):
        assert rel_err(y, reference(x, q)) <= 2e-3, f"call {i}"


def test_values_that_exercise_every_bit():
    # bf16 8-bit splits q and z at bit 7 (both halves of each, zeros from 0 to 255); constant and
    # extreme groups; q spans 0..2^bits-1
    for bits in BITS:
        levels = (1 << bits) - 1
        qv = torch.randint(0, levels + 1, (128, 512), device="cuda")
        qv[0] = levels  # a row at the top code
        qv[1] = 0
        scale = torch.rand(128, 4, device="cuda") * 0.1 + 0.01
        zero = torch.randint(0, levels + 1, (128, 4), device="cuda").float()
        for dt in (torch.float16, torch.bfloat16):
            q = LowBitWeight.from_hqq(qv, scale.to(dt), zero.to(dt), bits, 128, (128, 512))
            x = torch.randn(5, 512, device="cuda").to(dt)
            assert rel_err(fused(x, q), reference(x, q)) <= TOL[dt], (bits, dt)


def test_hqq_fractional_zeros():
    w_q = torch.randint(0, 16, (96, 256), device="cuda")
    scale = (torch.rand(96, 4, device="cuda") * 0.02 + 0.001).half()
    zero = (torch.rand(96, 4, device="cuda") * 15).half()  # fractional, as HQQ produces
    q = LowBitWeight.from_hqq(w_q, scale, zero, 4, 64, (96, 256))
    x = torch.randn(7, 256, device="cuda").half()
    assert rel_err(fused(x, q), reference(x, q)) <= 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_integer_and_fractional_zero_points_in_one_warp(dtype, monkeypatch):
    # The kernel subtracts a zero point's integer part in the A fragments and applies the rest
    # through sum(x), per 16-row warp tile and segment. Rows here mix integer zeros, fractional
    # ones, and zeros past the integer range (fp16 +-1024, bf16 +-128) that must fall back to the
    # sum; SPINFER_LOWBIT_XSUM=1 forces the sum path for all of them. The reference is the
    # exact float64 product with the stored fp16/bf16 scales and zeros, which is what the kernel
    # computes: q.dequantize() rounds (q - z) * s to the weight dtype, and for a zero of 3000
    # (q - z past fp16's exact integers) that rounding alone put it 2-4e-3 away on about one
    # run in forty at N = 1.
    m, k = 160, 512
    for bits in BITS:
        levels = (1 << bits) - 1
        w_q = torch.randint(0, levels + 1, (m, k), device="cuda")
        scale = torch.rand(m, k // 64, device="cuda") * 0.02 + 0.001
        zero = torch.randint(0, levels + 1, (m, k // 64), device="cuda").float()
        zero[5] += 0.25                      # one fractional row inside the first warp's tile
        zero[40:48] = torch.rand(8, k // 64, device="cuda") * levels  # a fractional block
        zero[70, 0] = 3000.0 if dtype == torch.float16 else 300.0 if bits == 8 else 200.0  # past the exact range
        zero[71, 1] = -2000.0 if dtype == torch.float16 else -300.0
        q = LowBitWeight.from_hqq(w_q, scale.to(dtype), zero.to(dtype), bits, 64, (m, k))
        w = ((w_q.double() - zero.to(dtype).double().repeat_interleave(64, 1))
             * scale.to(dtype).double().repeat_interleave(64, 1))
        for n in (1, 16, 40):
            x = torch.randn(n, k, device="cuda").to(dtype)
            ref = x.double() @ w.t()
            monkeypatch.delenv("SPINFER_LOWBIT_XSUM", raising=False)
            mixed = fused(x, q)
            monkeypatch.setenv("SPINFER_LOWBIT_XSUM", "1")
            forced = fused(x, q)
            assert rel_err(mixed, ref) <= TOL[dtype], (bits, n, "per-segment choice")
            assert rel_err(forced, ref) <= TOL[dtype], (bits, n, "sum(x) forced")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_zero_points_at_the_edges_of_the_integer_path(dtype):
    """The kernel decodes zero points in the weight dtype and takes the integer path where a
    16-row warp tile's zeros are all integers in [-1024, 1023] (fp16; bf16 [-128, 127], at 8 bits
    [0, 255]); anything else takes the sum(x) path. Every warp tile here holds one edge value, and
    every row is checked on its own. The last edges are integers far enough below the range that
    magic + z is still exact but (1024 + q) - (magic + z) is not: without the clamp to the
    range the integer path would take them and round (fp16 at 8 bits, bf16 at 4 and 8)."""
    for bits in (4, 8):
        lo, hi = (-1024, 1023) if dtype == torch.float16 else (0, 255) if bits == 8 else (-128, 127)
        edges = [hi, lo, hi + 1, lo - 1, 0.0, 2.5, -3.0, 127.0, 128.0, 127.5, 129.0,
                 -2000.0 if dtype == torch.float16 else -250.0, -120.0]
        m, k = 16 * len(edges), 512
        levels = (1 << bits) - 1
        w_q = torch.randint(0, levels + 1, (m, k), device="cuda")
        scale = (torch.rand(m, k // 128, device="cuda") * 0.02 + 0.001).to(dtype)
        zero = torch.tensor(edges, device="cuda").repeat_interleave(16)[:, None].expand(m, k // 128).to(dtype)
        q = LowBitWeight.from_hqq(w_q, scale, zero, bits, 128, (m, k))
        w = (w_q.double() - zero.double().repeat_interleave(128, 1)) * scale.double().repeat_interleave(128, 1)
        x = torch.randn(8, k, device="cuda").to(dtype)
        ref = x.double() @ w.t()
        err = ((fused(x, q).double() - ref).norm(dim=0) / ref.norm(dim=0)).cpu()
        assert float(err.max()) <= TOL[dtype], (bits, [edges[int(i) // 16] for i in (err > TOL[dtype]).nonzero()])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_integer_zeros_flag_skips_only_the_check(dtype):
    """integer_zeros=True, which lowbit_mm passes for weights whose zeros LowBitWeight has checked
    (RTN, GPTQ), drops the kernel's per-segment zero check. On zeros that pass that check both
    launches must compute the same thing, bit for bit, at every width, a two-segment group size
    (64) and each token tile."""
    m, k = 333, 1280
    for bits in BITS:
        q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").to(dtype), bits, 64)
        if bits == 8:  # zeros on both sides of 128 (bf16 splits them at bit 7), the range's ends
            zeros = q.scale_zero[..., 64:]  # in the records' order: rows 0-3 at halves 0, 2, 4, 6
            zeros.copy_(torch.randint(0, 256, zeros.shape, device="cuda"))
            zeros[0, :, 0:8:2] = torch.tensor([0.0, 127.0, 128.0, 255.0], device="cuda")
        assert q.integer_zeros, bits
        for n in (1, 16, 40):
            x = torch.randn(n, k, device="cuda").to(dtype)
            outs = []
            for flag in (False, True):
                out = torch.full((n, m), float("nan"), device="cuda", dtype=dtype)
                torch.ops.spinfer.lowbit_mm_out(x, q.qweight, q.scale_zero, bits, 64, m, k, None, None, 0, flag,
                                                out=out)
                assert not bool(out.isnan().any()), (bits, n, flag)
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), (bits, n)
            assert rel_err(outs[1], reference(x, q)) <= TOL[dtype], (bits, n)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_records_of_either_width_at_low_widths(dtype):
    """At 1, 2 and 4 bits zeros that are not 4-bit integers keep the dtype's records: integers
    outside [0, 15] (GPTQ's zero of 16, negative ones) and fractional ones both take the checked
    path, exact; and the launch takes its path from the records, whatever flag a direct call
    passes, so integer_zeros=True on fractional zeros cannot skip the sum(x) correction."""
    m, k = 200, 768
    for bits in (1, 2, 4):
        top = (1 << bits) - 1
        w_q = torch.randint(0, top + 1, (m, k), device="cuda")
        scale = (torch.rand(m, k // 64, device="cuda") * 0.02 + 0.001).to(dtype)
        for zero in (torch.randint(-3, 20, (m, k // 64), device="cuda").float(),  # integers, some outside
                     torch.rand(m, k // 64, device="cuda") * top):  # fractional
            q = LowBitWeight.from_hqq(w_q, scale, zero.to(dtype), bits, 64, (m, k))
            assert q.scale_zero.shape[-1] == 128 and not q.integer_zeros
            for n in (1, 8, 40):
                x = torch.randn(n, k, device="cuda").to(dtype)
                for flag in (False, True):
                    out = torch.full((n, m), float("nan"), device="cuda", dtype=dtype)
                    torch.ops.spinfer.lowbit_mm_out(x, q.qweight, q.scale_zero, bits, 64, m, k, None, None, 0, flag,
                                                    out=out)
                    assert rel_err(out, exact_reference(x, q)) <= TOL[dtype], (bits, n, flag)


def test_lowbit_mm_learns_the_flag_eagerly_and_never_syncs_while_capturing():
    """lowbit_mm computes a weight's integer_zeros at its first eager call (one sync) and passes
    it on; a first call inside a CUDA graph capture must not sync, so it runs the checked path."""
    x = torch.randn(3, 512, device="cuda").half()
    spinfer.lowbit_mm(x, LowBitWeight.quantize(torch.randn(64, 512, device="cuda").half(), 4, 128))  # build
    torch.cuda.synchronize()
    q = LowBitWeight.quantize(torch.randn(200, 512, device="cuda").half(), 2, 64)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = spinfer.lowbit_mm(x, q)
    assert q.cached_integer_zeros() is None  # not computed during the capture
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(y, reference(x, q)) <= 2e-3
    assert rel_err(spinfer.lowbit_mm(x, q), reference(x, q)) <= 2e-3 and q.cached_integer_zeros() is True
    frac = LowBitWeight.from_hqq(torch.randint(0, 4, (200, 512), device="cuda"),
                                 (torch.rand(200, 8, device="cuda") * 0.02).half(),
                                 (torch.rand(200, 8, device="cuda") * 3 + 0.1).half(), 2, 64, (200, 512))
    assert rel_err(spinfer.lowbit_mm(x, frac), reference(x, frac)) <= 2e-3 and frac.cached_integer_zeros() is False


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_in_place_zero_edits_take_the_checked_path_again(bits):
    """A weight whose cached flag said "integer zeros" and whose zeros then turn fractional in
    place (an HQQ state_dict loaded into a SparseLinear, or any in-place edit) must not launch the
    unchecked kernel: its output would skip the sum(x) correction. In place that is possible at 8
    bits; at 1, 2 and 4 bits the zeros are 4-bit integers, and fractional ones come as records of
    another width, which load_state_dict takes."""
    x = torch.randn(5, 512, device="cuda").half()
    q = LowBitWeight.quantize(torch.randn(200, 512, device="cuda").half(), bits, 64)
    assert rel_err(spinfer.lowbit_mm(x, q), reference(x, q)) <= 2e-3 and q.cached_integer_zeros() is True
    if bits == 8:
        zeros = q.scale_zero[..., 64:]  # a view of the stored records' zeros
        zeros.add_(torch.rand_like(zeros) * 0.9 + 0.05)  # fractional now
        assert rel_err(spinfer.lowbit_mm(x, q), reference(x, q)) <= 2e-3 and q.cached_integer_zeros() is False
        g = torch.cuda.CUDAGraph()
        zeros.add_(0.5)  # a capture after an edit takes the checked path without syncing
        with torch.cuda.graph(g):
            y = spinfer.lowbit_mm(x, q)
        g.replay()
        assert q.cached_integer_zeros() is None and rel_err(y, reference(x, q)) <= 2e-3

    # The module path: load_state_dict copies into the buffers in place (records of another width:
    # a new buffer) and drops the module's cached LowBitWeight, so the flag is recomputed either way.
    lin = torch.nn.Linear(512, 200, bias=False, device="cuda").half()
    layer = spinfer.nn.SparseLinear.from_linear(lin, quant=f"w{bits}", policy="lowbit")
    layer(x)  # caches integer zeros
    sd = {k: v.clone() for k, v in layer.state_dict().items()}
    w = layer.weight_object()
    sd["scale_zero"] = tile_scale_zero(torch.stack((w.scales, w.zeros + 0.375), -1), bits)
    layer.load_state_dict(sd)
    w = layer.weight_object()
    assert layer.scale_zero.shape[-1] == 128
    assert rel_err(layer(x), reference(x, w)) <= 2e-3 and w.cached_integer_zeros() is False
    sd["scale_zero"] = tile_scale_zero(torch.stack((w.scales, w.zeros - 0.375), -1), bits)  # and back
    layer.load_state_dict(sd)
    w = layer.weight_object()
    assert layer.scale_zero.shape[-1] == (80 if bits <= 4 else 128)
    assert rel_err(layer(x), reference(x, w)) <= 2e-3 and w.cached_integer_zeros() is True


def test_integer_zero_path_is_exact_up_to_the_output_rounding():
    # RTN weights have integer zeros: A holds q - z exactly, the tensor cores multiply exactly
    # and fp32 accumulates; the scale is applied in fp32. So the output is sum_k (q - z) s x
    # (the dequantized weight *before* its rounding to fp16) rounded once to fp16, but for the
    # rare sums that land within fp32 error of a rounding boundary.
    from spinfer.quant.lowbit import unpack

    m, k, g = 256, 4096, 128
    q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").half(), 4, g)
    x = torch.randn(8, k, device="cuda").half()
    ints = unpack(q.qweight, 4, m)[:, :k].double()
    w = (ints - q.zeros.double().repeat_interleave(g, 1)) * q.scales.double().repeat_interleave(g, 1)
    exact = x.double() @ w.t()
    out = fused(x, q)
    assert rel_err(out, reference(x, q)) <= 4e-4
    assert (out.cpu() != exact.half().cpu()).float().mean().item() < 0.01


def test_gptq_act_order_on_cuda():
    qweight, scales, qzeros, g_idx, w_ref = random_gptq(512, 72, 4, 128, True)
    q = LowBitWeight.from_gptq(qweight, scales, qzeros, bits=4, group_size=128, g_idx=g_idx).to("cuda")
    x = torch.randn(9, 512, device="cuda").half()
    ref = x.double() @ w_ref.double().t().cuda()
    assert rel_err(fused(x, q), ref) <= 2e-3
    assert rel_err(spinfer.lowbit_mm(x, q), ref) <= 2e-3


def test_batch_dims_views_and_empty():
    q = LowBitWeight.quantize(torch.randn(40, 384, device="cuda").half(), 4, 128)
    x = torch.randn(2, 3, 384, device="cuda").half()
    assert spinfer.lowbit_mm(x, q).shape == (2, 3, 40)
    assert rel_err(spinfer.lowbit_mm(x, q), reference(x.reshape(6, 384), q).reshape(2, 3, 40)) <= 2e-3
    xt = torch.randn(384, 5, device="cuda").half().t()  # non-contiguous
    assert rel_err(spinfer.lowbit_mm(xt, q), reference(xt, q)) <= 2e-3
    xo = torch.randn(1, 385, device="cuda").half()[:, 1:]  # misaligned storage offset
    assert rel_err(spinfer.lowbit_mm(xo, q), reference(xo, q)) <= 2e-3
    assert spinfer.lowbit_mm(torch.randn(0, 384, device="cuda").half(), q).shape == (0, 40)


def test_dispatch_uses_cublas_above_the_crossover():
    q = LowBitWeight.quantize(torch.randn(64, 256, device="cuda").half(), 4, 64)
    x = torch.randn(fused_max_n(4) + 1, 256, device="cuda").half()
    assert rel_err(spinfer.lowbit_mm(x, q), reference(x, q)) <= 2e-3


def test_cuda_graph_capture():
    q = LowBitWeight.quantize(torch.randn(500, 1024, device="cuda").half(), 4, 128)
    b = torch.randn(500, device="cuda").half()
    x = torch.randn(4, 1024, device="cuda").half()
    spinfer.lowbit_mm(x, q, b)  # warm up (and build) outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = spinfer.lowbit_mm(x, q, b)
    for _ in range(2):
        x.copy_(torch.randn(4, 1024, device="cuda").half())
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(y, reference(x, q, b)) <= 2e-3


def test_torch_compile_fullgraph():
    q = LowBitWeight.quantize(torch.randn(256, 512, device="cuda").half(), 2, 64)

    @torch.compile(fullgraph=True)
    def f(x):
        return torch.relu(spinfer.lowbit_mm(x, q)) + 1

    x = torch.randn(3, 512, device="cuda").half()
    assert rel_err(f(x), torch.relu(reference(x, q)) + 1) <= 2e-3


def test_eager_calls_go_past_the_dispatcher_only_where_it_adds_nothing(monkeypatch):
    """As for spmm (tests/test_spmm_cuda.py): the fused kernel's entry point for an eager call in
    its range of N, the op for a dispatch mode, an x that autograd follows, out= and the N that
    decode + cuBLAS serves."""
    q = LowBitWeight.quantize(torch.randn(300, 512, device="cuda").half(), 4, 128)
    b = torch.randn(300, device="cuda").half()
    x = torch.randn(2, 3, 512, device="cuda").half()
    op = torch.ops.spinfer.lowbit_mm(x.reshape(6, 512), q.qweight, q.scale_zero, 4, 128, 300, 512, None, b, 0,
                                     q.integer_zeros).view(2, 3, 300)
    counting = count_entry_point_calls(monkeypatch)
    y = spinfer.lowbit_mm(x, q, b)
    assert counting.calls == ["lowbit_mm"] and torch.equal(y, op) and rel_err(y, reference(x, q, b)) <= 2e-3
    names, y = seen_ops(lambda: spinfer.lowbit_mm(x, q, b))
    assert "spinfer.lowbit_mm.default" in names and torch.equal(y, op)
    y = spinfer.lowbit_mm(x.clone().requires_grad_(), q, b)
    assert y.grad_fn is not None and torch.equal(y.detach(), op)
    spinfer.lowbit_mm(x, q, b, out=torch.empty(6, 300, device="cuda").half())
    big = torch.randn(fused_max_n(4) + 1, 512, device="cuda").half()
    assert rel_err(spinfer.lowbit_mm(big, q, b), reference(big, q, b)) <= 2e-3
    assert counting.calls == ["lowbit_mm"]


def test_bad_input_is_rejected_before_launch():
    q = LowBitWeight.quantize(torch.randn(64, 256, device="cuda").half(), 4, 128)
    # (an eager call at small N leaves these to the op's C++ checks, which read as Python's do)
    with pytest.raises(TypeError, match="x is torch.bfloat16 but the weight is torch.float16; cast x"):
        spinfer.lowbit_mm(torch.randn(2, 256, device="cuda").bfloat16(), q)
    with pytest.raises(TypeError, match="bias is torch.float32 but x is torch.float16"):
        spinfer.lowbit_mm(torch.randn(2, 256, device="cuda").half(), q, torch.zeros(64, device="cuda"))
    with pytest.raises(ValueError, match=r"bias must have shape \(64,\)"):
        spinfer.lowbit_mm(torch.randn(2, 256, device="cuda").half(), q, torch.zeros(65, device="cuda").half())
    with pytest.raises(ValueError, match="bias is on cpu"):
        spinfer.lowbit_mm(torch.randn(2, 256, device="cuda").half(), q, torch.zeros(64).half())
    with pytest.raises(ValueError, match="256"):
        spinfer.lowbit_mm(torch.randn(2, 255, device="cuda").half(), q)
    with pytest.raises(ValueError, match="out must be"):
        spinfer.lowbit_mm(torch.randn(2, 256, device="cuda").half(), q, out=torch.empty(3, 64, device="cuda").half())
    with pytest.raises(ValueError, match="cpu|cuda"):
        spinfer.lowbit_mm(torch.randn(2, 256).half(), q)


def test_sparse_linear_lowbit_first_call_inside_a_cuda_graph():
    # the policy must decide without syncing or touching TCA-BME-only state while capturing
    lin = torch.nn.Linear(512, 300, bias=True).cuda().half()
    layer = spinfer.SparseLinear.from_linear(lin, quant="w4", policy="lowbit")
    x = torch.randn(2, 512, device="cuda").half()
    spinfer.lowbit_mm(x, layer.weight_object())  # build the extension outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = layer(x)
    g.replay()
    torch.cuda.synchronize()
    ref = reference(x, layer.weight_object(), layer.bias)
    assert rel_err(y, ref) <= 2e-3
