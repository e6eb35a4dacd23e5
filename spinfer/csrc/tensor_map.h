// Tensor maps (sm_90 tensor copies, cp.async.bulk.tensor) of the activations, made on the host at
// launch: the low-bit kernel's activation slices (lowbit_mm.cu) and the SMBD kernel's wgmma variant
// (spmm_smbd.cu).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

#include <cstdint>

namespace spinfer {

// cuTensorMapEncodeTiled from the driver, found once through the runtime (the extension does not
// link libcuda); nullptr where the driver lacks it.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A row-major fp16 / bf16 matrix of `rows` rows of `cols` elements, `row_bytes` apart, copied in
// boxes of box_cols x box_rows (innermost first), without swizzle or with `swizzle` (the
// wgmma operand layouts); a box's elements past the matrix arrive as zeros and count as copied
// bytes.
inline cudaError_t encode_matrix_map(CUtensorMap* map, const void* base, bool bf16, uint64_t cols, uint64_t rows,
                                     uint64_t row_bytes, uint32_t box_cols, uint32_t box_rows,
                                     CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t steps[2] = {1, 1};
  const CUresult r = encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                            const_cast<void*>(base), dims, strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace spinfer
