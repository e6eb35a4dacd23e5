// The work schedules of the fused low-bit kernel (lowbit_mm.cuh).
//
// A layer's work is a list of units, one pipeline stage of one 64-row block each, row block
// major: unit u is stage u % T of row block u / T (T stages per row block). Block b of the G
// blocks along gridDim.y takes units floor(b W / G) .. floor((b + 1) W / G) - 1 of the W units,
// in order. G = row blocks is one block per row block; G = s x row blocks is split-K with s
// balanced splits; any other G (the balanced schedule: a few blocks per SM) gives every block
// the same number of stages, with ranges that cross row blocks. The packed format stores a row
// block's stages one after the other, so a block's weights are one contiguous stream. A
// block flushes its accumulators at the end of each row block it touches: stored with bias if
// it had the whole row, else a partial tile that the last of the row's blocks to arrive sums in
// block order (epilogue.cuh), so the result does not depend on which block ends first.
#pragma once

#include <algorithm>
#include <cstdint>

namespace spinfer {

// a / d for a >= 0, d > 0. A 64-bit division is a long software routine, and every block divides
// a few times at its start, before its first copy, and at its end; here both operands fit in 32
// bits unless the layer has 2^32 units, and a 32-bit division is a few instructions.
__device__ __forceinline__ int64_t floor_div(int64_t a, int64_t d) {
  if (((static_cast<uint64_t>(a) | static_cast<uint64_t>(d)) >> 32) == 0)
    return static_cast<uint32_t>(a) / static_cast<uint32_t>(d);
  return a / d;
}

struct Schedule {
  int64_t units;  // W
  int per_row;    // T
  int blocks;     // G
  // rows: row blocks; per_row: stages per row block.
  __device__ __forceinline__ Schedule(int rows, int per_row)
      : units(static_cast<int64_t>(rows) * per_row), per_row(per_row), blocks(gridDim.y) {}
  // The block whose range holds unit u: floor(((u + 1) G - 1) / W) (ranges are never empty).
  __device__ __forceinline__ int block_of(int64_t u) const {
    return static_cast<int>(floor_div((u + 1) * blocks - 1, units));
  }
  __device__ __forceinline__ int64_t begin(int b) const { return floor_div(b * units, blocks); }
  // The blocks whose ranges meet row block `row`: this block's place among them and their count
  // (1: this block had the whole row).
  __device__ __forceinline__ void shares_of_row(int row, int& split, int& splits) const {
    const int first = block_of(static_cast<int64_t>(row) * per_row);
    split = blockIdx.y - first;
    splits = block_of(static_cast<int64_t>(row + 1) * per_row - 1) - first + 1;
  }
};

// This block's range: its first unit, row block and stage in that row, and length.
struct Range {
  int64_t begin;
  int row, stage, units;
  __device__ __forceinline__ explicit Range(const Schedule& s) {
    const int b = blockIdx.y;
    begin = s.begin(b);
    units = static_cast<int>(s.begin(b + 1) - begin);
    row = static_cast<int>(floor_div(begin, s.per_row));
    stage = static_cast<int>(begin - static_cast<int64_t>(row) * s.per_row);
  }
};

// The balanced schedule's grid on the host: blocks per token tile (SMs x per_sm shared by the
// token tiles, at most one per unit) and the most blocks that share one row block's tile, which
// sizes the workspace. A row block's T units meet at most floor(G / rows) + 1 range boundaries
// (ranges hold at least floor(T rows / G) units), so at most that + 1 blocks share it; exactly
// G / rows when rows divide G (tests/test_lowbit.py checks both by enumeration).
struct BalancedGrid {
  int blocks, shares;
};
inline BalancedGrid balanced_grid(int sms, int per_sm, int n_tiles, int row_blocks, int64_t units) {
  const int64_t want = std::max<int64_t>(1, int64_t(sms) * per_sm / n_tiles);
  const int blocks = static_cast<int>(std::min(want, units));
  const int shares = blocks % row_blocks == 0 ? blocks / row_blocks : blocks / row_blocks + 2;
  return {blocks, std::min(blocks, shares)};
}

}  // namespace spinfer
