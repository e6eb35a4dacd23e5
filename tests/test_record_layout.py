"""The records' layout as the kernels address it (scale_word_of, zero_word_of, zero_shift_of in
spinfer/csrc/record_layout.h) against what spinfer.quant.lowbit stores, compiled for the host: by
nvcc through lowbit_mm.h, as the CUDA kernels include it (skipped where nvcc is missing), and by the
system C++ compiler, as the CPU codecs (cpu/codec.cpp) include it. A mismatch shows without a GPU."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import spinfer
from spinfer import cpu_kernels
from spinfer.quant.lowbit import tile_scale_zero

NVCC = shutil.which("nvcc")
PROBE = r"""
#include HEADER
#include <cstdio>
int main() {
  for (int r = 0; r < spinfer::kRecordTileRows; ++r)
    std::printf("%d %d %d %d %d %d\n", r, spinfer::scale_word_of(r), spinfer::zero_word_of(r, false),
                spinfer::zero_shift_of(r, false), spinfer::zero_word_of(r, true), spinfer::zero_shift_of(r, true));
  std::printf("%d %d\n", spinfer::record_words(false), spinfer::record_words(true));
}
"""


@pytest.fixture(scope="module", params=["nvcc", "c++"])
def kernel_layout(request, tmp_path_factory):
    if request.param == "nvcc":
        compiler, header, suffix = NVCC, "lowbit_mm.h", "cu"
    else:
        compiler, header, suffix = cpu_kernels.compiler(), "record_layout.h", "cpp"
    if compiler is None:
        pytest.skip(f"{request.param} not found")
    d = tmp_path_factory.mktemp("layout")
    (d / f"probe.{suffix}").write_text(PROBE.replace("HEADER", f'"{header}"'))
    csrc = Path(spinfer.__file__).parent / "csrc"
    subprocess.run([compiler, "-std=c++17", f"-I{csrc}", str(d / f"probe.{suffix}"), "-o", str(d / "probe")],
                   check=True, capture_output=True)
    lines = subprocess.run([str(d / "probe")], check=True, capture_output=True, text=True).stdout.split("\n")
    rows = [tuple(int(v) for v in line.split()) for line in lines[:64]]
    return rows, tuple(int(v) for v in lines[64].split())


def words_of(records: torch.Tensor) -> list:
    """A single tile's record as unsigned 32-bit words."""
    return [w & 0xFFFFFFFF for w in records[0, 0].contiguous().view(torch.int32).tolist()]


def test_the_kernels_read_each_row_where_the_format_stores_it(kernel_layout):
    rows, (dtype_words, nibble_words) = kernel_layout
    assert (dtype_words, nibble_words) == (64, 40)
    for r, scale_word, zero_word, zero_shift, nib_word, nib_shift in rows:
        # row r alone gets a scale (and a zero) whose bits are known; every other row holds zeros
        scale = torch.zeros(64, 1, dtype=torch.float16)
        scale[r] = 1.0  # 0x3c00
        for zero, bits, want_halves in ((torch.full((64, 1), 0.5), 4, 128), (torch.zeros(64, 1), 4, 80)):
            z = zero.clone().half()
            if want_halves == 80:
                z[r] = 5.0
            else:
                z.zero_()
                z[r] = 0.5  # fractional: zeros in the dtype (0x3800)
            rec = tile_scale_zero(torch.stack((scale, z), -1), bits)
            assert rec.shape[-1] == want_halves
            words = words_of(rec)
            half = 16 * ((r % 16) // 8)  # (the kernels take row r + 8's half from the same word)
            assert words[scale_word] >> half & 0xFFFF == 0x3C00, r
            assert sum(w != 0 for w in words[:32]) == 1, r
            if want_halves == 128:
                assert zero_shift == half and words[zero_word] >> zero_shift & 0xFFFF == 0x3800, r
                assert sum(w != 0 for w in words[32:]) == 1, r
            else:
                assert words[nib_word] >> nib_shift & 0xF == 5, r
                assert sum(w != 0 for w in words[32:]) == 1 and words[nib_word] == 5 << nib_shift, r
