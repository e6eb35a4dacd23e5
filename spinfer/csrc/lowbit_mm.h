// Host interface of the fused weight-only low-bit kernel: y[N, M] = x[N, K] @ W[M, K]^T (+ bias)
// with W = (q - zero) * scale, q packed at 1, 2, 4 or 8 bits (spinfer/quant/lowbit.py layout).
// Plain CUDA types only, so this compiles without torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>

#include "record_layout.h"

namespace spinfer {

struct LowbitArgs {
  const void* x;           // [n, kp] fp16/bf16 row-major, 16-byte aligned, zero past K; kp % 256 == 0
  const uint32_t* qweight; // [ceil(m/64), kp/stage, 64, stage*bits/32] tiles (spinfer/quant/lowbit.py)
  const void* scale_zero;  // [ceil(m/64), groups, record_words] scale and zero records in x's dtype (record_word)
  const void* bias;        // [m] or nullptr
  void* y;                 // [n, m]
  float* workspace;        // split-K partial tiles (plan.workspace_floats), or nullptr
  int32_t* counters;       // split-K arrival counters (plan.counters), zero on entry
  int m, n, kp;
  int group_shift;         // log2(group size); 30 for per-channel groups (one group: shift to 0)
  int groups;              // K / group_size
  int bits;
  bool bf16;
  bool force_xsum;         // apply every zero point through sum(x) (SPINFER_LOWBIT_XSUM=1: A/B runs, tests)
  bool integer_zeros;      // every zero is exact in the fast decode (LowBitWeight.integer_zeros): skip its check;
                           // at 1, 2 and 4 bits only with nibble_zeros
  bool nibble_zeros;       // the records hold 4-bit integer zeros (1, 2 and 4 bits; record_words)
  // Set by the GEMV's launch (lowbit_gemv.cuh), its only reader: record_words(nibble_zeros), read
  // from the constant bank. Computed in the kernel instead, 2-bit g128 took 64 -> 70 registers
  // (sm_90a), a resident block fewer.
  int record_words;
  int rotate;              // stage-order rotation (kLowbitRotate; SPINFER_LOWBIT_ROTATE overrides, 0: off)
  // Set by the launch from the plan (kernel arguments live in the constant bank, not in the
  // loop's registers): rows from tail_first on are split tail_splits ways, tail_iters stages each.
  int tail_first, tail_splits, tail_iters;
};

// The scale and zero records (record_words, record_word, scale_word_of, zero_word_of,
// zero_shift_of) are in record_layout.h, which the CPU codecs read too.

// A block of row block r (one-block-per-row and split-K grids) takes its stages starting at stage
// (r * kLowbitRotate) % stages of its range and wraps around, instead of every block starting at
// the range's first stage. All row blocks streaming the same column offset at once read addresses
// a power of two apart (a 64-row block of a 4-bit K = 4096 layer is 128 KB): same process on H100,
// geomean x cuBLAS over the four issue shapes, without / with: 4-bit g128 at N = 1-16 2.282 /
// 2.382x (14336x4096 N = 1 18.7 -> 17.2 us, 8192x28672 N = 8 63.0 -> 56.6 us), 8-bit 1.518 /
// 1.609x, 2-bit g64 and 4-bit g32 at N = 1-32 2.277 / 2.331x and 1.820 / 1.887x; a multiplier of
// 1 measured 2.367x. 5 is odd, so with a power-of-two stage count consecutive row blocks start
// at distinct stages. The SMBD kernel gained nothing from the same rotation (its value runs have
// no such stride). Accumulation order changes with it; results stay deterministic.
constexpr int kLowbitRotate = 5;
// The multiplier a launch uses: kLowbitRotate, or SPINFER_LOWBIT_ROTATE (A/B runs, tests; 0: off).
inline int lowbit_rotate() {
  const char* env = std::getenv("SPINFER_LOWBIT_ROTATE");
  return env ? std::atoi(env) : kLowbitRotate;
}

// Bytes of a packed weight (spinfer/quant/lowbit.py): ceil(m / 64) blocks of 64 rows x kp columns.
inline size_t lowbit_qweight_bytes(int m, int kp, int bits) {
  return static_cast<size_t>((m + 63) / 64) * 64 * static_cast<size_t>(kp) * bits / 8;
}

// The fused kernel's schedule variants (lowbit_mm.cuh).
enum LowbitVariant : int {
  kLowbitPerTile = 0,   // a block per 64-row tile and split: the grid (token tiles, row blocks, splits)
  kLowbitBalanced = 1,  // equal ranges of (row block, stage) units, across row blocks (Schedule)
  kLowbitRowPairs = 2,  // a block per 128-row tile and split: two row blocks share each activation slice
  kLowbitGemv = 3,      // N = 1: a block per 16 rows, weights straight into registers (lowbit_gemv.cuh)
};
// Output rows of a block's tile.
constexpr int lowbit_tile_rows(int variant) {
  return variant == kLowbitRowPairs ? 128 : variant == kLowbitGemv ? 16 : 64;
}

struct LowbitPlan {
  int bn;          // tokens per block tile: 8, 16 or 32
  int n_tiles;     // ceil(n / bn)
  int row_blocks;  // ceil(m / lowbit_tile_rows(variant))
  int chunks;      // kp / 128
  int grid_blocks; // blocks per token tile: row_blocks x splits, or the balanced schedule's
                   // SMs x kBalancedPerSM, each an equal range of the layer's (row block, stage)
                   // units (lowbit_mm.cuh, Schedule)
  int splits;      // most blocks that share one row block's tile (1: no reduction)
  int iters_per_split;  // stages per split-K block (not the balanced schedule)
  int ng;          // scale groups per 128-column chunk: 1 (group >= 128), 2 (64) or 4 (32)
  int blocks_per_sm;  // resident blocks of this variant (occupancy API)
  int variant;     // LowbitVariant
  // Split tail rows (schedule.cuh, tail_split): the row blocks from tail_first on are split
  // tail_splits ways (tail_iters stages each, grid_blocks blocks in all); the others are whole.
  // tail_splits 0: none.
  int tail_first, tail_splits, tail_iters;
  // The GEMV's loader (lowbit_gemv.cuh): 0, each lane's words of a stage straight into registers;
  // 2, each warp's ring of 2 shared-memory slots filled by cp.async (lowbit_mm.cu, gemv_ring_slots).
  int gemv_ring;
  // The GEMV's warps a block: 8, or 4 on the ring on short rows (lowbit_mm.cu, gemv_warps).
  int gemv_warps;
  int64_t workspace_floats;
  int counters;
  bool pdl;        // programmatic dependent launch (sm_90; SPINFER_PDL=0 turns it off)
  // The bulk loader: each stage's weight tiles come in one bulk copy (cp.async.bulk, completing
  // on an mbarrier) issued by one thread, unswizzled, and its activation slice in tensor copies,
  // instead of 16-byte cp.async from every thread into XOR-swizzled rows: sm_90 at 4 bits with
  // 32-token tiles (lowbit_mm.cuh, bulk_loader). SPINFER_LOADER=cp_async keeps the cp.async
  // loader (tests, A/B runs), as for the SMBD kernel.
  bool bulk_weights;
};

// splits > 0: that split-K factor (capped at the stages), -1: the balanced schedule, as tuned by
// spinfer.tuning; 0: the planner's rule, which SPINFER_LOWBIT_SPLITS (a factor, or -1) overrides
// (A/B runs and tests), as SPINFER_LOWBIT_BN (8, 16, 32) does the token tile;
// SPINFER_LOWBIT_BALANCED=0 keeps the rule to split-K; SPINFER_LOWBIT_PAIRS=1 / 0 forces row pairs
// on / off. At N = 1 the plan is the GEMV kernel (lowbit_gemv.cuh) where it exists (gemv_supported:
// 1 and 2 bits at group sizes >= 64, 4 bits at >= 128, 8 bits at >= 64; any K) unless the caller gives a split factor or one of
// SPINFER_LOWBIT_SPLITS, _BN, _PAIRS asks for the fused kernel; SPINFER_LOWBIT_GEMV=1 / 0 forces
// it where it exists / off.
LowbitPlan lowbit_mm_plan(int m, int n, int kp, int bits, int group_size, int device, bool bf16, int splits);

cudaError_t lowbit_mm_run(const LowbitArgs& args, const LowbitPlan& plan, cudaStream_t stream);

}  // namespace spinfer
