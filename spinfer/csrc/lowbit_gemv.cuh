// The low-bit GEMV kernel: y[1, M] = x[1, K] @ W[M, K]^T for one token (decode at batch 1), on
// the packed format of the fused kernel (lowbit_mm.cuh), at 1, 2, 4 and 8 bits (gemv_supported says
// which group sizes).
//
// Read top to bottom:
//  * A block of W warps owns 16 output rows (a quarter of one of the format's 64-row tiles) and
//    all of K: W = 8, or 4 on the ring on short rows (K <= 4096, where 8 warps would take at most
//    2 stages each) and on longer rows whose row blocks fill the SMs' slots for 4-warp blocks
//    (lowbit_mm.cu, gemv_warps). Warp w takes stages w, w + W, w + 2 W, ... of those
//    rows; at the end the block sums the W warps' accumulators through shared memory in warp order
//    (deterministic), adds bias and casts. A layer has ceil(M / 16) blocks, 4x the fused kernel's,
//    and the block scheduler hands them out as SMs free up. Where the row blocks are long (16 rows
//    x K of at least 80 KB, 128 at 8 bits: lowbit_mm.cu) the rows past the last whole wave of
//    resident blocks run split-K instead, as the fused kernel's tail rows do (schedule.cuh,
//    tail_split): alone, one an SM, they streamed at a fraction of the bandwidth. The last split to
//    arrive sums the partials in split order.
//  * No shared-memory ring and no barrier in the loop. Each lane loads its own A-fragment words
//    of rows g and g + 8 (lowbit_mm.cuh's fragment order: 32 bytes a row per stage at 4 and 8
//    bits, 16 at 2, 8 at 1) straight into registers with 16-, 8- or 4-byte
//    `ld.global.nc.L1::no_allocate`, one stage ahead of the one it computes, and dequantizes them
//    as the fused kernel does (unpack_pair).
//  * Each warp copies the x slice of each of its stages (512 bytes, 256 at 8 bits) into its own
//    two shared-memory buffers with `cp.async`, just before that stage's weight loads, and reads
//    the B fragments from there (at N = 1 the 8 columns of an n8 mma are the same token, a
//    broadcast). Read through L1 instead, they waited behind the weight loads issued before them
//    (the probe, docs/quant.md). Per warp, not per block: no warp waits on a block-wide copy of
//    x or on a barrier before its loop, and K has no limit. Against x copied whole per block
//    (H100, thirty-fourth session, docs/quant.md): 25 of 28 cells (four widths, seven layers, N = 1)
//    1-7% faster, the 8192-row layers (512 blocks, 1.29 waves) 4-10% slower.
//  * Or, where the planner asks (LowbitPlan::gemv_ring, lowbit_mm.cu's gemv_ring_slots: 1, 2 and 4
//    bits, where its resident blocks leave no tail rows to split), each warp streams through
//    a ring of two shared-memory slots instead: a stage's 16 rows of weights (2 KB at 4 bits), their
//    (scale, zero) words and its x slice come in one cp.async group, the lanes dividing the copies
//    (a (scale, zero) word once a warp, not once for each of the 4 lanes that use it), and the
//    lanes read their fragment words back from the slot (rows XOR-swizzled so that one
//    wavefront's reads fall on distinct banks, gemv_ring_piece).
//    No stage waits in registers (64 at 4 bits instead of 80: 4 resident blocks instead of 3),
//    and at 1 and 2 bits with two groups a chunk, bound by instruction issue, the scale loads
//    were ~65 of a stage's ~384 instructions (2-bit g64, thirty-third session). A lane's copy and
//    read addresses are computed once and kept in registers (thirty-seventh session: a 4-bit
//    step 415 -> 320 instructions). H100, N = 1 (docs/quant.md, thirty-sixth and thirty-seventh
//    sessions): 2-bit g64 28672x8192 39.1 -> 33.6 us, 4-bit 8192x28672 49.2 -> 46.8, 2-bit g128
//    8192x28672 36.1 -> 29.9. The ring has no split-tail variant.
//  * Zero points as in the fused kernel: the A fragments hold q - zi exactly, and a segment's
//    fractional rest z - zi (HQQ) is applied on the accumulator through the segment's sum of x,
//    which the warp sums from its slice when the launch needs it.
// Why (H100, docs/quant.md, thirtieth session): the fused kernel gives a 4096-row layer 64 blocks
// of 8 warps, a 14336-row one 224: 1-2 blocks an SM, too few warps to keep enough loads in flight,
// and each block's shared-memory ring waits on barriers. 16-row blocks give those layers 256 and
// 896 blocks.
#pragma once

#include <type_traits>

#include "lowbit_mm.cuh"

namespace spinfer {
namespace lowbit {

constexpr int kGemvWarps = 8;
// Warps a block of the ring on short rows, where 8 would take at most 2 stages each, and on longer
// rows that fill the SMs' slots for them (lowbit_mm.cu, gemv_short_rows, gemv_warps and why).
constexpr int kGemvShortWarps = 4;
constexpr int kGemvRows = 16;
// 80 registers: the stage in flight and the one computed. With 4 resident blocks (64 registers)
// the prefetch spilled at 4 bits; without it, 4 blocks measured slower than this (the probe).
constexpr int kGemvMinBlocks = 3;
// The ring path at 4 bits: 4 resident blocks (at most 64 registers). It took 52 before its lane
// addresses were kept in registers (RingLane, below), 66 after without this cap.
// With W warps a block instead of 8, 8 / W times as many blocks under the same register cap.
// The ring at 2 bits with groups of 64 took 79 registers under the default cap (3 blocks of 8
// warps, 6 of 4), the most of any ring; capped, it runs in 64 with 8 warps (4 blocks) and 72 with
// 4 (7 blocks), spilling nothing. (1 bit with groups of 64 takes the same caps: 72 -> 64 registers
// with 8 warps, 72 with 4 as before.) Whole layers then fit one wave of resident blocks: 8192x28672's
// 512 row blocks (528 slots on an H100 instead of 396, so the ring no longer leaves tail rows to
// split and the planner takes it over the registers) and 14336x4096's 896 (924 instead of 792).
// H100, N = 1, least of 3 rounds, two rounds of separate processes, us (docs/quant.md,
// forty-eighth session): 8192x28672 36.1 / 35.9 -> 30.3 / 30.4, 14336x4096 12.9 / 13.0 -> 11.5 /
// 11.7, 28672x4096 19.8 / 19.7 -> 18.8 / 18.9, 28672x8192 34.0 / 33.8 -> 32.5 / 33.5; 4096x14336
// (256 blocks, under a wave either way) 11.4 / 11.5 -> 11.6 / 11.6. With 4 warps, 8 blocks (64
// registers) were no faster than 7 (28672x4096 19.0-19.1 against 18.5-18.6). 1-bit g64 under the
// same caps, same method: 8192x28672 33.4 / 33.1 -> 32.3 / 32.3, 28672x8192 33.7 / 34.1 -> 33.1 /
// 33.2, the 4096-wide layers within 0.2 us.
template <int BITS, int NG, int kRing, int W = kGemvWarps>
constexpr int kGemvMinBlocksFor = kRing > 0 && BITS <= 2 && NG == 2 ? (W == kGemvShortWarps ? 7 : 4)
                                  : (kRing > 0 && BITS == 4 ? 4 : kGemvMinBlocks) * kGemvWarps / W;
// The (width, scale groups per 128-column chunk) pairs the GEMV is built for: those whose stage,
// the lane's words of rows g and g + 8 and their scale and zero words, takes at most 20 registers,
// as 4-bit g128 does (16 words + 4; with 2 groups a chunk its stage in flight spilled 16
// bytes at 80 registers). A stage is two 128-column chunks (one at 8 bits): a lane holds `bits`
// words a chunk and row. Groups of 32 (4 a chunk) fit at 1 bit only, and there the GEMV measured
// slower than the fused kernel on the large layers (docs/quant.md, thirty-second session).
__host__ __device__ constexpr int gemv_stage_registers(int bits, int ng) {
  return 2 * (bits == 8 ? 1 : 2) * (bits + ng);
}
__host__ __device__ constexpr bool gemv_supported(int bits, int ng) {
  return (bits == 1 || bits == 2 || bits == 4 || bits == 8) && (ng == 1 || ng == 2) &&
         gemv_stage_registers(bits, ng) <= 20;
}
// Where the main loop is built twice, with and without the zero points' sums (compute, below):
// 2 bits with groups of 64, where a segment is 4 k16 tiles of a cheap decode and its scale work
// the largest share. Chosen by measurement, H100, one process, least of 2 rounds, seven layers at
// N = 1 (docs/quant.md, thirty-third session): 2-bit g64 3.07-3.10 -> 3.18-3.20x cuBLAS
// (8192x28672 45.0 -> 39.4 us). Elsewhere it measured flat or slower (1-bit g64 3.34 -> 3.27x,
// 2-bit g128 3.70 -> 3.63x, 8-bit g128 1.83 -> 1.79x) but for 1-bit g128 (+1.6%). In the 8-bit
// SASS ptxas hoists the stage's first decode above the next stage's loads, which then have less
// time to land.
template <int BITS, int NG>
constexpr bool kGemvSplitSums = BITS == 2 && NG == 2;
// The ring path (kRing > 0, lowbit_gemv_kernel): a warp's slot holds a stage's 16 rows of weights,
// their scale and zero words (16 a segment) and the stage's x slice.
template <int BITS, int NG>
__host__ __device__ constexpr int gemv_slot_bytes() {
  return kGemvRows * chunks_per_stage<BITS>() * kChunk * BITS / 8 + kGemvRows * chunks_per_stage<BITS>() * NG * 4 +
         chunks_per_stage<BITS>() * kChunk * 2;
}
// The ring path's slots a warp (LowbitPlan::gemv_ring) and a block's dynamic shared memory. 3 and 4
// slots (2 and 3 stages in flight a warp) measured slower at every width: H100, N = 1, seven layers,
// geomean x cuBLAS 2 / 3 / 4 slots, 2-bit g64 3.91 / 3.72 / 3.49, 1-bit g128 4.11 / 4.00 / 3.92
// (docs/quant.md, forty-sixth and forty-ninth sessions).
constexpr int kGemvRingSlots = 2;
template <int BITS, int NG, int R, int W = kGemvWarps>
constexpr int gemv_smem_bytes() {
  return W * R * gemv_slot_bytes<BITS, NG>();
}
// Where 16-byte piece i of a stage's rows sits in its slot: a row's pieces XOR-swizzled so that
// the lanes' fragment reads (rows g and g + 8, lane t's bytes 4 BITS t of each chunk) of one
// shared-memory wavefront fall on distinct banks: rows 2j and 2j + 1 at 4 and 8 bits (16-byte
// reads, 8 lanes a wavefront), rows j and j + 2 at 2 bits (8-byte, 16 lanes), j and j + 4 at 1 bit.
template <int BITS>
__host__ __device__ constexpr int gemv_ring_piece(int i) {
  constexpr int P = chunks_per_stage<BITS>() * kChunk * BITS / 8 / 16;  // pieces a row
  const int row = i / P, c = i % P;
  const int f = BITS == 8 ? (row & 1) : BITS == 4 ? (row & 1) << 2 : BITS == 2 ? ((row >> 1) & 1) << 1 : (row >> 2) & 1;
  return row * P + (c ^ f);
}
// Whether moving n pieces on moves the swizzled piece n on as well, for every piece of a stage's
// 16 rows (the ring path computes a lane's offsets once from that).
template <int BITS>
__host__ __device__ constexpr bool gemv_ring_piece_shifts(int n) {
  constexpr int kPieces = kGemvRows * chunks_per_stage<BITS>() * kChunk * BITS / 8 / 16;
  for (int i = 0; i + n < kPieces; ++i)
    if (gemv_ring_piece<BITS>(i + n) != gemv_ring_piece<BITS>(i) + n) return false;
  return true;
}
// A flag fixed at compile time that converts to bool in device code (std::bool_constant's
// conversion is host-only without --expt-relaxed-constexpr).
template <bool V>
struct Fixed {
  __host__ __device__ constexpr operator bool() const { return V; }
};

// kTail: the launch splits its tail rows (LowbitArgs::tail_*). A variant of its own: the split's
// bookkeeping in the plain kernel cost the layers that never split 1-3% (1 bit up to 8%; H100,
// one process, thirty-fifth session).
// kRing: 0 keeps a stage in flight in registers (above); R >= 2 gives each warp a shared-memory
// ring of R stage slots (weights, scales and x of a stage, one cp.async group), R - 1 in flight.
// W: warps a block (kGemvWarps, or kGemvShortWarps on the ring).
template <bool kBF16, int BITS, int NG, bool kTail, int kRing, int W = kGemvWarps>
__global__ void __launch_bounds__(32 * W, (kGemvMinBlocksFor<BITS, NG, kRing, W>)) lowbit_gemv_kernel(const LowbitArgs args) {
  static_assert(gemv_supported(BITS, NG), "a stage in at most 20 registers");
  static_assert(kRing == 0 || kRing >= 2, "a ring of at least two slots");
  constexpr int U = chunks_per_stage<BITS>();
  constexpr int kCols = U * kChunk;                 // columns of a stage
  constexpr int kRowBytes = U * kChunk * BITS / 8;  // a row's bytes of a stage: 128 (8, 4 bits), 64, 32
  constexpr int kChunkBytes = kRowBytes / U;        // a row's bytes of one chunk
  constexpr int kTilesPerWord = 8 / BITS;
  constexpr int kSegTiles = 8 / NG;                 // k16 tiles of a segment (one scale group)
  constexpr int kXBytes = kCols * 2;               // x slice of a stage
  constexpr int kXLanes = kXBytes / 16;             // lanes that copy it, 16 bytes each
  constexpr int kSegLanes = kChunk / NG / 8;        // lanes whose 8 halves of x make a segment
  static_assert(kXLanes <= 32 && kSegLanes <= 16, "a stage's x slice is one 16-byte copy a lane");
  using Nm = Num<kBF16>;
  // the register path's x buffers (a token 16 bytes a warp on the ring path, which holds x in its slots)
  __shared__ __align__(16) unsigned char xbuf[W][kRing == 0 ? 2 : 1][kRing == 0 ? kXBytes : 16];
  __shared__ float red[W][kGemvRows];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int stages = args.kp / kCols;
  // The block's 16-row block rb and its stages [first, end): all of them, or, past tail_first (the
  // split tail rows, LowbitArgs), split `tail_splits` ways of `tail_iters` stages, consecutive
  // blocks taking consecutive splits of one row block.
  unsigned rb = blockIdx.x;  // unsigned, as blockIdx.x: the plain kernel's code is the same as before the split
  int split = 0, first = 0, end = stages;
  const bool is_split = kTail && rb >= static_cast<unsigned>(args.tail_first);
  if (is_split) {
    const unsigned j = rb - args.tail_first;
    rb = args.tail_first + j / args.tail_splits, split = static_cast<int>(j % args.tail_splits);
    first = split * args.tail_iters, end = min(first + args.tail_iters, stages);
  }
  const int row0 = rb * kGemvRows;  // the block's first output row
  // Rows g and g + 8 of the block are rows 16 (rb % 4) + g (+ 8) of 64-row tile rb / 4.
  const unsigned char* wrow = reinterpret_cast<const unsigned char*>(args.qweight) +
                              ((static_cast<int64_t>(rb / 4) * stages * 64) + (rb % 4) * 16 + g) * kRowBytes;
  // The block's scale and zero records (lowbit_mm.h): rows g and g + 8 of the block are rows
  // 16 (rb % 4) + g (+ 8) of 64-row tile rb / 4, whose scales share a word, and so do their zeros.
  // Rows past M read the records' padding: zeros, finite, never stored.
  const bool nib = BITS <= 4 && args.nibble_zeros;
  const int tile_row = 16 * (rb % 4) + g;
  const uint32_t* rec = static_cast<const uint32_t*>(args.scale_zero) + record_word(rb / 4, 0, args.groups, args.record_words);
  const int sc_at = scale_word_of(tile_row), z_at = zero_word_of(tile_row, nib);
  const int z_shift = zero_shift_of(tile_row, nib);  // row g's zero, the block's (row g + 8's: 16 bits on)

  struct Stage {
    uint32_t w[2][U * BITS];  // rows g, g + 8: the lane's words of the stage, chunk-major
    uint32_t sc[U * NG];      // their scale word a segment
    uint32_t zw[U * NG];      // and zero word
  };
  // The scale group of stage st's segment j (both loaders). Group sizes are powers of two;
  // per-channel groups come with a shift that gives 0, and padding columns clamp to the last group.
  auto group_at = [&](const int st, const int col) {  // the group of column col of stage st
    return min((st * kCols + col) >> args.group_shift, args.groups - 1);
  };
  auto group_of = [&](const int st, const int j) { return group_at(st, j * (kChunk / NG)); };

  // `after`: a zero that orders the loads after a use of the stage before (run, below).
  auto load = [&](Stage& s, const int st, const uint32_t after = 0u) {
    const unsigned char* p = wrow + static_cast<int64_t>(st) * (64 * kRowBytes) + after;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Chunk u's `BITS` words at byte 4 BITS t of the row's chunk (the format's fragment order):
      // 32 bytes at 8 bits (two loads), 16, 8 or 4 bytes below.
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const unsigned char* src = p + h * 8 * kRowBytes + u * kChunkBytes + 4 * BITS * t;
        uint32_t* d = s.w[h] + u * BITS;
        if constexpr (BITS >= 4) {
#pragma unroll
          for (int i = 0; i < BITS / 4; ++i) {
            const uint4 v = ptx::stream_v4(src + 16 * i);
            d[4 * i] = v.x, d[4 * i + 1] = v.y, d[4 * i + 2] = v.z, d[4 * i + 3] = v.w;
          }
        } else if constexpr (BITS == 2) {
          const uint2 v = ptx::stream_v2(src);
          d[0] = v.x, d[1] = v.y;
        } else {
          d[0] = ptx::stream_b32(src);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < U * NG; ++j) {
      const uint32_t* r = rec + args.record_words * group_of(st, j);
      s.sc[j] = ptx::ldg_b32(r + sc_at), s.zw[j] = ptx::ldg_b32(r + z_at);
    }
  };

  // The ring path's slot: the row block's 16 rows of the stage as the format stores them (16-byte
  // pieces, each row's swizzled by gemv_ring_piece), then 16 words a segment (its record's 8 scale
  // words of the block's rows, then their 8 zero words), then the stage's x slice.
  constexpr int kStageBytes = kGemvRows * kRowBytes;
  constexpr int kSzWords = U * NG;
  constexpr int kSlotBytes = gemv_slot_bytes<BITS, NG>();
  const unsigned char* wblock = reinterpret_cast<const unsigned char*>(args.qweight) +
                                ((static_cast<int64_t>(rb / 4) * stages * 64) + (rb % 4) * 16) * kRowBytes;
  unsigned char* ring = nullptr;
  if constexpr (kRing > 0) {
    extern __shared__ __align__(16) unsigned char ring_smem[];
    ring = ring_smem + warp * kRing * kSlotBytes;
  }
  // A lane's pieces, (scale, zero) words and x piece sit at the same offsets of every slot and
  // stage, so their addresses are computed once, here, and the steps are unrolled over the slots,
  // which makes a slot's offsets immediates. Computed in the copies, they were redone in every
  // step, with the slot's offset, the row block's base and the swizzles: a 4-bit step took 415
  // instructions, now 320 (sm_90a SASS, fp16; docs/quant.md, thirty-seventh session).
  // Piece i of the stage's rows sits at gemv_ring_piece(i), and piece i + 32 k (the lane's k-th)
  // 32 k pieces after it.
  constexpr int kPieces = kStageBytes / 16;
  static_assert(kPieces % 32 == 0 && gemv_ring_piece_shifts<BITS>(32),
                "a lane's pieces of a stage lie 32 pieces apart in the slot");
  constexpr int kSzCopies = kGemvRows * kSzWords;  // scale and zero words of a stage, a lane each
  constexpr int kSzPerLane = (kSzCopies + 31) / 32;
  constexpr int kReads = BITS >= 4 ? BITS / 4 : 1;  // a row's 16-byte reads a chunk (or one smaller)
  struct RingLane {
    uint32_t ring;                      // the warp's ring (shared address)
    uint32_t wdst;                      // the lane's first piece in slot 0
    const unsigned char* wsrc;          // and in stage 0
    const char* xsrc;                   // its x piece in stage 0
    const uint32_t* szsrc[kSzPerLane];  // word lane + 32 k of the stage's: in its segment's record (group 0's)
    int szcol[kSzPerLane];              // and its segment's first column in a stage
    int rd[U][kReads];                  // row g's read i of chunk u in a slot (row g + 8's: 8 rows on)
  } ln{};
  if constexpr (kRing > 0) {  // (the register path's code stays as it was)
    ln.ring = ptx::smem_addr(ring);
    ln.wdst = ptx::keep(ln.ring + 16 * gemv_ring_piece<BITS>(lane));
    ln.wsrc = ptx::keep(wblock + 16 * lane);
    ln.xsrc = ptx::keep(static_cast<const char*>(args.x) + 16 * lane);
#pragma unroll
    for (int k = 0; k < kSzPerLane; ++k) {
      const int i = lane + 32 * k, j = i / 16, w = i % 16;  // segment j's scale (w < 8) or zero word
      const int row = 16 * (rb % 4) + w % 8;  // (4-bit zeros: word w % 8 holds rows w % 8 (+ 8) of every block)
      ln.szsrc[k] = ptx::keep(rec + (w < 8 ? scale_word_of(row) : zero_word_of(row, nib)));
      ln.szcol[k] = static_cast<int>(ptx::keep(j * (kChunk / NG)));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int i = 0; i < kReads; ++i) {
        const int byte = g * kRowBytes + u * kChunkBytes + 4 * BITS * t;
        ln.rd[u][i] = static_cast<int>(ptx::keep(16 * gemv_ring_piece<BITS>(byte / 16 + i) + (BITS >= 4 ? 0 : byte % 16)));
      }
    }
  }
  // Stage st's weights and scales, and its x slice, into slot `slot` (no commit).
  auto copy_w = [&](const int slot, const int st) {
    const unsigned char* src = ln.wsrc + static_cast<int64_t>(st) * (64 * kRowBytes);
#pragma unroll
    for (int k = 0; k < kPieces / 32; ++k) ptx::cp_async_cg_16(ln.wdst + slot * kSlotBytes + 512 * k, src + 512 * k);
#pragma unroll
    for (int k = 0; k < kSzPerLane; ++k) {
      if (kSzCopies % 32 == 0 || lane + 32 * k < kSzCopies)
        ptx::cp_async_ca_4(ln.ring + slot * kSlotBytes + kStageBytes + 4 * (lane + 32 * k),
                           ln.szsrc[k] + args.record_words * group_at(st, ln.szcol[k]));
    }
  };
  constexpr int kSlotX = kStageBytes + 4 * kGemvRows * kSzWords;  // the x slice's offset in a slot
  auto copy_x = [&](const int slot, const int st) {
    if (lane < kXLanes) ptx::cp_async_cg_16(ln.ring + slot * kSlotBytes + kSlotX + 16 * lane, ln.xsrc + st * kXBytes);
  };
  // The lane's words of a slot, as `load` takes them from global memory.
  static_assert(gemv_ring_piece_shifts<BITS>(8 * kRowBytes / 16), "rows g and g + 8 swizzle alike");
  auto read_slot = [&](Stage& s, const int slot) {
    const unsigned char* b = ring + slot * kSlotBytes;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        uint32_t* d = s.w[h] + u * BITS;
        if constexpr (BITS >= 4) {
#pragma unroll
          for (int i = 0; i < BITS / 4; ++i) {
            const uint4 v = *reinterpret_cast<const uint4*>(b + ln.rd[u][i] + h * 8 * kRowBytes);
            d[4 * i] = v.x, d[4 * i + 1] = v.y, d[4 * i + 2] = v.z, d[4 * i + 3] = v.w;
          }
        } else if constexpr (BITS == 2) {
          const uint2 v = *reinterpret_cast<const uint2*>(b + ln.rd[u][0] + h * 8 * kRowBytes);
          d[0] = v.x, d[1] = v.y;
        } else {
          d[0] = *reinterpret_cast<const uint32_t*>(b + ln.rd[u][0] + h * 8 * kRowBytes);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kSzWords; ++j) {
      const uint32_t* words = reinterpret_cast<const uint32_t*>(b + kStageBytes) + 16 * j;
      s.sc[j] = words[g], s.zw[j] = words[8 + g];
    }
  };

  // Stage st's x slice into this warp's buffer b, as one cp.async group (an empty one where
  // `on` is false, so that every step waits on the same count).
  const char* x = static_cast<const char*>(args.x);
  auto load_x = [&](const int b, const int st, const bool on) {
    if (on && lane < kXLanes) ptx::cp_async_cg_16(xbuf[warp][b] + 16 * lane, x + st * kXBytes + 16 * lane);
    ptx::cp_async_commit_group();
  };

  // The first stage's weights go out before the wait for the previous kernel (programmatic
  // dependent launch, launch.cuh); its x after it.
  Stage cur, nxt;
  if constexpr (kRing == 0) {
    if (first + warp < end) load(cur, first + warp);
    ptx::griddep_wait();
    load_x(0, first + warp, first + warp < end);
  } else {
    // The first R - 1 stages' weights and scales, then (after the wait for the previous kernel)
    // their x: 2 (R - 1) groups; every step then adds one and waits for all but R - 2.
#pragma unroll
    for (int i = 0; i < kRing - 1; ++i) {
      if (first + warp + W * i < end) copy_w(i, first + warp + W * i);
      ptx::cp_async_commit_group();
    }
    ptx::griddep_wait();
#pragma unroll
    for (int i = 0; i < kRing - 1; ++i) {
      if (first + warp + W * i < end) copy_x(i, first + warp + W * i);
      ptx::cp_async_commit_group();
    }
  }

  // Fractional zero points (or force_xsum) need each segment's sum of x.
  const bool sums = args.force_xsum || !args.integer_zeros;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  // `sums`: the launch applies zero points through the segments' sums of x. Without it every zero
  // is an integer the A fragments subtract exactly (args.integer_zeros, checked on the host), and
  // the segment needs neither the clamp nor the sum term. Where kGemvSplitSums the main loop is
  // built twice, one copy a launch, and `sums` is a Fixed flag; elsewhere it is the launch's
  // bool and each segment branches on it.
  // `xs`: the stage's x slice in shared memory; this lane's B fragments are columns 16 T + 4 t .. + 3
  // of each k16 tile (the format's order).
  auto compute = [&](const Stage& s, const unsigned char* xs, const auto sums) {
    constexpr bool kFixed = !std::is_same_v<decltype(sums), const bool>;  // a Fixed<> flag
    // Each segment's sum of x: lane l adds columns 8 l .. 8 l + 7, then the segment's lanes meet.
    float xseg = 0.f;
    if (sums) {
      if (lane < kXLanes) {
        const uint4 v = *reinterpret_cast<const uint4*>(xs + 16 * lane);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
          xseg += Nm::to_float(static_cast<uint16_t>(w[i] & 0xffffu)) + Nm::to_float(static_cast<uint16_t>(w[i] >> 16));
      }
#pragma unroll
      for (int o = 1; o < kSegLanes; o <<= 1) xseg += __shfl_xor_sync(0xffffffffu, xseg, o);
    }
    const unsigned char* xlane = xs + 8 * t;
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int j = 0; j < NG; ++j) {
        const int seg = u * NG + j;
        // The zeros of rows g and g + 8 as the A fragments subtract them: 4-bit integers put into
        // the magic's mantissa (nibble_zero), or the dtype's (segment_zero, lowbit_mm.cuh),
        // clamped where the launch applies their fractional rest. Without sums the zeros are
        // integers, which at 1, 2 and 4 bits the records hold as 4-bit ones (the launch's rule).
        const bool nz = kFixed && !sums ? BITS <= 4 : nib;
        const SegmentZero z2 = nz ? nibble_zero<kBF16>(s.zw[seg], z_shift)
                                  : segment_zero<kBF16, BITS>(s.zw[seg], !kFixed || sums);
        uint32_t zc[2], zo[2] = {0u, 0u};
        float sc[2], zf[2] = {0.f, 0.f};
        // Folded at 1 and 2 bits: a 2-bit g64 step 270 -> 258 instructions (SASS, fp16; docs/quant.md,
        // forty-ninth session). At 4 bits the folded form compiled to more PRMT, not fewer, and
        // measured ~1% slower.
        row_constants<kBF16, BITS, (BITS <= 2)>(z2, zc, zo);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          sc[h] = Nm::to_float(static_cast<uint16_t>(h ? s.sc[seg] >> 16 : s.sc[seg] & 0xffffu));
          if (sums && !nz)  // z - zi, zi exact (4-bit zeros are integers: 0)
            zf[h] = Nm::to_float(static_cast<uint16_t>(h ? s.zw[seg] >> 16 : s.zw[seg] & 0xffffu)) -
                    Nm::to_float(static_cast<uint16_t>(h ? z2.zi2 >> 16 : z2.zi2 & 0xffffu));
        }
        float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int T = j * kSegTiles; T < (j + 1) * kSegTiles; ++T) {
          const int wi = u * BITS + T / kTilesPerWord;
          const int s0 = 2 * (T % kTilesPerWord);
          uint32_t a[4];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            a[h] = unpack_pair<kBF16, BITS>(s.w[h][wi], s0, zc[h], zo[h]);
            a[h + 2] = unpack_pair<kBF16, BITS>(s.w[h][wi], s0 + 1, zc[h], zo[h]);
          }
          const uint2 b = *reinterpret_cast<const uint2*>(xlane + (u * kChunk + 16 * T) * 2);
          ptx::mma_m16n8k16<kBF16>(part, a, b.x, b.y);
        }
        // acc += s * (sum (q - zi) x - (z - zi) sum x), per row (e / 2)
        if (kFixed && !sums) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[e] = fmaf(sc[e / 2], part[e], acc[e]);
        } else {
          const float xsum = sums ? __shfl_sync(0xffffffffu, xseg, seg * kSegLanes) : 0.f;
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[e] = fmaf(sc[e / 2], fmaf(-zf[e / 2], xsum, part[e]), acc[e]);
        }
      }
    }
  };

  // Two stage buffers in registers, named (not indexed) so they stay in registers, and x buffer
  // 0 with `cur`, 1 with `nxt`. Each step waits for the x of the stage it computes (issued a step
  // earlier) and meets the warp's lanes (__syncwarp: that x is visible to all, and all have read
  // the other buffer), issues the next stage's x and weights, then computes.
  // The stage's data must be waited for before the next stage's loads go out: ptxas counts all
  // the weight loads on one scoreboard, so a first use placed after the next loads waits for
  // those too, and the stage ahead is lost. Without help ptxas placed it there in every other
  // step (the SASS, docs/quant.md). So the next load addresses and the x pointer of the compute
  // take a zero computed from the stage's first scale word (ptx::zero_after): the wait comes
  // before the loads, and outside the branch around them.
  // One step: compute stage st from `now` and x buffer b, with stage st + 8 going out into `ahead`
  // and buffer b ^ 1.
  auto step = [&](Stage& now, Stage& ahead, const int b, const int st, const auto sums_arg) {
    const int nx = st + W;
    ptx::cp_async_wait_group<0>();
    __syncwarp();
    const uint32_t after = ptx::zero_after(now.sc[0]);
    load_x(b ^ 1, nx, nx < end);
    if (nx < end) load(ahead, nx, after);
    compute(now, xbuf[warp][b] + after, sums_arg);  // (the register path)
  };
  auto run = [&](const auto sums_arg) {
    if constexpr (kRing == 0) {
      for (int st = first + warp; st < end; st += 2 * W) {
        step(cur, nxt, 0, st, sums_arg);
        if (st + W >= end) break;
        step(nxt, cur, 1, st + W, sums_arg);
      }
    } else {
      // Slot `slot` holds stage st; the slot before it (computed by the last step, read by every
      // lane before this step's __syncwarp) takes stage st + 8 (R - 1). The warp's k-th stage is
      // in slot k % R: unrolled over the slots, so that each step's slot is a constant.
      for (int st0 = first + warp; st0 < end; st0 += kRing * W) {
#pragma unroll
        for (int slot = 0; slot < kRing; ++slot) {
          const int st = st0 + slot * W;
          if (st >= end) break;
          ptx::cp_async_wait_group<kRing - 2>();
          __syncwarp();
          const int nx = st + W * (kRing - 1), free_slot = slot == 0 ? kRing - 1 : slot - 1;
          if (nx < end) {
            copy_w(free_slot, nx);
            copy_x(free_slot, nx);
          }
          ptx::cp_async_commit_group();
          Stage s;
          read_slot(s, slot);
          compute(s, ring + slot * kSlotBytes + kSlotX, sums_arg);
        }
      }
    }
  };
  if constexpr (kGemvSplitSums<BITS, NG>) {
    if (sums)
      run(Fixed<true>{});
    else
      run(Fixed<false>{});
  } else {
    run(sums);
  }
  ptx::griddep_launch_dependents();  // the next layer may start its prologue as blocks drain

  // Token 0 is column 0 of the n8 accumulators: lanes with t = 0, registers 0 (row g) and 2 (g + 8).
  if (t == 0) red[warp][g] = acc[0], red[warp][g + 8] = acc[2];
  __syncthreads();
  float v = 0.f;
  if (threadIdx.x < kGemvRows) {
#pragma unroll
    for (int w = 0; w < W; ++w) v += red[w][threadIdx.x];
  }
  if (kTail && is_split) {
    // The row block's splits meet in the workspace ([splits][row blocks][16] floats, a 1-token
    // tile of 16 rows each); the last to arrive sums them in split order (deterministic), adds
    // bias and casts, as the fused kernel's epilogue does (epilogue.cuh).
    __shared__ int s_last;
    const int64_t split_stride = static_cast<int64_t>((args.m + kGemvRows - 1) / kGemvRows) * kGemvRows;
    if (threadIdx.x < kGemvRows) args.workspace[split * split_stride + rb * kGemvRows + threadIdx.x] = v;
    if (!arrive_last(args.counters, rb, args.tail_splits, threadIdx.x, &s_last)) return;
    const TileOut out{args.y, args.bias, args.workspace, args.counters, args.m, 1};
    reduce_splits<kBF16, kGemvRows, (32 * W)>(out, args.workspace + rb * kGemvRows, split_stride,
                                                   args.tail_splits, row0, 0, kGemvRows, threadIdx.x);
    if (threadIdx.x == 0) args.counters[rb] = 0;  // re-armed for the next launch
    return;
  }
  if (threadIdx.x < kGemvRows) {
    const int row = row0 + threadIdx.x;
    if (row < args.m) {
      if (args.bias != nullptr) v += load_float<kBF16>(args.bias, row);
      store_float<kBF16>(args.y, row, v);
    }
  }
}

// Host side of one (dtype, bits) pair, instantiated with the fused kernel's variants. No shared
// memory depends on K: the register loader's is static (x buffers of 8 KB a block at most), the
// ring's dynamic (gemv_smem_bytes: 42 KiB a block at 4-bit g128, 37 at 8-bit g128, 28 at 2-bit
// g64, 20 at 1-bit g64), opted in once per device.
template <bool kBF16, int BITS, int NG>
struct GemvLauncher {
  template <bool kTail, int R, int W = kGemvWarps>
  static cudaError_t launch_variant(const LowbitArgs& args, const LowbitPlan& plan, cudaStream_t stream) {
    constexpr auto kernel = lowbit_gemv_kernel<kBF16, BITS, NG, kTail, R, W>;
    constexpr int smem = gemv_smem_bytes<BITS, NG, R, W>();
    if constexpr (smem > 0) {
      static std::atomic<uint64_t> allowed{0};  // per kernel
      if (const cudaError_t e = allow_smem_once(kernel, smem, allowed); e != cudaSuccess) return e;
    }
    LowbitArgs a = args;
    a.record_words = record_words(BITS <= 4 && args.nibble_zeros);
    if (kTail) a.tail_first = plan.tail_first, a.tail_splits = plan.tail_splits, a.tail_iters = plan.tail_iters;
    // The ring's cp.async stream evicts L2 under the normal policy (the register loader's
    // ld.global.nc stream does not: docs/kernels.md, v13).
    const StreamWindow window =
        R > 0 ? stream_window(args.qweight, lowbit_qweight_bytes(args.m, args.kp, BITS)) : StreamWindow{};
    return launch_kernel_window(kernel, dim3(plan.grid_blocks), 32 * W, smem, stream, plan.pdl, window, a);
  }
  static cudaError_t launch(const LowbitArgs& args, const LowbitPlan& plan, cudaStream_t stream) {
    const bool tail = plan.tail_splits > 1;
    if (plan.gemv_ring != 0) {  // (the planner never splits the ring's tail rows)
      if (tail || plan.gemv_ring != kGemvRingSlots) return cudaErrorInvalidValue;
      if (plan.gemv_warps == kGemvShortWarps) return launch_variant<false, kGemvRingSlots, kGemvShortWarps>(args, plan, stream);
      if (plan.gemv_warps != kGemvWarps) return cudaErrorInvalidValue;
      return launch_variant<false, kGemvRingSlots>(args, plan, stream);
    }
    if (plan.gemv_warps != kGemvWarps) return cudaErrorInvalidValue;
    return tail ? launch_variant<true, 0>(args, plan, stream) : launch_variant<false, 0>(args, plan, stream);
  }
  template <int R, int W>
  static int occupancy() {
    int blocks = 1;
    const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &blocks, lowbit_gemv_kernel<kBF16, BITS, NG, false, R, W>, 32 * W, gemv_smem_bytes<BITS, NG, R, W>());
    return e == cudaSuccess && blocks > 0 ? blocks : 1;
  }
  static int blocks_per_sm(int ring, int warps) {
    if (ring == 0) return occupancy<0, kGemvWarps>();
    return warps == kGemvShortWarps ? occupancy<kGemvRingSlots, kGemvShortWarps>() : occupancy<kGemvRingSlots, kGemvWarps>();
  }
};

// The entry points of one (dtype, bits) pair for the runtime groups per chunk (those
// gemv_supported allows), instantiated in lowbit_mm_{fp16,bf16}_{bits}.cu beside the fused kernel's.
template <bool kBF16, int BITS, typename F>
auto with_groups(int ng, F f) {
  if constexpr (gemv_supported(BITS, 2)) {
    if (ng == 2) return f(GemvLauncher<kBF16, BITS, 2>{});
  }
  return f(GemvLauncher<kBF16, BITS, 1>{});
}
template <bool kBF16, int BITS>
cudaError_t launch_gemv(const LowbitArgs& args, const LowbitPlan& plan, cudaStream_t stream) {
  if (!gemv_supported(BITS, plan.ng)) return cudaErrorInvalidValue;
  return with_groups<kBF16, BITS>(plan.ng, [&](auto g) { return decltype(g)::launch(args, plan, stream); });
}
template <bool kBF16, int BITS>
int gemv_blocks_per_sm(int ng, int ring, int warps) {
  return with_groups<kBF16, BITS>(ng, [&](auto g) { return decltype(g)::blocks_per_sm(ring, warps); });
}

#define SPINFER_GEMV_INSTANTIATE(BF16, BITS)                                                           \
  template cudaError_t launch_gemv<BF16, BITS>(const LowbitArgs&, const LowbitPlan&, cudaStream_t); \
  template int gemv_blocks_per_sm<BF16, BITS>(int, int, int);
#define SPINFER_GEMV_EXTERN(BF16, BITS)                                                                       \
  extern template cudaError_t launch_gemv<BF16, BITS>(const LowbitArgs&, const LowbitPlan&, cudaStream_t); \
  extern template int gemv_blocks_per_sm<BF16, BITS>(int, int, int);

}  // namespace lowbit
}  // namespace spinfer
