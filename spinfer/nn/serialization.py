"""``spinfer.save`` / ``spinfer.load``: a model with SparseLinear layers to and from a
safetensors file. The file holds the state_dict plus a manifest naming every SparseLinear, its
format and its shape, so loading can rebuild those layers in a freshly built (dense) model."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn

from .sparse_linear import _FORMAT_CODE, SparseLinear

_MANIFEST = "spinfer.sparse_layers"


def save(model: nn.Module, path: Union[str, Path]) -> None:
    from safetensors.torch import save_file

    layers = {name: {"format": mod.format, "shape": [mod.out_features, mod.in_features], "policy": mod.policy}
              for name, mod in model.named_modules() if isinstance(mod, SparseLinear)}
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(path), metadata={_MANIFEST: json.dumps(layers)})


def _empty_layer(meta: torch.Tensor, policy: str, bias: bool, dtype) -> SparseLinear:
    """A SparseLinear of the stored format and shape, with placeholder arrays that
    load_state_dict then replaces (TCA-BME arrays are resized to the stored ones). The arrays
    are made as they are stored, not by encoding or quantizing a zero matrix: that took 0.43 s
    of a 14336x4096 TCA-BME layer's 0.69 s load on the CPU."""
    from ..format import TCABME, Geometry
    from ..format.tca_bme import row_table_dtype
    from ..quant import LowBitWeight
    from ..quant.lowbit import qweight_shape, resolve_group_size, tile_scale_zero

    _, code, m, k, a0, a1, _, _ = (int(v) for v in meta.tolist())
    fmt = {v: f for f, v in _FORMAT_CODE.items()}.get(code)
    b = torch.zeros(m, dtype=dtype) if bias else None
    if fmt == "dense":
        return SparseLinear(torch.zeros(m, k, dtype=dtype), b, policy=policy)
    if fmt == "tca-bme":  # an all-zero weight: empty bitmaps, no values, empty runs
        geom = Geometry(m, k, a0, a1)
        weight = TCABME(torch.zeros(geom.num_bitmap_tiles, dtype=torch.int64), torch.zeros(0, dtype=dtype),
                        torch.zeros(geom.num_group_tiles + 1, dtype=torch.int32), (m, k), (a0, a1), validate=False,
                        max_run=0, row_offset=torch.zeros(geom.num_group_tiles, geom.gt_h // 16, dtype=row_table_dtype(geom)))
        weight._nnz = 0
        return SparseLinear(weight, b, policy=policy)
    if fmt == "lowbit":  # q = 0 with zero scales
        g = resolve_group_size(a1, k)
        scale_zero = tile_scale_zero(torch.zeros(m, k // g, 2, dtype=dtype), a0)  # (the stored layout's one definition)
        weight = LowBitWeight(torch.zeros(qweight_shape(m, k, a0), dtype=torch.int32), None, None, a0, g, (m, k),
                              scale_zero=scale_zero, validate=False)
        return SparseLinear(weight, b, policy=policy)
    raise ValueError(f"unknown SparseLinear format code {code}")


def load(model: nn.Module, path: Union[str, Path], device: Union[str, torch.device, None] = None, *,
         assign: Optional[bool] = None) -> nn.Module:
    """Load a file written by :func:`save` into ``model`` (built the same way, before or after
    sparsify): every layer named in the file's manifest becomes a SparseLinear of the stored
    format; the arrays are validated. ``assign`` as for ``load_state_dict``: the file's tensors
    become the model's instead of being copied into them; by default it is on where the model
    has tensors on the meta device (built under ``torch.device("meta")`` so that no dense weight
    is ever allocated), into which a copy would do nothing. Returns ``model``."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            manifest = json.loads((f.metadata() or {}).get(_MANIFEST, "null"))
            state = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, FileNotFoundError):
        raise
    except Exception as exc:
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} was not written by spinfer.save (no sparse-layer manifest)")
    for name, info in manifest.items():
        try:
            current = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"the file has a layer {name!r} that this model does not have") from None
        if not isinstance(current, (nn.Linear, SparseLinear)):
            raise ValueError(f"{name!r} is a {type(current).__name__} in this model, the file holds a linear layer")
        if [current.out_features, current.in_features] != info["shape"]:
            raise ValueError(f"{name!r} is {current.out_features}x{current.in_features} in this model, "
                             f"{info['shape'][0]}x{info['shape'][1]} in the file")
        meta = state.get(f"{name}.spinfer_meta")
        if meta is None:
            raise ValueError(f"{path}: layer {name!r} has no spinfer_meta")
        values = [v for k, v in state.items() if k.startswith(name + ".") and v.is_floating_point()]
        layer = _empty_layer(meta, info.get("policy", "auto"), f"{name}.bias" in state,
                             values[0].dtype if values else torch.float16)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    if assign is None:
        assign = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    model.load_state_dict(state, assign=assign)
    if device is not None:
        model.to(device)
    return model
