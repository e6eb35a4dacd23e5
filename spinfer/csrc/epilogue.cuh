// The epilogue shared by the tensor-core kernels: fp32 accumulators of m16n8k16 tiles to the
// [N, M] output, with bias and the cast, or a deterministic split-K reduction.
//
// Grid convention of every caller: blockIdx.x = token tile (BN wide), blockIdx.y = block of
// kBlockRows output rows, blockIdx.z = split along K.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "ptx.cuh"

namespace spinfer {

template <bool kBF16>
struct Out;
template <>
struct Out<false> {
  static __device__ __forceinline__ float load(const void* p, int i) {
    return __half2float(static_cast<const __half*>(p)[i]);
  }
  static __device__ __forceinline__ void store(void* p, int64_t i, float v) {
    static_cast<__half*>(p)[i] = __float2half_rn(v);
  }
};
template <>
struct Out<true> {
  static __device__ __forceinline__ float load(const void* p, int i) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
  static __device__ __forceinline__ void store(void* p, int64_t i, float v) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  }
};

// Where a block's results go.
struct TileOut {
  void* y;               // [n, m]
  const void* bias;      // [m] or nullptr
  float* workspace;      // split-K partial tiles, or nullptr
  int32_t* counters;     // split-K arrival counters, zero on entry, re-armed by the kernel
  int m, n;
};

// Writes a block's results. A lane of a warp that holds accumulators (has_acc) holds rows
// m_base + m_local (+8) and token columns n0 + nb*8 + 2*(lane%4) (+1) of each n8 sub-tile;
// other warps (a copy-issuing producer) only help with the reduction.
// Split-K: an fp32 partial tile [BN][kBlockRows] per split; the last block to arrive for the
// tile sums the splits in order 0..splits-1 (deterministic), adds bias, casts, and re-arms the
// counter for the next launch. Every thread of the block must call this.
template <bool kBF16, int BN, int kBlockRows, int kThreads>
__device__ __forceinline__ void store_tile(const TileOut& o, int m_base, int m_local, int n0, int split, int splits,
                                           const float (&acc)[BN / 8][4], int lane, int tid, int* s_is_last,
                                           bool has_acc = true) {
  const int tq = lane % 4;
  if (splits == 1) {
    if (!has_acc) return;
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = m_base + m_local + (e / 2) * 8, n = n0 + nb * 8 + 2 * tq + (e % 2);
        if (m < o.m && n < o.n) {
          const float bias = o.bias ? Out<kBF16>::load(o.bias, m) : 0.f;
          Out<kBF16>::store(o.y, static_cast<int64_t>(n) * o.m + m, acc[nb][e] + bias);
        }
      }
    return;
  }
  const int64_t tile = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  constexpr int64_t kTileFloats = BN * kBlockRows;
  const int64_t split_stride = static_cast<int64_t>(gridDim.x) * gridDim.y * kTileFloats;
  float* part = o.workspace + split * split_stride + tile * kTileFloats;
  if (has_acc) {
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) part[(nb * 8 + 2 * tq + (e % 2)) * kBlockRows + m_local + (e / 2) * 8] = acc[nb][e];
  }
  // One thread publishes the block's partials and counts it: the barrier orders every
  // thread's partial stores before its fence, which is cumulative (the pattern of CUTLASS's
  // semaphore). One acq_rel fence per block instead of a sequentially consistent
  // __threadfence() in every thread, which ncu showed stalling the end of every split block.
  __syncthreads();
  if (tid == 0) {
    ptx::fence_acq_rel_gpu();  // release: the block's partials before the count
    const bool last = atomicAdd(o.counters + tile, 1) == splits - 1;
    if (last) ptx::fence_acq_rel_gpu();  // acquire: the other splits' partials before the reads below
    *s_is_last = last;
  }
  __syncthreads();
  if (!*s_is_last) return;
  const float* base = o.workspace + tile * kTileFloats;
  for (int idx = tid; idx < kTileFloats; idx += kThreads) {
    const int m = m_base + idx % kBlockRows, n = n0 + idx / kBlockRows;
    float s = 0.f;
    for (int sp = 0; sp < splits; ++sp) s += __ldcg(base + sp * split_stride + idx);
    if (m < o.m && n < o.n) {
      const float bias = o.bias ? Out<kBF16>::load(o.bias, m) : 0.f;
      Out<kBF16>::store(o.y, static_cast<int64_t>(n) * o.m + m, s + bias);
    }
  }
  if (tid == 0) o.counters[tile] = 0;
}

}  // namespace spinfer
