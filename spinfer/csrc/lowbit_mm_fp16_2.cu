// fp16 2-bit instantiations of the fused low-bit kernel (one unit per pair: parallel builds).
#include "lowbit_gemv.cuh"

namespace spinfer {
namespace lowbit {
SPINFER_LOWBIT_INSTANTIATE(false, 2)
SPINFER_GEMV_INSTANTIATE(false, 2)
}  // namespace lowbit
}  // namespace spinfer
