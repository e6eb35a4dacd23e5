"""Reading the ``meta`` record every format writes into its state_dict (untrusted input)."""

from __future__ import annotations

from typing import Iterable, List

import torch


def read_meta(state: dict, arrays: Iterable[str], format_name: str, version: int, fields: int,
              older: Iterable[int] = ()) -> List[int]:
    """Check that ``state`` holds ``arrays`` and an int64 ``meta`` of ``fields`` entries whose
    first is ``version`` (or one of the ``older`` versions the caller converts); return the meta
    entries after the version."""
    missing = (set(arrays) | {"meta"}) - set(state)
    if missing:
        raise ValueError(f"{format_name} state_dict is missing {sorted(missing)}")
    meta = state["meta"]
    if not isinstance(meta, torch.Tensor) or meta.dtype != torch.int64 or meta.shape != (fields,):
        raise ValueError(f"{format_name} state_dict 'meta' must be an int64 tensor of {fields} entries")
    values = [int(v) for v in meta.tolist()]
    if values[0] != version and values[0] not in older:
        readable = ", ".join(str(v) for v in sorted({version, *older}))
        raise ValueError(f"{format_name} format version {values[0]} is not supported (this version reads {readable})")
    return values[1:]
