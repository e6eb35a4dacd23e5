"""The dispatch policy: which kernel runs a layer for a given number of tokens N.

A cost model predicts each candidate's time from the layer's real bytes and a few device
constants. The SMBD kernel is not bandwidth-bound (docs/kernels.md): its time is the larger of
the bytes over the copy bandwidth and a per-GroupTile decode cost that grows with the token tile,
and both terms are in the model, with a fixed cost per token tile. The default constants are the
H100 80GB HBM3 figures measured on 2026-12-07 (SMBD v19); :func:`calibrate` re-measures them on the
current GPU and caches them per device under the user's cache folder.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, Optional, Tuple

import torch

from ..cache import read_entry, write_entry
from ..tuning import device_key, spmm_tile

# Kernel names a layer can dispatch to.
DENSE = "dense"  # F.linear on a dense weight (cuBLAS on CUDA)
SPMM = "spmm"  # SMBD kernel on TCA-BME
DECODE_DENSE = "decode+dense"  # TCA-BME decoded to dense per call, then F.linear (large N)
LOWBIT = "lowbit"  # spinfer.lowbit_mm

# Prefill sizes get buckets of their own. With the CUDA decode kernel (spinfer/csrc/to_dense.cu,
# 2.6-2.9 TB/s on H100) decode+dense overtakes SpMM from N = 128-160 on the large layers (with
# the torch-op decoder it was ~1500-2000 tokens); the buckets above 256 cost nothing and keep the
# choice per prompt size.
N_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 1024, 2048, 4096, 8192)
TOKEN_TILES = (8, 16, 32, 64, 128)  # the SMBD kernel's, each with its own constants below


def n_bucket(n: int) -> int:
    """Smallest bucket >= n (the last bucket takes everything above)."""
    for b in N_BUCKETS:
        if n <= b:
            return b
    return N_BUCKETS[-1]


@dataclass
class DeviceProfile:
    """Device constants of the cost model (seconds, bytes/s, FLOP/s)."""

    name: str = "NVIDIA H100 80GB HBM3 (defaults measured 2026-12-07)"
    # The defaults are calibrate() on an H100 80GB HBM3 with the SMBD kernel v19 and the CUDA
    # decode kernels, rounded (docs/policy.md, seventy-eighth session). Those of SMBD v11
    # (eighteenth session) overstated SpMM by 30-40% at N = 17-128 once the kernel ran on wgmma:
    # 135 of 144 cases picked the fastest kernel, the worst 1.21x slow. Before v10 the constants
    # were fitted to kernel v7, and kept 4096x4096 and 6144x4096 layers dense where SpMM is 10% faster.
    dense_bandwidth: float = 2.95e12  # bytes/s cuBLAS streams a dense fp16 weight at
    # bytes/s the SMBD kernel reaches when bytes dominate (the large layer's bytes over its
    # GroupTile term at BN = 8, at 50%)
    sparse_bandwidth: float = 3.0e12
    tensor_flops: float = 7.65e14  # dense fp16 FLOP/s at large N
    launch: float = 4.4e-6  # fixed cost per kernel call (a 64x64 F.linear)
    # The SMBD kernel by token tile BN: its fixed cost (launch, pipeline fill, the split-K
    # reduction; larger with the tile) and its decode cost per GroupTile (64x64) on the whole GPU:
    # the intercept and the slope of its time against GroupTiles through 4096x4096 and 16384x8192
    # at 50%, at N = BN (N > 128 pays the BN = 128 slope once per 128 tokens; where the kernel has
    # no 128-token tile, N = 128 runs two 64-token tiles, and the BN = 128 figures measure those;
    # BN = 128's are the eighty-first session's calibrate(), the 128-token tile with a stage's two
    # GroupTiles overlapping, SMBD v21; BN = 32's the eighty-sixth's, SMBD v24, where split grids
    # overlap them too and the producer warp counts the rows above). The fixed cost decides
    # small layers for dense (1024x4096: 10.5-11.6 us as SpMM, 9.6 dense). A single fixed cost for
    # every tile (the intercept at N = 1) and the slopes of SMBD v11 left the policy 1.21x slow
    # on kernel v19 (docs/policy.md, seventy-eighth session).
    spmm_fixed: Dict[int, float] = field(
        default_factory=lambda: {8: 8.7e-6, 16: 9.8e-6, 32: 11.1e-6, 64: 15.8e-6, 128: 15.4e-6})
    gt_cost: Dict[int, float] = field(
        default_factory=lambda: {8: 1.54e-9, 16: 1.55e-9, 32: 1.70e-9, 64: 1.96e-9, 128: 2.54e-9})
    # The same two constants through the same two layers pruned to 70%. The kernel's launch is not
    # the same at 70%: at N = 33-64 its blocks hold one GroupTile row and overlap a stage's two
    # GroupTiles, where at 50% they hold two rows, and its stage is shorter. With the 50% constants
    # alone the policy took decode+dense on 1024x4096 at 70%, N = 64, where SpMM was 1.14x faster;
    # with both it picked the fastest kernel in 144 of 144 cases (docs/policy.md, eighty-second
    # session). Between 50% and 70% sparsity the model interpolates (spmm_terms); below 50% it takes
    # the 50% figures, above 70% the 70% ones. H100, calibrate() on SMBD v22 (BN = 32 on v24): at
    # N = 33-64 12.0 us and 1.98 ns a GroupTile, against 16.1 us and 1.93 ns at 50%.
    spmm_fixed_70: Dict[int, float] = field(
        default_factory=lambda: {8: 8.5e-6, 16: 9.2e-6, 32: 10.7e-6, 64: 12.0e-6, 128: 15.6e-6})
    gt_cost_70: Dict[int, float] = field(
        default_factory=lambda: {8: 1.38e-9, 16: 1.50e-9, 32: 1.67e-9, 64: 1.98e-9, 128: 2.36e-9})
    # bytes/s (compressed read + fp16 written) of TCA-BME -> dense (or low-bit -> dense) per call,
    # and the decode kernel's fixed cost: the slope and the intercept of its time against bytes
    # through 4096x4096 and 16384x8192 at 50% (the CUDA decode kernels on H100, `spinfer bench
    # to_dense`, 2026-11-23: 2.57-2.88 TB/s for TCA-BME at 30-70%, 2.7-2.96 for low-bit; the
    # torch-op decoders before: 0.14 TB/s). Until the seventy-eighth session the decode was
    # charged a 64x64 F.linear's launch.
    decode_bandwidth: float = 2.84e12
    decode_launch: float = 2.8e-6
    # Decode+dense is two kernels back to back in one call: chain_launch is the large layer's
    # decode+dense time less the model's decode and dense terms (16384x8192 at 50%; 1.6 us on
    # 2026-11-23 when the decode was charged a launch, 8.0 us against the decode's intercept now).
    # And the decoded weight was just written, so when it is smaller than L2 part of it is read
    # back from L2: the dense term reads D - l2_reuse * D * (1 - D / l2_bytes) bytes from HBM (none
    # past l2_bytes, most at half of it); l2_reuse from 4096x4096 at 50% (33.5 MB decoded), which
    # now reaches its bound of 1. Without them the model kept SpMM at N = 128 on 1024-4096-row
    # layers where decode+dense was 3-15% faster (docs/policy.md, nineteenth session).
    chain_launch: float = 8.0e-6
    l2_bytes: float = 52428800.0  # the H100's L2 (torch's L2_cache_size); calibrate() reads the device's
    l2_reuse: float = 1.0
    # The fused low-bit kernel: bytes/s of its packed weight at N = 1, and the token count that
    # doubles its time (fitted to bench_lowbit on H100, 2026-11-22 after the warp-group change:
    # 28672x8192 4-bit 58 / 96 / 121 / 221 us at N = 1 / 16 / 32 / 64; the fit gives 57 / 91 /
    # 127 / 199). Not measured by calibrate().
    lowbit_bandwidth: float = 2.5e12
    lowbit_n_scale: float = 22.0
    measured: bool = False

    @staticmethod
    def token_tile(n: int) -> int:
        """The SMBD kernel's token tile BN at n tokens (spmm_smbd.cu's planner; 128 counts as two
        64-token tiles where the kernel has no 128-token tile)."""
        return spmm_tile(n)[0]

    def spmm_terms(self, n: int, sparsity: float = 0.5) -> Tuple[float, float]:
        """The SMBD kernel's fixed cost (s) and its decode term's seconds per GroupTile at n tokens
        on a weight of this sparsity: the 50% constants up to 50%, the 70% ones from 70%, linear
        between."""
        bn = self.token_tile(n)
        w = min(max((sparsity - 0.5) / 0.2, 0.0), 1.0)
        fixed = (1 - w) * self.spmm_fixed[bn] + w * self.spmm_fixed_70[bn]
        per_gt = (1 - w) * self.gt_cost[bn] + w * self.gt_cost_70[bn]
        return fixed, per_gt * (1 if n <= 128 else math.ceil(n / 128))


def predict(kernel: str, m: int, k: int, n: int, weight_bytes: int, profile: DeviceProfile,
            num_group_tiles: int = 0, bits: int = 4, sparsity: float = 0.5) -> float:
    """Predicted seconds of one call of ``kernel`` on an ``[m, k]`` layer with ``n`` tokens
    (``sparsity``: the TCA-BME weight's, for SpMM)."""
    io = 2 * n * (m + k)  # fp16 activations in and out
    dense_compute = 2.0 * m * k * n / profile.tensor_flops
    dense = max((2 * m * k + io) / profile.dense_bandwidth, dense_compute) + profile.launch
    if kernel == DENSE:
        return dense
    if kernel == SPMM:
        fixed, per_gt = profile.spmm_terms(n, sparsity)
        return max((weight_bytes + io) / profile.sparse_bandwidth, num_group_tiles * per_gt) + fixed
    decode_dense = _decode_then_dense(m, k, weight_bytes, io, dense_compute, profile)
    if kernel == DECODE_DENSE:
        return decode_dense
    if kernel == LOWBIT:
        from ..ops.lowbit_mm import fused_max_n

        if n <= fused_max_n(bits):  # the fused kernel re-reads the weight per 32-token tile
            return (weight_bytes + io) / profile.lowbit_bandwidth * (1 + n / profile.lowbit_n_scale) + profile.launch
        return decode_dense  # dequantize, then cuBLAS
    raise ValueError(f"unknown kernel {kernel!r}")


def _decode_then_dense(m: int, k: int, weight_bytes: int, io: int, dense_compute: float,
                       profile: DeviceProfile) -> float:
    """Decode to a dense fp16 weight (its stream and launch), then F.linear on it launched right
    behind (chain_launch), reading back from L2 what of the decoded weight stayed there."""
    decoded = 2 * m * k
    reused = profile.l2_reuse * decoded * max(0.0, 1.0 - decoded / profile.l2_bytes)
    decode = (weight_bytes + decoded) / profile.decode_bandwidth + profile.decode_launch
    return decode + max((decoded - reused + io) / profile.dense_bandwidth, dense_compute) + profile.chain_launch


_PROFILE_FILE = "device_profiles.json"
_AUTOTUNE_FILE = "autotune.json"


_PROFILES: Dict[str, DeviceProfile] = {}


def profile_for(device: Optional[torch.device] = None) -> DeviceProfile:
    """The cached measured profile of a CUDA device, else the defaults (no GPU: the defaults
    describe the H100 the kernels are tuned for; an uncalibrated GPU gets them with its own L2
    size, which torch reports without timing anything)."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return DeviceProfile()
    key = device_key(torch.device(device))
    if key in _PROFILES:
        return _PROFILES[key]
    stored = read_entry(_PROFILE_FILE, key)
    # another build's profile is under another key (device_key names the kernels' revision); one whose
    # fields or token tiles are not this model's (a file edited or written by other code) is not used
    # either: the defaults stand until calibrate() runs again
    usable = bool(stored) and set(stored) == {f.name for f in fields(DeviceProfile)}
    if usable:
        for name in ("gt_cost", "spmm_fixed", "gt_cost_70", "spmm_fixed_70"):
            stored[name] = {int(b): v for b, v in stored[name].items()}
            usable = usable and set(stored[name]) == set(TOKEN_TILES)
    if usable:
        _PROFILES[key] = DeviceProfile(**stored)
    else:
        l2 = getattr(torch.cuda.get_device_properties(torch.device(device)), "L2_cache_size", 0)
        _PROFILES[key] = DeviceProfile(l2_bytes=float(l2)) if l2 > 0 else DeviceProfile()
    return _PROFILES[key]


def calibrate(device=None, *, save: bool = True) -> DeviceProfile:
    """Measure the cost model's constants on a CUDA device (a few seconds) and cache them."""
    from ..format import TCABME
    from ..ops import spmm
    from ..timing import median_time

    if not torch.cuda.is_available():
        raise RuntimeError("spinfer.calibrate() needs a CUDA GPU; without one the H100 defaults are used")
    dev = torch.device(device or "cuda")
    m, k = 16384, 8192
    w = torch.randn(m, k, device=dev).half()
    x1 = torch.randn(1, k, device=dev).half()
    t = median_time(lambda: torch.nn.functional.linear(x1, w), dev, reps=30)
    dense_bw = 2 * m * k / t
    xl = torch.randn(4096, k, device=dev).half()
    tl = median_time(lambda: torch.nn.functional.linear(xl, w), dev, reps=10)
    flops = 2.0 * m * k * 4096 / tl
    tiny = torch.randn(64, 64, device=dev).half()
    launch = median_time(lambda: torch.nn.functional.linear(tiny[:1], tiny), dev, reps=50, flush_l2=False)
    # Each token tile's SpMM fixed cost and per-GroupTile cost: the intercept and the slope of the
    # line through two layers' times at N = BN, 4096x4096 and the large one, at 50% sparsity and
    # again at 70%. (A 1024x4096 layer's own time, used for the fixed cost before, overstated it:
    # its few blocks stream slowly, and 4096x4096 stayed dense where SpMM is 10% faster on H100.)
    small = torch.randn(4096, 4096, device=dev).half()
    keep, keep_small = torch.rand(m, k, device=dev), torch.rand(4096, 4096, device=dev)
    xs = torch.randn(1, 4096, device=dev).half()
    constants = {}
    for sparsity in (0.7, 0.5):  # 50% last: its layers are the ones used below
        enc = TCABME.from_dense(torch.where(keep < sparsity, 0, w))
        small_enc = TCABME.from_dense(torch.where(keep_small < sparsity, 0, small))
        ngt, large_bytes = enc.geometry.num_group_tiles, enc.storage_bytes().total
        small_ngt, small_bytes = small_enc.geometry.num_group_tiles, small_enc.storage_bytes().total
        spmm_fixed, gt_cost = {}, {}
        for bn in TOKEN_TILES:
            xb, xbs = torch.randn(bn, k, device=dev).half(), torch.randn(bn, 4096, device=dev).half()
            t_large = median_time(lambda: spmm(xb, enc), dev, reps=20)
            t_small = median_time(lambda: spmm(xbs, small_enc), dev, reps=30)
            gt_cost[bn] = max((t_large - t_small) / (ngt - small_ngt), 0.0)
            spmm_fixed[bn] = max(t_small - gt_cost[bn] * small_ngt, 0.0)
        constants[sparsity] = spmm_fixed, gt_cost
    spmm_fixed, gt_cost = constants[0.5]
    # the decode kernel: bandwidth and fixed cost from the same two layers
    td = median_time(enc.to_dense, dev, reps=5)
    td_small = median_time(small_enc.to_dense, dev, reps=20)
    decoded_large, decoded_small = large_bytes + 2 * m * k, small_bytes + 2 * 4096 * 4096
    decode_bw = (decoded_large - decoded_small) / max(td - td_small, 1e-9)
    decode_launch = max(td_small - decoded_small / decode_bw, 0.0)
    prof = DeviceProfile(name=torch.cuda.get_device_name(dev), dense_bandwidth=dense_bw,
                         sparse_bandwidth=large_bytes / (gt_cost[8] * ngt), tensor_flops=flops,
                         launch=launch, spmm_fixed=spmm_fixed, gt_cost=gt_cost, spmm_fixed_70=constants[0.7][0],
                         gt_cost_70=constants[0.7][1], decode_bandwidth=decode_bw,
                         decode_launch=decode_launch,
                         l2_bytes=float(torch.cuda.get_device_properties(dev).L2_cache_size), measured=True)
    # Decode+dense as one call: chain_launch from the large layer (decoded far past L2), then
    # l2_reuse from the small one (decoded 33.5 MB: below an H100's 50 MB L2, not on every GPU).
    prof.chain_launch = prof.l2_reuse = 0.0
    t_dd = median_time(lambda: torch.nn.functional.linear(x1, enc.to_dense()), dev, reps=10)
    prof.chain_launch = max(t_dd - predict(DECODE_DENSE, m, k, 1, large_bytes, prof), 0.0)
    t_dd_small = median_time(lambda: torch.nn.functional.linear(xs, small_enc.to_dense()), dev, reps=20)
    decoded = 2 * 4096 * 4096
    room = decoded * max(0.0, 1.0 - decoded / prof.l2_bytes)
    if room > 0:
        unexplained = predict(DECODE_DENSE, 4096, 4096, 1, small_bytes, prof) - t_dd_small
        prof.l2_reuse = min(max(unexplained * dense_bw / room, 0.0), 1.0)
    key = device_key(dev)
    _PROFILES[key] = prof
    if save:
        write_entry(_PROFILE_FILE, key, asdict(prof))
    return prof


# ---- autotune results, persisted per (device, format, shape, nonzeros, N bucket) -------------------

def device_name(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return device_key(device)
    import platform

    return f"cpu|{platform.processor() or platform.machine()}|{torch.get_num_threads()}threads"


def autotune_key(device, fmt: str, m: int, k: int, nnz: int, bucket: int) -> str:
    return f"{device_name(device)}|{fmt}|{m}x{k}|nnz{nnz}|N{bucket}"


def load_autotuned(key: str) -> Optional[Dict[str, float]]:
    return read_entry(_AUTOTUNE_FILE, key)


def store_autotuned(key: str, times: Dict[str, float]) -> None:
    write_entry(_AUTOTUNE_FILE, key, times)
