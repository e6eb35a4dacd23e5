"""Compression study (scipy sizes read from scipy objects, closed forms, crossovers, plot) and the
roofline model (intensities, ceilings, measured points, plot), plus the bench front door."""

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from spinfer.analysis import compression as C
from spinfer.analysis import roofline as R
from spinfer.bench.__main__ import main as bench_main
from spinfer.quant import LowBitWeight
from spinfer.format import TCABME

DOCS_CSV = Path(__file__).resolve().parents[1] / "docs" / "spmm-h100-2026-11-22.csv"
LOWBIT_CSV = DOCS_CSV.with_name("lowbit-h100-2026-11-22.csv")


def sparse_weight(m, k, s):
    w = torch.randn(m, k).half()
    w[w.view(torch.int16) == 0] = 1.0
    return w.masked_fill(torch.rand(m, k) < s, 0.0)


def test_measured_sizes_match_closed_forms_and_scipy_objects():
    m, k = 300, 500
    w = sparse_weight(m, k, 0.6)
    nnz = int((w.view(torch.int16) != 0).sum())
    b = C.format_bytes(w)
    # scipy objects, read back independently: 2 B values (int16 patterns), int32 indices
    csr = sp.csr_matrix(w.view(torch.int16).numpy())
    assert b["csr"] == csr.data.nbytes + csr.indices.nbytes + csr.indptr.nbytes
    assert b["csr"] == 2 * nnz + 4 * nnz + 4 * (m + 1)
    assert b["csc"] == 2 * nnz + 4 * nnz + 4 * (k + 1)
    assert b["coo"] == 2 * nnz + 4 * nnz + 4 * nnz
    assert b["bsr"] >= 2 * m * k  # random sparsity leaves no 16x16 block empty
    assert b["tiled-csl"] == 4 * (math.ceil(m / 64) * math.ceil(k / 64) + 1) + 4 * nnz
    enc = TCABME.from_dense(w)
    assert b["tca-bme"] == enc.storage_bytes().total
    assert b["tca-bme-eq9"] == enc.storage_bytes().eq9
    assert b["w4-g128"] == m * k // 2 + 2.5 * m * math.ceil(k / 128)  # fp16 scales, 4-bit zeros
    # SparTA: the expectation matches the count on a large random matrix
    big = C.format_bytes(sparse_weight(512, 1024, 0.5))
    assert big["sparta-expected"] == pytest.approx(big["sparta"], rel=0.01)


def test_sparta_remainder_counts_only_what_2_4_cannot_hold():
    mask = np.zeros((2, 8), bool)
    mask[0, :4] = True  # a full group: 2 go to the remainder
    mask[1, 4:7] = True  # three in a group: 1
    assert C.sparta_counted_remainder(mask) == 3


def test_sweep_crossover_and_plot(tmp_path):
    rows = C.sweep((256, 512), [0.0, 0.3, 0.5, 0.7, 0.9])
    assert rows[2]["tca-bme"] == pytest.approx(2 / (1 + 1 / 8), rel=0.03)
    assert C.crossover(rows, "csr") == 0.0  # TCA-BME beats CSR everywhere
    x = C.crossover(rows, "w4-g128")
    assert 0.7 < x < 0.9  # 4-bit (3.8x) is overtaken between 70% and 90%
    path = tmp_path / "cr.png"
    drawn = C.plot(rows, path)
    # the expected series: scipy's four, the tiled formats, TCA-BME measured and by eq. 9, low-bit
    assert drawn == ["dense", "csr", "csc", "coo", "bsr", "tiled-csl", "sparta", "tca-bme-eq9", "tca-bme",
                     "w8-g128", "w4-g128"]
    assert C.plot([{k: v for k, v in r.items() if k != "bsr"} for r in rows], tmp_path / "no-bsr.png")[4] == "tiled-csl"
    import matplotlib.image as mpimg

    img = mpimg.imread(path)
    assert img.shape[0] > 300 and img.shape[1] > 500 and img.std() > 0.01  # a non-blank image


def test_compression_bad_input():
    with pytest.raises(ValueError, match="sparsity"):
        C.sweep((64, 64), [1.5])
    with pytest.raises(ValueError, match="2-D"):
        C.format_bytes(torch.zeros(4).half())
    with pytest.raises(TypeError, match="float16"):
        C.format_bytes(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="1x1"):
        C.sweep((0, 64), [0.5])


def test_roofline_intensities_and_ceilings():
    assert R.intensity_dense(4096, 4096, 1) == pytest.approx(2 * 4096 * 4096 / (2 * 4096 * 4096 + 4 * 4096), rel=1e-9)
    assert R.intensity_spmm(4096, 4096, 8, 1.0) == pytest.approx(R.intensity_dense(4096, 4096, 8))
    assert R.intensity_optimal(4096, 4096, 8, 0.5) > R.intensity_spmm(4096, 4096, 8, 1.77)
    c = R.Ceilings(bandwidth=2e12, flops=500e12)
    assert R.attainable(1.0, c) == 2e12 and R.attainable(1e6, c) == 500e12
    with pytest.raises(ValueError, match="positive"):
        R.Ceilings(bandwidth=-1, flops=1)
    with pytest.raises(ValueError, match="sparsity"):
        R.intensity_optimal(8, 8, 8, 1.0)


def test_roofline_points_and_plot(tmp_path):
    pts = R.points_from_bench_csv(DOCS_CSV, max_n=16)
    kinds = {p["kind"] for p in pts}
    assert kinds == {"cuBLAS", "spmm 30%", "spmm 40%", "spmm 50%", "spmm 60%", "spmm 70%"}
    c = R.Ceilings()
    fr = [R.roof_fraction(p, c) for p in pts]
    assert all(0 < f < 1.05 for f in fr)
    placed = R.plot(c, pts, tmp_path / "roof.png")
    assert (tmp_path / "roof.png").stat().st_size > 20_000
    # One label per series and N, at that group's fastest point.
    groups = {(p["kind"], p["N"]) for p in pts}
    assert sorted((kind, n) for kind, n, _, _ in placed) == sorted(groups)
    for kind, n, x, y in placed:
        assert y == max(p["flops"] for p in pts if (p["kind"], p["N"]) == (kind, n)) / 1e12
    assert {p["device"] for p in pts} == {"NVIDIA H100 80GB HBM3"}  # the CSV's device column: the title's
    assert R.plot(c, pts, tmp_path / "bare.png", label_points=False) == []


def test_roofline_lowbit_points(tmp_path):
    from spinfer.analysis.compression import lowbit_bytes

    # Closed form: 4-bit g128 on 4096x4096 at N=1 moves 8 MiB of integers, 512 KiB of scale/zero
    # pairs, x and y.
    m = k = 4096
    assert lowbit_bytes(m, k, 4, 128) == m * k // 2 + 2.5 * m * (k // 128)
    assert lowbit_bytes(m, k, 4, 128, integer_zeros=False) == lowbit_bytes(m, k, 8, 128) - m * k // 2 == \
        m * k // 2 + 4 * m * (k // 128)
    assert R.intensity_lowbit(m, k, 1, 4, 128) == pytest.approx(2 * m * k / (m * k / 2 + 2.5 * m * 32 + 2 * k + 2 * m))
    # the format's own sizes, rows that fill whole tiles: RTN's zeros are 4-bit integers
    for bits, g in ((4, 128), (2, 64), (8, 128)):
        q = LowBitWeight.quantize(torch.randn(128, 512).half(), bits, g)
        assert q.storage_bytes().total == lowbit_bytes(128, 512, bits, g), (bits, g)
    assert R.intensity_lowbit(m, k, 8, 2, 64) > R.intensity_lowbit(m, k, 8, 4, 128) > R.intensity_dense(m, k, 8)
    with pytest.raises(ValueError, match="bits"):
        R.intensity_lowbit(m, k, 1, 3, 128)
    with pytest.raises(ValueError, match="group"):
        R.intensity_lowbit(m, k, 1, 4, 0)
    pts = R.points_from_lowbit_csv(LOWBIT_CSV, max_n=16)
    assert {p["kind"] for p in pts} == {"w4 g128", "w8 g128", "w2 g64", "w4 g32", "w1 g128"}
    assert max(p["N"] for p in pts) == 16
    c = R.Ceilings()
    assert all(0 < R.roof_fraction(p, c) < 1.05 for p in pts)
    summary = R.roof_summary(pts + R.points_from_bench_csv(DOCS_CSV, max_n=16), c)
    lo, med, hi = summary["w4 g128"]
    assert 0 < lo <= med <= hi < 1.05 and "cuBLAS" in summary and "spmm 50%" in summary
    # A CSV row turned into a point by hand: the plot's y is dense-equivalent FLOP/s.
    csv_path = tmp_path / "lb.csv"
    csv_path.write_text("M,K,N,bits,group,lowbit_us\n4096,4096,1,4,128,10.0\n4096,4096,1,8,None,20.0\n")
    a, b = R.points_from_lowbit_csv(csv_path)
    assert a["flops"] == pytest.approx(2 * m * k / 10e-6) and a["kind"] == "w4 g128"
    assert b["kind"] == "w8 gch" and b["intensity"] == pytest.approx(R.intensity_lowbit(m, k, 1, 8, k))


def test_bench_front_door(tmp_path, capsys):
    assert bench_main(["compression", "--quick", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "compression.csv").exists() and (tmp_path / "compression.png").exists()
    assert "TCA-BME overtakes" in capsys.readouterr().out
    assert bench_main(["roofline", "--csv", str(DOCS_CSV), "--bandwidth", "3000", "--flops", "800",
                       "--out", str(tmp_path)]) == 0
    assert "% of roof" in capsys.readouterr().out
    assert bench_main(["roofline", "--csv", str(DOCS_CSV), "--lowbit-csv", str(LOWBIT_CSV),
                       "--shapes", "28672x8192,4096x14336", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "w4 g128" in out and "median" in out and " 4096  4096 " not in out
    assert bench_main(["roofline", "--csv", str(DOCS_CSV), "--shapes", "1x1", "--out", str(tmp_path)]) == 2
    assert bench_main(["roofline", "--csv", str(DOCS_CSV), "--shapes", "big", "--out", str(tmp_path)]) == 2
    assert bench_main(["roofline", "--csv", str(DOCS_CSV), "--bandwidth", "3000", "--out", str(tmp_path)]) == 2
    assert bench_main(["nonsense"]) == 2
    assert bench_main(["e2e", "--tiny", "--device", "cpu", "--layers", "2", "--batches", "1,2", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "sparse50" in out and "sparse70" in out and "w4" in out and "lowbit->lowbit" in out
    assert bench_main(["e2e", "--tiny", "--device", "cpu", "--layers", "1", "--batches", "1", "--steps", "2",
                       "--variants", "dense,sparse50+tuned,w4+tuned"]) == 0
    assert "sparse50+tuned" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown variant"):
        bench_main(["e2e", "--tiny", "--device", "cpu", "--layers", "1", "--batches", "1", "--steps", "2",
                    "--variants", "dense,fast+tuned"])
    assert bench_main(["e2e", "--tiny", "--device", "cpu", "--layers", "1", "--batches", "1", "--steps", "2",
                       "--variants", "dense,sparse50,w4,w2g64", "--fused", "--glue", "pdl"]) == 0
    out = capsys.readouterr().out  # the CPU runs every glue mode's functions eagerly
    assert "fused qkv and gate_up" in out and "w4" in out and "w2g64" in out
    if not torch.cuda.is_available():
        assert bench_main(["lowbit", "--quick"]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    assert bench_main(["compression", "--shape", "12by4"]) == 2


def test_lowbit_summary_covers_only_the_issue_shapes(capsys):
    """Rows of extra shapes (here a slow 1024x4096) stay out of the geomean the summary prints."""
    from spinfer.bench.lowbit import SHAPES, print_summary

    def row(m, k, speedup):
        return {"M": m, "K": k, "N": 1, "bits": 4, "group": 128, "speedup": speedup, "pct_copy": 50.0,
                "int4_speedup": None}

    print_summary([row(m, k, 2.0) for m, k in SHAPES] + [row(1024, 4096, 0.5)])
    out = capsys.readouterr().out
    assert "4-bit g128  N=1    geomean  2.00x  (min 2.00x" in out


def test_steady_time_measures_a_suspect_cell_again():
    """A time above its bound is measured again (the least kept); if every try stays above, the
    cell is marked suspect. Without a bound, one measurement."""
    from spinfer.bench import steady_time

    def measure(values):
        it = iter(values)
        calls = []
        return (lambda: calls.append(1) or next(it)), calls

    fn, calls = measure([400e-6, 45e-6, 44e-6])
    assert steady_time(fn, bound=88e-6) == (45e-6, False) and len(calls) == 2
    fn, calls = measure([400e-6, 390e-6, 410e-6, 1.0])
    assert steady_time(fn, bound=88e-6) == (390e-6, True) and len(calls) == 3
    fn, calls = measure([80e-6, 1.0])
    assert steady_time(fn, bound=88e-6) == (80e-6, False) and len(calls) == 1  # within the bound: kept
    fn, calls = measure([400e-6, 1.0])
    assert steady_time(fn) == (400e-6, False) and len(calls) == 1
    fn, calls = measure([400e-6, 45e-6, 1.0])
    assert steady_time(fn, tries=2) == (45e-6, False) and len(calls) == 2


def test_time_against_cublas_flags_a_slow_op_and_measures_it_three_times():
    """On the CPU clock: an op far above 2x its previous-N time is measured three times and
    comes back with a warning naming it; cuBLAS within its bound, and rows past N = 64, are
    measured once and carry none."""
    import time

    from spinfer.bench import time_against_cublas

    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.002)

    cpu = torch.device("cpu")
    t_ref, t_op, warnings = time_against_cublas(lambda: None, slow, cpu, 3, 8, 1.0, (1, 1e-5), "the op")
    assert t_op >= 0.002 and t_ref < 1.0 and len(calls) == 3 * (5 + 3)  # warm-up 5 + reps 3, three times
    assert len(warnings) == 1 and warnings[0].startswith("the op took") and "previous N" in warnings[0]
    calls.clear()
    assert time_against_cublas(lambda: None, slow, cpu, 3, 128, 1.0, (64, 1e-5), "the op")[2] == []
    assert len(calls) == 5 + 3


def test_op_bound_catches_a_doubled_decode_cell_and_spares_the_compute_bound_step():
    """A decode-size row at 2.15x its previous N (a disturbed median, sixty-first session) is measured
    again; the N = 32 -> 64 step, where the fused low-bit kernels grew by up to 2.05x, is not."""
    from spinfer.bench import op_bound, steady_time

    assert [op_bound(n) for n in (1, 8, 16, 32, 33, 64)] == [2.0] * 4 + [3.0] * 2
    medians = iter([57.9e-6, 26.7e-6])
    assert steady_time(lambda: next(medians), bound=op_bound(16) * 26.9e-6) == (26.7e-6, False)
    assert steady_time(lambda: 58.0e-6, bound=op_bound(64) * 28.3e-6) == (58.0e-6, False)


def test_summaries_leave_out_suspect_cells(capsys):
    """A row whose timing stayed suspect (cuBLAS or the op) is neither in a geomean nor behind a verdict: the
    low-bit summary says the line is over fewer shapes and not judged, the SpMM one names it."""
    from spinfer.bench import lowbit, spmm

    def lrow(m, k, speedup, suspect=False):
        return {"M": m, "K": k, "N": 8, "bits": 8, "group": 128, "speedup": speedup, "pct_copy": 50.0,
                "int4_speedup": None, "timing_suspect": suspect}

    rows = [lrow(m, k, 1.5) for m, k in lowbit.SHAPES[:-1]] + [lrow(*lowbit.SHAPES[-1], 13.4, True)]
    lowbit.print_summary(rows)
    out = capsys.readouterr().out
    m, k = lowbit.SHAPES[-1]
    assert "8-bit g128  N=8    geomean  1.50x" in out and "met" not in out
    assert f"over 3 of 4 shapes (timing suspect on {m}x{k}): not judged" in out

    def srow(m, k, n, speedup, suspect=False):
        return {"M": m, "K": k, "N": n, "sparsity": 0.5, "speedup": speedup, "pct_copy": 60.0,
                "timing_suspect": suspect}

    rows = [srow(m, k, n, 1.2) for m, k in spmm.QUICK_SHAPES for n in (1, 8)]
    rows[-1] = srow(*spmm.QUICK_SHAPES[-1], 8, 9.0, True)
    spmm.print_summary(rows)
    out = capsys.readouterr().out
    m, k = spmm.QUICK_SHAPES[-1]
    assert f"left out, timing suspect: {m}x{k} N=8" in out
    assert "geomean 1.20x cuBLAS, min 1.20x, max 1.20x" in out and "(7 cases)" in out


def test_e2e_fused_layer_equals_the_unfused_one():
    """The fused decoder layer (one qkv and one gate_up projection) computes what the unfused one
    does when its weights are the concatenations, over several decode steps of the KV cache."""
    from spinfer.bench.e2e import DecoderLayer

    torch.manual_seed(0)
    hidden, inter, heads, kv, max_len, batch = 64, 96, 8, 2, 6, 3
    plain = DecoderLayer(hidden, inter, heads, kv, max_len, batch).double()
    fused = DecoderLayer(hidden, inter, heads, kv, max_len, batch, fused=True).double()
    with torch.no_grad():
        fused.qkv_proj.weight.copy_(torch.cat([plain.q_proj.weight, plain.k_proj.weight, plain.v_proj.weight]))
        fused.gate_up_proj.weight.copy_(torch.cat([plain.gate_proj.weight, plain.up_proj.weight]))
        fused.o_proj.weight.copy_(plain.o_proj.weight)
        fused.down_proj.weight.copy_(plain.down_proj.weight)
        for step in range(4):
            pos = torch.tensor([step])
            mask = (torch.arange(max_len) <= step).view(1, 1, 1, -1)
            x = torch.randn(batch, 1, hidden, dtype=torch.float64)
            torch.testing.assert_close(fused(x, pos, mask), plain(x, pos, mask))
    linears = [sum(isinstance(m, torch.nn.Linear) for m in layer.modules()) for layer in (plain, fused)]
    assert linears == [7, 4]


@pytest.mark.parametrize("fused", [False, True])
def test_e2e_prefill_equals_token_by_token_decode(fused):
    """A prompt through DecoderLayer.prefill (causal attention over it) gives each position the
    output the one-token decode steps give, and leaves the same keys and values in the cache."""
    from spinfer.bench.e2e import DecoderLayer

    torch.manual_seed(1)
    hidden, inter, heads, kv, t = 64, 96, 8, 2, 5
    layer = DecoderLayer(hidden, inter, heads, kv, t, 2, fused=fused).double()
    x = torch.randn(2, t, hidden, dtype=torch.float64)
    with torch.no_grad():
        out = layer.prefill(x)
        k_cache, v_cache = layer.k_cache.clone(), layer.v_cache.clone()
        layer.k_cache.zero_(), layer.v_cache.zero_()
        for step in range(t):
            mask = (torch.arange(t) <= step).view(1, 1, 1, -1)
            torch.testing.assert_close(layer(x[:, step:step + 1], torch.tensor([step]), mask), out[:, step:step + 1])
    torch.testing.assert_close(layer.k_cache, k_cache)
    torch.testing.assert_close(layer.v_cache, v_cache)


def test_e2e_prefill_cli(capsys):
    from spinfer.bench.__main__ import main as bench_main

    assert bench_main(["e2e", "--tiny", "--device", "cpu", "--layers", "1", "--batches", "", "--prefill", "16,24",
                       "--variants", "dense,sparse50,w4"]) == 0
    out = capsys.readouterr().out
    assert "p16" in out and "p24" in out and "lowbit->lowbit" in out


def test_e2e_runs_every_variant_in_bf16(monkeypatch, capsys):
    """--dtype bf16: every variant's stack, its stored weights and the step's activations are
    bf16 (decode and prefill), and its tokens come out finite."""
    import spinfer.bench.e2e as e2e
    from spinfer.bench.__main__ import main as bench_main

    seen = []  # (the model's formats, its norm's dtype, its weights' dtypes, its KV cache finite after a run)

    def recording(runner):
        def wrapped(model, *args, **kwargs):
            run, tokens = runner(model, *args, **kwargs)
            weights = {b.dtype for m in model.modules() if isinstance(m, e2e.SparseLinear) for b in m.buffers()
                       if b.is_floating_point()}
            weights |= {m.weight.dtype for m in model.modules() if isinstance(m, torch.nn.Linear)}
            run()
            seen.append((e2e.formats(model, 1), model.norm.weight.dtype, weights,
                         bool(model.layers[0].kv_cache.isfinite().all())))
            return run, tokens
        return wrapped

    monkeypatch.setattr(e2e, "decode_runner", recording(e2e.decode_runner))
    monkeypatch.setattr(e2e, "prefill_runner", recording(e2e.prefill_runner))
    assert bench_main(["e2e", "--tiny", "--device", "cpu", "--layers", "1", "--batches", "1", "--prefill", "8",
                       "--steps", "2", "--variants", "dense,sparse50,spmm70,w4", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "bf16, eager" in out and "p8" in out
    assert len(seen) == 8, seen  # 4 variants, decode and prefill
    assert {f for f, *_ in seen} >= {"dense nn.Linear", "7 tca-bme->spmm", "7 lowbit->lowbit"}, seen
    assert all(norm == torch.bfloat16 and weights == {torch.bfloat16} and finite for _, norm, weights, finite in seen), seen


def test_e2e_attention_equals_attention_over_repeated_kv_heads():
    """The decode step's grouped-query attention on the cache, with the Stack's additive mask,
    equals plain attention over the cache with each KV head repeated for its query heads and a
    boolean mask of the positions written so far."""
    import torch.nn.functional as F

    from spinfer.bench.e2e import Stack

    torch.manual_seed(2)
    hidden, inter, heads, kv, max_len, batch = 64, 96, 8, 2, 7, 3
    stack = Stack(1, hidden, inter, heads, kv, max_len, batch).double()
    layer = stack.layers[0]
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(batch, 1, hidden, dtype=torch.float64)
            pos = torch.tensor([step])
            out = stack(x, pos)
            q = layer._qkv(layer.norm1(x))[0]
            rep = heads // kv
            mask = (torch.arange(max_len) <= step).view(1, 1, 1, -1)
            a = F.scaled_dot_product_attention(q, layer.k_cache.repeat_interleave(rep, dim=1),
                                               layer.v_cache.repeat_interleave(rep, dim=1), attn_mask=mask)
            torch.testing.assert_close(out, stack.norm(layer._rest(x, a)))


def test_bench_weight_options_and_the_gpu_check():
    """bits:group lists (bench lowbit --configs, bench to_dense --quants), and the GPU-only
    benches' refusal without a GPU."""
    from spinfer.bench import parse_quants, require_cuda
    from spinfer.bench.__main__ import main as bench_main

    assert parse_quants("1:128,4:64") == [(1, 128), (4, 64)] and parse_quants("") == []
    for bad in ("4", "4:x"):
        with pytest.raises(SystemExit, match="BITS:GROUP"):
            parse_quants(bad)
    if not torch.cuda.is_available():
        assert require_cuda("spmm") is False
        for bench in ("spmm", "lowbit", "to_dense", "policy"):
            assert bench_main([bench]) == 2


def test_e2e_glue_falls_back_to_torch_when_compile_fails(monkeypatch, capsys):
    """The benchmark's compiled glue (CUDA only) goes on with torch's kernels, and says so, when
    torch.compile cannot build it (no Triton)."""
    import spinfer.bench.e2e as e2e

    def broken(*args, **kwargs):
        raise RuntimeError("no triton")

    monkeypatch.setattr(e2e, "_GLUE", {"mode": "fused"})
    monkeypatch.setattr(e2e, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    x, r, w = torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64), torch.rand(8, dtype=torch.float64)
    s, h = e2e._compiled_call(e2e.add_rms_norm, x, r, w)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(h, e2e.rms_norm(x + r, w))
    assert e2e._GLUE["mode"] == "eager" and "torch.compile of add_rms_norm failed" in capsys.readouterr().err


@pytest.mark.parametrize("glue", ["eager", "pdl"])
def test_e2e_stack_adds_each_residual_in_the_next_norm(monkeypatch, glue):
    """The Stack's step, which leaves each layer's MLP output to be added inside the next layer's
    norm, equals running the layers one after another, and writes the same caches. With the pdl
    glue the step's attention is e2e.decode_attention (on the CPU: index_copy_ and SDPA with a mask
    made from pos); the layers' reference below runs the eager glue's SDPA on the cache views."""
    import spinfer.bench.e2e as e2e
    from spinfer.bench.e2e import Stack

    monkeypatch.setattr(e2e, "_GLUE", {"mode": glue})
    torch.manual_seed(3)
    hidden, inter, heads, kv, max_len, batch = 64, 96, 8, 2, 5, 2
    for fused in (False, True):
        stack = Stack(3, hidden, inter, heads, kv, max_len, batch, fused).double()
        ref = copy.deepcopy(stack)
        with torch.no_grad():
            for step in range(3):
                x = torch.randn(batch, 1, hidden, dtype=torch.float64)
                pos = torch.tensor([step])
                mask = torch.zeros(max_len, dtype=torch.float64).masked_fill(torch.arange(max_len) > step,
                                                                              float("-inf")).view(1, 1, 1, -1)
                h = x
                e2e._GLUE["mode"] = "eager"
                for layer in ref.layers:
                    h = layer(h, pos, mask)
                e2e._GLUE["mode"] = glue
                torch.testing.assert_close(stack(x, pos), ref.norm(h))
        for a, b in zip(stack.layers, ref.layers):
            torch.testing.assert_close(a.kv_cache, b.kv_cache)
            assert a.kv_cache[:, :, :, 3:].abs().sum() == 0 and a.kv_cache[:, :, :, :3].abs().sum() > 0


def test_pdl_glue_replaces_e2e_functions_by_name():
    """e2e._glue dispatches the pdl glue by function name: every kernel must name one of e2e's
    glue functions with the same parameters, or a rename would silently drop it."""
    import inspect

    import spinfer.bench.e2e as e2e
    from spinfer.bench import pdl_glue

    for name, kernel in pdl_glue.KERNELS.items():
        fn = getattr(e2e, name)
        assert list(inspect.signature(fn).parameters) == [
            p.name for p in inspect.signature(kernel).parameters.values()
            if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD], name


def test_lowbit_summary_names_the_targets_dtype(capsys):
    """bench lowbit --dtype bf16 prints its geomeans against issue 4's targets, which are ratios to
    cuBLAS fp16: the verdict says so, and an fp16 run's does not."""
    from spinfer.bench.lowbit import SHAPES, print_summary

    rows = [dict(M=m, K=k, N=1, bits=4, group=128, speedup=3.0, pct_copy=80.0, int4_speedup=None,
                 timing_suspect=False) for m, k in SHAPES]
    print_summary(rows, "bf16")
    out = capsys.readouterr().out
    assert "x cuBLAS bf16" in out and "fp16 target >= 3.3x: MISSED" in out
    print_summary(rows)
    out = capsys.readouterr().out
    assert "x cuBLAS fp16" in out and "  target >= 3.3x: MISSED" in out and "fp16 target" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the test below")
def test_bench_host_says_it_needs_a_gpu(capsys):
    assert bench_main(["host"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.cuda
def test_bench_host_reports_every_call_against_f_linear(capsys):
    assert bench_main(["host", "--rounds", "1", "--reps", "20"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.endswith("x F.linear")]
    assert len(rows) == 9 and "1.00x F.linear" in rows[0] and any("SparseLinear w4" in r for r in rows)
