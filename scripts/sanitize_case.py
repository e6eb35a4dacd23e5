"""Small and odd launches for compute-sanitizer (memcheck, racecheck, synccheck): SpMM with
split-K on and off (its reducer by ticket, the default, as the last stages start), 2 to 4 pipeline stages, stages holding one GroupTile (odd K), both decode
variants, the three register budgets, the rows above counted by the producer warp, by each warp or read
from the weight's row table (also a corrupt one), the next stage requested after the
first has landed or with it, wgmma or mma.sync at BN = 32 and 64 (token tiles under BN: x rows no copy
writes), one or two GroupTile rows a block, the 128-token tile (SPINFER_BN=128), a stage's two GroupTiles' wgmma
overlapping (SPINFER_WGMMA=5), at BN = 32 the rows above from the producer, the row table or each warp, a corrupt offsets array, fp16 and bf16; the fused low-bit kernel at every
width and group, odd M and K, split-K on and off (a short last split at K = 1792), every tile
width, all three zero-point paths (integer_zeros, the per-segment check, sum(x) forced), the balanced schedule (splits -1: ranges across row blocks), row
pairs, and split tail rows (at 4 bits and N > 16 with the sm_90 bulk loader: bulk weight copies
and tensor copies of the activations, boxes below a tile (N = 20) and past N (33); or the cp.async
loader under SPINFER_LOADER=cp_async, as scripts/device_check.sh runs both); the low-bit GEMV
kernel at every width, two groups a chunk below 4 bits and at 8, both loaders (registers and the
shared-memory ring, the ring with blocks of 8 warps and of 4), with both zero-point paths, and its split tail rows; the weight-to-dense
kernels on odd shapes, with corrupt TCA-BME offsets.

SANITIZE_PARTS (a comma list of spmm, bn128, pair, above32, lowbit, gemv, dense; default all) runs some of them, and
SANITIZE_BITS (a comma list of 1, 2, 4, 8; default all) the low-bit widths of the lowbit and gemv
parts: racecheck of every part takes more than 5 minutes, so the pieces run in processes of their own."""

import os

import torch

import spinfer
from spinfer.format import TCABME

spinfer.build.load_extension()
def chosen(name: str, choices: str) -> list:
    """The comma list in environment variable ``name`` (default: all of ``choices``); an unknown
    entry is an error, since a typo would check nothing and pass."""
    picked = [v.strip() for v in os.environ.get(name, choices).split(",")]
    if unknown := set(picked) - set(choices.split(",")):
        raise SystemExit(f"{name}: unknown {sorted(unknown)}; choose from {choices}")
    return picked


PARTS = chosen("SANITIZE_PARTS", "spmm,bn128,pair,above32,lowbit,gemv,dense")
BITS = [int(b) for b in chosen("SANITIZE_BITS", "1,2,4,8")]
SPMM_CASES = [
        (64, 64, 1, "1", "2", "lean", "9", "1", "1", "1", "1"), (4097, 1000, 7, "1", "3", "safe", "9", "0", "1", "1", "1"),
        (4097, 1000, 9, "3", "2", "lean", "8", "1", "1", "1", "1"), (200, 700, 33, "2", "4", "safe", "9", "0", "0", "1", "1"),
        (300, 1450, 5, "3", "3", "lean", "7", "1", "1", "1", "1"), (300, 1450, 24, "2", "2", "lean", "9", "0", "1", "1", "1"),
        (4097, 1000, 16, "2", "2", "lean", "8", "0", "0", "1", "1"), (4097, 1000, 1, "2", "2", "lean", "7", "0", "1", "1", "1"),
        (4097, 1000, 8, "2", "4", "lean", "7", "1", "1", "1", "1"), (4097, 1000, 1, "2", "2", "lean", "7", "0", "0", "1", "1"),
        (4097, 1000, 40, "1", "3", "lean", "7", "0", "0", "1", "1"), (300, 1450, 20, "3", "2", "lean", "7", "0", "0", "2", "1"),
        (4097, 1000, 64, "2", "2", "lean", "7", "0", "0", "2", "1"), (200, 700, 20, "1", "2", "lean", "7", "0", "0", "0", "1"),
        (300, 1450, 48, "2", "3", "lean", "7", "0", "0", "4", "1"), (4097, 1000, 30, "1", "2", "lean", "7", "0", "0", "4", "1"),
        (300, 1450, 64, "2", "3", "lean", "7", "0", "0", "3", "1"), (4097, 1000, 24, "1", "2", "lean", "7", "0", "0", "3", "1"),
        (4097, 1000, 1, "2", "2", "lean", "7", "0", "1", "4", "1"), (300, 1450, 5, "3", "3", "lean", "7", "1", "1", "4", "1"),
        (4097, 1000, 16, "1", "2", "lean", "7", "1", "1", "4", "1"), (300, 1450, 8, "2", "2", "lean", "7", "0", "0", "4", "1"),
        (300, 1450, 48, "2", "3", "lean", "7", "0", "0", "4", "2"), (4097, 1000, 30, "1", "2", "lean", "7", "0", "0", "4", "2"),
        (4097, 1000, 64, "3", "2", "lean", "7", "0", "0", "4", "2"), (640, 1000, 33, "2", "2", "lean", "7", "0", "0", "4", "2")]
# the 128-token tile (SPINFER_BN=128, wgmma groups of 4): one and two GroupTile rows, partial tiles, split
BN128_CASES = [(300, 1450, 100, "2", "3", "lean", "7", "0", "0", "4", "1"), (4097, 1000, 129, "1", "2", "lean", "7", "0", "0", "4", "1"),
               (4097, 1000, 200, "3", "2", "lean", "7", "0", "0", "4", "2"), (640, 1000, 65, "2", "2", "lean", "7", "0", "0", "4", "2")]
# a stage's two GroupTiles' wgmma overlapping (SPINFER_WGMMA=5) at the planner's tile: 128, 64 and 32, one and two rows
PAIR_CASES = [(300, 1450, 130, "2", "3", "lean", "7", "0", "0", "5", "1"), (4097, 1000, 100, "1", "2", "lean", "7", "0", "0", "5", "2"),
              (4097, 1000, 64, "3", "2", "lean", "7", "0", "0", "5", "2"), (300, 1450, 40, "1", "2", "lean", "7", "0", "0", "5", "1"),
              (4097, 1000, 24, "2", "2", "lean", "7", "0", "0", "5", "1"), (300, 1450, 32, "1", "3", "lean", "7", "0", "0", "5", "2")]
# at BN = 32 (wgmma groups of 4, plain and overlapped) the rows above counted by the producer (count "1"),
# or (count "0") read from the row table, as the other lists' BN = 32 cases do, or with the table off
# (the last field "0") counted by each decoding warp; split and not, 2 and 3 stages, a stage of a single GroupTile
ABOVE32_CASES = [((4097, 1000, 24, "2", "2", "lean", "7", "1", "0", "4", "1"), "1"),
                 ((300, 1450, 32, "1", "3", "lean", "7", "1", "0", "5", "1"), "1"),
                 ((4097, 1000, 17, "3", "2", "lean", "7", "0", "0", "5", "1"), "0"),
                 ((300, 1450, 32, "2", "3", "lean", "7", "0", "0", "4", "1"), "0")]
for (m, k, n, splits, stages, decode, budget, count, stagger, wgmma, rows), bn, table in (
        [(case, "0", "1") for case in SPMM_CASES if "spmm" in PARTS]
        + [(case, "128", "1") for case in BN128_CASES if "bn128" in PARTS]
        + [(case, "0", "1") for case in PAIR_CASES if "pair" in PARTS]
        + [(case, "0", t) for case, t in ABOVE32_CASES if "above32" in PARTS]):
    os.environ["SPINFER_BN"] = bn  # 0: the planner's token tile
    os.environ["SPINFER_ROW_TABLE"] = table  # the rows above from the weight's row table where no producer counts
    os.environ["SPINFER_SPLITS"] = splits
    os.environ["SPINFER_STAGES"] = stages
    os.environ["SPINFER_DECODE"] = decode
    os.environ["SPINFER_MIN_BLOCKS"] = budget  # register budget of the sm_90 kernel at BN <= 16
    os.environ["SPINFER_COUNT_ROWS"] = count  # the producer warp counts the rows above (sm_90, BN <= 16 and 32)
    os.environ["SPINFER_STAGGER"] = stagger  # the next stage after the first lands (sm_90, BN = 8)
    os.environ["SPINFER_WGMMA"] = wgmma  # wgmma groups of 1, 2 or 4 TCTiles, or mma.sync (sm_90, BN >= 32, lean)
    os.environ["SPINFER_WGMMA_SMALL"] = "1" if n <= 16 and wgmma == "4" else "0"  # and at BN <= 16
    os.environ["SPINFER_SMBD_ROWS"] = rows  # two GroupTile rows a block (wgmma groups of 4, BN >= 32)
    for dt in (torch.float16, torch.bfloat16):
        w = torch.randn(m, k, device="cuda").to(dt)
        w[torch.rand(m, k, device="cuda") < 0.5] = 0
        enc = TCABME.from_dense(w)
        x = torch.randn(n, k, device="cuda").to(dt)
        y = spinfer.spmm(x, enc, torch.randn(m, device="cuda").to(dt))
        off = enc.gtile_offset.clone()
        off[1] = 2**31 - 1  # corrupt on purpose: must stay in bounds
        torch.ops.spinfer.spmm(x, enc.bitmap, enc.values, off, m, k, 64, 64, enc.max_run)
        garbage = torch.randint(-32768, 32767, enc.row_offset.shape, dtype=torch.int16, device="cuda")
        torch.ops.spinfer.spmm(x, enc.bitmap, enc.values, off, m, k, 64, 64, enc.max_run, None, 0, garbage)
        torch.ops.spinfer.spmm(x, enc.bitmap, enc.values, enc.gtile_offset, m, k, 64, 64, 8)  # too small
from spinfer.quant import LowBitWeight  # noqa: E402

for bits in BITS if "lowbit" in PARTS else ():
    for m, k, group, n, splits in [(333, 1000, None, 1, "1"), (70, 1280, 64, 16, "3"), (130, 1152, 32, 33, "2"),
                                   (64, 256, 128, 8, "1"), (70, 1792, 64, 5, "2"), (333, 1000, None, 9, "-1"),
                                   (333, 1000, None, 20, "-1"), (1000, 512, 64, 1, "-1")]:
        os.environ["SPINFER_LOWBIT_SPLITS"] = splits
        os.environ["SPINFER_LOWBIT_XSUM"] = "1" if n % 2 else "0"  # both zero-point paths
        for dt in (torch.float16, torch.bfloat16):
            q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").to(dt), bits, group)
            x = torch.randn(n, k, device="cuda").to(dt)
            out = torch.empty(n, m, device="cuda", dtype=dt)
            spinfer.lowbit_mm(x, q, torch.randn(m, device="cuda").to(dt), out=out)
            # the launch that checks each segment's zeros (lowbit_mm passes integer_zeros=True here)
            torch.ops.spinfer.lowbit_mm_out(x, q.qweight, q.scale_zero, bits, q.group_size, m, k, None, None, 0,
                                            False, out=out)
            # the records with their zeros in the dtype (fractional ones, HQQ's), not 4-bit ones
            spinfer.lowbit_mm(x, LowBitWeight(q.qweight, q.scales, q.zeros + 0.5, bits, group, (m, k)), out=out)
# row pairs (128-row blocks): a last pair without its second row block (M = 4097, 70), split and not
os.environ["SPINFER_LOWBIT_PAIRS"] = "1"
for bits in BITS if "lowbit" in PARTS else ():
    for m, k, group, n, splits in [(4097, 512, 128, 16, "1"), (200, 1280, 32, 33, "2"), (70, 1000, None, 8, "1")]:
        os.environ["SPINFER_LOWBIT_SPLITS"] = splits
        os.environ["SPINFER_LOWBIT_XSUM"] = "1" if n % 2 else "0"
        for dt in (torch.float16, torch.bfloat16):
            q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").to(dt), bits, group)
            spinfer.lowbit_mm(torch.randn(n, k, device="cuda").to(dt), q, torch.randn(m, device="cuda").to(dt))
os.environ.pop("SPINFER_LOWBIT_PAIRS", None)
os.environ.pop("SPINFER_LOWBIT_SPLITS", None)
# the GEMV kernel (lowbit_gemv.cuh, N = 1): odd M and K, one row, a warp with no stage, a K of many
# stages a warp (each warp's two x buffers, or its ring's two slots, refilled), both loaders (the
# ring with 8 and 4 warps a block), both zero-point paths, the integer check skipped and not
os.environ["SPINFER_LOWBIT_GEMV"] = "1"
for bits in BITS if "gemv" in PARTS else ():
    for m, k, group in [(333, 1000, None), (1, 256, 128), (4097, 1280, 256), (17, 2560, 128 if bits == 4 else 64),
                        (17, 9216, 128)]:
        for xsum, ring, warps in (("0", "0", "8"), ("1", "0", "8"), ("0", "2", "8"), ("1", "2", "8"), ("0", "2", "4"),
                                  ("1", "2", "4")):
            os.environ["SPINFER_LOWBIT_RING"] = ring
            os.environ["SPINFER_GEMV_WARPS"] = warps
            os.environ["SPINFER_LOWBIT_XSUM"] = xsum
            for dt in (torch.float16, torch.bfloat16):
                q = LowBitWeight.quantize(torch.randn(m, k, device="cuda").to(dt), bits, group)
                x = torch.randn(1, k, device="cuda").to(dt)
                spinfer.lowbit_mm(x, q, torch.randn(m, device="cuda").to(dt))
                torch.ops.spinfer.lowbit_mm_out(x, q.qweight, q.scale_zero, bits, q.group_size, m, k, None, None, 0,
                                                False, out=torch.empty(1, m, device="cuda", dtype=dt))
# ... and its split tail rows: one wave of resident slots and 2 row blocks past it, split 3 ways
# with a short last split (K = 6300: 25 stages of 256 columns, 50 at 8 bits), at 2 and 8 bits,
# both zero-point paths
from spinfer.ops.lowbit_mm import lowbit_plan  # noqa: E402

os.environ["SPINFER_LOWBIT_TAIL"] = "3"
os.environ["SPINFER_LOWBIT_RING"] = "0"  # (the ring never splits its tail rows)
os.environ.pop("SPINFER_GEMV_WARPS", None)
sms = torch.cuda.get_device_properties(0).multi_processor_count
for bits in [b for b in (2, 8) if b in BITS] if "gemv" in PARTS else ():
    q = LowBitWeight.quantize(torch.randn(16, 6300, device="cuda").half(), bits, None)
    slots = sms * lowbit_plan(q, 1)["resident_blocks"]
    q = LowBitWeight.quantize(torch.randn(16 * (slots + 2) - 5, 6300, device="cuda").half(), bits, None)
    assert lowbit_plan(q, 1)["tail_splits"] == 3
    for xsum in ("0", "1"):
        os.environ["SPINFER_LOWBIT_XSUM"] = xsum
        spinfer.lowbit_mm(torch.randn(1, 6300, device="cuda").half(), q, torch.randn(q.shape[0], device="cuda").half())
os.environ.pop("SPINFER_LOWBIT_TAIL", None)
os.environ.pop("SPINFER_LOWBIT_GEMV", None)
os.environ.pop("SPINFER_LOWBIT_RING", None)
os.environ.pop("SPINFER_LOWBIT_XSUM", None)
# split tail rows (schedule.cuh, tail_split): SMs + 2 row blocks, the 2 past the wave split 3 ways
os.environ["SPINFER_LOWBIT_TAIL"] = "3"
sms = torch.cuda.get_device_properties(0).multi_processor_count
if "lowbit" in PARTS and 4 in BITS:
    q = LowBitWeight.quantize(torch.randn(64 * (sms + 2) - 5, 1792, device="cuda").half(), 4, 128)
    spinfer.lowbit_mm(torch.randn(3, 1792, device="cuda").half(), q)
# weight to dense (to_dense.cu): odd shapes, every width, and corrupt offsets
for dt in (torch.float16, torch.bfloat16) if "dense" in PARTS else ():
    w = torch.randn(130, 1001, device="cuda").to(dt)
    w[torch.rand(130, 1001, device="cuda") < 0.6] = 0
    enc = TCABME.from_dense(w)
    enc.to_dense()
    for off in (enc.gtile_offset.flip(0), -enc.gtile_offset, torch.full_like(enc.gtile_offset, 2**31 - 1)):
        torch.ops.spinfer.tca_bme_to_dense(enc.bitmap, enc.values, off, 130, 1001, 64, 64)
    for bits in (1, 2, 4, 8):
        for k, group in ((1000, None), (1152, 32), (1280, 256)):
            q = LowBitWeight.quantize(torch.randn(70, k, device="cuda").to(dt), bits, group)
            spinfer.ops.lowbit_to_dense(q)
            spinfer.ops.lowbit_to_dense(LowBitWeight(q.qweight, q.scales, q.zeros + 0.5, bits, group, (70, k)))
torch.cuda.synchronize()
print("sanitize cases ran")
