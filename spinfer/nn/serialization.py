"""``spinfer.save`` / ``spinfer.load``: a model with SparseLinear layers to and from a
safetensors file. The file holds the state_dict plus a manifest naming every SparseLinear, its
format and its shape, so loading can rebuild those layers in a freshly built (dense) model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

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
    load_state_dict then replaces (TCA-BME arrays are resized to the stored ones)."""
    from ..format import TCABME
    from ..quant import LowBitWeight

    _, code, m, k, a0, a1, _, _ = (int(v) for v in meta.tolist())
    fmt = {v: f for f, v in _FORMAT_CODE.items()}.get(code)
    zeros = torch.zeros(m, k, dtype=dtype)
    b = torch.zeros(m, dtype=dtype) if bias else None
    if fmt == "dense":
        return SparseLinear(zeros, b, policy=policy)
    if fmt == "tca-bme":
        return SparseLinear(TCABME.from_dense(zeros, group_tile=(a0, a1)), b, policy=policy)
    if fmt == "lowbit":
        return SparseLinear(LowBitWeight.quantize(zeros, a0, a1), b, policy=policy)
    raise ValueError(f"unknown SparseLinear format code {code}")


def load(model: nn.Module, path: Union[str, Path], device: Union[str, torch.device, None] = None) -> nn.Module:
    """Load a file written by :func:`save` into ``model`` (built the same way, before or after
    sparsify): every layer named in the file's manifest becomes a SparseLinear of the stored
    format; the arrays are validated. Returns ``model``."""
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
    model.load_state_dict(state)
    if device is not None:
        model.to(device)
    return model
