// bf16 1-bit instantiations of the fused low-bit kernel (one unit per pair: parallel builds).
#include "lowbit_gemv.cuh"

namespace spinfer {
namespace lowbit {
SPINFER_LOWBIT_INSTANTIATE(true, 1)
SPINFER_GEMV_INSTANTIATE(true, 1)
}  // namespace lowbit
}  // namespace spinfer
