"""Build of the CUDA extension: torch.utils.cpp_extension + ninja, compiled on first use into
a cache folder keyed by the sources, torch and CUDA versions, and reused after that.

    python -m spinfer.build        # prebuild and report

Set SPINFER_CACHE to choose the folder (default: ~/.cache/spinfer). A failed build raises
RuntimeError carrying the compiler's message.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ["bindings.cpp", "spmm_smbd.cu", "spmm_smbd_fp16.cu", "spmm_smbd_bf16.cu", "lowbit_mm.cu", "to_dense.cu"] + [
    f"lowbit_mm_{dt}_{bits}.cu" for dt in ("fp16", "bf16") for bits in (1, 2, 4, 8)
]
CUDA_FLAGS = [  # no -std: torch adds the one its headers need (C++20 for torch 2.10+)
    "-O3",
    "-lineinfo",
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90a,code=sm_90a",
]

_loaded = False


def _source_hash() -> str:
    h = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        if f.suffix in {".cu", ".cuh", ".cpp", ".h"}:
            h.update(f.name.encode())
            h.update(f.read_bytes())
    h.update(torch.__version__.encode())
    h.update(str(torch.version.cuda).encode())
    h.update(" ".join(CUDA_FLAGS).encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    root = Path(os.environ.get("SPINFER_CACHE", Path.home() / ".cache" / "spinfer"))
    return root / f"ext-{_source_hash()}"


def is_loaded() -> bool:
    return _loaded


def load_for(t: torch.Tensor) -> bool:
    """Whether ``t`` is on a CUDA device, compiling (once) and loading the kernels first if so: the
    public wrappers call it on their first GPU call. Not while torch.compile traces (a compiled
    graph's ops load the kernels from their fake implementations)."""
    if t.is_cuda and not _loaded and not torch.compiler.is_compiling():
        load_extension()
    return t.is_cuda


def load_extension(verbose: bool = False) -> None:
    """Compile (once) and load the CUDA kernels, registering the ops' CUDA implementations."""
    global _loaded
    if _loaded:
        return
    if torch.version.cuda is None:
        raise RuntimeError("spinfer's CUDA kernels need a CUDA build of torch; this one is CPU-only")
    from torch.utils.cpp_extension import load

    build_dir = cache_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    load(
        name=f"spinfer_cuda_{build_dir.name.split('-')[1]}",
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=["-O3"],  # torch picks the C++ standard its headers need
        extra_cuda_cflags=CUDA_FLAGS,
        extra_include_paths=[str(CSRC)],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=verbose,
    )
    _loaded = True


def main() -> int:
    t0 = time.perf_counter()
    try:
        load_extension(verbose="-v" in sys.argv)
    except RuntimeError as exc:
        print(f"spinfer.build: FAILED\n{exc}", file=sys.stderr)
        return 1
    print(f"spinfer.build: CUDA kernels ready in {cache_dir()} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
