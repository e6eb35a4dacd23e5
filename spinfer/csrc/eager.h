// The kernels' entry points for eager Python calls (eager.cpp binds them): the same checks and
// launches as the CUDA kernels of spinfer::spmm and spinfer::lowbit_mm_out (bindings.cpp), called
// without the dispatcher. At batch 1 an eager decode step is bound by host time, and a call through
// torch.ops spends several microseconds matching its thirteen arguments to the schema before the
// kernel's own code runs (docs/policy.md, "Host time of an eager call"). The Python wrappers take
// this path only where the dispatcher would add nothing: a plain CUDA tensor, no gradient to
// record, no torch.compile tracing and no torch function or dispatch mode.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace spinfer {

// x @ W.T + bias for x [..., k] and a TCA-BME weight (GroupTile 64x64): spmm_cuda on x flattened to
// [N, k], returned as [..., m].
// The bias comes second, so that a layer can keep every argument after it between calls.
at::Tensor spmm_eager(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& bitmap,
                      const at::Tensor& values, const at::Tensor& gtile_offset, int64_t m, int64_t k, int64_t max_run,
                      int64_t splits, const std::optional<at::Tensor>& row_offset);

// The fused low-bit kernel (lowbit_mm_out_cuda) for x [..., k], returned as [..., m]. The caller
// keeps N within the fused kernel's range (spinfer.ops.lowbit_mm.fused_max_n).
at::Tensor lowbit_mm_eager(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& qweight,
                           const at::Tensor& scale_zero, int64_t bits, int64_t group_size, int64_t m, int64_t k,
                           const std::optional<at::Tensor>& perm, int64_t splits, bool integer_zeros);

}  // namespace spinfer
