"""Prune-then-wrap of whole models: ``spinfer.sparsify``."""

from __future__ import annotations

import fnmatch
from typing import Iterable, List, Optional, Sequence

import torch
import torch.nn as nn

from .magnitude import check_sparsity
from .scores import score_mask, wanda_scores

METHODS = ("magnitude", "wanda")


def _matches(name: str, patterns) -> bool:
    return any(p in name or fnmatch.fnmatch(name, p) for p in patterns)


def _eligible(model: nn.Module, include, exclude) -> List[tuple]:
    found = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        if include is not None and not _matches(name, include):
            continue
        if exclude and _matches(name, exclude):
            continue
        found.append((name, mod))
    return found


@torch.no_grad()
def _input_norms(model: nn.Module, layers: Sequence[tuple], calib: Iterable) -> dict:
    """Per layer, the L2 norm over all calibration tokens of each input feature (forward hooks)."""
    sums = {name: None for name, _ in layers}

    def hook(name, width):
        def fn(module, args, kwargs=None):
            x = args[0]
            if x.shape[-1] != width:
                raise ValueError(f"{name}: calibration activations have width {x.shape[-1]}, the layer takes {width}")
            sq = x.detach().float().reshape(-1, width).pow(2).sum(0)
            sums[name] = sq if sums[name] is None else sums[name] + sq
        return fn

    handles = [mod.register_forward_pre_hook(hook(name, mod.in_features)) for name, mod in layers]
    try:
        for batch in calib:
            if isinstance(batch, dict):
                model(**batch)
            elif isinstance(batch, (tuple, list)):
                model(*batch)
            else:
                model(batch)
    finally:
        for h in handles:
            h.remove()
    missing = [n for n, s in sums.items() if s is None]
    if missing:
        raise ValueError(f"calibration batches never reached {missing[:3]}{'...' if len(missing) > 3 else ''}")
    return {n: s.sqrt() for n, s in sums.items()}


def sparsify(model: nn.Module, sparsity: float = 0.5, method: str = "wanda", calib: Optional[Iterable] = None, *,
             quant: Optional[str] = None, group_size: Optional[int] = 128, include=None, exclude=("lm_head",),
             nm: Optional[tuple] = None, per_row: Optional[bool] = None, policy: str = "auto",
             progress: bool = True) -> List[dict]:
    """Prune every eligible ``nn.Linear`` of ``model`` and replace it with a
    :class:`~spinfer.nn.SparseLinear`, in place. Returns one report row per layer.

    ``method``: ``"magnitude"`` (|W|, per layer unless ``per_row``) or ``"wanda"`` (|W| times the
    input-activation norms collected from ``calib`` batches, compared per output row as in the
    paper). ``nm=(2, 4)`` prunes to an N:M pattern instead of ``sparsity``. ``quant`` and
    ``group_size`` (None: per channel) as for :meth:`SparseLinear.from_weight`. ``include`` /
    ``exclude``: substrings or globs of module names.
    """
    from ..nn.sparse_linear import SparseLinear

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if nm is None:
        check_sparsity(sparsity)
    layers = _eligible(model, include, exclude)
    if not layers:
        raise ValueError("sparsify found no nn.Linear to prune (check include/exclude)")
    devices = {}
    for name, mod in layers:
        devices.setdefault(mod.weight.device, name)
    if len(devices) > 1:
        (d0, n0), (d1, n1) = list(devices.items())[:2]
        raise ValueError(f"the model mixes devices: layer {n0!r} is on {d0} and layer {n1!r} on {d1}; move it to one device first")
    if method == "wanda":
        if calib is None:
            raise ValueError("method='wanda' needs calibration batches: pass calib=[...]")
        norms = _input_norms(model, layers, calib)
    if per_row is None:
        per_row = method == "wanda"
    iterator = layers
    if progress:
        try:
            from tqdm.auto import tqdm

            iterator = tqdm(layers, desc="sparsify", unit="layer")
        except ImportError:
            pass
    report = []
    for name, lin in iterator:
        w = lin.weight.detach()
        if w.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{name}: weights are {w.dtype}; convert the model with .half() or .bfloat16() first")
        scores = wanda_scores(w, norms[name]) if method == "wanda" else w.abs().float()
        keep = score_mask(scores, sparsity, per_row=per_row, nm=nm)
        pruned = w.masked_fill(~keep, 0.0)
        layer = SparseLinear.from_weight(pruned, lin.bias, quant=quant, group_size=group_size, policy=policy)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        report.append({
            "layer": name,
            "shape": (lin.out_features, lin.in_features),
            "sparsity": layer.sparsity if layer.format != "lowbit" else float((~keep).float().mean()),
            "format": layer.format,
            "compression_ratio": layer.compression_ratio,
            "memory_before": w.numel() * w.element_size(),
            "memory_after": layer.memory_bytes(),
            "kernels": {b: layer.choose(b) for b in (1, 16, 128, 1024)},
        })
    return report
