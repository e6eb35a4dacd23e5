"""spinfer.tuning: the split-K table (keys, persistence, lookup), the ``splits`` argument of the
public ops (checked, ignored on the CPU) and, on a GPU, that tuned and explicit factors reach
the kernels and give correct results."""

import json

import pytest
import torch

import spinfer
from spinfer import tuning
from spinfer.format import TCABME
from spinfer.ops.lowbit_mm import fused_max_n
from spinfer.quant import LowBitWeight
from tests.conftest import rel_err
from tests.test_tca_bme import random_sparse


@pytest.fixture
def table(tmp_path, monkeypatch):
    """An empty table in a fresh cache folder, forgotten afterwards."""
    monkeypatch.setenv("SPINFER_CACHE", str(tmp_path))
    tuning.clear()
    monkeypatch.setattr(tuning, "_loaded_from", None)  # read this folder's (absent) file
    yield tmp_path
    tuning.clear()
    tuning._loaded_from = None


def test_tiles_mirror_the_planners():
    assert [tuning.spmm_tile(n) for n in (1, 8, 9, 16, 17, 32, 33, 64, 65, 1000)] == [
        (8, 1), (8, 1), (16, 1), (16, 1), (32, 1), (32, 1), (64, 1), (64, 1), (128, 1), (128, 8)]
    assert [tuning.lowbit_tile(n) for n in (1, 9, 17, 32, 33, 256)] == [
        (8, 1), (16, 1), (32, 1), (32, 1), (32, 2), (32, 8)]


def test_splits_argument_is_checked_and_ignored_on_cpu():
    w = random_sparse((70, 130), 0.5, torch.float16)
    enc = TCABME.from_dense(w)
    q = LowBitWeight.quantize(torch.randn(70, 256).half(), 4, 128)
    x = torch.randn(3, 130).half()
    xq = torch.randn(3, 256).half()
    for op, wt, xx, lowest in ((spinfer.spmm, enc, x, 0), (spinfer.lowbit_mm, q, xq, -1)):
        assert torch.equal(op(xx, wt, splits=5), op(xx, wt))
        assert torch.equal(op(xx, wt, splits=0), op(xx, wt))
        assert torch.equal(op(xx, wt, splits=lowest), op(xx, wt))  # -1: lowbit_mm's balanced schedule
        with pytest.raises(ValueError, match=f"splits must be >= {lowest}"):
            op(xx, wt, splits=lowest - 1)
        with pytest.raises(TypeError, match="splits must be an int"):
            op(xx, wt, splits=2.0)
        with pytest.raises(TypeError, match="splits must be an int"):
            op(xx, wt, splits=True)


def test_table_lookup_persistence_and_clear(table, monkeypatch):
    monkeypatch.setattr(tuning, "_device_key_cached", lambda device: "GPU-X|sm90|132")
    enc = TCABME.from_dense(random_sparse((128, 256), 0.5, torch.float16))
    other = TCABME.from_dense(random_sparse((128, 256), 0.9, torch.float16))  # another max_run
    dev = torch.device("cuda", 0)
    assert tuning.spmm_splits(enc, 1, dev) == 0  # nothing tuned: the planner's choice
    tuning._record(tuning._spmm_key(dev, enc, 1), 6, save=True)
    assert tuning.spmm_splits(enc, 5, dev) == 6  # same token tile (8, 1)
    assert tuning.spmm_splits(enc, 9, dev) == 0  # tile 16
    assert other.max_run != enc.max_run and tuning.spmm_splits(other, 1, dev) == 0
    q = LowBitWeight.quantize(torch.randn(128, 256).half(), 4, 128)
    tuning._record(tuning._lowbit_key(dev, q, 40), 3, save=True)
    assert tuning.lowbit_splits(q, 64, dev) == 3 and tuning.lowbit_splits(q, 1, dev) == 0
    q8 = LowBitWeight.quantize(torch.randn(128, 256).half(), 8, 128)
    assert tuning.lowbit_splits(q8, 64, dev) == 0  # another width
    saved = json.loads((table / "splits.json").read_text())
    assert sorted(saved.values()) == [3, 6]
    # a new process reads the file
    tuning._table.clear()
    tuning._loaded_from = None
    assert tuning.spmm_splits(enc, 1, dev) == 6
    tuning.clear()
    assert tuning.spmm_splits(enc, 1, dev) == 0 and (table / "splits.json").exists()
    tuning.clear(saved=True)
    assert not (table / "splits.json").exists()


def test_figures_of_another_kernel_revision_are_not_used(table, monkeypatch):
    """The device key names the kernels' revision (the extension build's source hash): a split factor
    stored by another build (its kernels timed, not these) is not found, and one stored under this
    build's key is."""
    import types

    props = types.SimpleNamespace(name="GPU-X", major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(tuning, "_device_keys", {})
    dev = torch.device("cuda", 0)
    key = tuning.device_key(dev)
    revision = tuning.kernel_revision()
    assert key == f"GPU-X|sm90|132|{revision}" and revision == spinfer.build.cache_dir().name[len("ext-"):]
    enc = TCABME.from_dense(random_sparse((128, 256), 0.5, torch.float16))
    current = tuning._spmm_key(dev, enc, 1)
    assert current.startswith(key + "|")
    stale = current.replace(f"|{revision}|", "|0123456789abcdef|")  # another build's
    (table / "splits.json").write_text(json.dumps({stale: 6}))
    assert tuning.spmm_splits(enc, 1, dev) == 0  # the planner's rule
    tuning._loaded_from = None
    (table / "splits.json").write_text(json.dumps({stale: 6, current: 3}))
    assert tuning.spmm_splits(enc, 1, dev) == 3


def test_compiled_graphs_take_the_split_rule(table, monkeypatch):
    # torch.compile cannot trace the table's file read, which a model compiled before any eager
    # call in its process met (fullgraph=True failed there): while tracing, the lookup finds nothing.
    monkeypatch.setattr(tuning, "_device_key_cached", lambda device: "GPU-X|sm90|132")
    enc = TCABME.from_dense(random_sparse((128, 256), 0.5, torch.float16))
    dev = torch.device("cuda", 0)
    tuning._record(tuning._spmm_key(dev, enc, 1), 6, save=True)
    tuning._table.clear()
    tuning._loaded_from = None  # as in a new process: the next eager lookup reads the file

    @torch.compile(fullgraph=True, backend="aot_eager")
    def traced(x):
        return x + tuning.spmm_splits(enc, 1, dev)

    assert torch.equal(traced(torch.zeros(2)), torch.zeros(2))
    assert tuning.spmm_splits(enc, 1, dev) == 6  # eager calls still find it


def test_corrupt_or_foreign_table_is_ignored(table, monkeypatch):
    monkeypatch.setattr(tuning, "_device_key_cached", lambda device: "GPU-X")
    enc = TCABME.from_dense(random_sparse((64, 64), 0.5, torch.float16))
    key = tuning._spmm_key(torch.device("cuda", 0), enc, 1)
    (table / "splits.json").write_text("{not json")
    assert tuning.spmm_splits(enc, 1, torch.device("cuda", 0)) == 0
    tuning._loaded_from = None
    (table / "splits.json").write_text(json.dumps({key: -1, "x": "y"}))
    assert tuning.spmm_splits(enc, 1, torch.device("cuda", 0)) == 0  # -1 is low-bit only
    q = LowBitWeight.quantize(torch.randn(64, 256).half(), 4, 128)
    qkey = tuning._lowbit_key(torch.device("cuda", 0), q, 1)
    tuning._loaded_from = None
    (table / "splits.json").write_text(json.dumps({qkey: -1, tuning._lowbit_key(torch.device("cuda", 0), q, 9): -2}))
    assert tuning.lowbit_splits(q, 1, torch.device("cuda", 0)) == -1  # the balanced schedule
    assert tuning.lowbit_splits(q, 9, torch.device("cuda", 0)) == 0


def test_tuners_need_cuda_weights():
    enc = TCABME.from_dense(random_sparse((64, 64), 0.5, torch.float16))
    with pytest.raises(TypeError, match="CUDA"):
        tuning.tune_spmm(enc, [1])
    with pytest.raises(TypeError, match="CUDA"):
        tuning.tune_lowbit(LowBitWeight.quantize(torch.randn(64, 256).half(), 4, 128), [1])
    with pytest.raises(TypeError, match="TCABME"):
        tuning.tune_spmm(torch.randn(4, 4), [1])


# ---- on a GPU -------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_explicit_splits_are_exact_and_deterministic(dtype):
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    w = random_sparse((333, 4096), 0.5, dtype, device="cuda")
    enc = TCABME.from_dense(w)
    q = LowBitWeight.quantize(torch.randn(333, 4096, device="cuda").to(dtype), 4, 128)
    b = torch.randn(333, device="cuda").to(dtype)
    for n in (1, 20, 70):
        x = torch.randn(n, 4096, device="cuda").to(dtype)
        ref = x.double() @ w.double().t() + b.double()
        refq = x.double() @ q.dequantize().double().t() + b.double()
        for s in (1, 2, 3, 5, 13, 1000):  # 1000: capped at the GroupTile columns / stages
            y = spinfer.spmm(x, enc, b, splits=s)
            assert rel_err(y, ref) <= tol, f"spmm N={n} splits={s}"
            assert torch.equal(y, spinfer.spmm(x, enc, b, splits=s)), "split-K sums are deterministic"
            if n <= 256 and s <= 16:
                assert rel_err(spinfer.lowbit_mm(x, q, b, splits=s), refq) <= tol, f"lowbit N={n} splits={s}"


@pytest.mark.cuda
def test_tuned_factor_reaches_the_kernel(table):
    """A recorded factor is what a default call runs: the split-K sum's order shows it bitwise."""
    enc = TCABME.from_dense(random_sparse((256, 8192), 0.5, torch.float16, device="cuda"))
    x = torch.randn(1, 8192, device="cuda").half()
    by_split = {s: spinfer.spmm(x, enc, splits=s) for s in (1, 2, 3, 4, 6, 8)}
    differs = [s for s in by_split if not torch.equal(by_split[s], by_split[1])]
    assert differs, "no two split factors summed differently: the test cannot tell them apart"
    s = differs[0]
    tuning._record(tuning._spmm_key(x.device, enc, 1), s, save=False)
    assert torch.equal(spinfer.spmm(x, enc), by_split[s])
    tuning._record(tuning._spmm_key(x.device, enc, 1), 1, save=False)
    assert torch.equal(spinfer.spmm(x, enc), by_split[1])


@pytest.mark.cuda
def test_tune_spmm_and_lowbit_record_their_choice(table):
    enc = TCABME.from_dense(random_sparse((512, 2048), 0.5, torch.float16, device="cuda"))
    report = tuning.tune_spmm(enc, [1, 16], reps=3)
    assert set(report) == {1, 16}
    for n, r in report.items():
        assert set(r["times"]) == {0, *tuning.SPMM_CANDIDATES} and all(t > 0 for t in r["times"].values())
        assert tuning.spmm_splits(enc, n, torch.device("cuda")) == r["splits"]
        if r["splits"]:
            assert r["times"][r["splits"]] < (1 - tuning.MIN_GAIN) * r["times"][0]
    q = LowBitWeight.quantize(torch.randn(512, 2048, device="cuda").half(), 4, 128)
    rq = tuning.tune_lowbit(q, [8], reps=3)
    assert tuning.lowbit_splits(q, 8, torch.device("cuda")) == rq[8]["splits"]
    saved = json.loads((table / "splits.json").read_text())
    assert len(saved) == 3
    with pytest.raises(ValueError, match=f"N <= {fused_max_n(4)} at 4 bits"):
        tuning.tune_lowbit(q, [fused_max_n(4) + 1])
