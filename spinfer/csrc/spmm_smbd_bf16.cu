// bf16 instantiations of the SMBD kernel (a separate unit so nvcc builds dtypes in parallel).
#include "spmm_smbd.cuh"

namespace spinfer {
namespace smbd {
SPINFER_SMBD_FOR_TILES(SPINFER_SMBD_INSTANTIATE_ONE, true)
}  // namespace smbd
}  // namespace spinfer
