"""Weight-only low-bit format: asymmetric group quantization ``W ~ (W_q - zero) * scale``.

Layout (chosen for the kernels; docs/quant.md):

* ``qweight``: int32 ``[Mp/64, Kp/S, 64, S*bits/32]``: tiles of 64 output rows by ``S``
  input columns (``S`` = 256, or 128 at 8 bits), each tile contiguous, so the kernel's copy
  of one pipeline stage (a tile) is one 4..8 KB span of memory. ``Mp`` is M rounded up to 64
  and ``Kp`` is K rounded up to 256; padding holds ``q = 0`` (padded rows are never stored to
  the output, padded columns meet zero-padded activations). Inside a tile each row is a
  sequence of 128-column chunks of ``4 * bits`` words, and inside a chunk the values are in
  the fused kernel's fragment order (:func:`fragment_order`): lane ``t`` of an mma.m16n8k16
  warp reads its share of the chunk (``bits`` consecutive words) and finds value ``s`` and
  value ``s + 16/bits`` of a word 16 bits apart, ready for a one-instruction conversion to a
  half2. Inside a word, stream value ``j`` occupies bits ``[bits*j, bits*(j+1))``.
* ``scale_zero``: ``[Mp/64, K / group_size, R]`` in the weight dtype (fp16/bf16): one record
  of ``R`` halves per 64-row tile and group, contiguous, so a kernel stage's scales and zeros of
  a row block are a few 16-byte copies. Halves ``[0, 64)`` are the scales: half ``2 w + h`` of
  word ``w = 8 b + i`` is row ``16 b + i + 8 h`` (b = 0..3, i = 0..7), so one word holds the
  two rows an mma lane owns. The zeros follow, either as 64 more halves in the same order
  (``R = 128``: fractional zeros such as HQQ's import exactly, and every 8-bit weight), or, at
  1, 2 and 4 bits where every zero is an integer in [0, 15] (RTN, GPTQ), as 4-bit integers:
  ``R = 80``, the 16 halves read as 8 words, word ``i`` holding row ``16 b + i``'s zero at bits
  ``4 b`` and row ``16 b + i + 8``'s at bits ``16 + 4 b`` (raw bits, not numbers: never cast
  such a tensor). A lane of the kernels then finds its two rows' zeros in its own word at a
  shift that is the same for its whole warp. A 4-bit g128 row group is 66.5 bytes, not 68.
  Padding rows hold zeros. ``LowBitWeight.scales`` and ``.zeros`` are ``[M, K/g]`` copies
  (:func:`untile_scale_zero`).
* ``perm`` (optional): int64 ``[K]``. GPTQ act-order checkpoints have groups scattered over K;
  importing permutes K once so groups are contiguous, and the op gathers ``x[..., perm]``.

Dequantization, the reference every kernel is held to: ``w = ((q - zero) * scale)`` computed in
float32 and rounded once to the weight dtype.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from ..format.state import read_meta
from ..versions import changed, version_or_none

SUPPORTED_BITS = (1, 2, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
K_ALIGN = 256  # K padding: whole kernel stages (256 columns; two 128-column stages at 8 bits)
CHUNK = 128  # columns per fragment-order chunk
ROW_BLOCK = 64  # output rows per kernel block and per qweight tile
FORMAT_VERSION = 4  # 2: fragment order inside each 128-column chunk; scale_zero interleaved; 3: in 64-row tiles;
#                      4: records of scales then zeros, 4-bit integer zeros where they fit


@dataclass(frozen=True)
class LowBitStorage:
    qweight: int
    scales: int
    zeros: int
    perm: int

    @property
    def total(self) -> int:
        return self.qweight + self.scales + self.zeros + self.perm


def check_bits(bits) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return int(bits)


def resolve_group_size(group_size, k: int) -> int:
    """``None``, -1 or K itself means per-channel: one group spanning all of K."""
    if group_size is None or group_size == -1 or group_size == k:
        return k
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(
            f"group_size must be one of {SUPPORTED_GROUP_SIZES} or None (per-channel), got {group_size!r}"
        )
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide K={k}; use a divisor of K or None (per-channel)")
    return int(group_size)


def padded_k(k: int) -> int:
    return -(-k // K_ALIGN) * K_ALIGN


def fragment_order(bits: int) -> torch.Tensor:
    """Column (0..127) of each value of a packed 128-column chunk, in stream order.

    Stream value ``j`` is word ``j // V`` (``V = 32 // bits`` values per word), position
    ``p = j % V`` in it. Word ``t * bits + wi`` belongs to lane ``t`` (0..3) of the kernel. In
    the word, position ``p`` is pair ``s = p % (V/2)``, half ``e = p // (V/2)`` (so the pair's
    two values sit 16 bits apart); pair ``s`` of word ``wi`` feeds k16 tile
    ``T = wi * V/4 + s // 2`` and A-fragment slot ``2 * (s % 2) + e``, which is column
    ``16*T + 4*t + slot`` of the chunk: the four columns whose activations lane ``t`` holds
    in its B fragment."""
    bits = check_bits(bits)
    v = 32 // bits
    j = torch.arange(CHUNK)
    word, p = j // v, j % v
    t, wi = word // bits, word % bits
    s, e = p % (v // 2), p // (v // 2)
    tile = wi * (v // 4) + s // 2
    return 16 * tile + 4 * t + 2 * (s % 2) + e


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Little-endian bit packing: integer ``[R, C]`` (``C*bits`` a multiple of 32) -> int32
    ``[R, C*bits/32]``, value ``j`` of a word at bits ``[bits*j, bits*(j+1))``."""
    m, kp = q.shape
    per_byte = 8 // bits
    qb = q.to(torch.uint8).reshape(m, kp // per_byte, per_byte)
    byte = qb[..., 0].clone()
    for j in range(1, per_byte):
        byte |= qb[..., j] << (bits * j)
    return byte.contiguous().view(torch.int32)


def unpack_bits(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: int32 ``[R, W]`` -> uint8 ``[R, W*32/bits]``."""
    byte = words.contiguous().view(torch.uint8)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=words.device)
    vals = (byte[..., None] >> shifts) & ((1 << bits) - 1)
    return vals.reshape(words.shape[0], -1)


def stage_cols(bits: int) -> int:
    """Input columns of one qweight tile (one kernel pipeline stage)."""
    return 128 if bits == 8 else 256


RECORD_DTYPE_ZEROS = 128  # halves of a record with zeros in the weight dtype
RECORD_NIBBLE_ZEROS = 80  # halves of a record with 4-bit integer zeros
NIBBLE_MAX = 15


def _record_rows() -> torch.Tensor:
    """Row (0..63 of the tile) of each of a record's 64 scale halves: half ``16 b + 2 i + h`` is
    row ``16 b + i + 8 h``."""
    p = torch.arange(ROW_BLOCK)
    b, i, h = p // 16, (p % 16) // 2, p % 2
    return 16 * b + i + 8 * h


def nibble_zeros_fit(zeros: torch.Tensor, bits: int) -> bool:
    """Whether ``zeros`` (any shape) are stored as 4-bit integers: 1, 2 or 4 bits, and every zero
    an integer in [0, 15]."""
    if bits > 4:
        return False
    z = zeros.float()
    return bool(((z == torch.round(z)) & (z >= 0) & (z <= NIBBLE_MAX)).all())


def tile_scale_zero(scale_zero: torch.Tensor, bits: int) -> torch.Tensor:
    """``[M, G, 2]`` (scale, zero) pairs -> the stored ``[Mp/64, G, R]`` records (module
    docstring): 4-bit integer zeros where :func:`nibble_zeros_fit`, else zeros in the dtype. Rows
    are padded with zeros to a multiple of 64."""
    m, groups, _ = scale_zero.shape
    mb = -(-m // ROW_BLOCK)
    padded = torch.nn.functional.pad(scale_zero, (0, 0, 0, 0, 0, mb * ROW_BLOCK - m))
    tiles = padded.reshape(mb, ROW_BLOCK, groups, 2).permute(0, 2, 3, 1)  # [mb, G, 2, 64 rows]
    rows = _record_rows().to(scale_zero.device)
    scales = tiles[:, :, 0, rows]
    if not nibble_zeros_fit(scale_zero[..., 1], bits):
        return torch.cat((scales, tiles[:, :, 1, rows]), dim=-1).contiguous()
    z = tiles[:, :, 1].float().to(torch.int64).reshape(mb, groups, 4, 2, 8)  # rows 16 b + 8 h + i
    shifts = 4 * torch.arange(4, device=z.device)[:, None, None] + 16 * torch.arange(2, device=z.device)[:, None]
    words = (z << shifts).sum(dim=(2, 3))  # over b and h: [mb, G, 8], word i
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return torch.cat((scales, words.view(scale_zero.dtype)), dim=-1).contiguous()


def untile_scale_zero(scale_zero: torch.Tensor, m: int) -> torch.Tensor:
    """The stored ``[Mp/64, G, R]`` records -> ``[M, G, 2]`` (scale, zero) pairs: a copy."""
    halves = scale_zero.shape[-1]
    order = torch.argsort(_record_rows()).to(scale_zero.device)  # the half of each row
    scales = scale_zero[..., :ROW_BLOCK][..., order]
    if halves == RECORD_DTYPE_ZEROS:
        zeros = scale_zero[..., ROW_BLOCK:][..., order]
    else:
        words = scale_zero[..., ROW_BLOCK:].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        r = torch.arange(ROW_BLOCK, device=scale_zero.device)
        word = r % 8
        shift = 16 * ((r % 16) // 8) + 4 * (r // 16)
        zeros = ((words[..., word] >> shift) & NIBBLE_MAX).to(scale_zero.dtype)
    return _rows_of_tiles(torch.stack((scales, zeros), dim=-1), m)


def _rows_of_tiles(tiles: torch.Tensor, m: int) -> torch.Tensor:
    """``[Mp/64, G, 64, 2]`` (scale, zero) pairs in 64-row tiles (format 3's stored form, and the
    records' once unpacked) -> ``[M, G, 2]``: a copy."""
    mb, groups = tiles.shape[:2]
    return tiles.transpose(1, 2).reshape(mb * ROW_BLOCK, groups, 2)[:m].contiguous()


def records_in_dtype(scale_zero: torch.Tensor, m: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored records of ``m`` rows in ``dtype``: rebuilt (scales cast, zeros kept), since a cast of
    records holding 4-bit zeros would convert those bits as numbers."""
    return tile_scale_zero(untile_scale_zero(scale_zero, m).to(dtype), bits)


def records_from_format3(scale_zero, m: int, bits: int) -> torch.Tensor:
    """Format 3's ``[Mp/64, G, 64, 2]`` (scale, zero) tiles, as checkpoints saved before format 4
    hold them, -> this format's records (:func:`tile_scale_zero`). ``qweight`` is laid out the
    same in both, so this is the whole conversion."""
    if not isinstance(scale_zero, torch.Tensor) or scale_zero.dim() != 4 or tuple(scale_zero.shape[2:]) != (ROW_BLOCK, 2):
        shape = tuple(scale_zero.shape) if isinstance(scale_zero, torch.Tensor) else type(scale_zero).__name__
        raise ValueError(f"a format 3 scale_zero is [Mp/64, K/group_size, {ROW_BLOCK}, 2], got {shape}")
    if scale_zero.shape[0] != -(-m // ROW_BLOCK):
        raise ValueError(f"a format 3 scale_zero of {m} rows has {-(-m // ROW_BLOCK)} tiles, got {scale_zero.shape[0]}")
    return tile_scale_zero(_rows_of_tiles(scale_zero, m), bits)


def nibble_records(scale_zero: torch.Tensor) -> bool:
    """Whether stored records hold 4-bit integer zeros (``R = 80``)."""
    return scale_zero.shape[-1] == RECORD_NIBBLE_ZEROS


def exact_integer_zeros(scale_zero: torch.Tensor, bits: int) -> bool:
    """Whether the kernels take every zero of the stored records as an exact integer, with no check
    of their own. At 1, 2 and 4 bits: the records hold 4-bit integer zeros (other zeros, even
    integers, go through the kernels' per-segment check, which is exact too). At 8 bits: every
    zero ``z`` is an integer the fused kernel subtracts inside the tensor-core fragments
    (``kZeroLo`` / ``kZeroHi`` in spinfer/csrc/lowbit_mm.cuh): ``magic + z`` exact in the weight
    dtype (magic 1024 in fp16, 128 in bf16), so ``z`` in [-1024, 1023] (fp16); in bf16 the kernel
    splits ``q`` and ``z`` at bit 7, for ``z`` in [0, 255]."""
    if bits <= 4:
        return nibble_records(scale_zero)
    z = scale_zero[..., ROW_BLOCK:].float()
    lo, hi = (-1024.0, 1023.0) if scale_zero.dtype == torch.float16 else (0.0, 255.0)
    return bool(((z == torch.round(z)) & (z >= lo) & (z <= hi)).all())


def qweight_shape(m: int, k: int, bits: int) -> Tuple[int, int, int, int]:
    sc = stage_cols(bits)
    return (-(-m // ROW_BLOCK), padded_k(k) // sc, ROW_BLOCK, sc * bits // 32)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``q`` integer ``[M, Kp]`` (Kp a multiple of 256) with values in ``[0, 2**bits)`` -> the
    ``qweight`` layout (module docstring): row tiles of 64 x stage columns, fragment order
    inside each 128-column chunk."""
    m, kp = q.shape
    if kp % K_ALIGN:
        raise ValueError(f"pack takes K padded to a multiple of {K_ALIGN}, got {kp}")
    order = fragment_order(bits).to(q.device)
    stream = q.reshape(m, kp // CHUNK, CHUNK)[..., order].reshape(m, kp)
    words = pack_bits(stream, bits)
    mb, stages, rows, sw = qweight_shape(m, kp, bits)
    words = torch.nn.functional.pad(words, (0, 0, 0, mb * rows - m))
    return words.reshape(mb, rows, stages, sw).transpose(1, 2).contiguous()


def unpack(qweight: torch.Tensor, bits: int, m: Optional[int] = None) -> torch.Tensor:
    """Inverse of :func:`pack`: ``qweight`` -> uint8 ``[M, Kp]`` in column order (``m`` drops
    the padding rows; default: keep all ``Mp``)."""
    mb, stages, rows, sw = qweight.shape
    words = qweight.transpose(1, 2).reshape(mb * rows, stages * sw)
    if m is not None:
        words = words[:m]
    stream = unpack_bits(words, bits)
    mm, kp = stream.shape
    out = torch.empty_like(stream).reshape(mm, kp // CHUNK, CHUNK)
    out[..., fragment_order(bits).to(stream.device)] = stream.reshape(mm, kp // CHUNK, CHUNK)
    return out.reshape(mm, kp)


def dequantize(qweight, scale_zero, bits: int, group_size: int, shape, perm=None) -> torch.Tensor:
    """The reference dequantization: ``(q - zero) * scale`` in float32, rounded once to the
    scales' dtype; columns returned to the original K order when ``perm`` is given."""
    m, k = shape
    sz = untile_scale_zero(scale_zero, m)
    scales, zeros = sz[..., 0], sz[..., 1]
    q = unpack(qweight, bits, m)[:, :k].float().reshape(m, k // group_size, group_size)
    w = ((q - zeros.float()[..., None]) * scales.float()[..., None]).reshape(m, k).to(scales.dtype)
    return w if perm is None else restore_k_order(w, perm)


def restore_k_order(w: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """A dequantized ``[M, K]`` in the stored (act-order permuted) K order -> the original order:
    stored column ``j`` is original column ``perm[j]``."""
    out = torch.empty_like(w)
    out[:, perm] = w
    return out


class LowBitWeight:
    """A ``[M, K]`` weight quantized to 1, 2, 4 or 8 bits with group-wise scale and zero."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: Optional[torch.Tensor],
        zeros: Optional[torch.Tensor],
        bits: int,
        group_size: Optional[int],
        shape: Tuple[int, int],
        perm: Optional[torch.Tensor] = None,
        *,
        validate: bool = True,
        scale_zero: Optional[torch.Tensor] = None,
    ):
        """``scales`` and ``zeros`` ``[M, K/g]`` are stored as records of 64-row tiles (module
        docstring); or pass them already stored so as ``scale_zero`` ``[Mp/64, K/g, R]`` (with
        ``scales=zeros=None``), as the op and modules do, to skip the copy."""
        try:
            m, k = (int(v) for v in shape)
        except (TypeError, ValueError):
            raise ValueError(f"shape must be a pair of ints, got {shape!r}") from None
        if m < 1 or k < 1:
            raise ValueError(f"shape must be at least 1x1, got {(m, k)}")
        self.bits = check_bits(bits)
        self.group_size = resolve_group_size(group_size, k)
        self.shape = (m, k)
        if scale_zero is None:
            for name, t in (("scales", scales), ("zeros", zeros)):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if scales.dtype != zeros.dtype:
                raise TypeError(f"scales are {scales.dtype} but zeros are {zeros.dtype}")
            if scales.shape != zeros.shape or scales.device != zeros.device:
                raise ValueError(f"scales are {tuple(scales.shape)} on {scales.device} but zeros are "
                                 f"{tuple(zeros.shape)} on {zeros.device}")
            if scales.dim() != 2:
                raise ValueError(f"scales and zeros must be [M, K/g], got {tuple(scales.shape)}")
            scale_zero = tile_scale_zero(torch.stack((scales, zeros), dim=-1).detach(), self.bits)
        elif scales is not None or zeros is not None:
            raise ValueError("pass scales and zeros, or scale_zero, not both")
        self.qweight, self.scale_zero, self.perm = qweight, scale_zero, perm
        # integer_zeros, once computed: (the flag, the scale_zero tensor it was computed from,
        # that tensor's version counter), so in-place edits and a new tensor both invalidate it
        self._integer_zeros: Optional[Tuple[bool, "weakref.ref[torch.Tensor]", Optional[int]]] = None
        if validate:
            self.validate()
        else:
            self.check_structure()

    # construction -------------------------------------------------------------------
    @classmethod
    def quantize(cls, weight: torch.Tensor, bits: int, group_size: Optional[int] = 128) -> "LowBitWeight":
        """Round-to-nearest asymmetric min/max quantization of a fp16/bf16 ``[M, K]`` weight."""
        _check_weight(weight)
        weight = weight.detach()  # the quantized weight is frozen: the op differentiates x and bias only
        bits = check_bits(bits)
        m, k = weight.shape
        g = resolve_group_size(group_size, k)
        levels = (1 << bits) - 1
        w = weight.float().reshape(m, k // g, g)
        wmin, wmax = w.amin(-1), w.amax(-1)
        scale = (wmax - wmin) / levels
        # A constant group: scale |c| and zero 0 (c > 0: q = 1) or 1 (c < 0: q = 0) give c exactly.
        const = scale == 0
        scale = torch.where(const, torch.where(wmax != 0, wmax.abs(), torch.ones_like(wmax)), scale)
        zero = torch.where(const, (wmax < 0).float(), torch.round(-wmin / scale).clamp(0, levels))
        # Quantize against the stored (rounded) scale and zero so dequantization is consistent.
        scale_s, zero_s = scale.to(weight.dtype), zero.to(weight.dtype)
        q = torch.round(w / scale_s.float()[..., None] + zero_s.float()[..., None]).clamp(0, levels)
        q = torch.where(const[..., None], (wmax > 0)[..., None].float().expand_as(q), q)
        q = torch.nn.functional.pad(q.reshape(m, k), (0, padded_k(k) - k))
        return cls(pack(q.to(torch.uint8), bits), scale_s.contiguous(), zero_s.contiguous(), bits, g, (m, k))

    @classmethod
    def from_hqq(cls, W_q, scale, zero, bits: int, group_size: Optional[int], shape) -> "LowBitWeight":
        """Import HQQ/GemLite-style tensors with HQQ's axis=1 grouping: ``W_q`` unpacked integer
        values as ``[M, K]`` or ``[M*K/g, g]``, ``scale``/``zero`` as ``[M, K/g]`` or
        ``[M*K/g, 1]``; HQQ's own formula is ``((W_q - zero) * scale).reshape(shape)``."""
        bits = check_bits(bits)
        m, k = (int(v) for v in shape)
        g = resolve_group_size(group_size, k)
        for name, t in (("W_q", W_q), ("scale", scale), ("zero", zero)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if W_q.numel() != m * k:
            raise ValueError(f"W_q has {W_q.numel()} values, shape {shape} needs {m * k}")
        if W_q.dtype.is_floating_point or W_q.dtype == torch.bool:
            raise TypeError(f"W_q must hold integers, got {W_q.dtype}")
        q = W_q.reshape(m, k).to(torch.int32)
        if bool(((q < 0) | (q > (1 << bits) - 1)).any()):
            raise ValueError(f"W_q has values outside [0, {(1 << bits) - 1}] for {bits} bits")
        groups = m * (k // g)
        for name, t in (("scale", scale), ("zero", zero)):
            if t.numel() != groups:
                raise ValueError(f"{name} has {t.numel()} entries, {groups} groups of {g} need {groups}")
            if t.dtype not in SUPPORTED_DTYPES and t.dtype != torch.float32:
                raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
        dtype = scale.dtype if scale.dtype in SUPPORTED_DTYPES else torch.float16
        q = torch.nn.functional.pad(q, (0, padded_k(k) - k))
        return cls(pack(q.to(torch.uint8), bits), scale.reshape(m, k // g).to(dtype).contiguous(),
                   zero.reshape(m, k // g).to(dtype).contiguous(), bits, g, (m, k))

    @classmethod
    def from_gptq(cls, qweight, scales, qzeros, bits: int = 4, group_size: Optional[int] = 128,
                  g_idx: Optional[torch.Tensor] = None) -> "LowBitWeight":
        """Import a GPTQ layer: ``qweight`` int32 ``[K*bits/32, M]`` (packed along K), ``scales``
        ``[K/g, M]``, ``qzeros`` int32 ``[K/g, M*bits/32]`` holding ``zero - 1``, optional act-order
        ``g_idx`` ``[K]``. GPTQ's formula: ``W[k, m] = scales[g_idx[k], m] * (q[k, m] - (qzeros[g_idx[k], m] + 1))``."""
        bits = check_bits(bits)
        if bits == 1:
            raise ValueError("GPTQ checkpoints use 2, 4 or 8 bits here, got 1")
        for name, t in (("qweight", qweight), ("scales", scales), ("qzeros", qzeros)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 2:
                raise ValueError(f"GPTQ {name} must be 2-D, got shape {tuple(t.shape)}")
        if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
            raise TypeError(f"GPTQ qweight and qzeros must be int32, got {qweight.dtype} and {qzeros.dtype}")
        if scales.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"GPTQ scales must be float16 or bfloat16, got {scales.dtype}")
        per_word = 32 // bits
        k, m = qweight.shape[0] * per_word, qweight.shape[1]
        g = resolve_group_size(group_size, k)
        if scales.shape != (k // g, m):
            raise ValueError(f"GPTQ scales must be [K/g, M] = [{k // g}, {m}], got {tuple(scales.shape)}")
        if qzeros.shape != (k // g, -(-m // per_word)):
            raise ValueError(
                f"GPTQ qzeros must be [K/g, ceil(M*bits/32)] = [{k // g}, {-(-m // per_word)}], got {tuple(qzeros.shape)}"
            )
        q = unpack_bits(qweight.t().contiguous(), bits)  # [M, K]: word w of column m holds k = w*per_word + j
        z = unpack_bits(qzeros, bits)[:, :m].t().float() + 1.0  # [M, K/g], the stored zero - 1 convention
        perm = None
        if g_idx is not None:
            if not isinstance(g_idx, torch.Tensor) or g_idx.shape != (k,):
                raise ValueError(f"g_idx must be a [{k}] tensor")
            g_idx = g_idx.long()
            if bool(((g_idx < 0) | (g_idx >= k // g)).any()):
                raise ValueError(f"g_idx has group indices outside [0, {k // g})")
            trivial = torch.arange(k, device=g_idx.device) // g
            if not torch.equal(g_idx, trivial):
                # Act-order: permute K once so each group is contiguous; x is gathered by perm.
                perm = torch.argsort(g_idx, stable=True)
                if bool((torch.bincount(g_idx, minlength=k // g) != g).any()):
                    raise ValueError("g_idx does not assign exactly group_size input channels to every group")
                q = q[:, perm]
        q = torch.nn.functional.pad(q, (0, padded_k(k) - k))
        return cls(pack(q, bits), scales.t().contiguous(), z.to(scales.dtype).contiguous(), bits, g, (m, k),
                   perm=perm)

    # reference ----------------------------------------------------------------------
    def dequantize(self) -> torch.Tensor:
        """Dense ``[M, K]`` in the weight dtype, in the original K order (perm undone); exactly
        :func:`dequantize` (a CUDA kernel on a GPU: spinfer/ops/to_dense.py)."""
        from ..ops.to_dense import lowbit_to_dense  # the ops import this module

        return lowbit_to_dense(self)

    def validate(self) -> None:
        """Full check: :meth:`check_structure` plus that ``perm`` is a permutation (O(K), and a
        device sync for CUDA arrays)."""
        self.check_structure()
        if self.perm is not None:
            k = self.shape[1]
            if not torch.equal(torch.sort(self.perm).values, torch.arange(k, device=self.perm.device)):
                raise ValueError("perm is not a permutation of range(K)")

    def check_structure(self) -> None:
        """O(1) checks of types, dtypes, shapes and devices, with no device sync."""
        m, k = self.shape
        want = qweight_shape(m, k, self.bits)
        if not isinstance(self.qweight, torch.Tensor) or self.qweight.dtype != torch.int32:
            raise TypeError("qweight must be an int32 tensor")
        if tuple(self.qweight.shape) != want:
            raise ValueError(f"qweight must be {list(want)} for {m}x{k} at {self.bits} bits, "
                             f"got {list(self.qweight.shape)}")
        groups = k // self.group_size
        sz = self.scale_zero
        if not isinstance(sz, torch.Tensor) or sz.dtype not in SUPPORTED_DTYPES:
            raise TypeError("scales and zeros must be float16 or bfloat16 tensors")
        mb = -(-m // ROW_BLOCK)
        widths = (RECORD_NIBBLE_ZEROS, RECORD_DTYPE_ZEROS) if self.bits <= 4 else (RECORD_DTYPE_ZEROS,)
        if sz.dim() != 3 or sz.shape[:2] != (mb, groups) or sz.shape[2] not in widths:
            want = " or ".join(f"[{mb}, {groups}, {w}]" for w in widths)
            raise ValueError(f"scales and zeros must be [{m}, {groups}] (scale_zero records {want} at {self.bits} bits; "
                             f"docs/quant.md), got scale_zero {tuple(sz.shape)}")
        if self.perm is not None:
            if self.perm.shape != (k,) or self.perm.dtype != torch.int64:
                raise ValueError(f"perm must be an int64 [{k}] tensor")
        devices = {t.device for t in (self.qweight, self.scale_zero)}
        if self.perm is not None:
            devices.add(self.perm.device)
        if len(devices) != 1:
            raise ValueError(f"LowBitWeight arrays are on different devices: {sorted(map(str, devices))}")

    # properties and movement -------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.scale_zero.dtype

    @property
    def scales(self) -> torch.Tensor:
        """``[M, K/g]`` scales: a copy (the stored records are in 64-row tiles, module docstring;
        build a new weight to change them)."""
        return untile_scale_zero(self.scale_zero, self.shape[0])[..., 0]

    @property
    def zeros(self) -> torch.Tensor:
        """``[M, K/g]`` zero points: a copy, as :attr:`scales`."""
        return untile_scale_zero(self.scale_zero, self.shape[0])[..., 1]

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def __getstate__(self):
        # (the integer-zeros cache holds a weak reference, which does not pickle; it is remade)
        return {**self.__dict__, "_integer_zeros": None}

    @property
    def integer_zeros(self) -> bool:
        """Whether every zero point is one the fused kernel subtracts exactly with no check of
        its own (:func:`exact_integer_zeros`): true of RTN and GPTQ weights, false of HQQ's
        fractional zeros. Computed on first use (one device sync) and cached until ``scale_zero``
        changes: in place (its version counter, which ``copy_``, ``load_state_dict`` and every
        in-place op bump) or by assigning another tensor. Writes through ``scale_zero.data``
        bypass the version counter and are not seen, nor are in-place writes to an inference
        tensor (one made under ``torch.inference_mode``), which keeps no version counter."""
        cached = self.cached_integer_zeros()
        if cached is None:
            cached = exact_integer_zeros(self.scale_zero, self.bits)
            self._integer_zeros = (cached, weakref.ref(self.scale_zero), version_or_none(self.scale_zero))
        return cached

    def cached_integer_zeros(self) -> Optional[bool]:
        """:attr:`integer_zeros` if it was computed for ``scale_zero`` as it is now, else None;
        never syncs (what a CUDA graph capture or a compiled graph may ask)."""
        if self._integer_zeros is None:
            return None
        flag, ref, version = self._integer_zeros
        if ref() is not self.scale_zero or changed(self.scale_zero, version):
            return None
        return flag

    def storage_bytes(self) -> LowBitStorage:
        def size(t):
            return 0 if t is None else t.numel() * t.element_size()

        scales = size(self.scale_zero[..., :ROW_BLOCK])
        return LowBitStorage(size(self.qweight), scales, size(self.scale_zero) - scales, size(self.perm))

    @property
    def compression_ratio(self) -> float:
        m, k = self.shape
        return 2 * m * k / self.storage_bytes().total

    def to(self, device: Union[str, torch.device]) -> "LowBitWeight":
        perm = None if self.perm is None else self.perm.to(device)
        return LowBitWeight(self.qweight.to(device), None, None, self.bits, self.group_size, self.shape, perm,
                            scale_zero=self.scale_zero.to(device))

    def state_dict(self) -> dict:
        m, k = self.shape
        sd = {"qweight": self.qweight, "scale_zero": self.scale_zero,
              "meta": torch.tensor([FORMAT_VERSION, m, k, self.bits, self.group_size], dtype=torch.int64)}
        if self.perm is not None:
            sd["perm"] = self.perm
        return sd

    @classmethod
    def from_state_dict(cls, state: dict) -> "LowBitWeight":
        m, k, bits, g = read_meta(state, ("qweight", "scale_zero"), "LowBitWeight", FORMAT_VERSION, 5, older=(3,))
        scale_zero = state["scale_zero"]
        if int(state["meta"][0]) == 3:  # saved before format 4: the same qweight, (scale, zero) pairs in tiles
            scale_zero = records_from_format3(scale_zero, m, check_bits(bits))
        return cls(state["qweight"], None, None, bits, None if g == k else g, (m, k), state.get("perm"),
                   scale_zero=scale_zero)

    def __repr__(self) -> str:
        m, k = self.shape
        g = "per-channel" if self.group_size == k else f"g{self.group_size}"
        return (f"LowBitWeight(shape=({m}, {k}), bits={self.bits}, {g}, dtype={self.dtype}, "
                f"device={self.device}, compression_ratio={self.compression_ratio:.2f}x"
                f"{', act-order' if self.perm is not None else ''})")


def _check_weight(weight) -> None:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"low-bit quantization takes float16 or bfloat16 weights, got {weight.dtype}")
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"weight has an empty dimension: shape {tuple(weight.shape)}")
