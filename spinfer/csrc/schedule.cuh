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

// Split tail rows. A layer of R >= SMs row blocks, one block each, runs floor(R / SMs) blocks
// on every SM and one more on R mod SMs of them, which the block scheduler issues last: their
// first stages land last and they share their SM with the others, so they end last.
// Timeline of 28672x8192 4-bit at N = 1 on H100 (448 blocks: 80 SMs hold 3, 52 hold 4; the
// 4th blocks are rows 396-447): the 3-block SMs end at 45.5 us (p50), the 4th blocks at 52.3,
// the launch at 56. Splitting those tail rows over the SMs as short split-K blocks, as many as
// give every SM at most one more (floor(SMs / tail) splits), leaves every SM the same whole
// rows plus a shorter share. H100, same process, off -> on (2 splits), N = 1 / 4 / 8, us:
// 4-bit g128 28672x8192 55.6 / 57.3 / 63.4 -> 53.3 / 54.2 / 60.0, 28672x4096 31.6 / 31.7 / 34.9 ->
// 30.1 / 30.5 / 33.2; 8-bit 28672x8192 96.7 -> 93.6 at N = 1; 2-bit g64 28672x8192 52.1 -> 46.4.
// 3 or 4 splits (the tail blocks exceed the SMs: some get two) measured between the two.
// `wanted` > 0 asks for that many splits (the planner passes SPINFER_LOWBIT_TAIL, an A/B switch
// whose 0 turns the split off; scripts/timeline_lowbit.cu its `tail:S`). The GEMV (lowbit_gemv.cuh)
// counts waves of its resident slots (SMs x blocks per SM, passed as `sms`, with no resident cap)
// and asks for longer splits (`min_iters`, lowbit_mm.cu).
struct TailSplit {
  int first, splits, iters;
};
inline TailSplit tail_split(int rows, int sms, int resident, int total_iters, int wanted = 0, int min_iters = 2) {
  const int waves = rows / sms, tail = rows - waves * sms;
  if (waves < 1 || tail == 0 || waves + 1 > resident) return {0, 0, 0};
  const int s = std::min(wanted > 0 ? wanted : sms / tail, total_iters / min_iters);  // min_iters stages a split
  if (s < 2) return {0, 0, 0};
  const int iters = (total_iters + s - 1) / s;
  return {waves * sms, (total_iters + iters - 1) / iters, iters};  // no empty splits
}

}  // namespace spinfer
