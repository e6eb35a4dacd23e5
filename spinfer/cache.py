"""The user's spinfer cache folder (``$SPINFER_CACHE`` or ``~/.cache/spinfer``) and the small
JSON files kept there: device profiles, roofline ceilings, autotune results."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional


def cache_root() -> Path:
    return Path(os.environ.get("SPINFER_CACHE", Path.home() / ".cache" / "spinfer"))


def read_all(name: str) -> dict:
    """Every entry of a JSON cache file; empty when it is absent or not a JSON object."""
    try:
        data = json.loads((cache_root() / name).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_entry(name: str, key: str) -> Optional[Any]:
    return read_all(name).get(key)


def write_entry(name: str, key: str, value: Any) -> None:
    """Set one key of a JSON cache file; the replace is atomic, so a concurrent reader sees the
    old file or the new one, never half of one."""
    path = cache_root() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[key] = value
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
