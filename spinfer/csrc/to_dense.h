// Host interface of the weight-to-dense kernels (to_dense.cu): a TCA-BME weight or a packed
// low-bit weight written out as a dense row-major [m, k] fp16/bf16 matrix. They serve the large
// token counts, where one dense GEMM (cuBLAS) on the decoded weight beats the fused kernels,
// which decode the weight again for every token tile. Plain CUDA types only, so this compiles
// without torch.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace spinfer {

struct TcaBmeToDenseArgs {
  const uint64_t* bitmap;      // [grid_m * grid_k * 64] BitmapTile words (GroupTile 64x64)
  const uint16_t* values;      // [nvalues] 16-bit patterns (fp16 or bf16: copied, never converted)
  const int32_t* gtile_offset; // [grid_m * grid_k + 1]
  int64_t nvalues;
  uint16_t* out;               // [m, k] row-major
  int m, k, grid_m, grid_k;
};

// Bit-exact: every stored pattern (-0.0 and NaN included) lands where the bitmap puts it, every
// other element is +0.0. Corrupt offsets give wrong values, never an out-of-bounds access.
cudaError_t tca_bme_to_dense(const TcaBmeToDenseArgs& args, cudaStream_t stream);

struct LowbitToDenseArgs {
  const uint32_t* qweight;  // [ceil(m/64), kp/stage, 64, stage*bits/32] (spinfer/quant/lowbit.py)
  const void* scale_zero;   // [ceil(m/64), groups, record_words] records in the output dtype (lowbit_mm.h)
  void* out;                // [m, k] row-major
  int m, k, kp, bits;
  int group_shift;          // log2(group size); 30 for one group per row (per-channel)
  int groups;
  bool bf16;
  bool nibble_zeros;        // the records hold 4-bit integer zeros (lowbit_mm.h)
};

// (q - zero) * scale in fp32, rounded once to the output dtype: spinfer.quant.lowbit.dequantize
// exactly (without the act-order permutation, which callers apply to x instead).
cudaError_t lowbit_to_dense(const LowbitToDenseArgs& args, cudaStream_t stream);

}  // namespace spinfer
