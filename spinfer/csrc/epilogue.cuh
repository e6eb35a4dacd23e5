// The epilogue shared by the tensor-core kernels: fp32 accumulators of m16n8k16 tiles to the
// [N, M] output, with bias and the cast, or a deterministic split-K reduction.
//
// A tile is kBlockRows output rows x BN tokens; the callers number tiles row block major
// (row_block * token_tiles + token_tile) and keep split s of every tile s * split_stride floats
// into the workspace.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "dtype.cuh"
#include "ptx.cuh"

namespace spinfer {

// Where a block's results go.
struct TileOut {
  void* y;               // [n, m]
  const void* bias;      // [m] or nullptr
  float* workspace;      // split-K partial tiles, or nullptr
  int32_t* counters;     // split-K arrival counters, zero on entry, re-armed by the kernel
  int m, n;
};

// The last block's sum of a tile's split partials [splits][BN][kBlockRows] (fp32, split_stride
// floats apart), with bias and the cast. It is on the launch's critical path (the last block of
// each tile runs it after everyone else), so a thread waits for memory once per float4 it owns
// (4 rows of one token): its bias loads and its splits' loads are issued before any sum. One
// float per thread and iteration waited ceil(BN * 64 / threads) times in a row: for the low-bit
// kernel's 256 threads 2 / 4 / 8 times at BN = 8 / 16 / 32, now 1 / 1 / 2. Same lease, 4096x14336
// (4 splits), N = 16 / 32: 4 bits 27.0 -> 25.7 / 36.8 -> 34.7 us, 8 bits 35.4 -> 34.0 / 45.7 -> 43.0.
template <bool kBF16, int kBlockRows, int kThreads>
__device__ __forceinline__ void reduce_splits(const TileOut& o, const float* tile_base, int64_t split_stride,
                                              int splits, int m_base, int n0, int valid_floats, int tid) {
  const int vecs = valid_floats / 4;
  const float4* base = reinterpret_cast<const float4*>(tile_base);
  const int64_t vec_stride = split_stride / 4;
#pragma unroll 1
  for (int v = tid; v < vecs; v += kThreads) {
    const int m = m_base + (4 * v) % kBlockRows, n = n0 + 4 * v / kBlockRows;
    float bias[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) bias[e] = o.bias && m + e < o.m ? load_float<kBF16>(o.bias, m + e) : 0.f;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int sp = 0; sp < splits; ++sp) {  // in split order: the sum is deterministic
      const float4 p = __ldcg(base + sp * vec_stride + v);
      sum.x += p.x, sum.y += p.y, sum.z += p.z, sum.w += p.w;
    }
    const float s[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (m + e < o.m) store_float<kBF16>(o.y, static_cast<int64_t>(n) * o.m + m + e, s[e] + bias[e]);
  }
}

// Split-K arrival, after every thread has stored its share of the block's partials: whether this
// block is the last of `splits` to arrive for `tile`. Every thread of the block must call it. One
// thread publishes the block's partials and counts it: the barrier orders every thread's partial
// stores before its fence, which is cumulative (the pattern of CUTLASS's semaphore). One acq_rel
// fence per block instead of a sequentially consistent __threadfence() in every thread, which ncu
// showed stalling the end of every split block. The last block re-arms the counter once it has
// read the partials (counters[tile] = 0).
__device__ __forceinline__ bool arrive_last(int32_t* counters, int64_t tile, int splits, int tid, int* s_is_last) {
  __syncthreads();
  if (tid == 0) {
    ptx::fence_acq_rel_gpu();  // release: the block's partials before the count
    const bool last = atomicAdd(counters + tile, 1) == splits - 1;
    if (last) ptx::fence_acq_rel_gpu();  // acquire: the other splits' partials before the reads after it
    *s_is_last = last;
  }
  __syncthreads();
  return *s_is_last;
}

// Split-K with the reducer chosen ahead (the SMBD kernel on sm_90, SpmmArgs::ticket): the arrival
// above puts a fence (the wait for the block's partial stores to be acknowledged), an atomic and a
// barrier between the last block's main loop and its first read of the other partials, and the
// last block of the launch ends it. Here a block takes a ticket when its last stage starts (the
// SMBD producer warp, idle by then): the last ticket of a tile makes that block the reducer, and
// its producer lane waits for the others' partials while its decoding warps run the last stage.
// The others, after their stores, count themselves as stored with a release (the arrival's fence
// and atomic, off the reducer's path). counters[tile]: tickets in bits 0-15, stored partials in
// bits 16-31; the reducer re-arms it to zero. It can wait only on blocks that took their tickets
// before it, so are resident and in their last stage: no deadlock. The sum is the same, in split
// order, whichever block runs it: bit for bit what arrive_last's reducer gives.
// Called by one thread, once its block's last stage has started; true: this block reduces, with the
// other splits' partials visible to it (acquire; a block barrier before the reads extends it to the
// block, as in arrive_last).
__device__ __forceinline__ bool take_reducer_ticket(int32_t* counters, int64_t tile, int splits) {
  if ((atomicAdd(counters + tile, 1) & 0xffff) != splits - 1) return false;
  while ((ptx::ld_acquire_gpu(counters + tile) >> 16) != splits - 1) {
  }
  return true;
}

// After every thread has stored its share of the block's partials, with *s_is_last set by
// take_reducer_ticket: whether this block reduces. Every thread of the block must call it.
__device__ __forceinline__ bool arrive_ticketed(int32_t* counters, int64_t tile, int tid, int* s_is_last) {
  __syncthreads();
  const bool last = *s_is_last;
  if (!last && tid == 0) {
    ptx::fence_acq_rel_gpu();  // release: the block's partials before the count
    atomicAdd(counters + tile, 1 << 16);
  }
  return last;
}

// Writes a block's results. A lane of a warp that holds accumulators (has_acc) holds rows
// m_base + m_local (+8) and token columns n0 + nb*8 + 2*(lane%4) (+1) of each n8 sub-tile;
// other warps (a copy-issuing producer) only help with the reduction.
// Split-K: an fp32 partial tile [BN][kBlockRows] per split; the last block to arrive for the
// tile sums the splits in order 0..splits-1 (deterministic), adds bias, casts, and re-arms the
// counter for the next launch. Every thread of the block must call this. Only the tile's tokens
// below N are stored and summed (token-major, so they are a prefix of the tile): at N = 1 a
// BN = 8 tile moves 256 bytes per split instead of 2 KB, and the last block's sum, which ends
// the launch, waits on an eighth of the loads.
// kVectorSum = false keeps the one-float-per-iteration sum: the SMBD kernel's 40- and
// 48-register variants (BN <= 16 on sm_90) measured 1-4% slower with the float4 sum, whether
// inlined (it spilled the main loop) or called out of line (it moved the main loop's register
// allocation), although the sum itself is faster. The 56-register variant (the default since
// v10) takes the float4 sum with no spill and the same stage loop: A-B-A-B on H100, five shapes
// x N = 1 / 8 / 16, geomean x cuBLAS 1.251 / 1.232 -> 1.290 / 1.295 at 50% sparsity and 1.351 /
// 1.351 -> 1.393 / 1.406 at 70%, +3-11% at N = 8 and 16 on split layers, N = 1 unchanged.
// The partial tiles of tile `tile` sit split_stride floats apart, split 0 first.
// ticketed: the block's reducer role was set ahead in *s_is_last (take_reducer_ticket).
template <bool kBF16, int BN, int kBlockRows, int kThreads, bool kVectorSum = true>
__device__ __forceinline__ void store_tile(const TileOut& o, int m_base, int m_local, int n0, int64_t tile,
                                           int64_t split_stride, int split, int splits,
                                           const float (&acc)[BN / 8][4], int lane, int tid, int* s_is_last,
                                           bool has_acc = true, bool ticketed = false) {
  static_assert(kBlockRows % 4 == 0, "the split-K reduction reads float4 rows");
  const int tq = lane % 4;
  if (splits == 1) {
    if (!has_acc) return;
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = m_base + m_local + (e / 2) * 8, n = n0 + nb * 8 + 2 * tq + (e % 2);
        if (m < o.m && n < o.n) {
          const float bias = o.bias ? load_float<kBF16>(o.bias, m) : 0.f;
          store_float<kBF16>(o.y, static_cast<int64_t>(n) * o.m + m, acc[nb][e] + bias);
        }
      }
    return;
  }
  constexpr int64_t kTileFloats = BN * kBlockRows;
  float* part = o.workspace + split * split_stride + tile * kTileFloats;
  const int valid = min(BN, o.n - n0);  // tokens of the tile below N
  if (has_acc) {
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (nb * 8 + 2 * tq + (e % 2) < valid)
          part[(nb * 8 + 2 * tq + (e % 2)) * kBlockRows + m_local + (e / 2) * 8] = acc[nb][e];
  }
  const bool last = ticketed ? arrive_ticketed(o.counters, tile, tid, s_is_last)
                             : arrive_last(o.counters, tile, splits, tid, s_is_last);
  if (!last) return;
  const float* tile_base = o.workspace + tile * kTileFloats;
  if constexpr (kVectorSum) {
    reduce_splits<kBF16, kBlockRows, kThreads>(o, tile_base, split_stride, splits, m_base, n0, valid * kBlockRows, tid);
  } else {
    for (int idx = tid; idx < valid * kBlockRows; idx += kThreads) {
      const int m = m_base + idx % kBlockRows, n = n0 + idx / kBlockRows;
      float s = 0.f;
      for (int sp = 0; sp < splits; ++sp) s += __ldcg(tile_base + sp * split_stride + idx);
      if (m < o.m && n < o.n) {
        const float bias = o.bias ? load_float<kBF16>(o.bias, m) : 0.f;
        store_float<kBF16>(o.y, static_cast<int64_t>(n) * o.m + m, s + bias);
      }
    }
  }
  if (tid == 0) o.counters[tile] = 0;
}

}  // namespace spinfer
