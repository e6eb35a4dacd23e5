"""Tensor-Core-Aware Bitmap Encoding (TCA-BME), the sparse weight format of SpInfer.

Layout (docs/format.md has a worked example):

* A weight ``W [M, K]`` is zero-padded to ``[Mp, Kp]``, multiples of the GroupTile
  ``(gt_h, gt_w)`` (default 64x64).  The logical shape is kept beside the arrays.
* **BitmapTile**: 8x8 elements, one 64-bit word, bit ``r*8 + c`` set when element
  ``(r, c)`` is stored.
* **TCTile**: 16x16 elements = 2x2 BitmapTiles in *column-major* order (top-left,
  bottom-left, top-right, bottom-right): the order of the mma.m16n8k16 A-fragment
  registers Ra0..Ra3.
* **GroupTile**: ``gt_h x gt_w`` elements; its TCTiles row-major; GroupTiles row-major over
  the ``[Mp/gt_h, Kp/gt_w]`` grid.
* ``bitmap``: int64 ``[NBT]`` (uint64 bit patterns), BitmapTiles in the nested order above.
* ``values``: the stored elements in GroupTile -> TCTile -> BitmapTile -> bit order; each
  GroupTile's run is zero-padded to a multiple of ``VALUE_ALIGN`` elements (16 bytes) so a
  kernel can fetch any run with aligned 128-bit copies.
* ``gtile_offset``: int32 ``[NGT + 1]``, start of each GroupTile's run in ``values``.

"Stored" means the 16-bit pattern is not all-zero: +0.0 is dropped, while -0.0 and NaN are
kept, so decoding is bit-exact for every input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Tuple, Union

import torch

from .bits import pack_bitmaps, popcount64, unpack_bitmaps
from .state import read_meta

VALUE_ALIGN = 8  # elements per GroupTile run alignment: 16 bytes of 16-bit values
FORMAT_NAME = "tca-bme"
FORMAT_VERSION = 1
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
DEFAULT_GROUP_TILE = (64, 64)
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class StorageBreakdown:
    """Bytes of each TCA-BME array; ``total`` is what the format costs in memory."""

    offsets: int  # 4 B * (NGT + 1)
    bitmap: int  # 8 B * NBT
    values: int  # 2 B * NNZ
    padding: int  # 2 B * zero elements that align each GroupTile run to 16 bytes

    @property
    def total(self) -> int:
        return self.offsets + self.bitmap + self.values + self.padding

    @property
    def eq9(self) -> int:
        """SpInfer paper eq. 9: 4B*(NGT+1) + 8B*NBT + 2B*NNZ (no alignment padding)."""
        return self.offsets + self.bitmap + self.values


@dataclass(frozen=True)
class Geometry:
    """Tile counts of a logical ``[M, K]`` weight under a GroupTile shape. Each count is computed
    once, at construction: every spmm call checks the arrays' sizes against them. (Not
    ``functools.cached_property``: on Python <= 3.11 it takes a lock, which torch.compile cannot
    trace, so a model compiled before its first eager call broke its graph there.)"""

    m: int
    k: int
    gt_h: int
    gt_w: int
    padded_shape: Tuple[int, int] = field(init=False)
    grid: Tuple[int, int] = field(init=False)
    num_group_tiles: int = field(init=False)
    num_bitmap_tiles: int = field(init=False)

    def __post_init__(self):
        mp, kp = -(-self.m // self.gt_h) * self.gt_h, -(-self.k // self.gt_w) * self.gt_w
        gm, gk = mp // self.gt_h, kp // self.gt_w
        set_ = object.__setattr__  # (frozen)
        set_(self, "padded_shape", (mp, kp))
        set_(self, "grid", (gm, gk))
        set_(self, "num_group_tiles", gm * gk)
        set_(self, "num_bitmap_tiles", gm * gk * self.gtile_elems // 64)

    @property
    def gtile_elems(self) -> int:
        return self.gt_h * self.gt_w


def check_group_tile(group_tile) -> Tuple[int, int]:
    try:
        gt_h, gt_w = (int(v) for v in group_tile)
    except (TypeError, ValueError):
        raise ValueError(f"group_tile must be a pair of ints, got {group_tile!r}") from None
    if gt_h <= 0 or gt_w <= 0 or gt_h % 16 or gt_w % 16:
        raise ValueError(
            f"group_tile dimensions must be positive multiples of 16 (a TCTile), got {(gt_h, gt_w)}"
        )
    return gt_h, gt_w


def _to_tile_order(padded: torch.Tensor, gt_h: int, gt_w: int) -> torch.Tensor:
    """``[Mp, Kp]`` -> ``[NGT, gt_h*gt_w]`` with each row one GroupTile in storage order."""
    mp, kp = padded.shape
    gm, gk, tr, tc = mp // gt_h, kp // gt_w, gt_h // 16, gt_w // 16
    t = padded.reshape(gm, tr, 2, 8, gk, tc, 2, 8)  # gm, tr, br, r, gk, tc, bc, c
    # -> gm, gk, tr, tc, bc, br, r, c: GroupTiles row-major, TCTiles row-major,
    # BitmapTiles column-major (bc outer, br inner), elements r*8 + c.
    return t.permute(0, 4, 1, 5, 6, 2, 3, 7).reshape(gm * gk, gt_h * gt_w)


def _from_tile_order(tiles: torch.Tensor, geom: Geometry) -> torch.Tensor:
    """Inverse of :func:`_to_tile_order`, returning the padded ``[Mp, Kp]`` matrix."""
    gm, gk = geom.grid
    tr, tc = geom.gt_h // 16, geom.gt_w // 16
    t = tiles.reshape(gm, gk, tr, tc, 2, 2, 8, 8)  # gm, gk, tr, tc, bc, br, r, c
    return t.permute(0, 2, 5, 6, 1, 3, 4, 7).reshape(geom.padded_shape)


def _run_index(mask: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """Flat indices into ``[NGT, E + VALUE_ALIGN]`` of every slot of the padded value runs,
    in storage order: each GroupTile's stored elements, then ``pad[g]`` padding slots.
    (nonzero + index_select is several times faster on CPU than boolean indexing.)"""
    cols = torch.arange(VALUE_ALIGN, device=mask.device)
    return torch.cat([mask, cols < pad[:, None]], dim=1).reshape(-1).nonzero().squeeze(1)


def _gtile_counts(bitmap: torch.Tensor, num_group_tiles: int) -> torch.Tensor:
    """Stored elements per GroupTile, by PopCount of its bitmap words."""
    return popcount64(bitmap).reshape(num_group_tiles, -1).sum(1)


def row_table_dtype(geom: Geometry) -> torch.dtype:
    """The row table's dtype: int16 where a GroupTile's largest entry, (gt_h - 16) * gt_w, fits
    (every GroupTile up to 128x128, among them the 64x64 the CUDA kernel takes), int32 beyond."""
    return torch.int16 if (geom.gt_h - 16) * geom.gt_w <= torch.iinfo(torch.int16).max else torch.int32


def row_offsets(bitmap: torch.Tensor, geom: Geometry) -> torch.Tensor:
    """``[NGT, gt_h / 16]`` of :func:`row_table_dtype`: for each GroupTile, the stored elements of
    its TCTile rows above each row (0 for the first). The CUDA kernel reads a decoding warp's start
    in the GroupTile's run from it instead of counting the rows above every stage
    (docs/kernels.md). Derived from the bitmap, so it is made, moved and dropped with the weight
    and never saved."""
    rows = geom.gt_h // 16
    per_row = popcount64(bitmap).reshape(geom.num_group_tiles, rows, -1).sum(-1)
    return (torch.cumsum(per_row, 1) - per_row).to(row_table_dtype(geom))


def check_row_table(row_offset: Optional[torch.Tensor], geom: Geometry, device: torch.device) -> None:
    """A row table passed beside the arrays has :func:`row_offsets`' dtype and shape and the
    arrays' device (its values are not trusted: the kernel clamps what it derives from them)."""
    if row_offset is None:
        return
    want = (geom.num_group_tiles, geom.gt_h // 16)
    dtype = row_table_dtype(geom)
    if not isinstance(row_offset, torch.Tensor) or row_offset.dtype != dtype:
        got = row_offset.dtype if isinstance(row_offset, torch.Tensor) else type(row_offset).__name__
        raise TypeError(f"row_offset must be an {str(dtype).removeprefix('torch.')} tensor, got {got}")
    if tuple(row_offset.shape) != want:
        raise ValueError(f"row_offset must have shape {want}, got {tuple(row_offset.shape)}")
    if row_offset.device != device:
        raise ValueError(f"row_offset is on {row_offset.device} but the weight is on {device}")


def encode(weight: torch.Tensor, group_tile=DEFAULT_GROUP_TILE):
    """Encode a dense ``[M, K]`` fp16/bf16 weight; returns ``(bitmap, values, gtile_offset)``. On
    the CPU the compiled encoder (spinfer/cpu_kernels.py) makes them, elsewhere (or without it)
    :func:`encode_reference`; the same arrays either way."""
    check_weight(weight)
    group_tile = check_group_tile(group_tile)
    if weight.device.type == "cpu":
        from .. import cpu_kernels  # (a leaf module: no cycle, but the format package loads first)

        arrays = cpu_kernels.tca_bme_encode(weight, group_tile)
        if arrays is not None:
            return arrays
    return encode_reference(weight, group_tile)


def encode_reference(weight: torch.Tensor, group_tile=DEFAULT_GROUP_TILE):
    """:func:`encode` in torch ops, on any device: the reference the compiled encoder is held to."""
    check_weight(weight)
    weight = weight.detach()  # the encoded weight is frozen: the ops differentiate x and bias only
    gt_h, gt_w = check_group_tile(group_tile)
    m, k = weight.shape
    geom = Geometry(m, k, gt_h, gt_w)
    mp, kp = geom.padded_shape
    padded = torch.nn.functional.pad(weight, (0, kp - k, 0, mp - m))
    tiles = _to_tile_order(padded, gt_h, gt_w)
    mask = tiles.view(torch.int16) != 0  # bit pattern, so -0.0 survives the round trip
    bitmap = pack_bitmaps(mask.reshape(-1, 64))
    counts = _gtile_counts(bitmap, geom.num_group_tiles)
    pad = (-counts) % VALUE_ALIGN
    ends = torch.cumsum(counts + pad, 0)
    total = int(ends[-1]) if ends.numel() else 0
    if total > _INT32_MAX:
        raise ValueError(
            f"weight has {total} stored values, more than int32 GroupTile offsets can address"
        )
    ext = torch.cat([tiles, tiles.new_zeros(tiles.shape[0], VALUE_ALIGN)], dim=1)
    values = ext.reshape(-1).index_select(0, _run_index(mask, pad))
    offsets = torch.zeros(geom.num_group_tiles + 1, dtype=torch.int32, device=weight.device)
    offsets[1:] = ends.to(torch.int32)
    return bitmap, values, offsets


def decode(bitmap, values, gtile_offset, shape, group_tile=DEFAULT_GROUP_TILE) -> torch.Tensor:
    """Dense ``[M, K]`` weight from validated TCA-BME arrays."""
    geom = Geometry(int(shape[0]), int(shape[1]), *check_group_tile(group_tile))
    mask = unpack_bitmaps(bitmap).reshape(geom.num_group_tiles, geom.gtile_elems)
    counts = _gtile_counts(bitmap, geom.num_group_tiles)
    pad = gtile_offset[1:].long() - gtile_offset[:-1].long() - counts
    ext = values.new_zeros(geom.num_group_tiles, geom.gtile_elems + VALUE_ALIGN)
    ext.view(-1).index_copy_(0, _run_index(mask, pad), values)
    dense = _from_tile_order(ext[:, : geom.gtile_elems], geom)
    return dense[: geom.m, : geom.k].contiguous()


def check_weight(weight) -> None:
    """Reject what the encoder cannot store, naming the problem."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"TCA-BME stores torch.float16 or torch.bfloat16 weights, got {weight.dtype}; "
            "convert with .half() or .bfloat16() first"
        )
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"weight has an empty dimension: shape {tuple(weight.shape)}")
    if weight.is_meta:  # (the arrays' lengths depend on where the nonzeros are)
        raise ValueError("a weight on the meta device has no values to encode; build the layer from a real "
                         "weight, or build the model on the meta device and fill it with spinfer.load")


def check_structure(bitmap, values, gtile_offset, geom: Geometry) -> None:
    """Cheap O(1) checks: types, dtypes, sizes and devices of the three arrays."""
    for name, arr in (("bitmap", bitmap), ("values", values), ("gtile_offset", gtile_offset)):
        if not isinstance(arr, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(arr).__name__}")
        if arr.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    if bitmap.dtype != torch.int64:
        raise TypeError(f"bitmap must be torch.int64 (uint64 bit patterns), got {bitmap.dtype}")
    if values.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"values must be torch.float16 or torch.bfloat16, got {values.dtype}")
    if gtile_offset.dtype != torch.int32:
        raise TypeError(f"gtile_offset must be torch.int32, got {gtile_offset.dtype}")
    if not (bitmap.device == values.device == gtile_offset.device):
        raise ValueError(
            f"TCA-BME arrays are on different devices: bitmap {bitmap.device}, "
            f"values {values.device}, gtile_offset {gtile_offset.device}"
        )
    if geom.m < 1 or geom.k < 1:
        raise ValueError(f"logical shape must be at least 1x1, got {(geom.m, geom.k)}")
    if bitmap.numel() != geom.num_bitmap_tiles:
        raise ValueError(
            f"bitmap has {bitmap.numel()} words, a {geom.m}x{geom.k} weight with GroupTile "
            f"{geom.gt_h}x{geom.gt_w} needs {geom.num_bitmap_tiles}"
        )
    if gtile_offset.numel() != geom.num_group_tiles + 1:
        raise ValueError(
            f"gtile_offset has {gtile_offset.numel()} entries, expected NGT+1 = "
            f"{geom.num_group_tiles + 1}"
        )


def _boundary_bits_set(bitmap: torch.Tensor, geom: Geometry) -> bool:
    """True when a bit is set in the zero padding beyond row M or column K."""
    gm, gk = geom.grid
    mp, kp = geom.padded_shape
    if mp == geom.m and kp == geom.k:
        return False
    # Coordinates of every element of one GroupTile, in storage order.
    rows = torch.arange(geom.gt_h, device=bitmap.device)[:, None].expand(geom.gt_h, geom.gt_w)
    cols = torch.arange(geom.gt_w, device=bitmap.device)[None, :].expand(geom.gt_h, geom.gt_w)
    local_r = _to_tile_order(rows, geom.gt_h, geom.gt_w)[0]
    local_c = _to_tile_order(cols, geom.gt_h, geom.gt_w)[0]
    words = bitmap.reshape(gm, gk, geom.gtile_elems // 64)
    edge = []
    if mp != geom.m:  # last GroupTile row
        edge.append((words[gm - 1], local_r + (gm - 1) * geom.gt_h >= geom.m))
    if kp != geom.k:  # last GroupTile column
        edge.append((words[:, gk - 1], local_c + (gk - 1) * geom.gt_w >= geom.k))
    for w, outside in edge:
        bits = unpack_bitmaps(w).reshape(w.shape[0], geom.gtile_elems)
        if bool((bits & outside).any()):
            return True
    return False


def longest_run(gtile_offset: torch.Tensor) -> int:
    """Longest GroupTile value run (elements, padding included) given by the offsets."""
    off = gtile_offset.long()
    return int((off[1:] - off[:-1]).max()) if off.numel() > 1 else 0


def validate_arrays(bitmap, values, gtile_offset, geom: Geometry) -> None:
    """Full check that the arrays are a well-formed TCA-BME encoding of ``geom``.

    After this passes, every GroupTile run lies inside ``values``, holds exactly the
    PopCount of its bitmaps rounded up to ``VALUE_ALIGN``, and no bit is set in the
    padding beyond the logical shape: a kernel decoding it cannot read out of bounds.
    """
    check_structure(bitmap, values, gtile_offset, geom)
    off = gtile_offset.long()
    if int(off[0]) != 0:
        raise ValueError(f"gtile_offset[0] must be 0, got {int(off[0])}")
    run = off[1:] - off[:-1]
    if bool((run < 0).any()):
        g = int(torch.nonzero(run < 0)[0])
        raise ValueError(f"gtile_offset is not monotone: entry {g + 1} < entry {g}")
    if bool((off % VALUE_ALIGN != 0).any()):
        g = int(torch.nonzero(off % VALUE_ALIGN != 0)[0])
        raise ValueError(
            f"gtile_offset[{g}] = {int(off[g])} is not a multiple of {VALUE_ALIGN} (16-byte runs)"
        )
    if int(off[-1]) != values.numel():
        raise ValueError(
            f"gtile_offset ends at {int(off[-1])} but values has {values.numel()} elements"
        )
    counts = _gtile_counts(bitmap, geom.num_group_tiles)
    expected = counts + (-counts) % VALUE_ALIGN
    bad = run != expected
    if bool(bad.any()):
        g = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"GroupTile {g}: its bitmaps hold {int(counts[g])} nonzeros (run of "
            f"{int(expected[g])} with padding) but gtile_offset gives a run of {int(run[g])}"
        )
    if _boundary_bits_set(bitmap, geom):
        raise ValueError(f"bitmap marks nonzeros outside the logical {geom.m}x{geom.k} shape")


class TCABME:
    """A sparse ``[M, K]`` weight in TCA-BME.  Build it with :meth:`from_dense`."""

    def __init__(
        self,
        bitmap: torch.Tensor,
        values: torch.Tensor,
        gtile_offset: torch.Tensor,
        shape: Tuple[int, int],
        group_tile: Tuple[int, int] = DEFAULT_GROUP_TILE,
        *,
        validate: bool = True,
        max_run: Optional[int] = None,
        row_offset: Optional[torch.Tensor] = None,
    ):
        try:
            m, k = (int(v) for v in shape)
        except (TypeError, ValueError):
            raise ValueError(f"shape must be a pair of ints, got {shape!r}") from None
        self.geometry = Geometry(m, k, *check_group_tile(group_tile))
        self.bitmap = bitmap
        self.values = values
        self.gtile_offset = gtile_offset
        self._nnz: Optional[int] = None
        if validate:
            self.validate()
        else:
            check_structure(bitmap, values, gtile_offset, self.geometry)
        # Read now, eagerly: under torch.compile a lazy read would be data-dependent. Callers
        # that already know it (a module rebuilding its weight) pass it and skip the sync.
        if max_run is None or validate:
            actual = longest_run(gtile_offset)
            if max_run is not None and int(max_run) != actual:
                raise ValueError(f"max_run={max_run} does not match the longest GroupTile run ({actual})")
            max_run = actual
        self._max_run = int(max_run)
        # The kernel's row table: made here unless the caller kept it (a module rebuilding its
        # weight from buffers, where a compiled graph must not recompute it every call).
        check_row_table(row_offset, self.geometry, bitmap.device)
        self.row_offset = row_offsets(bitmap, self.geometry) if row_offset is None else row_offset

    # construction -------------------------------------------------------------------
    @classmethod
    def from_dense(cls, weight: torch.Tensor, group_tile=DEFAULT_GROUP_TILE) -> "TCABME":
        """Encode a dense fp16/bf16 ``[M, K]`` weight (CPU or CUDA; same arrays either way)."""
        bitmap, values, offsets = encode(weight, group_tile)
        out = cls(bitmap, values, offsets, tuple(weight.shape), group_tile, validate=False)
        return out

    def to_dense(self) -> torch.Tensor:
        """The dense ``[M, K]`` weight, bit-exact (a CUDA kernel on a GPU: spinfer/ops/to_dense.py)."""
        from ..ops.to_dense import tca_bme_to_dense  # the ops import this module

        return tca_bme_to_dense(self)

    def validate(self) -> None:
        validate_arrays(self.bitmap, self.values, self.gtile_offset, self.geometry)

    # properties ---------------------------------------------------------------------
    @property
    def shape(self) -> Tuple[int, int]:
        return (self.geometry.m, self.geometry.k)

    @property
    def group_tile(self) -> Tuple[int, int]:
        return (self.geometry.gt_h, self.geometry.gt_w)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nnz(self) -> int:
        """Stored elements (nonzero bit patterns), excluding alignment padding."""
        if self._nnz is None:
            self._nnz = int(popcount64(self.bitmap).sum())
        return self._nnz

    @property
    def max_run(self) -> int:
        """Longest GroupTile value run (elements, padding included). Kernels size their
        shared-memory value buffers by it instead of by a dense GroupTile."""
        return self._max_run

    @property
    def sparsity(self) -> float:
        m, k = self.shape
        return 1.0 - self.nnz / (m * k)

    def storage_bytes(self) -> StorageBreakdown:
        """Bytes of each array, read off the arrays themselves."""
        nnz = self.nnz
        vsize = self.values.element_size()
        return StorageBreakdown(
            offsets=self.gtile_offset.numel() * self.gtile_offset.element_size(),
            bitmap=self.bitmap.numel() * self.bitmap.element_size(),
            values=nnz * vsize,
            padding=(self.values.numel() - nnz) * vsize,
        )

    @property
    def compression_ratio(self) -> float:
        """Dense fp16 bytes over TCA-BME bytes (paper eq. 1), alignment padding counted."""
        m, k = self.shape
        return 2 * m * k / self.storage_bytes().total

    # movement and persistence -------------------------------------------------------
    def to(self, device: Union[str, torch.device]) -> "TCABME":
        out = TCABME(
            self.bitmap.to(device),
            self.values.to(device),
            self.gtile_offset.to(device),
            self.shape,
            self.group_tile,
            validate=False,
            max_run=self.max_run,
            row_offset=self.row_offset.to(device),
        )
        out._nnz = self._nnz
        return out

    def state_dict(self) -> dict:
        m, k = self.shape
        meta = torch.tensor([FORMAT_VERSION, m, k, *self.group_tile], dtype=torch.int64)
        return {
            "bitmap": self.bitmap,
            "values": self.values,
            "gtile_offset": self.gtile_offset,
            "meta": meta,
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> "TCABME":
        """Rebuild from :meth:`state_dict`; the arrays are untrusted, so this validates."""
        m, k, gt_h, gt_w = read_meta(state, ("bitmap", "values", "gtile_offset"), "TCA-BME", FORMAT_VERSION, 5)
        return cls(state["bitmap"], state["values"], state["gtile_offset"], (m, k), (gt_h, gt_w))

    def save(self, path: Union[str, Path]) -> None:
        """Write a safetensors file (arrays + shape metadata)."""
        from safetensors.torch import save_file

        m, k = self.shape
        meta = {
            "format": FORMAT_NAME,
            "version": str(FORMAT_VERSION),
            "shape": json.dumps([m, k]),
            "group_tile": json.dumps(list(self.group_tile)),
        }
        tensors = {
            "bitmap": self.bitmap.contiguous().cpu(),
            "values": self.values.contiguous().cpu(),
            "gtile_offset": self.gtile_offset.contiguous().cpu(),
        }
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: Union[str, Path], device: Union[str, torch.device] = "cpu") -> "TCABME":
        """Read a file written by :meth:`save`; the file is untrusted and is validated."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                names = set(f.keys())
                tensors = {n: f.get_tensor(n) for n in names & {"bitmap", "values", "gtile_offset"}}
        except (OSError, FileNotFoundError):
            raise
        except Exception as exc:  # safetensors raises its own error type for bad headers
            raise ValueError(f"{path} is not a readable safetensors file: {exc}") from None
        if meta.get("format") != FORMAT_NAME:
            raise ValueError(f"{path} is not a TCA-BME file (format={meta.get('format')!r})")
        if meta.get("version") != str(FORMAT_VERSION):
            raise ValueError(f"{path}: TCA-BME version {meta.get('version')!r} is not supported")
        missing = {"bitmap", "values", "gtile_offset"} - set(tensors)
        if missing:
            raise ValueError(f"{path} is missing the arrays {sorted(missing)}")
        try:
            shape = json.loads(meta["shape"])
            group_tile = json.loads(meta["group_tile"])
        except (KeyError, ValueError, TypeError):
            raise ValueError(f"{path}: malformed shape/group_tile metadata") from None
        out = cls(tensors["bitmap"], tensors["values"], tensors["gtile_offset"], shape, group_tile)
        return out.to(device)

    def __repr__(self) -> str:
        m, k = self.shape
        return (
            f"TCABME(shape=({m}, {k}), dtype={self.dtype}, device={self.device}, "
            f"group_tile={self.group_tile}, sparsity={self.sparsity:.3f}, "
            f"compression_ratio={self.compression_ratio:.2f}x)"
        )
