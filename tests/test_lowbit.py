"""Weight-only low-bit format and spinfer::lowbit_mm: packing, quantizer, exact-dequantization
reference, GPTQ and HQQ importers against their own formulas, bad input, persistence, op
registration. The CUDA path runs where a GPU is present."""

import pytest
import torch

import spinfer
from spinfer.quant import LowBitWeight, pack, unpack
from spinfer.quant.lowbit import exact_integer_zeros, fragment_order, pack_bits, tile_scale_zero, unpack_bits
from tests.conftest import rel_err

BITS = [1, 2, 4, 8]
GROUPS = [32, 64, 128, 256, None]


@pytest.mark.parametrize("bits", BITS)
def test_pack_unpack_round_trip_and_bit_order(bits):
    q = torch.randint(0, 1 << bits, (70, 512), dtype=torch.uint8)
    packed = pack(q, bits)
    sc = 128 if bits == 8 else 256
    assert packed.dtype == torch.int32 and packed.shape == (2, 512 // sc, 64, sc * bits // 32)
    assert torch.equal(unpack(packed, bits, 70), q)
    assert not bool(unpack(packed, bits)[70:].any())  # padding rows hold q = 0
    # tile (row block 1, stage 1) starts at row 64, column sc, and is contiguous
    flat = packed.reshape(-1)
    tile = flat[(1 * (512 // sc) + 1) * 64 * (sc * bits // 32):][: 6 * (sc * bits // 32)]
    assert torch.equal(tile.reshape(6, -1), pack(q[64:70, sc:2 * sc].contiguous().repeat(1, 512 // sc), bits)
                       .reshape(-1, 64, sc * bits // 32)[0, :6])
    assert torch.equal(unpack_bits(pack_bits(q, bits), bits), q)
    one = torch.zeros(1, 128, dtype=torch.uint8)
    one[0, 1] = 1  # little-endian: value 1 of word 0 sits at bit `bits`
    assert int(pack_bits(one, bits)[0, 0]) == 1 << bits


def _kernel_column(bits, t, wi, p):
    """Where the fused kernel expects a value, written from the lane's point of view: lane t,
    its word wi, position p; pair (p, p + V/2) feeds A-fragment slots (0,1) or (2,3) of tile T."""
    v = 32 // bits
    s, e = p % (v // 2), p // (v // 2)
    tile = wi * (v // 4) + s // 2
    return 16 * tile + 4 * t + (2 if s % 2 else 0) + e


@pytest.mark.parametrize("bits", BITS)
def test_fragment_order_is_the_kernel_lane_layout(bits):
    order = fragment_order(bits)
    assert sorted(order.tolist()) == list(range(128))
    v = 32 // bits
    for j in range(128):
        word, p = divmod(j, v)
        assert int(order[j]) == _kernel_column(bits, word // bits, word % bits, p)
    # one explicit case per width: column 1 (tile 0, lane 0, slot 1) is the upper half of pair 0
    # of lane 0's first word, 16 bits above column 0
    one = torch.zeros(1, 256, dtype=torch.uint8)
    one[0, 1] = 1
    assert int(pack(one, bits)[0, 0, 0, 0]) == 1 << 16


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
def test_quantizer_error_is_within_half_a_step(bits, group):
    w = torch.randn(33, 512).half()
    q = LowBitWeight.quantize(w, bits, group)
    g = q.group_size
    step = q.scales.float().repeat_interleave(g, dim=1)
    err = (q.dequantize().float() - w.float()).abs()
    # half a quantization step, plus fp16 rounding of scale/zero/result
    assert bool((err <= 0.5 * step * 1.01 + 2e-3 * w.float().abs() + 1e-4).all())


def test_constant_groups_are_exact_and_odd_shapes_work():
    w = torch.full((3, 64), 0.25).half()
    w[1], w[2] = -0.3, 0.0
    assert torch.equal(LowBitWeight.quantize(w, 2, 32).dequantize(), w)
    w = torch.randn(77, 1000).half()  # odd M, K not a multiple of 128: per-channel
    q = LowBitWeight.quantize(w, 4, None)
    assert q.group_size == 1000 and q.qweight.shape == (2, 4, 64, 256 * 4 // 32)
    assert rel_err(q.dequantize(), w) < 0.15


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
def test_lowbit_mm_matches_the_dequantized_reference(bits, group, dtype):
    m, k = 67, 768
    w = torch.randn(m, k).to(dtype)
    q = LowBitWeight.quantize(w, bits, group)
    ref_w = q.dequantize().double()
    b = torch.randn(m).to(dtype)
    for n in (1, 3, 8, 16, 64, 300):
        x = torch.randn(n, k).to(dtype)
        y = spinfer.lowbit_mm(x, q, b)
        ref = x.double() @ ref_w.t() + b.double()
        assert y.shape == (n, m) and y.dtype == dtype
        assert rel_err(y, ref) <= (2e-3 if dtype == torch.float16 else 1e-2), (n, bits, group)


def random_gptq(k, m, bits, g, act_order):
    pw = 32 // bits
    q = torch.randint(0, 1 << bits, (k, m), dtype=torch.int64)
    qweight = torch.zeros(k // pw, m, dtype=torch.int64)
    for j in range(pw):
        qweight |= q[j::pw] << (bits * j)
    zeros_minus_1 = torch.randint(0, (1 << bits) - 1, (k // g, m), dtype=torch.int64)
    mz = -(-m // pw) * pw
    zpad = torch.nn.functional.pad(zeros_minus_1, (0, mz - m))
    qzeros = torch.zeros(k // g, mz // pw, dtype=torch.int64)
    for j in range(pw):
        qzeros |= zpad[:, j::pw] << (bits * j)
    to32 = lambda t: ((t + 2**31) % 2**32 - 2**31).to(torch.int32)  # uint32 bits as int32
    scales = (torch.rand(k // g, m) * 0.01 + 0.001).half()
    g_idx = torch.arange(k) // g
    if act_order:
        g_idx = g_idx[torch.randperm(k)]
    # GPTQ's own formula
    w = scales.float()[g_idx] * (q.float() - (zeros_minus_1.float()[g_idx] + 1))
    return to32(qweight), scales, to32(qzeros), g_idx, w.t()  # reference W [M, K]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_import_matches_gptq_formula(bits, act_order):
    k, m, g = 512, 72, 128
    qweight, scales, qzeros, g_idx, w_ref = random_gptq(k, m, bits, g, act_order)
    q = LowBitWeight.from_gptq(qweight, scales, qzeros, bits=bits, group_size=g, g_idx=g_idx)
    assert (q.perm is not None) == act_order
    assert rel_err(q.dequantize(), w_ref) < 1e-3
    x = torch.randn(9, k).half()
    assert rel_err(spinfer.lowbit_mm(x, q), x.double() @ w_ref.double().t()) <= 2e-3


@pytest.mark.parametrize("layout", ["flat", "matrix"])
def test_hqq_import_matches_hqq_formula(layout):
    m, k, g, bits = 40, 256, 64, 4
    W_q = torch.randint(0, 16, (m * k // g, g), dtype=torch.uint8)
    scale = (torch.rand(m * k // g, 1) * 0.02).half()
    zero = (torch.rand(m * k // g, 1) * 15).half()  # fractional zeros, as HQQ optimises them
    w_ref = ((W_q.float() - zero.float()) * scale.float()).reshape(m, k)  # HQQ's formula
    if layout == "matrix":
        W_q, scale, zero = W_q.reshape(m, k), scale.reshape(m, k // g), zero.reshape(m, k // g)
    q = LowBitWeight.from_hqq(W_q, scale, zero, bits, g, (m, k))
    assert rel_err(q.dequantize(), w_ref) < 1e-3
    x = torch.randn(6, k).half()
    assert rel_err(spinfer.lowbit_mm(x, q), x.double() @ w_ref.double().t()) <= 2e-3


def test_bad_input():
    w = torch.randn(8, 256).half()
    with pytest.raises(ValueError, match="bits"):
        LowBitWeight.quantize(w, 3, 32)
    with pytest.raises(ValueError, match="group_size"):
        LowBitWeight.quantize(w, 4, 48)
    with pytest.raises(ValueError, match="does not divide"):
        LowBitWeight.quantize(torch.randn(8, 96).half(), 4, 64)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        LowBitWeight.quantize(w.float(), 4, 32)
    with pytest.raises(ValueError, match="2-D"):
        LowBitWeight.quantize(w[0], 4, 32)
    q = LowBitWeight.quantize(w, 4, 32)
    with pytest.raises(ValueError, match="scales"):
        LowBitWeight(q.qweight, q.scales[:, :-1], q.zeros, 4, 32, (8, 256))
    with pytest.raises(ValueError, match="qweight"):
        LowBitWeight(q.qweight[:-1], q.scales, q.zeros, 4, 32, (8, 256))
    with pytest.raises(TypeError, match="zeros"):
        LowBitWeight(q.qweight, q.scales, q.zeros.float(), 4, 32, (8, 256))
    qweight, scales, qzeros, g_idx, _ = random_gptq(256, 16, 4, 128, False)
    with pytest.raises(TypeError, match="int32"):
        LowBitWeight.from_gptq(qweight.long(), scales, qzeros)
    with pytest.raises(ValueError, match="scales"):
        LowBitWeight.from_gptq(qweight, scales[:, :-1], qzeros)
    with pytest.raises(ValueError, match="qzeros"):
        LowBitWeight.from_gptq(qweight, scales, qzeros[:1])
    with pytest.raises(ValueError, match="g_idx"):
        LowBitWeight.from_gptq(qweight, scales, qzeros, g_idx=torch.full((256,), 5))
    with pytest.raises(ValueError, match="outside"):
        LowBitWeight.from_hqq(torch.full((8, 256), 16, dtype=torch.uint8), q.scales, q.zeros, 4, 32, (8, 256))
    with pytest.raises(ValueError, match=r"\[\.\.\., 256\]"):
        spinfer.lowbit_mm(torch.randn(2, 255).half(), q)
    with pytest.raises(TypeError, match="float32"):
        spinfer.lowbit_mm(torch.randn(2, 256), q)


def test_state_dict_repr_storage_and_empty_batch():
    w = torch.randn(24, 512).bfloat16()
    qweight, scales, qzeros, g_idx, _ = random_gptq(512, 24, 4, 128, True)
    frac = LowBitWeight.from_hqq(torch.randint(0, 16, (24, 512)), torch.rand(24, 4), torch.rand(24, 4) * 15, 4, 128,
                                 (24, 512))
    for q in (LowBitWeight.quantize(w, 2, 64), LowBitWeight.from_gptq(qweight, scales, qzeros, g_idx=g_idx), frac):
        back = LowBitWeight.from_state_dict(q.state_dict())
        assert torch.equal(back.dequantize(), q.dequantize())
        st = q.storage_bytes()
        arrays = [q.qweight, q.scale_zero] + ([q.perm] if q.perm is not None else [])
        assert st.total == sum(t.numel() * t.element_size() for t in arrays)
        assert st.qweight == 64 * 512 * q.bits // 8  # M padded to a 64-row tile, K=512 needs none
        assert st.scales == 64 * (512 // q.group_size) * 2  # and so are the scales and zeros: 4-bit ones
        assert st.zeros == 64 * (512 // q.group_size) * (2 if q.scale_zero.shape[-1] == 128 else 0.5)
        assert q.compression_ratio == pytest.approx(2 * 24 * 512 / st.total)
        assert "LowBitWeight(shape=(24, 512)" in repr(q)
        assert spinfer.lowbit_mm(torch.randn(0, 512).to(q.dtype), q).shape == (0, 24)
        assert spinfer.lowbit_mm(torch.randn(2, 3, 512).to(q.dtype), q).shape == (2, 3, 24)


def test_op_registration_and_compile():
    q = LowBitWeight.quantize(torch.randn(40, 256).half(), 4, 64)
    x = torch.randn(3, 256).half()
    for args in ((x, q.qweight, q.scale_zero, 4, 64, 40, 256, None, None),
                 (x, q.qweight, q.scale_zero, 4, 64, 40, 256, None, None, 0, True)):
        torch.library.opcheck(torch.ops.spinfer.lowbit_mm.default, args, test_utils=("test_schema", "test_faketensor"))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x):
        return spinfer.lowbit_mm(x, q) + 1

    assert rel_err(f(x), x.double() @ q.dequantize().double().t() + 1) <= 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_integer_zeros_are_those_the_kernel_subtracts_exactly(dtype):
    """LowBitWeight.integer_zeros lets the kernels skip their zero-point check, so it must be false
    for any zero outside the set they decode unchecked. At 1, 2 and 4 bits: the records' 4-bit zeros,
    so integers in [0, 15] (others, integers or not, keep the zeros in the dtype and take the
    check). At 8 bits: integers with magic + z exact in the dtype (fp16 [-1024, 1023]), and in
    bf16, where the kernel splits q and z at bit 7, [0, 255]."""

    def flag(zero, bits=4):
        sz = torch.stack((torch.ones(len(zero)), torch.tensor(zero, dtype=torch.float32)), -1)
        return exact_integer_zeros(tile_scale_zero(sz[:, None].to(dtype), bits), bits)

    for bits in (1, 2, 4):
        assert flag([0.0, 3.0, 15.0], bits)
        for bad in (0.5, -1.0, 16.0, -2.25, 1000.0, float("nan"), float("inf"), -float("inf")):
            assert not flag([1.0, bad], bits), (bits, bad)
    assert flag([0.0, 0.0, 5.0, 127.0, 128.0, 255.0], bits=8)
    for bad in (-1.0, 256.0, 127.5, float("nan")):  # -1 and 256 are fine in fp16, not in bf16
        assert flag([1.0, bad], bits=8) == (dtype == torch.float16 and bad in (-1.0, 256.0)), bad
    assert flag([-1024.0, 1023.0], bits=8) == (dtype == torch.float16)
    for bits in BITS:  # RTN stores integer zeros in [0, 2^bits - 1]
        q = LowBitWeight.quantize(torch.randn(70, 512).to(dtype), bits, 64)
        assert q.integer_zeros and bool(q.zeros.any()), bits
        assert q.scale_zero.shape[-1] == (80 if bits <= 4 else 128), bits
    frac = LowBitWeight.from_hqq(torch.randint(0, 16, (8, 256)), torch.rand(8, 4).to(dtype),
                                 (torch.rand(8, 4) * 15 + 0.1).to(dtype), 4, 64, (8, 256))
    assert frac.cached_integer_zeros() is None and not frac.integer_zeros
    assert frac.cached_integer_zeros() is False  # cached


def test_integer_zeros_follow_in_place_edits_and_new_tensors():
    """A stale True would let the kernel skip the check that fractional zeros need: at 8 bits the
    cache follows scale_zero's version counter (views share it) and the tensor's identity. At 1,
    2 and 4 bits the records' width decides, which no edit changes."""
    q = LowBitWeight.quantize(torch.randn(64, 256).half(), 8, 64)
    assert q.integer_zeros and q.cached_integer_zeros() is True
    q.scale_zero[0, 1, 64 + 3] += 0.5  # in place: a zero of group 1, through a view
    assert q.cached_integer_zeros() is None and not q.integer_zeros and q.cached_integer_zeros() is False
    q.scale_zero[..., 64:].round_()
    assert q.cached_integer_zeros() is None and q.integer_zeros
    q.scale_zero = tile_scale_zero(torch.stack((q.scales, q.zeros + 0.25), -1), 8)  # another tensor
    assert q.cached_integer_zeros() is None and not q.integer_zeros
    sd = LowBitWeight.quantize(torch.randn(64, 256).half(), 8, 64).scale_zero
    q.scale_zero.copy_(sd)  # what load_state_dict does to a module's buffer
    assert q.cached_integer_zeros() is None and q.integer_zeros
    q4 = LowBitWeight.quantize(torch.randn(64, 256).half(), 4, 64)
    assert q4.integer_zeros
    q4.scale_zero = tile_scale_zero(torch.stack((q4.scales, q4.zeros + 0.25), -1), 4)
    assert q4.scale_zero.shape[-1] == 128 and not q4.integer_zeros


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gptq_zeros_are_integer_zeros(bits):
    """GPTQ stores integer zeros (qzeros + 1, here 1 .. 2^bits - 1): imported in fp16 or bf16, the
    kernel may skip its check."""
    qweight, scales, qzeros, _, _ = random_gptq(512, 72, bits, 128, False)
    q = LowBitWeight.from_gptq(qweight, scales, qzeros, bits=bits, group_size=128)
    assert q.integer_zeros
    q16 = LowBitWeight.from_gptq(qweight, scales.bfloat16(), qzeros, bits=bits, group_size=128)
    assert q16.integer_zeros


def test_zero_ranges_match_the_kernel():
    """exact_integer_zeros restates the kernel's exact zero ranges at 8 bits (Num<false>::kZeroLo/Hi
    in lowbit_mm.cuh for fp16, and kZeroLo/Hi<kBF16, BITS> for bf16 at 8 bits); they must not
    drift apart."""
    import re
    from pathlib import Path

    src = (Path(spinfer.__file__).parent / "csrc" / "lowbit_mm.cuh").read_text()
    ranges = re.findall(r"kZeroLo = (-?[0-9.]+)f, kZeroHi = (-?[0-9.]+)f", src)
    assert len(ranges) == 2, ranges  # fp16, then bf16
    byte = [re.findall(rf"constexpr float {name} = kBF16 && BITS == 8 \? (-?[0-9.]+)f", src) for name in
            ("kZeroLo", "kZeroHi")]
    assert all(len(v) == 1 for v in byte), byte
    for lo, hi, dtype in ((*ranges[0], torch.float16), (byte[0][0], byte[1][0], torch.bfloat16)):
        lo, hi = float(lo), float(hi)
        sz = torch.tensor([[[1.0, z]] for z in (lo, hi, lo - 1, hi + 1)]).to(dtype)
        assert exact_integer_zeros(tile_scale_zero(sz[:2], 8), 8), dtype
        for z in (sz[2:3], sz[3:]):
            assert not exact_integer_zeros(tile_scale_zero(z, 8), 8), dtype


def test_structure_only_check_skips_the_permutation_content():
    qweight, scales, qzeros, g_idx, _ = random_gptq(256, 16, 4, 128, True)
    q = LowBitWeight.from_gptq(qweight, scales, qzeros, g_idx=g_idx)
    bad = q.perm.clone()
    bad[0] = bad[1]  # not a permutation any more
    with pytest.raises(ValueError, match="permutation"):
        LowBitWeight(q.qweight, q.scales, q.zeros, 4, 128, (16, 256), bad)
    LowBitWeight(q.qweight, q.scales, q.zeros, 4, 128, (16, 256), bad, validate=False)  # O(1) checks pass
    with pytest.raises(ValueError, match="perm must be"):
        LowBitWeight(q.qweight, q.scales, q.zeros, 4, 128, (16, 256), bad[:-1], validate=False)


def test_out_variant_on_cpu_writes_the_reference():
    q = LowBitWeight.quantize(torch.randn(40, 256).half(), 4, 64)
    x = torch.randn(3, 256).half()
    out = torch.full((3, 40), float("nan")).half()
    assert spinfer.lowbit_mm(x, q, out=out) is not None
    assert rel_err(out, x.double() @ q.dequantize().double().t()) <= 2e-3
    args = (x, q.qweight, q.scale_zero, 4, 64, 40, 256, None, None, 0, True)
    torch.library.opcheck(torch.ops.spinfer.lowbit_mm_out.default, args, {"out": torch.empty(3, 40).half()},
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="out must be"):
        spinfer.lowbit_mm(x, q, out=torch.empty(3, 41).half())


def test_balanced_schedule_partition_bounds():
    """The arithmetic of the low-bit kernel's balanced schedule (schedule.cuh, Schedule and
    balanced_grid), by enumeration: block b of G takes units floor(bW/G) .. floor((b+1)W/G) - 1
    of W = rows x T; the block holding unit u is floor(((u+1)G - 1) / W); and at most
    floor(G/rows) + 2 blocks (G/rows when rows divide G, never more than G) share one row block,
    which sizes the kernel's workspace of partial tiles."""
    for rows in range(1, 30):
        for t in range(1, 14):
            w = rows * t
            for g in range(1, min(w, 90) + 1):
                owner = [b for b in range(g) for _ in range(b * w // g, (b + 1) * w // g)]
                assert len(owner) == w
                assert all(((u + 1) * g - 1) // w == owner[u] for u in range(w))
                bound = min(g, g // rows if g % rows == 0 else g // rows + 2)
                shares = max(len(set(owner[r * t:(r + 1) * t])) for r in range(rows))
                assert shares <= bound, (rows, t, g)
                if g % rows == 0:
                    assert shares == bound


def test_lowbit_plan_refuses_bad_arguments():
    from spinfer.ops.lowbit_mm import lowbit_plan

    q = LowBitWeight.quantize(torch.randn(64, 256).half(), 4, 128)
    with pytest.raises(ValueError, match="CUDA kernel"):
        lowbit_plan(q, 1, device="cpu")
    with pytest.raises(TypeError, match="LowBitWeight"):
        lowbit_plan(torch.randn(64, 256), 1)
    with pytest.raises(ValueError, match="n must be"):
        lowbit_plan(q, 0)
    with pytest.raises(TypeError, match="dtype"):
        lowbit_plan(q, 1, dtype=torch.float32)
    with pytest.raises(ValueError, match="splits"):
        lowbit_plan(q, 1, splits=-2)


def record_half(r):
    """The half of a record that holds row r's scale (lowbit.py; scale_word_of in lowbit_mm.h)."""
    r %= 64
    return 2 * (8 * (r // 16) + r % 8) + (r % 16) // 8


@pytest.mark.parametrize("frac", [0.0, 0.5])
def test_scale_zero_is_stored_in_64_row_records(frac):
    """The kernels read group j of row r from the record of tile r // 64 and group j (record_word
    in lowbit_mm.h): the scale at half 2 (8 b + i) + h for r % 64 = 16 b + i + 8 h, the zero at 64
    halves on, or as 4 bits of word 32 + i at bit 16 h + 4 b (zero_word_of / zero_shift_of); padding
    rows hold zeros, and scales / zeros are [M, K/g] copies."""
    m, k, g = 150, 512, 64
    q = LowBitWeight.quantize(torch.randn(m, k).half(), 4, g)
    if frac:  # fractional zeros: kept in the dtype
        q = LowBitWeight(q.qweight, q.scales, q.zeros + frac, 4, g, (m, k))
    sz = q.scale_zero
    assert sz.shape == (3, k // g, 128 if frac else 80) and sz.is_contiguous()
    scales, zeros = q.scales, q.zeros
    assert scales.shape == zeros.shape == (m, k // g)
    words = sz[..., 64:].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    for r in (0, 7, 8, 15, 16, 63, 64, 100, 149):
        for j in (0, 5, k // g - 1):
            t, rr = r // 64, r % 64
            assert sz[t, j, record_half(r)] == scales[r, j], (r, j)
            if frac:
                assert sz[t, j, 64 + record_half(r)] == zeros[r, j], (r, j)
            else:
                b, i, h = rr // 16, rr % 8, (rr % 16) // 8
                nib = (words[t, j, i] >> (16 * h + 4 * b)) & 15
                assert nib == zeros[r, j], (r, j)
    pad = [record_half(r) for r in range(m - 128, 64)]  # rows 150..191
    assert not bool(sz[2, :, pad].any())
    if not frac:
        # rows 16 b + i + 8 h of tile 2 from 22 on: block 1 (bits 4 and 20 on) from i = 6 (h = 0) and all i
        # (h = 1), and blocks 2 and 3 (bits 8-15 and 24-31) of every word
        assert not bool((words[2] & 0xFF00FF00).any()) and not bool((words[2] & 0x00F00000).any())
        assert not bool((words[2, :, 6:] & 0xF0).any())
    scales[0, 0] = 7  # a copy: the weight is unchanged
    assert q.scales[0, 0] != 7
    assert torch.equal(LowBitWeight(q.qweight, scales, zeros, 4, g, (m, k)).scale_zero[0, 1:], sz[0, 1:])


def test_scales_and_zeros_are_copies_even_with_one_group():
    """Per-channel weights (one group a row) are where a reshape of the tiles would have been a
    view: the properties must still not alias the stored pairs."""
    q = LowBitWeight.quantize(torch.randn(100, 256).half(), 4, None)
    assert q.scale_zero.shape == (2, 1, 80)
    scales, zeros = q.scales, q.zeros
    assert scales.shape == zeros.shape == (100, 1)
    assert scales.untyped_storage().data_ptr() != q.scale_zero.untyped_storage().data_ptr()
    before = q.scale_zero.clone()
    scales.fill_(3), zeros.fill_(5)
    assert torch.equal(q.scale_zero, before)
