"""Build of the CUDA extension: torch.utils.cpp_extension + ninja, compiled on first use into
a cache folder keyed by the sources, torch and CUDA versions, and reused after that.

    python -m spinfer.build        # prebuild and report (the CPU decoders of spinfer/cpu_kernels.py too)

Set SPINFER_CACHE to choose the folder (default: ~/.cache/spinfer). A failed build raises
RuntimeError carrying the compiler's message. The C++ compiler is torch's (CXX, else c++) unless
that one links the C++ runtime statically (host_compiler), which makes failed checks crash.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ["bindings.cpp", "eager.cpp", "spmm_smbd.cu", "spmm_smbd_fp16.cu", "spmm_smbd_bf16.cu", "lowbit_mm.cu", "to_dense.cu"] + [
    f"lowbit_mm_{dt}_{bits}.cu" for dt in ("fp16", "bf16") for bits in (1, 2, 4, 8)
]
CUDA_FLAGS = [  # no -std: torch adds the one its headers need (C++20 for torch 2.10+)
    "-O3",
    "-lineinfo",
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90a,code=sm_90a",
]

_loaded = False
_module = None  # the extension's Python module: the eager entry points (csrc/eager.h)


def _source_hash() -> str:
    """What the extension is built from (its sources, torch and the flags): the build's cache folder
    and the key of every figure measured on its kernels (spinfer.tuning.kernel_revision)."""
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


def shares_libstdcxx(cxx: str) -> Optional[bool]:
    """Whether ``cxx`` links a shared object against the shared C++ runtime (libstdc++ among the
    object's NEEDED entries, per readelf); None where it cannot tell (no such compiler, no
    readelf, a failed compile)."""
    readelf = shutil.which("readelf")
    if readelf is None or shutil.which(cxx) is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        src, so = Path(d, "probe.cpp"), Path(d, "probe.so")
        src.write_text('#include <stdexcept>\nvoid spinfer_probe(int v) { if (v) throw std::runtime_error("v"); }\n')
        try:
            subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(so)], check=True, capture_output=True,
                           timeout=120)
            out = subprocess.run([readelf, "-d", str(so)], check=True, capture_output=True, text=True,
                                 timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    return "libstdc++.so" in out


def newest_first(paths: list[str]) -> list[str]:
    """Compiler paths by the version numbers in their names, highest first (g++-13, g++-12, g++-9)."""
    return sorted(paths, key=lambda p: tuple(int(v) for v in re.findall(r"\d+", Path(p).name)), reverse=True)


def system_gxx() -> list[str]:
    """The distribution's versioned g++ (/usr/bin/g++-N), newest first, then /usr/bin/g++."""
    return newest_first([str(p) for p in Path("/usr/bin").glob("g++-[0-9]*")]) + ["/usr/bin/g++"]


def host_compiler() -> Optional[str]:
    """The C++ compiler to build with instead of torch's (CXX, else ``c++``), or None to keep it.

    A compiler that links the C++ runtime statically gives the extension its own copy: an
    exception thrown in it (every failed TORCH_CHECK) and caught by torch's copy then crashes the
    process (SIGSEGV) instead of raising. The lent H100 machines set CXX to such a compiler (a
    g++ 13 wrapper), which crashes even for a 5-line op; their ``c++``, ``/usr/bin/g++-12`` and
    ``g++-13`` raise cleanly (docs/kernels.md). So where torch's compiler links statically, the
    first of ``c++``, the newest ``/usr/bin/g++-N`` and ``/usr/bin/g++`` that links dynamically
    builds the extension, with a warning where it replaces the user's CXX; with none, a warning
    says so."""
    chosen = os.environ.get("CXX") or "c++"
    if shares_libstdcxx(chosen) is not False:
        return None

    def resolved(cxx):
        return os.path.realpath(shutil.which(cxx) or cxx)

    for cxx in ([] if chosen == "c++" else ["c++"]) + system_gxx():
        if resolved(cxx) != resolved(chosen) and shares_libstdcxx(cxx):
            cxx = shutil.which(cxx) or cxx
            if chosen != "c++":
                warnings.warn(f"spinfer.build: CXX={chosen} links the C++ runtime statically, so a failed "
                              f"check in a kernel call would crash the process instead of raising; building "
                              f"with {cxx} instead", RuntimeWarning, stacklevel=2)
            return cxx
    warnings.warn(f"spinfer.build: {chosen} links the C++ runtime statically, so a failed check in a kernel "
                  "call would crash the process instead of raising, and no compiler that links it "
                  "dynamically was found; set CXX to one", RuntimeWarning, stacklevel=2)
    return None


def _chosen_compiler(build_dir: Path) -> Optional[str]:
    """host_compiler(), decided once per build folder and torch's compiler (a probe compile costs
    ~0.4 s, and a changed compiler would make ninja rebuild everything): the record holds the
    compiler asked about and the answer, and a different CXX is asked about again."""
    record = build_dir / "host_cxx.txt"
    asked = os.environ.get("CXX") or "c++"
    if record.exists():
        lines = record.read_text().splitlines()
        if len(lines) == 2 and lines[0] == asked:
            return lines[1] or None
    cxx = host_compiler()
    record.write_text(f"{asked}\n{cxx or ''}\n")
    return cxx


@contextlib.contextmanager
def _env(key: str, value: Optional[str]):
    """``key`` set to ``value`` (unchanged where None) for the block's duration."""
    old = os.environ.get(key)
    if value is not None:
        os.environ[key] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                del os.environ[key]
            else:
                os.environ[key] = old


def is_loaded() -> bool:
    return _loaded


def eager_module():
    """The extension's Python module, compiled and loaded on first use: ``spmm`` and ``lowbit_mm``
    run the CUDA kernels without the dispatcher, for eager calls that need nothing it adds
    (spinfer/csrc/eager.h; :func:`spinfer.ops.linear_input.direct_call_ok` says when)."""
    if _module is None:
        load_extension()
    return _module


def load_for(t: torch.Tensor) -> bool:
    """Whether ``t`` is on a CUDA device, compiling (once) and loading the kernels first if so: the
    public wrappers call it on their first GPU call. Not while torch.compile traces (a compiled
    graph's ops load the kernels from their fake implementations)."""
    if t.is_cuda and not _loaded and not torch.compiler.is_compiling():
        load_extension()
    return t.is_cuda


def load_extension(verbose: bool = False) -> None:
    """Compile (once) and load the CUDA kernels, registering the ops' CUDA implementations."""
    global _loaded, _module
    if _loaded:
        return
    if torch.version.cuda is None:
        raise RuntimeError("spinfer's CUDA kernels need a CUDA build of torch; this one is CPU-only")
    from torch.utils.cpp_extension import load

    build_dir = cache_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    with _env("CXX", _chosen_compiler(build_dir)):
        _module = load(
            name=f"spinfer_cuda_{build_dir.name.split('-')[1]}",
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=["-O3"],  # torch picks the C++ standard its headers need
            extra_cuda_cflags=CUDA_FLAGS,
            extra_include_paths=[str(CSRC)],
            build_directory=str(build_dir),
            is_python_module=True,  # (the ops register as the module loads)
            verbose=verbose,
        )
    _loaded = True


def main() -> int:
    from . import cpu_kernels  # (the CPU decoders and encoder: a library of their own, built on first use)

    t0 = time.perf_counter()
    if cpu_kernels.library() is None:
        print(f"spinfer.build: CPU decoders unavailable ({cpu_kernels.unavailable_reason()}); the CPU path uses the "
              "torch-op references")
    else:
        print(f"spinfer.build: CPU decoders ready in {cpu_kernels.library_path(cpu_kernels.compiler()).parent} "
              f"({time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    try:
        load_extension(verbose="-v" in sys.argv)
    except RuntimeError as exc:
        print(f"spinfer.build: FAILED\n{exc}", file=sys.stderr)
        return 1
    cxx = _chosen_compiler(cache_dir()) or os.environ.get("CXX") or "c++"
    print(f"spinfer.build: CUDA kernels ready in {cache_dir()} ({time.perf_counter() - t0:.1f} s, C++ compiler {cxx})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
