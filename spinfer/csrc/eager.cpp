// The Python module of the extension: the eager entry points of eager.h. Kept apart from
// bindings.cpp, whose dispatcher registrations need no Python headers.
#include <torch/extension.h>

#include "eager.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "spinfer's CUDA kernels for eager calls, past the dispatcher (spinfer/csrc/eager.h)";
  m.def("spmm", &spinfer::spmm_eager, "x @ W.T + bias, W in TCA-BME");
  m.def("lowbit_mm", &spinfer::lowbit_mm_eager, "x @ W.T + bias, W weight-only low-bit (fused kernel)");
}
