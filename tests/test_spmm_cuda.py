"""The SMBD CUDA kernel against a float64 reference: every output element written (poisoned
first), fresh random data, the shapes and sparsities of issue 3, adversarial patterns, split-K
on and off, CUDA graphs, torch.compile and bad input.  Skipped without a GPU."""

import math
import os

import pytest
import torch

import spinfer
from spinfer.format import TCABME
from spinfer.ops.spmm import PLAN_FIELDS, spmm_plan
from tests.conftest import count_entry_point_calls, rel_err, run_direct_op_calls, seen_ops
from tests.test_tca_bme import random_sparse

pytestmark = pytest.mark.cuda
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def spmm_poisoned(x, enc, bias=None, row_table=True):
    """Run the op into a NaN-filled buffer; every element must be overwritten. row_table: pass the
    weight's row table, as spinfer.spmm does (without it the kernel counts the rows above)."""
    m, k = enc.shape
    out = torch.full((x.shape[0], m), float("nan"), dtype=x.dtype, device=x.device)
    torch.ops.spinfer.spmm_out(x, enc.bitmap, enc.values, enc.gtile_offset, m, k, 64, 64, enc.max_run, bias, 0,
                               enc.row_offset if row_table else None, out=out)
    assert not bool(out.isnan().any()), "kernel left output elements unwritten"
    return out


def check(w, ns, dtype, with_bias=True):
    enc = TCABME.from_dense(w)
    for n in ns:
        x = torch.randn(n, w.shape[1], device="cuda").to(dtype)
        b = torch.randn(w.shape[0], device="cuda").to(dtype) if with_bias else None
        y = spmm_poisoned(x, enc, b)
        ref = x.double() @ w.double().t() + (b.double() if with_bias else 0)
        err = rel_err(y, ref)
        assert err <= TOL[dtype], f"N={n}: rel err {err:.2e}"


@pytest.fixture(autouse=True)
def _ext():
    spinfer.build.load_extension()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.7, 0.9, 0.999])
@pytest.mark.parametrize("k", [1000, 4096])
@pytest.mark.parametrize("m", [64, 4097, 14336])
def test_matches_float64(m, k, sparsity, dtype):
    w = random_sparse((m, k), sparsity, dtype, device="cuda")
    check(w, [1, 7, 8, 16, 32, 33, 256], dtype, with_bias=(m % 2 == 1))  # every token tile: 8, 16, 32, 64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decode", ["lean", "safe"])
def test_decode_variants_forced(monkeypatch, decode, dtype):
    """Both decode variants at every token tile (N = 1, 16, 24, 64: BN 8, 16, 32, 64), on an odd
    shape with split-K from the planner; the plan reports the variant the environment forced."""
    monkeypatch.setenv("SPINFER_DECODE", decode)
    w = random_sparse((4097, 1000), 0.5, dtype, device="cuda")
    check(w, [1, 16, 24, 64], dtype)
    enc = TCABME.from_dense(w)
    for n in (1, 16, 24, 64):
        assert spmm_plan(enc, n, dtype=dtype)["lean"] == (decode == "lean")


@pytest.mark.parametrize("bn", ["8", "16", "32"])
def test_token_tile_forced(monkeypatch, bn):
    """A token tile smaller than the planner's (SPINFER_BN, for A/B runs) gives several tiles with
    a partial last one, split and unsplit, in fp16 and bf16; the plan reports the tile forced."""
    monkeypatch.setenv("SPINFER_BN", bn)
    for dtype in (torch.float16, torch.bfloat16):
        w = random_sparse((4097, 1000), 0.5, dtype, device="cuda")
        check(w, [20, 45], dtype)
        monkeypatch.setenv("SPINFER_SPLITS", "3")
        check(w, [20], dtype)
        monkeypatch.delenv("SPINFER_SPLITS")
        assert spmm_plan(TCABME.from_dense(w), 45, dtype=dtype)["bn"] == int(bn)


@pytest.mark.parametrize("budget", ["7", "8", "9"])
def test_register_budgets_forced(monkeypatch, budget):
    """Each register budget of the sm_90 kernel at BN = 8 and 16, fp16 and bf16, split and not;
    the plan reports the one forced (the sm_80 loader has no budgets: the environment is ignored)."""
    monkeypatch.setenv("SPINFER_MIN_BLOCKS", budget)
    for dtype in (torch.float16, torch.bfloat16):
        w = random_sparse((4097, 1000), 0.6, dtype, device="cuda")
        check(w, [1, 9, 16], dtype)
        enc = TCABME.from_dense(w)
        plan = spmm_plan(enc, 16, dtype=dtype)  # the budgets belong to the sm_90 bulk loader
        assert plan["min_blocks"] == (int(budget) if plan["bulk"] else 0)
        monkeypatch.setenv("SPINFER_SPLITS", "3")
        check(w, [1, 16], dtype)
        monkeypatch.delenv("SPINFER_SPLITS")


@pytest.mark.parametrize("loader", ["bulk", "cp_async"])
def test_l2_policy_forced(monkeypatch, loader):
    """The bitmaps and values under either L2 policy (evict_first, or the normal one under
    SPINFER_L2_EVICT_FIRST=0, for A/B runs): the bulk loader's in-kernel hint, the cp.async
    loader's access-policy window on the launch. Correct at every token tile, split and not, in
    fp16 and bf16, and the same bits either way (a cache policy moves no result)."""
    if loader == "cp_async":
        monkeypatch.setenv("SPINFER_LOADER", "cp_async")
    for dtype in (torch.float16, torch.bfloat16):
        w = random_sparse((4097, 1000), 0.5, dtype, device="cuda")
        enc = TCABME.from_dense(w)
        x = torch.randn(24, 1000, device="cuda").to(dtype)
        outs = []
        for evict_first in ("0", "1"):
            monkeypatch.setenv("SPINFER_L2_EVICT_FIRST", evict_first)
            check(w, [1, 16, 24, 64], dtype)
            monkeypatch.setenv("SPINFER_SPLITS", "3")
            check(w, [1, 16], dtype)
            monkeypatch.delenv("SPINFER_SPLITS")
            outs.append(spinfer.spmm(x, enc))
        assert torch.equal(outs[0], outs[1])


def check_forced_flag(monkeypatch, env, value, w, ns, plan_flag, reported):
    """Launches under SPINFER_<env>=value and under the other value give the same bits for every
    N in ns, split and unsplit, the float64 check holds, and the plan's `plan_flag` is
    reported(plan) for the forced value."""
    enc = TCABME.from_dense(w)
    for splits in (None, "3"):
        if splits:
            monkeypatch.setenv("SPINFER_SPLITS", splits)
        for n in ns:
            x = torch.randn(n, w.shape[1], device="cuda").to(w.dtype)
            monkeypatch.setenv(f"SPINFER_{env}", "1" if value == "0" else "0")
            other = spmm_poisoned(x, enc)
            monkeypatch.setenv(f"SPINFER_{env}", value)
            y = spmm_poisoned(x, enc)
            assert torch.equal(y, other), (n, splits)
            assert rel_err(y, x.double() @ w.double().t()) <= TOL[w.dtype]
            plan = spmm_plan(enc, n, dtype=w.dtype)
            assert plan[plan_flag] == reported(plan), plan
        monkeypatch.delenv("SPINFER_SPLITS", raising=False)


def set_overrides(monkeypatch, **values):
    """Sets SPINFER_<name> to each value given, or unsets it where the value is None."""
    for name, value in values.items():
        if value is None:
            monkeypatch.delenv(f"SPINFER_{name}", raising=False)
        else:
            monkeypatch.setenv(f"SPINFER_{name}", value)


def check_against(y, other, x, w, b, where):
    """y = x @ w.T + b passes the float64 check, and is within fp32 rounding of `other`, the same
    product by another variant of the kernel (the tolerances of the forced-variant tests)."""
    ref = x.double() @ w.double().t() + b.double()
    assert rel_err(y, ref) <= TOL[y.dtype], where
    agree = 8e-3 if y.dtype == torch.bfloat16 else 1e-3  # a rounding apart
    assert rel_err(y, other.double()) <= agree, where


# (SPINFER_STAGES, SPINFER_SPLITS) of the forced-variant tests: the defaults, split, 3 stages, both
STAGES_SPLITS = ((None, None), (None, "3"), ("3", None), ("3", "5"))


def wide_tile_weights(dtype, dense_row, extra=()):
    """The weights of the forced-variant tests at BN >= 32: 4097x1450 at 60% (23 GroupTiles, so a
    stage of a single one) with a dense GroupTile and a dense row `dense_row`, the `extra` shapes
    at 50%, and 300x1000 at 0% and 99.9%."""
    w = random_sparse((4097, 1450), 0.6, dtype, device="cuda")
    w[64:128, 128:192] = torch.randn(64, 64, device="cuda").to(dtype)  # a dense GroupTile
    w[dense_row, :] = torch.randn(1450, device="cuda").to(dtype)  # one dense row
    return [w, *(random_sparse(shape, 0.5, dtype, device="cuda") for shape in extra),
            random_sparse((300, 1000), 0.0, dtype, device="cuda"), random_sparse((300, 1000), 0.999, dtype, device="cuda")]


def wide_tile_cases(monkeypatch, dense_row, extra=(), **overrides):
    """Each weight of wide_tile_weights in fp16 and in bf16, with its encoding and a bias, under each
    (stages, splits) of STAGES_SPLITS and the other SPINFER_ `overrides` in turn: yields (dtype, index,
    w, enc, b, stages, splits)."""
    for dtype in (torch.float16, torch.bfloat16):
        for wi, w in enumerate(wide_tile_weights(dtype, dense_row, extra)):
            enc = TCABME.from_dense(w)
            b = torch.randn(w.shape[0], device="cuda").to(dtype)
            for stages, splits in STAGES_SPLITS:
                set_overrides(monkeypatch, STAGES=stages, SPLITS=splits, **overrides)
                yield dtype, wi, w, enc, b, stages, splits


def wgmma_can_run():
    """Whether the sm_90 kernel's wgmma form must be what runs where the plan allows it: an sm_90
    GPU, the bulk loader and the lean decode (no SPINFER_LOADER / SPINFER_DECODE override). The
    warp-group tests assert it, so an override left set elsewhere cannot turn them into tests of
    mma.sync that still pass."""
    return (torch.cuda.get_device_capability()[0] == 9 and os.environ.get("SPINFER_LOADER") != "cp_async"
            and os.environ.get("SPINFER_DECODE") != "safe")


@pytest.mark.parametrize("wgmma", ["0", "1", "2", "3", "4", "5"])
def test_warp_group_mma_forced(monkeypatch, wgmma):
    """The sm_90 kernel at BN = 32, 64 and 128 on wgmma, one, two or four TCTiles a group, one a group
    with one group left in flight (3), four with a stage's second GroupTile decoded while the first
    multiplies (5), or on mma.sync (SPINFER_WGMMA): the float64
    check holds and the results agree with mma.sync's to fp32
    rounding (the two accumulate in different orders), for tiles of fewer tokens than BN (whose
    x slice has rows no copy writes), partial last tiles, split and unsplit, 2 and 3 stages, a stage
    of a single GroupTile (1450 columns: 23 GroupTiles), a dense GroupTile and a dense row among
    sparse ones, 0% and 99.9% sparsity, bias, fp16 and bf16. The plan reports it where it runs
    (the lean sm_90 kernel at BN >= 32) and nowhere else."""
    for dtype, wi, w, enc, b, stages, splits in wide_tile_cases(monkeypatch, dense_row=200):
        for n in (17, 24, 32, 33, 40, 64, 100) if wi == 0 else (20, 64):
            x = torch.randn(n, w.shape[1], device="cuda").to(dtype)
            monkeypatch.setenv("SPINFER_WGMMA", "0")
            other = spmm_poisoned(x, enc, b)
            monkeypatch.setenv("SPINFER_WGMMA", wgmma)
            y = spmm_poisoned(x, enc, b)
            check_against(y, other, x, w, b, (n, stages, splits))
            plan = spmm_plan(enc, n, dtype=dtype)
            runs = plan["bulk"] and plan["lean"] and plan["bn"] >= 32
            assert runs or not wgmma_can_run(), plan
            group = int(wgmma)
            assert plan["wgmma"] == (group if runs else 0), plan
            tile = 128 if runs and n > 64 and group in (4, 5) else min(1 << (n - 1).bit_length(), 64)
            assert plan["bn"] == tile, plan  # (N = 17-100 here)
    monkeypatch.delenv("SPINFER_STAGES", raising=False)
    monkeypatch.delenv("SPINFER_SPLITS", raising=False)
    enc = TCABME.from_dense(random_sparse((300, 1000), 0.5, torch.float16, device="cuda"))
    monkeypatch.setenv("SPINFER_WGMMA", wgmma)
    for n in (1, 8, 16):  # BN <= 16 has groups of 4 only; SPINFER_WGMMA=0 is mma.sync there too
        plan = spmm_plan(enc, n)
        runs = plan["bulk"] and plan["lean"] and plan["min_blocks"] == 7 and wgmma != "0"
        assert plan["wgmma"] == (4 if runs else 0), plan
    monkeypatch.delenv("SPINFER_WGMMA")
    for n in (1, 8, 16, 32, 64):  # by default groups of a GroupTile's 4 TCTiles, wherever the variant runs,
        plan = spmm_plan(enc, n)  # overlapped (5) at BN = 32 where split (this grid of 5 rows always is)
        runs = plan["bulk"] and plan["lean"] and (plan["bn"] >= 32 or plan["min_blocks"] == 7)
        assert runs or not wgmma_can_run(), plan
        pair = plan["bn"] == 32 or (plan["bn"] == 64 and plan["rows"] == 1)
        assert plan["wgmma"] == ((5 if pair else 4) if runs else 0), plan


def test_warp_group_mma_small_tiles(monkeypatch):
    """The sm_90 kernel at BN = 8 and 16 on wgmma (groups of 4 TCTiles, the default),
    with each way of finding the rows above a warp's row (the producer's count at 30% sparsity and
    at BN = 16, the row table at 60%, neither with SPINFER_ROW_TABLE=0): the float64 check holds
    and the results agree with mma.sync's, at N = 1-16 (tiles of fewer tokens than BN, whose x
    slice has rows no copy writes), split and unsplit, 2 and 3 stages, a dense GroupTile and a
    dense row, 0% and 99.9% sparsity, bias, fp16 and bf16. The plan reports it only at the default
    register budget; SPINFER_WGMMA_SMALL=0 keeps mma.sync."""
    for dtype in (torch.float16, torch.bfloat16):
        weights = []
        for sparsity in (0.3, 0.6):
            w = random_sparse((4097, 1450), sparsity, dtype, device="cuda")
            w[64:128, 128:192] = torch.randn(64, 64, device="cuda").to(dtype)  # a dense GroupTile
            w[200, :] = torch.randn(1450, device="cuda").to(dtype)  # one dense row
            weights.append(w)
        weights += [random_sparse((300, 1000), 0.0, dtype, device="cuda"),
                    random_sparse((300, 1000), 0.999, dtype, device="cuda")]
        for wi, w in enumerate(weights):
            enc = TCABME.from_dense(w)
            b = torch.randn(w.shape[0], device="cuda").to(dtype)
            for stages, splits, table in ((None, None, "1"), (None, "3", "1"), ("3", None, "1"), ("3", "5", "0")):
                set_overrides(monkeypatch, STAGES=stages, SPLITS=splits, ROW_TABLE=table)
                for n in (1, 3, 8, 9, 13, 16) if wi < 2 else (1, 16):
                    x = torch.randn(n, w.shape[1], device="cuda").to(dtype)
                    monkeypatch.setenv("SPINFER_WGMMA_SMALL", "0")
                    other = spmm_poisoned(x, enc, b)
                    assert spmm_plan(enc, n, dtype=dtype)["wgmma"] == 0
                    monkeypatch.delenv("SPINFER_WGMMA_SMALL")
                    y = spmm_poisoned(x, enc, b)
                    check_against(y, other, x, w, b, (wi, n, stages, splits, table))
                    plan = spmm_plan(enc, n, dtype=dtype)
                    runs = plan["bulk"] and plan["lean"] and plan["min_blocks"] == 7
                    assert runs or not wgmma_can_run(), plan
                    assert plan["wgmma"] == (4 if runs else 0), plan
    for env in ("SPINFER_STAGES", "SPINFER_SPLITS", "SPINFER_ROW_TABLE"):
        monkeypatch.delenv(env, raising=False)
    enc = TCABME.from_dense(random_sparse((300, 1000), 0.5, torch.float16, device="cuda"))
    monkeypatch.setenv("SPINFER_MIN_BLOCKS", "8")  # another register budget: mma.sync
    assert all(spmm_plan(enc, n)["wgmma"] == 0 for n in (1, 8, 16))


def test_warp_group_two_rows_forced(monkeypatch):
    """The sm_90 wgmma kernel with two GroupTile rows a block (SPINFER_SMBD_ROWS=2, groups of 4 at
    BN = 32 and 64), whose two warp groups share each stage's x slice: the float64 check holds and
    the results agree with one row a block's to fp32 rounding, at odd and even counts of GroupTile rows
    (4097 and 300 rows: the last block's second row lies past the weight; 640 and 64), split and
    unsplit, 2 and 3 stages, a stage of a single GroupTile (1450 columns), a dense GroupTile and a
    dense row, 0% and 99.9% sparsity, bias, fp16 and bf16. The plan reports 2 rows only where the
    variant runs; by default it takes them at BN = 64 where they keep more GroupTile rows resident."""
    # the dense row in the last block (whose second GroupTile row lies past the weight)
    for dtype, wi, w, enc, b, stages, splits in wide_tile_cases(monkeypatch, 4000, ((640, 1000), (64, 1000))):
        for n in (17, 32, 33, 64, 100) if wi == 0 else (20, 64):
            x = torch.randn(n, w.shape[1], device="cuda").to(dtype)
            monkeypatch.setenv("SPINFER_SMBD_ROWS", "1")
            other = spmm_poisoned(x, enc, b)
            assert spmm_plan(enc, n, dtype=dtype)["rows"] == 1
            monkeypatch.setenv("SPINFER_SMBD_ROWS", "2")
            y = spmm_poisoned(x, enc, b)
            check_against(y, other, x, w, b, (wi, n, stages, splits))
            plan = spmm_plan(enc, n, dtype=dtype)
            runs = plan["bulk"] and plan["lean"] and plan["bn"] >= 32 and plan["wgmma"] in (4, 5)
            assert runs or not wgmma_can_run(), plan
            assert plan["rows"] == (2 if runs else 1), plan
    monkeypatch.delenv("SPINFER_STAGES", raising=False)
    monkeypatch.setenv("SPINFER_SPLITS", "2")  # 32 GroupTiles a split, at which the rule compares occupancy
    taken = set()
    for sparsity in (0.3, 0.5, 0.7):
        enc = TCABME.from_dense(random_sparse((4096, 4096), sparsity, torch.float16, device="cuda"))
        for n in (1, 8, 16, 32, 64):
            resident = {}
            monkeypatch.setenv("SPINFER_WGMMA", "4")  # the rule compares plain groups of 4
            for rows in ("1", "2"):
                monkeypatch.setenv("SPINFER_SMBD_ROWS", rows)
                resident[rows] = spmm_plan(enc, n)["resident_blocks"]
            monkeypatch.delenv("SPINFER_SMBD_ROWS")
            monkeypatch.delenv("SPINFER_WGMMA")
            plan = spmm_plan(enc, n)
            runs = plan["bulk"] and plan["lean"] and plan["bn"] >= 32 and plan["wgmma"] in (4, 5)
            two = runs and plan["bn"] == 64 and 2 * resident["2"] > resident["1"]
            assert plan["rows"] == (2 if two else 1), (sparsity, n, resident)
            # one row a block at BN = 64 takes the overlapped groups (kWgPair), two rows plain ones;
            # BN = 32 takes them where the grid is split (this one of 64 GroupTile rows always is)
            pair = (plan["bn"] == 64 and not two) or plan["bn"] == 32
            assert not runs or plan["wgmma"] == (5 if pair else 4), plan
            taken.add(plan["rows"])
    assert taken == ({1, 2} if wgmma_can_run() else {1})  # the rule takes both somewhere on sm_90
    monkeypatch.setenv("SPINFER_WGMMA", "1")  # groups of 1: one row a block
    monkeypatch.setenv("SPINFER_SMBD_ROWS", "2")
    assert all(spmm_plan(enc, n)["rows"] == 1 for n in (32, 64))


def test_rows_above_at_bn32_forced(monkeypatch):
    """At BN = 32 (17-32 tokens) the rows above each decoding warp's row counted by the producer
    warp (the planner's choice), read from the weight's row table (SPINFER_COUNT_ROWS=0) or counted
    by each decoding warp (and SPINFER_ROW_TABLE=0), in plain (SPINFER_WGMMA=4) and overlapped (5)
    wgmma groups: the float64 check holds and the three agree to fp32 rounding, on odd shapes with a
    dense GroupTile and a dense row, split and unsplit, 2 and 3 stages, a stage of a single
    GroupTile, 0% and 99.9% sparsity, bias, fp16 and bf16. The plan reports which one runs; without
    the weight's row table the decoding warps count; blocks of two GroupTile rows count in each warp."""
    for dtype, wi, w, enc, b, stages, splits in wide_tile_cases(monkeypatch, dense_row=4000):
        for group in ("4", "5"):
            monkeypatch.setenv("SPINFER_WGMMA", group)
            n = 17 if wi % 2 else 32
            x = torch.randn(n, w.shape[1], device="cuda").to(dtype)
            set_overrides(monkeypatch, COUNT_ROWS="0", ROW_TABLE="0")
            other = spmm_poisoned(x, enc, b)
            plan = spmm_plan(enc, n, dtype=dtype)
            runs = plan["bulk"] and plan["lean"] and plan["wgmma"] == int(group)
            assert runs or not wgmma_can_run(), plan
            assert not plan["count_rows"] and not plan["row_table"], plan
            for count, table in ((None, None), ("0", None)):
                set_overrides(monkeypatch, COUNT_ROWS=count, ROW_TABLE=table)
                y = spmm_poisoned(x, enc, b)
                check_against(y, other, x, w, b, (wi, n, stages, splits, group, count))
                plan = spmm_plan(enc, n, dtype=dtype)
                assert plan["count_rows"] == (runs and count is None), plan
                assert plan["row_table"] == (runs and count == "0"), plan
            if wi == 0:  # no row table handed in: the decoding warps count
                check_against(spmm_poisoned(x, enc, b, row_table=False), other, x, w, b, (wi, n, "no table"))
        set_overrides(monkeypatch, COUNT_ROWS=None, ROW_TABLE=None, SMBD_ROWS="2")
        plan = spmm_plan(enc, 32, dtype=dtype)
        assert plan["rows"] == (2 if wgmma_can_run() else 1), plan
        assert not (plan["count_rows"] or plan["row_table"]) or not wgmma_can_run(), plan
        monkeypatch.delenv("SPINFER_SMBD_ROWS")


def test_overlap_at_bn32_where_the_grid_is_split(monkeypatch):
    """At 17-32 tokens (BN = 32) the planner takes the overlapped wgmma groups (kWgPair) where the
    split rule gives their grid more than one split, else plain groups of 4: a 4096x4096 weight
    (64 GroupTile rows, split) and a 65536x1024 one (1024 rows of 16 GroupTiles, more than a round
    of resident blocks unsplit). A forced split count does not move the choice."""
    taken = set()
    for shape in ((4096, 4096), (65536, 1024)):
        enc = TCABME.from_dense(random_sparse(shape, 0.5, torch.float16, device="cuda"))
        for n in (24, 32):
            monkeypatch.setenv("SPINFER_WGMMA", "5")
            pair_splits = spmm_plan(enc, n)["splits"]
            monkeypatch.delenv("SPINFER_WGMMA")
            plan = spmm_plan(enc, n)
            runs = plan["bulk"] and plan["lean"] and plan["wgmma"] in (4, 5)
            assert runs or not wgmma_can_run(), plan
            assert plan["bn"] == 32 and plan["rows"] == 1, plan
            if runs:
                assert plan["wgmma"] == (5 if pair_splits > 1 else 4), (shape, n, pair_splits, plan)
                taken.add(plan["wgmma"])
            monkeypatch.setenv("SPINFER_SPLITS", "3")
            assert spmm_plan(enc, n)["wgmma"] == plan["wgmma"], (shape, n)
            monkeypatch.delenv("SPINFER_SPLITS")
    assert taken == ({4, 5} if wgmma_can_run() else set())  # both somewhere on sm_90


@pytest.mark.parametrize("rows", ["1", "2"])
@pytest.mark.parametrize("wgmma", ["4", "5"])
def test_token_tile_128(monkeypatch, rows, wgmma):
    """The sm_90 wgmma kernel's 128-token tile, the planner's past 64 tokens, one or two GroupTile
    rows a block, groups of 4 waited for one by one or a stage's two overlapping (SPINFER_WGMMA=5):
    the float64 check holds and the results agree with 64-token tiles' (SPINFER_BN=64) to
    fp32 rounding, for tiles of fewer tokens than 128 (N = 1 forced, and N = 65-127: x rows no copy
    writes), partial last tiles,
    split and unsplit, 2 and 3 stages, a stage of a single GroupTile, a dense GroupTile and a dense
    row, 0% and 99.9% sparsity, bias, fp16 and bf16. Where the wgmma form does not run, the plan
    falls back to 64-token tiles."""
    for dtype, wi, w, enc, b, stages, splits in wide_tile_cases(monkeypatch, 4000, ((640, 1000),), SMBD_ROWS=rows,
                                                                WGMMA=wgmma):
        for n in (1, 65, 128, 129, 300) if wi == 0 else (100, 256):
            x = torch.randn(n, w.shape[1], device="cuda").to(dtype)
            monkeypatch.setenv("SPINFER_BN", "64")
            other = spmm_poisoned(x, enc, b)
            monkeypatch.setenv("SPINFER_BN", "128" if n <= 64 else "0")  # 0: the planner's
            y = spmm_poisoned(x, enc, b)
            check_against(y, other, x, w, b, (wi, n, stages, splits))
            plan = spmm_plan(enc, n, dtype=dtype)
            runs = plan["bulk"] and plan["lean"] and plan["wgmma"] == int(wgmma)
            assert runs or not wgmma_can_run(), plan
            assert plan["bn"] == (128 if runs else 64), plan
            assert plan["n_tiles"] == -(-n // plan["bn"]), plan
            assert plan["rows"] == (int(rows) if runs else 1), plan
    for env in ("SPINFER_STAGES", "SPINFER_SPLITS", "SPINFER_SMBD_ROWS", "SPINFER_BN", "SPINFER_WGMMA"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("SPINFER_WGMMA", "1")  # groups of 1 have no 128-token tile: 64
    enc = TCABME.from_dense(random_sparse((300, 1000), 0.5, torch.float16, device="cuda"))
    assert spmm_plan(enc, 200)["bn"] == 64


@pytest.mark.parametrize("x_l1", ["0", "1"])
def test_activation_copies_through_l1_forced(monkeypatch, x_l1):
    """The sm_90 loader's activation copies through L1 or not (SPINFER_SPMM_XL1) give the same
    bits at every token tile, split and unsplit, fp16 and bf16, and the float64 check holds; the
    plan reports what was forced (never on the sm_80 loader, which has no such copies)."""
    for dtype in (torch.float16, torch.bfloat16):
        w = random_sparse((4097, 1000), 0.4, dtype, device="cuda")
        check_forced_flag(monkeypatch, "SPMM_XL1", x_l1, w, (1, 8, 16, 24, 64), "x_l1",
                          lambda plan: plan["bulk"] and x_l1 == "1")


def counts_where_asked(plan):
    """Whether the plan's kernel has the producer's row count: the lean sm_90 one at BN <= 16, and
    its wgmma groups of 4 (plain or overlapped) with one GroupTile row a block at BN = 32."""
    return plan["bulk"] and (plan["bn"] <= 16 or (plan["bn"] == 32 and plan["wgmma"] in (4, 5) and plan["rows"] == 1))


@pytest.mark.parametrize("count_rows", ["0", "1"])
def test_rows_above_counted_by_either_warp(monkeypatch, count_rows):
    """The bitmap rows above each decoding warp's row counted by the producer warp or by the warp
    itself (SPINFER_COUNT_ROWS) give the same bits at BN = 8 and 16, split and unsplit, with a
    stage of a single GroupTile (1450 columns: 23 GroupTiles), a dense GroupTile and a dense row
    among sparse ones, and the float64 check holds; the plan reports it (BN <= 16 on the sm_90
    loader, and BN = 32 on its wgmma groups of 4)."""
    for dtype in (torch.float16, torch.bfloat16):
        w = random_sparse((4097, 1450), 0.6, dtype, device="cuda")
        w[64:128, 128:192] = torch.randn(64, 64, device="cuda").to(dtype)  # a dense GroupTile
        w[200, :] = torch.randn(1450, device="cuda").to(dtype)  # one dense row
        check_forced_flag(monkeypatch, "COUNT_ROWS", count_rows, w, (1, 5, 8, 16, 32), "count_rows",
                          lambda plan: counts_where_asked(plan) and count_rows == "1")


@pytest.mark.parametrize("stagger", ["0", "1"])
def test_next_stage_requested_after_the_first_lands_or_with_it(monkeypatch, stagger):
    """The sm_90 producer at BN = 8 requesting the ring's last stage once the first has landed, or
    with it (SPINFER_STAGGER), gives the same bits, split and unsplit, with 2 and 3 stages, a stage
    of a single GroupTile (1450 columns), blocks of one stage and a dense row, and the float64 check
    holds; wider tiles and the row-counting producer (here made to count by a dense GroupTile)
    ignore it, and the plan says where it applies (the sm_90 loader, BN = 8, the producer not
    counting rows). The weights are checked to take the stagger's path where it applies."""
    def reported(plan):
        return plan["bulk"] and plan["bn"] == 8 and not plan["count_rows"] and stagger == "1"

    bulk = spmm_plan(TCABME.from_dense(random_sparse((64, 64), 0.5, torch.float16, device="cuda")), 1)["bulk"]
    for dtype in (torch.float16, torch.bfloat16):
        w = random_sparse((4097, 1450), 0.6, dtype, device="cuda")
        w[200, :] = torch.randn(1450, device="cuda").to(dtype)  # one dense row
        # runs well under 60% of a GroupTile: the producer does not count rows, so at N <= 8 the
        # stagger is what runs (a dense GroupTile would make it count rows, and skip the stagger)
        assert spmm_plan(TCABME.from_dense(w), 1, dtype=dtype)["count_rows"] is False
        check_forced_flag(monkeypatch, "STAGGER", stagger, w, (1, 5, 8, 16, 32), "stagger", reported)
        w[64:128, 128:192] = torch.randn(64, 64, device="cuda").to(dtype)  # a dense GroupTile
        assert spmm_plan(TCABME.from_dense(w), 1, dtype=dtype)["count_rows"] is bulk
        check_forced_flag(monkeypatch, "STAGGER", stagger, w, (1, 8), "stagger", reported)
    w = random_sparse((300, 1450), 0.5, torch.float16, device="cuda")
    assert spmm_plan(TCABME.from_dense(w), 1)["count_rows"] is False  # the stagger runs at N = 1
    monkeypatch.setenv("SPINFER_STAGES", "3")
    check_forced_flag(monkeypatch, "STAGGER", stagger, w, (1, 16), "stagger", reported)
    # 12 splits of 23 GroupTiles: blocks of a single stage (the helper's unsplit pass runs under
    # it, then its 3-split pass)
    monkeypatch.setenv("SPINFER_SPLITS", "12")
    check_forced_flag(monkeypatch, "STAGGER", stagger, w, (1,), "stagger", reported)


@pytest.mark.parametrize("row_table", ["0", "1"])
def test_rows_above_read_from_the_table_or_counted(monkeypatch, row_table):
    """The decoding warps reading the rows above their own from the weight's row table, or
    counting them (SPINFER_ROW_TABLE), give the same bits at BN = 8 and (with the producer's count
    off) 16, split and unsplit, with 2 and 3 stages, stages of a single GroupTile and a dense row,
    fp16 and bf16, and the float64 check holds; also at BN = 32 with the producer's count off. The
    plan reports the table where it applies (the lean sm_90 kernel at BN <= 16 with 56 registers and
    its wgmma groups of 4 with one row a block at BN = 32, the producer not counting rows)."""
    def reported(plan):
        kernel = plan["min_blocks"] == 7 if plan["bn"] <= 16 else counts_where_asked(plan)
        return plan["bulk"] and kernel and not plan["count_rows"] and row_table == "1"

    for dtype in (torch.float16, torch.bfloat16):
        w = random_sparse((4097, 1450), 0.6, dtype, device="cuda")
        w[200, :] = torch.randn(1450, device="cuda").to(dtype)  # one dense row
        assert spmm_plan(TCABME.from_dense(w), 1, dtype=dtype)["count_rows"] is False
        check_forced_flag(monkeypatch, "ROW_TABLE", row_table, w, (1, 5, 8, 32), "row_table", reported)
        monkeypatch.setenv("SPINFER_COUNT_ROWS", "0")  # BN = 16 and 32 without the producer's count
        check_forced_flag(monkeypatch, "ROW_TABLE", row_table, w, (9, 16, 32), "row_table", reported)
        monkeypatch.delenv("SPINFER_COUNT_ROWS")
    w = random_sparse((300, 1450), 0.7, torch.float16, device="cuda")
    monkeypatch.setenv("SPINFER_STAGES", "3")
    check_forced_flag(monkeypatch, "ROW_TABLE", row_table, w, (1, 8), "row_table", reported)
    monkeypatch.setenv("SPINFER_SPLITS", "12")  # 12 splits of 23 GroupTiles: blocks of one stage
    check_forced_flag(monkeypatch, "ROW_TABLE", row_table, w, (1,), "row_table", reported)


def test_row_table_optional_and_untrusted():
    """A direct call without the row table counts the rows above (same bits as with it); a table
    of the wrong shape or dtype is refused before the launch; a corrupt table gives wrong results
    and never an out-of-range access (the decode clamps every prefix to its run), and the next
    launch is right again."""
    w = random_sparse((640, 1024), 0.7, torch.float16, device="cuda")
    enc = TCABME.from_dense(w)
    x = torch.randn(3, 1024, device="cuda").half()
    assert spmm_plan(enc, 3)["row_table"] == spmm_plan(enc, 3)["bulk"]
    with_table = spmm_poisoned(x, enc)
    assert torch.equal(with_table, spmm_poisoned(x, enc, row_table=False))
    assert torch.equal(with_table, spinfer.spmm(x, enc))
    m, k = enc.shape
    args = (x, enc.bitmap, enc.values, enc.gtile_offset, m, k, 64, 64, enc.max_run, None, 0)
    for bad in (enc.row_offset.int(), enc.row_offset[:-1], enc.row_offset.reshape(-1)):
        with pytest.raises((TypeError, ValueError), match="row_offset"):
            torch.ops.spinfer.spmm(*args, bad)
    garbage = torch.randint(-32768, 32767, enc.row_offset.shape, dtype=torch.int16, device="cuda")
    torch.ops.spinfer.spmm(*args, garbage)
    torch.cuda.synchronize()
    assert torch.equal(spinfer.spmm(x, enc), with_table)


def test_plan_reports_the_launch():
    """spmm_plan: the tile by N, the GroupTile grid, a forced split factor, and a default of the
    lean decode at every tile."""
    w = random_sparse((300, 1450), 0.5, torch.float16, device="cuda")
    enc = TCABME.from_dense(w)
    for n, bn in [(1, 8), (9, 16), (17, 32), (32, 32), (33, 64), (300, 64)]:
        p = spmm_plan(enc, n)
        bn = 128 if bn == 64 and n > 64 and p["wgmma"] == 5 else bn  # sm_90's tile past 64 tokens
        # groups of 4 up to 16 tokens, overlapped a stage (kWgPair) at the 128-token tile, at 64
        # tokens where a block holds one GroupTile row and at 32 where the grid is split (this one
        # of 5 GroupTile rows always is)
        pair = n > 64 or (n > 32 and p["rows"] == 1) or 16 < n <= 32
        assert p["wgmma"] == (5 if pair else 4 if n > 16 else p["wgmma"]) or not wgmma_can_run(), p
        assert (p["bn"], p["n_tiles"], p["grid_m"], p["grid_k"]) == (bn, -(-n // bn), 5, 23)
        assert p["lean"] and p["resident_blocks"] >= 1 and p["stages"] == 2
        assert p["splits"] * p["k_per_split"] >= 23 > (p["splits"] - 1) * p["k_per_split"]
    for n in (1, 16, 32):
        p = spmm_plan(enc, n)
        assert p["min_blocks"] == (7 if p["bulk"] and n <= 16 else 0), (n, p)  # 56 registers (spmm_smbd.cu)
        assert p["bulk"] == (torch.cuda.get_device_capability()[0] >= 9 and os.environ.get("SPINFER_LOADER") != "cp_async")
        # activations through L1 where a stage's slice (2 x 64 columns x bn tokens, fp16) is at
        # most half its compressed weights (two 512-byte bitmaps, two runs of value_cap values)
        x_bytes, w_bytes = 2 * 64 * p["bn"] * 2, 2 * (512 + 2 * p["value_cap"])
        assert p["x_l1"] == (p["bulk"] and 2 * x_bytes <= w_bytes), (n, p)
        # the producer counts the rows above at BN = 16 and 32 (wgmma groups of 4, one row a block),
        # and at BN = 8 where the longest run is at least 60% of a GroupTile (spmm_smbd.cu)
        long_runs = 5 * p["value_cap"] >= 3 * 4096
        assert p["count_rows"] == (counts_where_asked(p) and (p["bn"] >= 16 or long_runs)), (n, p)
        assert p["count_rows"] or n != 32 or not wgmma_can_run(), p
        # the next stage waits for the first to land at BN = 8 where the producer does not count rows
        assert p["stagger"] == (p["bulk"] and p["bn"] == 8 and not p["count_rows"]), (n, p)
        # a split grid's reducer by ticket with the sm_90 loader (the default register budgets)
        assert p["ticket"] == (p["bulk"] and p["splits"] > 1 and p["min_blocks"] in (0, 7)), (n, p)
    for sparsity, long_runs in ((0.3, True), (0.5, False), (0.8, False)):
        p = spmm_plan(TCABME.from_dense(random_sparse((128, 1024), sparsity, torch.float16, device="cuda")), 1)
        assert p["count_rows"] == (p["bulk"] and long_runs), (sparsity, p)
    assert spmm_plan(enc, 1, splits=3)["splits"] == 3
    assert spmm_plan(enc, 1, splits=3)["k_per_split"] == 8  # 23 GroupTiles: whole pairs per split
    with pytest.raises(ValueError, match="n must be"):
        spmm_plan(enc, 0)
    with pytest.raises(ValueError, match="CUDA kernel"):
        spmm_plan(enc, 1, device="cpu")


def plan_of(m, k, max_run, n, dtype=torch.float16, splits=0):
    """The planner's plan (PLAN_FIELDS) for an M x K weight whose longest run is max_run, at N tokens
    (x is a stride-0 view: the planner reads only its shape, dtype and device)."""
    x = torch.empty((n, 1), dtype=dtype, device="cuda").expand(n, k)
    return dict(zip(PLAN_FIELDS, torch.ops.spinfer.spmm_plan(x, m, k, max_run, splits)))


def rule_splits(m, k, max_run, n, dtype, fixed=4.0, cap=None, v23=False):
    """The planner's split rule written out from its definition (docs/kernels.md, spmm_smbd.cu):
    over split counts s, GroupTiles per split kps = ceil(grid_k / s) rounded up to a pair (when
    split), at least min(28, grid_k / 8) of them. For the sm_90 loader's 8-token tile where the value
    buffer holds at least 45% of a GroupTile, and its 16-token tile where it holds at least 60% (the
    streaming cap): the most splits, in that order, whose grid has at most 4 blocks per SM and fits
    the resident slots, if the unsplit grid does (`cap`, blocks per SM, overrides the 4; 0: none).
    Otherwise the cost rule: (kps + fixed) x ceil(blocks / (resident blocks per SM x SMs)), or, for
    the sm_90 loader's 8- and 16-token tiles where the value buffer holds at most 40% of a GroupTile
    (decode-bound), (kps + 10) x blocks / slots + kps; the first least cost wins. Each candidate's
    resident blocks come from the planner's own plan with that factor forced; a block holds the
    plan's GroupTile rows (1 or 2). `v23`: the rule of kernel v23 (SPINFER_SPLIT_RULE=23), without
    the 16-token cap and the decode-bound cost."""
    plan = lambda splits: plan_of(m, k, max_run, n, dtype, splits)
    auto = plan(0)
    grid_k, base = auto["grid_k"], -(-auto["grid_m"] // auto["rows"]) * auto["n_tiles"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gt_values = 64 * 64
    if cap is None:
        streams = (auto["bn"] == 8 and auto["value_cap"] >= 0.45 * gt_values
                   or not v23 and auto["bn"] == 16 and auto["value_cap"] >= 0.6 * gt_values)
        cap = 4.0 if auto["bulk"] and streams else 0.0
    fluid = not v23 and auto["bulk"] and auto["bn"] <= 16 and auto["value_cap"] <= 0.4 * gt_values
    min_per_split = max(1, min(28, grid_k // 8))
    candidates, last = [], 0  # (splits, kps, resident blocks per SM)
    for s in range(1, max(1, grid_k // min_per_split) + 1):
        kps = -(-grid_k // s)
        if kps < grid_k:
            kps = (kps + 1) // 2 * 2
        splits = -(-grid_k // kps)
        if splits == last:
            continue
        last = splits
        forced = plan(splits)
        assert forced["k_per_split"] == kps, (s, forced)
        candidates.append((splits, kps, forced["resident_blocks"]))
    if cap and base <= min(cap, candidates[0][2]) * sms:
        fits = 1
        for splits, _, resident in candidates[1:]:
            if base * splits > min(cap, resident) * sms:
                break
            fits = splits
        return auto["splits"], fits
    best, best_cost = 1, None
    for splits, kps, resident in candidates:
        if fluid:
            cost = (kps + 10) * base * splits / (resident * sms) + kps
        else:
            cost = (kps + fixed) * math.ceil(base * splits / (resident * sms))
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return auto["splits"], best


@pytest.mark.parametrize("fixed", [None, "0", "160"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_rule_picks_the_least_cost(dtype, fixed, monkeypatch):
    """The split count the planner launches is the one its rule defines, on the issue's shapes
    (longest runs of 30 / 50 / 70% sparsity) and narrow and odd ones, N from 1 to 64; with the
    default fixed cost per round (4 GroupTiles) and with SPINFER_SPLIT_FIXED (tenths) overriding it."""
    monkeypatch.delenv("SPINFER_SPLITS", raising=False)
    monkeypatch.delenv("SPINFER_SPLIT_MARGIN", raising=False)
    monkeypatch.delenv("SPINFER_SPLIT_CAP", raising=False)
    if fixed is None:
        monkeypatch.delenv("SPINFER_SPLIT_FIXED", raising=False)
    else:
        monkeypatch.setenv("SPINFER_SPLIT_FIXED", fixed)
    cost = 4.0 if fixed is None else int(fixed) / 10
    for m, k, max_run in [(28672, 8192, 2200), (8192, 28672, 2200), (14336, 4096, 1360), (4096, 14336, 3000),
                          (4096, 4096, 2200), (4097, 1000, 2200), (300, 1450, 4096)]:
        for n in (1, 8, 16, 32, 64):
            chosen, defined = rule_splits(m, k, max_run, n, dtype, cost)
            assert chosen == defined, f"{m}x{k} max_run {max_run} N={n}: planner {chosen}, rule {defined}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_rule_of_v23_on_request(dtype, monkeypatch):
    """SPINFER_SPLIT_RULE=23 launches what the rule of kernel v23 defines (no 16-token cap, rounds
    everywhere), and the default rule differs from it where it should on an sm_90 part of 100+ SMs:
    28672x8192 at 30% sparsity (longest run 3000) and N = 16 streams unsplit, at 70% (1360) and
    N = 1 / 16 it runs more splits than v23's one round of 896 blocks."""
    for var in ("SPINFER_SPLITS", "SPINFER_SPLIT_MARGIN", "SPINFER_SPLIT_CAP", "SPINFER_SPLIT_FIXED"):
        monkeypatch.delenv(var, raising=False)
    default = {(max_run, n): plan_of(28672, 8192, max_run, n, dtype)["splits"] for max_run, n in
               [(3000, 16), (1360, 1), (1360, 16), (2200, 1), (2200, 16)]}
    monkeypatch.setenv("SPINFER_SPLIT_RULE", "23")
    for m, k, max_run in [(28672, 8192, 3000), (28672, 8192, 1360), (8192, 28672, 1360), (4096, 14336, 2200)]:
        for n in (1, 8, 16, 32):
            chosen, defined = rule_splits(m, k, max_run, n, dtype, v23=True)
            assert chosen == defined, f"v23 rule, {m}x{k} max_run {max_run} N={n}: planner {chosen}, rule {defined}"
    old = {key: plan_of(28672, 8192, key[0], key[1], dtype)["splits"] for key in default}
    if not plan_of(64, 64, 64, 1)["bulk"]:
        assert default == old  # the other loader keeps v23's rule
        return
    if torch.cuda.get_device_properties(0).multi_processor_count < 100:
        return  # the grids below are an H100's
    assert default[(3000, 16)] == 1 < old[(3000, 16)], (default, old)
    assert default[(1360, 1)] > old[(1360, 1)] and default[(1360, 16)] > old[(1360, 16)], (default, old)
    assert default[(2200, 1)] == old[(2200, 1)] and default[(2200, 16)] == old[(2200, 16)], (default, old)


# (shape, longest run, N, the cap's grid against the cost rule's: fewer splits on any sm_90 part of
# 100+ SMs; capped, where the count depends on the SM count (an H100 SXM's 528-block cap keeps
# 4096x14336 at the cost rule's 8 splits); or no cap)
CAP_CASES = [(6144, 4096, 2200, 1, "fewer"), (6144, 4096, 2200, 8, "fewer"), (8192, 28672, 3000, 1, "fewer"),
             (4096, 14336, 2200, 1, "capped"), (6144, 4096, 1360, 1, "uncapped"), (6144, 4096, 2200, 16, "uncapped")]


def skip_unless_bulk_loader():
    if not plan_of(64, 64, 64, 1)["bulk"]:
        pytest.skip("the split cap is the sm_90 loader's")


def test_split_rule_caps_blocks_per_sm_for_dense_8_token_tiles(monkeypatch):
    """With the sm_90 loader at N <= 8, weights whose longest run holds 45% of a GroupTile or more
    get a grid of at most 4 blocks per SM, never more splits than the cost rule's
    (SPINFER_SPLIT_CAP=0) and fewer where a round of 7 blocks per SM holds more; sparser weights,
    and N = 16, get the cost rule's count."""
    for var in ("SPINFER_SPLITS", "SPINFER_SPLIT_MARGIN", "SPINFER_SPLIT_CAP"):
        monkeypatch.delenv(var, raising=False)
    skip_unless_bulk_loader()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m, k, max_run, n, expect in CAP_CASES:
        default = plan_of(m, k, max_run, n)
        monkeypatch.setenv("SPINFER_SPLIT_CAP", "0")
        cost_rule = plan_of(m, k, max_run, n)
        monkeypatch.delenv("SPINFER_SPLIT_CAP")
        if expect == "uncapped":
            assert default["splits"] == cost_rule["splits"], (m, k, max_run, n, default["splits"], cost_rule["splits"])
            continue
        assert default["grid_m"] * default["n_tiles"] * default["splits"] <= 4 * sms, (m, k, max_run, n, default)
        assert default["splits"] <= cost_rule["splits"], (m, k, max_run, n, default["splits"], cost_rule["splits"])
        if expect == "fewer":
            assert default["splits"] < cost_rule["splits"], (m, k, max_run, n, default["splits"], cost_rule["splits"])


@pytest.mark.parametrize("cap", ["0", "25", "40", "70"])
def test_split_cap_override_follows_the_rule(cap, monkeypatch):
    """SPINFER_SPLIT_CAP (tenths of a block per SM; 0: the cost rule) sets the cap for every launch,
    and the planner then launches what rule_splits defines with it."""
    for var in ("SPINFER_SPLITS", "SPINFER_SPLIT_MARGIN"):
        monkeypatch.delenv(var, raising=False)
    skip_unless_bulk_loader()
    monkeypatch.setenv("SPINFER_SPLIT_CAP", cap)
    for m, k, max_run, n, _ in CAP_CASES:
        chosen, defined = rule_splits(m, k, max_run, n, torch.float16, cap=int(cap) / 10)
        assert chosen == defined, f"{m}x{k} max_run {max_run} N={n} cap {cap}: planner {chosen}, rule {defined}"


@pytest.mark.parametrize("stages", ["2", "3", "4"])
@pytest.mark.parametrize("splits", ["1", "2", "3", "7"])
@pytest.mark.parametrize("n", [1, 9, 40, 65])
def test_split_k_and_stages_forced(monkeypatch, splits, stages, n):
    """Every (split-K, pipeline depth) combination, on a shape whose K (1450) is not a GroupTile
    multiple and whose 23 GroupTile columns leave an odd count in the last split of every split
    factor, so stages holding a single GroupTile run too."""
    monkeypatch.setenv("SPINFER_SPLITS", splits)
    monkeypatch.setenv("SPINFER_STAGES", stages)
    w = random_sparse((300, 1450), 0.5, torch.float16, device="cuda")
    check(w, [n], torch.float16)
    check(w, [n], torch.float16)  # counters are re-armed by the kernel: a second call is right too


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_reducer_by_ticket_or_by_arrival(monkeypatch, dtype):
    """Split-K's reducer chosen by a ticket as each block's last stage starts (SpmmPlan::ticket, the
    sm_90 loader's default) or by the last arrival (SPINFER_SPLIT_TICKET=0): the same sum in the same
    split order, so the same bits, at every token tile (N = 1 / 9 / 24 / 40 / 65: BN 8-128), blocks of
    two GroupTile rows, 2-7 splits and 3 stages; each launch leaves the counters zero for the other
    protocol (the arrival compares the whole counter), and repeated launches agree."""
    for (m, k), sparsity in [((300, 1450), 0.5), ((4097, 1000), 0.3), ((700, 3000), 0.7)]:
        w = random_sparse((m, k), sparsity, dtype, device="cuda")
        w[-1, :] = torch.randn(k, device="cuda").to(dtype)  # one dense row, in the bottom tile
        enc = TCABME.from_dense(w)
        b = torch.randn(m, device="cuda").to(dtype)
        for n in (1, 9, 24, 40, 65):
            x = torch.randn(n, k, device="cuda").to(dtype)
            for splits, stages, rows in (("2", None, None), ("3", "3", None), ("7", None, "2"), (None, None, None)):
                set_overrides(monkeypatch, SPLITS=splits, STAGES=stages, SMBD_ROWS=rows, SPLIT_TICKET=None)
                plan = spmm_plan(enc, n, dtype=dtype)
                where = (m, k, n, splits, stages, rows, plan)
                assert plan["ticket"] == (plan["bulk"] and plan["splits"] > 1), where
                assert plan["splits"] > 1 or splits is None, where
                by_ticket = [spmm_poisoned(x, enc, b) for _ in range(2)]
                set_overrides(monkeypatch, SPLIT_TICKET="0")
                assert not spmm_plan(enc, n, dtype=dtype)["ticket"], where
                by_arrival = spmm_poisoned(x, enc, b)
                check_against(by_ticket[0], by_arrival, x, w, b, where)
                assert torch.equal(by_ticket[0], by_arrival) and torch.equal(by_ticket[1], by_arrival), where
    set_overrides(monkeypatch, SPLITS=None, STAGES=None, SMBD_ROWS=None, SPLIT_TICKET=None)


def test_split_counters_shared_across_calls_and_streams(monkeypatch):
    """Split launches share one arrival-counter buffer per stream, which every launch must leave
    zero: different split factors and tile counts back to back, on the default stream and on a
    side stream (its own buffer), each checked; then queued without a sync in between."""
    shapes = [(300, 1450), (700, 3000), (130, 900)]
    ws = [random_sparse(s, 0.5, torch.float16, device="cuda") for s in shapes]
    encs = [TCABME.from_dense(w) for w in ws]
    side = torch.cuda.Stream()
    for splits in ["2", "7", "3", "5"]:
        monkeypatch.setenv("SPINFER_SPLITS", splits)
        for w, enc in zip(ws, encs):
            x = torch.randn(9, w.shape[1], device="cuda").half()
            ref = x.double() @ w.double().t()
            assert rel_err(spmm_poisoned(x, enc), ref) <= 2e-3, f"splits {splits}, {tuple(w.shape)}"
            side.wait_stream(torch.cuda.current_stream())  # x was made on the default stream
            with torch.cuda.stream(side):
                y = spinfer.spmm(x, enc)
            torch.cuda.current_stream().wait_stream(side)
            assert rel_err(y, ref) <= 2e-3, f"side stream, splits {splits}, {tuple(w.shape)}"
    xs = [torch.randn(9, w.shape[1], device="cuda").half() for w in ws]
    ys = []
    for splits in ["4", "2", "6"]:  # queued back to back, no sync
        monkeypatch.setenv("SPINFER_SPLITS", splits)
        ys += [spinfer.spmm(x, enc) for x, enc in zip(xs, encs)]
    for i, y in enumerate(ys):
        w, x = ws[i % 3], xs[i % 3]
        assert rel_err(y, x.double() @ w.double().t()) <= 2e-3, f"queued call {i}"


def adversarial(name, m=200, k=700):
    w = torch.zeros(m, k, device="cuda")
    if name == "one_dense_group_tile":
        w[64:128, 128:192] = torch.randn(64, 64, device="cuda")
    elif name == "empty_rows":
        w = torch.randn(m, k, device="cuda")
        w[::3] = 0
        w[70:140] = 0
    elif name == "dense_first_column":
        w[:, 0] = torch.randn(m, device="cuda")
        w[5, 300] = 1.0
    elif name == "one_dense_row":
        w[77] = torch.randn(k, device="cuda")
    elif name == "checkerboard_group_tiles":
        for r in range(0, m, 128):
            for c in range(0, k, 128):
                w[r:r + 64, c:c + 64] = torch.randn(min(64, m - r), min(64, k - c), device="cuda")
    elif name == "last_row_and_column":
        w[-1] = torch.randn(k, device="cuda")
        w[:, -1] = torch.randn(m, device="cuda")
    w[w == 0] = 0.0  # +0.0 everywhere it is empty
    return w


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["one_dense_group_tile", "empty_rows", "dense_first_column",
                                  "one_dense_row", "checkerboard_group_tiles", "last_row_and_column"])
def test_adversarial_patterns(name, dtype):
    check(adversarial(name).to(dtype), [1, 8, 33], dtype)


def test_all_zero_weight_gives_bias():
    w = torch.zeros(130, 260, dtype=torch.float16, device="cuda")
    enc = TCABME.from_dense(w)
    x = torch.randn(5, 260, device="cuda").half()
    b = torch.randn(130, device="cuda").half()
    assert torch.equal(spmm_poisoned(x, enc, b), b.expand(5, 130))


def test_large_n_and_deterministic():
    w = random_sparse((1000, 2048), 0.5, torch.float16, device="cuda")
    check(w, [1000, 4096], torch.float16)
    enc = TCABME.from_dense(w)
    x = torch.randn(8, 2048, device="cuda").half()
    assert torch.equal(spinfer.spmm(x, enc), spinfer.spmm(x, enc))


def test_wrapper_batch_dims_noncontiguous_and_empty():
    w = random_sparse((96, 200), 0.5, torch.bfloat16, device="cuda")
    enc = TCABME.from_dense(w)
    x = torch.randn(2, 3, 200, device="cuda").bfloat16()
    assert spinfer.spmm(x, enc).shape == (2, 3, 96)
    assert rel_err(spinfer.spmm(x, enc), x.double() @ w.double().t()) <= 1e-2
    xt = torch.randn(200, 5, device="cuda").bfloat16().t()  # non-contiguous
    assert rel_err(spinfer.spmm(xt, enc), xt.double() @ w.double().t()) <= 1e-2
    xo = torch.randn(1, 201, device="cuda").bfloat16()[:, 1:]  # misaligned storage offset
    assert rel_err(spinfer.spmm(xo, enc), xo.double() @ w.double().t()) <= 1e-2
    assert spinfer.spmm(torch.randn(0, 200, device="cuda").bfloat16(), enc).shape == (0, 96)


def test_eager_calls_go_past_the_dispatcher_only_where_it_adds_nothing(monkeypatch):
    """An eager call with nothing for the dispatcher to do runs the kernel through the extension's
    entry point (csrc/eager.h), bit for bit the op's result; a dispatch mode, a torch function
    mode or an x that autograd follows takes the op, and the mode sees it. The profiler still
    names the call."""
    w = random_sparse((300, 520), 0.6, torch.float16, device="cuda")
    enc = TCABME.from_dense(w)
    b = torch.randn(300, device="cuda").half()
    x = torch.randn(2, 3, 520, device="cuda").half()
    ref = x.double() @ w.double().t() + b.double()
    op = torch.ops.spinfer.spmm(x.reshape(6, 520), enc.bitmap, enc.values, enc.gtile_offset, 300, 520, 64, 64,
                                enc.max_run, b, 0, enc.row_offset).view(2, 3, 300)
    counting = count_entry_point_calls(monkeypatch)
    y = spinfer.spmm(x, enc, b)
    assert counting.calls == ["spmm"] and y.shape == (2, 3, 300) and torch.equal(y, op)
    assert rel_err(y, ref) <= 2e-3
    names, y = seen_ops(lambda: spinfer.spmm(x, enc, b))
    assert counting.calls == ["spmm"] and "spinfer.spmm.default" in names and torch.equal(y, op)
    with torch.device("cuda"):  # a torch function mode
        assert torch.equal(spinfer.spmm(x, enc, b), op) and counting.calls == ["spmm"]
    xg = x.clone().requires_grad_()
    y = spinfer.spmm(xg, enc, b)
    assert y.grad_fn is not None and counting.calls == ["spmm"] and torch.equal(y.detach(), op)
    with torch.no_grad():
        assert torch.equal(spinfer.spmm(xg, enc, b), op) and counting.calls == ["spmm", "spmm"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        spinfer.spmm(x, enc, b)
    assert "spinfer::spmm" in [e.name for e in prof.events()] and counting.calls[-1] == "spmm"


def test_cuda_graph_capture():
    w = random_sparse((500, 1024), 0.7, torch.float16, device="cuda")
    enc = TCABME.from_dense(w)
    b = torch.randn(500, device="cuda").half()
    x = torch.randn(4, 1024, device="cuda").half()
    spinfer.spmm(x, enc, b)  # warm up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = spinfer.spmm(x, enc, b)
    for _ in range(2):
        x.copy_(torch.randn(4, 1024, device="cuda").half())
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(y, x.double() @ w.double().t() + b.double()) <= 2e-3


def test_torch_compile_fullgraph():
    w = random_sparse((256, 512), 0.5, torch.float16, device="cuda")
    enc = TCABME.from_dense(w)

    @torch.compile(fullgraph=True)
    def f(x):
        return torch.relu(spinfer.spmm(x, enc)) + 1

    x = torch.randn(3, 512, device="cuda").half()
    assert rel_err(f(x), torch.relu(x.double() @ w.double().t()) + 1) <= 2e-3


def test_bad_input_is_rejected_before_launch():
    w = random_sparse((64, 128), 0.5, torch.float16, device="cuda")
    enc = TCABME.from_dense(w)
    with pytest.raises(ValueError, match="128"):
        spinfer.spmm(torch.randn(2, 127, device="cuda").half(), enc)
    # (an eager CUDA call leaves these to the op's C++ checks, which name dtypes as Python does)
    with pytest.raises(TypeError, match="x is torch.bfloat16 but the weight is torch.float16; cast x"):
        spinfer.spmm(torch.randn(2, 128, device="cuda").bfloat16(), enc)
    with pytest.raises(TypeError, match="bias is torch.float32 but x is torch.float16"):
        spinfer.spmm(torch.randn(2, 128, device="cuda").half(), enc, torch.zeros(64, device="cuda"))
    with pytest.raises(ValueError, match=r"bias must have shape \(64,\)"):
        spinfer.spmm(torch.randn(2, 128, device="cuda").half(), enc, torch.zeros(63, device="cuda").half())
    with pytest.raises(ValueError, match="cpu|cuda"):
        spinfer.spmm(torch.randn(2, 128).half(), enc)
    enc16 = TCABME.from_dense(w, group_tile=(32, 32))
    with pytest.raises(ValueError, match=r"GroupTile \(64, 64\)"):
        spinfer.spmm(torch.randn(2, 128, device="cuda").half(), enc16)


def test_direct_op_call_with_bad_arrays_raises():
    """torch.ops.spinfer.spmm called directly reaches the C++ checks (in a subprocess: see
    run_direct_op_calls)."""
    out = run_direct_op_calls(
        "from spinfer.format import TCABME\n"
        "enc = TCABME.from_dense(torch.randn(64, 128, device='cuda').half())\n"
        "try:\n"
        "    torch.ops.spinfer.spmm(torch.randn(2, 128, device='cuda').half(), enc.bitmap[:-1],\n"
        "                           enc.values, enc.gtile_offset, 64, 128, 64, 64, enc.max_run)\n"
        "except ValueError as e:\n"
        "    print('ValueError:', e)\n"
    )
    assert "ValueError" in out and "bitmap" in out


def test_corrupt_offsets_stay_in_bounds():
    """Arrays that skipped validation give garbage, never an out-of-bounds access (the
    sanitizer run in scripts/device_check.sh checks the same under memcheck)."""
    w = random_sparse((256, 512), 0.5, torch.float16, device="cuda")
    enc = TCABME.from_dense(w)
    off = enc.gtile_offset.clone()
    off[3] = 2**31 - 1
    off[5] = -1000
    bm = enc.bitmap.clone()
    bm[7] = -1
    x = torch.randn(4, 512, device="cuda").half()
    garbage = torch.ops.spinfer.spmm(x, bm, enc.values, off, 256, 512, 64, 64, enc.max_run)
    torch.ops.spinfer.spmm(x, enc.bitmap, enc.values, enc.gtile_offset, 256, 512, 64, 64, 8)  # too small a max_run
    torch.cuda.synchronize()  # an out-of-bounds access would surface here as a CUDA error
    assert garbage.shape == (4, 256)
    # the context is still healthy: a valid call right after is exact
    assert rel_err(spinfer.spmm(x, enc), x.double() @ w.double().t()) <= 2e-3
