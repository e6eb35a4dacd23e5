// The SMBD SpMM kernel: y[N, M] = x[N, K] @ W[M, K]^T with W in TCA-BME (GroupTile 64x64).
//
// Read top to bottom:
//  * One thread block (4 warps) owns one GroupTile row of W (64 output features) and a tile of
//    BN tokens (8 to 64; 128 past 64 tokens on sm_90's wgmma form), and walks a range of GroupTiles along K (all of them, or a split-K share). (On
//    sm_90 at BN >= 64 a block may own two GroupTile rows instead, two warp groups sharing each
//    stage's x slice: kRows, SpmmPlan::rows.)
//  * A ring of `stages` pipeline stages brings the GroupTiles to shared memory *compressed*, two
//    consecutive GroupTiles per stage: their bitmaps (2 x 512 B), their value runs (adjacent in
//    global memory, so one copy) and the matching 128-column slice of x. Two per stage halves
//    the block barriers, the mbarrier waits and the copy-issue work per GroupTile, which ncu
//    showed as ~40% of the instructions and the largest stall (the barrier) with one per stage.
//    On sm_90 a producer warp fills the stages: one lane issues bulk copies (cp.async.bulk) of
//    the bitmaps and runs, all lanes 16-byte cp.async of the x rows, and both complete on the
//    stage's mbarrier; on sm_80 all threads issue 16-byte cp.async. Nothing dense of W ever
//    exists outside registers.
//  * Warp w decodes TCTile row w of each GroupTile straight into mma.m16n8k16 A fragments
//    (Shared-Memory Bitmap Decoding): a lane's value offset is the PopCount of everything before
//    its bits plus a masked PopCount inside its word. fp32 accumulators.
//  * The epilogue adds bias and casts, or (split-K) stores fp32 partials and the last block to
//    arrive for a tile reduces them in a fixed order.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "epilogue.cuh"
#include "launch.cuh"
#include "ptx.cuh"
#include "spmm_smbd.h"

namespace spinfer {
namespace smbd {

constexpr int kGt = 64;                 // GroupTile is kGt x kGt
constexpr int kWarps = 4;               // one decoding warp per TCTile row of the GroupTile
// Threads per block: the decoding warps (kWarps for each of the block's kRows GroupTile rows), plus
// on sm_90 one producer warp that issues the bulk copies. With a decoding warp issuing them (~130
// instructions per stage on top of its ~520) the other three waited for it at every stage's
// barrier: ncu's largest stall.
template <bool kBulk, int kRows = 1>
constexpr int kThreads = 32 * (kWarps * kRows + (kBulk ? 1 : 0));
constexpr int kPair = 2;                // GroupTiles per pipeline stage
constexpr int kMaxStages = 4;
constexpr int kWordsPerGt = kGt * kGt / 64;
constexpr int kBitmapBytes = kWordsPerGt * 8;
constexpr int kMaxValues = kGt * kGt;   // a fully dense GroupTile
constexpr int kXStride = kPair * kGt + 8;  // halves per x row in smem: 272 B, so the 8 rows of
                                           // an ldmatrix phase start in 8 distinct bank groups
constexpr unsigned kFull = 0xffffffffu;

// A decoding lane reads values[e - 2] and values[e - 1] unconditionally, where e, its prefix plus
// the set bits up to its pair, is at most the run for valid data; e < 2 reads up to two values
// before the run, which are other bytes of the same stage (bitmaps or the first run). Arrays
// that bypassed validation can push e past the run. The per-word decode clamps every e to the
// run; the lean decode clamps each half-word's prefix once per GroupTile, after which a lane
// adds at most 32 (its PopCount), so its reads stay inside this slack.
constexpr int kValueSlack = 40;

// The {bits, prefix} pairs a warp publishes for one GroupTile: 16 words x 2 halves, stored
// half-major so a lane fetches the four words of a TCTile with two 16-byte loads. The halves are
// 24 pairs apart (192 B, 64 B past a multiple of the 128 B bank row): the publishing store is
// 8 bytes a lane, which shared memory serves a half-warp at a time, and each half-warp writes
// pairs 0-7 (or 8-15) of both halves, so the two 64-byte pieces must fall in different banks.
// At 20 apart (160 B) they shared 32 B of banks and every store took four wavefronts instead of
// two (Nsight Compute, fifty-first session). The second GroupTile's pairs start 40 pairs in
// (320 B), which keeps the same 192 B between its halves in the 80 pairs of before:
// [0, 128) [192, 320) for the first GroupTile, [320, 448) [512, 640) for the second. The 16-byte
// loads of decode_gt read one address a half-warp, which fall in different banks at 160 B and 192 B.
constexpr int kPackStride = 24;
constexpr int kPackPerGt = 40;
static_assert(kPackStride >= 16 && kPackPerGt >= kPackStride + 16 && kPackPerGt + kPackStride + 16 <= 2 * kPackPerGt,
              "the four 16-pair pieces of a warp's pairs must not overlap");
static_assert(kPackStride * 8 % 128 == 64 && kPackPerGt * 8 % 16 == 0, "halves 64 B off the bank row, 16 B aligned");

// A GroupTile's entry of the weight's row table (TCABME.row_offset): the set bits of its TCTile
// rows above each of its 4 rows, 4 x int16. The producer's lanes copy a stage's two entries into a
// static array beside the mbarriers (SpmmPlan::row_table): 16 bytes more in each stage's buffer
// made ptxas spill in the 40-register variant. Any value is safe to read: it only moves a warp's
// start in the run, which the decode clamps.
constexpr int kTableBytes = 8;

// Shared memory of one block: `stages` stages, each holding two bitmaps (1 KB), a value buffer
// for two runs and one x slice [x_rows][kXStride]; then the GroupTile offsets of the block and
// its stage table (stage_pair, 8 bytes per GroupTile pair). The
// value buffer holds 2 * value_cap elements, value_cap being the weight's longest run
// (TCABME.max_run) rather than a dense GroupTile: ~2.2k values instead of 4096 at 50% sparsity.
// The x slice has only min(BN, N) rows, so at N=1 a stage is 1.9 KB smaller: the B fragments of
// tokens past N repeat the last valid token's row, and the accumulator columns they feed are
// never stored (an mma's output column n depends on B's column n only). Both keep more blocks
// resident, which measured as the strongest lever of this kernel (2 stages beat 3 and 4).
// kWg (the warp-group MMA variant): the x slice is wgmma's K-major B operand instead, with the
// 128-byte swizzle: GroupTile g's 64 columns of token n are the 128-byte row n of a region of BN
// rows at g * BN * 128, 1024-byte aligned (the swizzle's period); one tensor copy a GroupTile
// (box 64 columns x min(BN, N) tokens) writes it. BN rows whatever N: wgmma reads all BN columns
// of B (rows past N that no copy writes feed only output columns that are never stored). The
// first form, 16 copies a stage of 8 columns x the tokens each (16-byte rows, half of each 32-byte
// L2 sector), ran 0.70x the mma.sync kernel whatever the group size (H100, 2026-12-07).
// kRows = 2 (a block of two GroupTile rows, kWg at BN >= 32 only): a stage holds both rows' bitmaps,
// then both rows' value buffers, then the one x slice they share; the offsets and the stage table
// come once for each row.
template <int BN, bool kWg = false, int kRows = 1>
struct Layout {
  static constexpr int kBitmapRegion = kPair * kBitmapBytes;  // one GroupTile row's bitmaps of a stage
  static constexpr int kValueOffset = kRows * kBitmapRegion;
  static constexpr int kXTileBytes = BN * kGt * 2;  // kWg: a GroupTile's x region
  int value_bytes, x_offset, stage_bytes, stages;
  __host__ __device__ Layout(int value_cap, int n_stages, int n)
      : value_bytes(((kPair * value_cap + kValueSlack) * 2 + 15) / 16 * 16),
        x_offset(kWg ? (kValueOffset + kRows * value_bytes + 1023) / 1024 * 1024 : kValueOffset + kRows * value_bytes),
        stage_bytes(kWg ? x_offset + kPair * kXTileBytes
                        : x_offset + (n < BN ? n : BN) * kXStride * 2),  // 272 B rows: 16-byte aligned
        stages(n_stages) {}
  __host__ __device__ static int offsets_stride(int k_per_split) { return ((k_per_split + 1) * 4 + 15) / 16 * 16; }
  __host__ __device__ static int pairs_stride(int k_per_split) {
    return ((k_per_split + kPair - 1) / kPair * 8 + 15) / 16 * 16;
  }
  __host__ __device__ int offsets_offset() const { return stages * stage_bytes; }
  __host__ __device__ int pairs_offset(int k_per_split) const {
    return offsets_offset() + kRows * offsets_stride(k_per_split);
  }
  __host__ __device__ int smem_bytes(int k_per_split) const {  // kWg: with the slack to align the base
    return pairs_offset(k_per_split) + kRows * pairs_stride(k_per_split) + (kWg ? 1024 - 16 : 0);
  }
};

// What one block works on, derived from blockIdx: GroupTile rows `row` .. row+rows-1 (kRows of
// them, fewer at the bottom edge), tokens n0 .. n0+valid_rows-1, GroupTile columns g_begin ..
// g_begin+nk-1 (pairs (nk+1)/2 stages' worth).
struct BlockWork {
  int row, rows, split, g_begin, nk, n0, valid_rows;
};

template <int kRows>
__device__ __forceinline__ BlockWork block_work(const SpmmArgs& args, int bn, int grid_k, int k_per_split) {
  BlockWork b;
  b.row = blockIdx.y * kRows;
  b.rows = kRows == 1 ? 1 : min(kRows, (args.m + kGt - 1) / kGt - b.row);
  b.split = blockIdx.z;
  b.g_begin = b.split * k_per_split;
  b.nk = max(0, min(grid_k, b.g_begin + k_per_split) - b.g_begin);
  b.n0 = blockIdx.x * bn;
  b.valid_rows = min(bn, args.n - b.n0);
  return b;
}

// The block's GroupTile offsets, loaded once so issuing a copy never waits on a dependent
// global load. Clamped and rounded down to 16 bytes: arrays that bypassed validation can give
// wrong results but can never send a copy outside `values`.
// Row r of the block's offsets at s_off + r * stride (ints); a row past the weight's gets zeros
// (empty runs, never copied). The kRows == 1 forms here, in the stage table and in issue_bulk keep
// the one-row kernels' code as it was before two-row blocks: the general forms moved the BN = 8
// stage by 3 instructions (sm_90a SASS, seventy-eighth session).
template <int kRows>
__device__ __forceinline__ void load_offsets(const SpmmArgs& args, const BlockWork& b, int grid_k, int* s_off,
                                             int stride, int tid, int threads) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t first = static_cast<int64_t>(b.row + r) * grid_k + b.g_begin;
    for (int idx = tid; idx <= b.nk; idx += threads) {
      int64_t o = 0;
      if (kRows == 1 || r < b.rows)
        o = min(max(static_cast<int64_t>(args.gtile_offset[first + idx]), int64_t(0)), args.nvalues);
      (kRows == 1 ? s_off : s_off + r * stride)[idx] = static_cast<int>(o & ~int64_t(7));
    }
  }
}

// The runs of the GroupTiles of stage p, clamped to the value buffer (2 * value_cap): only a
// max_run below the truth or corrupt offsets ever clamp. total = both runs; split = where the
// second run starts (== total when the stage holds one GroupTile).
struct PairRuns {
  int gts, total, split;
};

__device__ __forceinline__ PairRuns pair_runs(const int* s_off, int nk, int p, int value_cap) {
  PairRuns r;
  const int g = kPair * p;
  r.gts = min(kPair, nk - g);
  r.total = min(max(s_off[g + r.gts] - s_off[g], 0), kPair * value_cap);
  r.split = r.gts == kPair ? min(max(s_off[g + 1] - s_off[g], 0), r.total) : r.total;
  return r;
}

// What the decoding warps need of a stage's runs, made once per block into a table in shared
// memory, so a stage costs them one 8-byte load instead of the offsets' loads, clamps and
// subtractions (~10 instructions a stage):
//   x = last0 | last1 << 16: the last index of each run (0 for an empty one), the decode's clamp
//       targets, in the 16-bit fields the packed prefixes use, so one __vminu2 clamps both;
//   y = split | gts << 16: where the second run starts, and the stage's GroupTiles (1 or 2).
// Every field fits 16 bits: pair_runs clamps a stage's runs to 2 * value_cap <= 8192 values.
__device__ __forceinline__ uint2 stage_pair(const PairRuns& r) {
  const uint32_t last0 = max(r.split - 1, 0), last1 = max(r.total - r.split - 1, 0);
  return make_uint2(last0 | last1 << 16, static_cast<uint32_t>(r.split) | static_cast<uint32_t>(r.gts) << 16);
}

// How a lane turns one bitmap half-word into an A-fragment register (two fp16/bf16 values):
//   kept = bits << (30 - lp), as a multiply on the FMA pipe, keeps the bits up to and including
//   the lane's pair, with the pair {b0, b1} at bits 30 and 31. e = popc(kept) is then the index
//   one past the pair's last value, so the candidates are u0 = values[e - 2] and
//   u1 = values[e - 1] (each zero-extended to 32 bits): f = b0 + 2 b1 = 1 or 2 takes u1 as
//   the low or the high value, 3 takes both, 0 neither. The register is prmt(u0, u1, S(f)) with
//   S(f)'s low byte 0x10 (u0), 0x54 (u1) or a zero pair, and its high byte 0x54 or a zero pair.
//   A zero pair is any byte whose two nibbles have bit 1 set (bytes 2-3 of u0 or u1, always
//   zero, or with bit 3 set their sign, also zero), or 0xFF.
// S(f) is one permute of {kSelTable, 0} with the index L = kSelMul * f + kSelAdd (mod 256):
// L = 7F, 76, 6D, 64 for f = 0..3. Nibble 0 of L picks S's low byte, nibble 1 its high byte:
//   f = 0: F -> sign of table byte 7 (A2) = FF, zero | 7 -> A2, zero
//   f = 1: 6 -> 54, u1                              | 7 -> A2, zero
//   f = 2: D -> sign of table byte 5 (80) = FF, zero | 6 -> 54, u1
//   f = 3: 4 -> 10, u0                              | 6 -> 54, u1
// The zero source takes the place of a second table register: an 8-byte table in two
// registers cost an extra move per word (the compiler kept one half in a uniform register,
// which a permute cannot read). No affine function of f is the selector S(f) itself (checked
// by enumeration), so the lookup stays. ALU work per word: a PopCount and two permutes; FMA
// pipe: the kept, address, f and L multiplies.
constexpr uint32_t kSelMul = 0xF7u;
constexpr uint32_t kSelAdd = 0x7Fu;
constexpr uint32_t kSelTable = 0xA2548010u;

__device__ __forceinline__ uint32_t pair_selector(uint32_t kept) {
  const uint32_t f = ptx::mul_hi(kept, 4u);  // kept >> 30, on the FMA pipe
  return ptx::prmt(0u, kSelTable, f * kSelMul + kSelAdd);
}

// Decodes TCTile t of this warp's row into an A fragment (a[j]: BitmapTile j = register Ra_j,
// TL, BL, TR, BR). pk: this lane's half of the published pairs; vals/last: the run (lean: unused,
// the pairs carry shared addresses); to_top: see pair_selector.
template <bool kLean>
__device__ __forceinline__ void decode_tctile(const uint4* pk, const uint16_t* vals, int last, int t, uint32_t to_top,
                                              uint32_t (&a)[4]) {
  const uint4 qa = pk[2 * t], qb = pk[2 * t + 1];
  const uint2 words[4] = {{qa.x, qa.y}, {qa.z, qa.w}, {qb.x, qb.y}, {qb.z, qb.w}};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint2 he = words[j];  // {this lane's half of word 4t+j, its prefix}
    // Both candidates are loaded unconditionally and selected: cheaper than two predicated
    // loads plus two zeroings. Either may lie up to two values before the run (at e = 0
    // or 1); those are other bytes of the stage, read and discarded.
    const uint32_t kept = ptx::mul_lo(he.x, to_top);
    const int e = __popc(kept);
    uint32_t u0, u1;
    if constexpr (kLean) {  // he.y: the shared address of values[prefix - 2]
      const uint32_t addr = he.y + 2u * e;
      u0 = ptx::lds_u16(addr);
      u1 = ptx::lds_u16(addr + 2);
    } else {
      const int off = min(static_cast<int>(he.y) + e, last + 1) - 2;
      u0 = vals[off];
      u1 = vals[off + 1];
    }
    a[j] = ptx::prmt(u0, u1, pair_selector(kept));
  }
}

// This lane's half of a GroupTile's published pairs: lanes 0-15 read the low 32-bit half of each
// BitmapTile word, lanes 16-31 the high one (see decode_gt), kPackStride apart.
__device__ __forceinline__ const uint4* lane_pairs(const uint2* pack, int lane) {
  return reinterpret_cast<const uint4*>(pack + (lane >> 4) * kPackStride);
}

// Decodes this warp's TCTile row of one GroupTile from its published pairs and multiplies it
// into acc. pack: the pairs (half-major, kPackStride apart); vals/last: the run (lean: unused,
// the pairs carry shared addresses); xa: this lane's ldmatrix row address in each n8 block of
// the x slice, at this GroupTile's columns; to_top: 1 << (30 - 2 * (lane % 16)), made once by the
// kernel (see pair_selector's comment for its use).
template <bool kBF16, int BN, bool kLean>
__device__ __forceinline__ void decode_gt(const uint2* pack, const uint16_t* vals, int last,
                                          const uint32_t (&xa)[BN / 8], int gt, int lane, uint32_t to_top,
                                          float (&acc)[BN / 8][4]) {
  // Lane geometry of the m16n8k16 fragments: group g = lane/4 owns row g (and g+8) of A; in a
  // BitmapTile word that row and column pair are bits 2*lane and 2*lane+1: lanes 0-15 read the
  // low 32-bit half, lanes 16-31 the high one.
  const uint4* pk = lane_pairs(pack, lane);

#pragma unroll
  for (int tt = 0; tt < 4; tt += 2) {
    // B fragments of TCTiles tt and tt+1 (k columns 16tt .. 16tt+31) for every n8 block: one
    // ldmatrix.x4 each instead of four 4-byte loads.
    uint32_t b[BN / 8][4];
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb) ptx::ldmatrix_x4(b[nb], xa[nb] + (gt * kGt + 16 * tt) * 2);
#pragma unroll
    for (int t = tt; t < tt + 2; ++t) {  // TCTile (warp, t): k columns 16t .. 16t+15
      uint32_t a[4];
      decode_tctile<kLean>(pk, vals, last, t, to_top, a);
#pragma unroll
      for (int nb = 0; nb < BN / 8; ++nb) ptx::mma_m16n8k16<kBF16>(acc[nb], a, b[nb][2 * (t - tt)], b[nb][2 * (t - tt) + 1]);
    }
  }
}

// decode_gt for the warp-group MMA variant (kWg, every BN, sm_90a, lean decode): the four
// decoding warps are one warp group, whose TCTile rows are the 64 rows of one wgmma.m64nBNk16 per
// TCTile, with B (the x slice, Layout's kWg layout, x_desc the low word of its descriptor) read
// from shared memory by the tensor cores. So no warp loads B fragments (at BN = 32, 16
// ldmatrix.x4 a stage, each warp the same ones) and a TCTile takes one wgmma where it took BN / 8
// mma.sync. kGroup TCTiles' wgmma form a group, waited for before the next group's decode
// overwrites their A registers; by the stage's end every group has retired, so the producer may
// refill the stage after the block barrier. (decode_gt_wg_ring leaves one group in flight
// across the next decode instead, in a second set of A registers.)
// Each group is a warp-group rendezvous (its fence and wait), so larger groups meet less often:
// 1, 2 or 4 TCTiles (a GroupTile), sm_90a fp16 at BN = 32: 447 / 442 / 481 instructions a
// stage on the decoding path, 54 / 54 / 62 registers; at BN = 64 453 / 449 / 479, 64 / 68 / 74.
// Groups of 4 measured fastest (H100, same process, 4 issue shapes x N = 24 / 32 / 64, geomean
// x cuBLAS at 50%: mma.sync 0.963, groups of 1 1.068, of 4 1.121), so the planner takes them.
// Pins every accumulator at this point (ptx::wgmma_hold): the compiler may not move their reads
// or writes across a wgmma fence or wait.
template <int BN>
__device__ __forceinline__ void hold_accumulators(float (&acc)[BN / 8][4]) {
#pragma unroll
  for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) ptx::wgmma_hold(acc[nb][e]);
}

constexpr int kWgRing = 3;  // SpmmPlan::wgmma: groups of 1 TCTile, one left in flight (decode_gt_wg_ring)
constexpr int kWgPair = 5;  // SpmmPlan::wgmma: groups of 4, a stage's second decoded while the first multiplies

// Decodes TCTiles t0 .. t0 + kGroup - 1 of GroupTile gt into `a` and issues their wgmma as one
// group, without waiting for it. decode_gt_wg waits for each group before the next decode
// overwrites `a`. kWgPair calls it with a GroupTile's four TCTiles: decode_stage decodes the
// stage's second GroupTile into another register set while the first's group runs, and waits for
// both at the stage's end, before the block barrier lets the producer refill the stage. At
// BN = 128 a group of 4 is 256 tensor-pipe cycles, and ncu on plain groups of 4 put 18% of the
// stall samples on the wait after each one (eightieth session).
template <bool kBF16, int BN, int kGroup>
__device__ __forceinline__ void decode_group_issue(const uint4* pk, uint32_t x_desc, uint32_t desc_hi, int gt, int t0,
                                                   uint32_t to_top, float (&acc)[BN / 8][4],
                                                   uint32_t (&a)[kGroup][4]) {
#pragma unroll
  for (int t = 0; t < kGroup; ++t) decode_tctile<true>(pk, nullptr, 0, t0 + t, to_top, a[t]);
  hold_accumulators<BN>(acc);
  ptx::wgmma_fence();
#pragma unroll
  for (int t = 0; t < kGroup; ++t)  // k16 tile t0 + t of GroupTile gt: 32 (t0 + t) bytes into its rows
    ptx::wgmma_m64k16<kBF16, BN>(acc, a[t], x_desc + (gt * BN * kGt * 2 + 32 * (t0 + t)) / 16, desc_hi);
  ptx::wgmma_commit();
}

template <bool kBF16, int BN, int kGroup>
__device__ __forceinline__ void decode_gt_wg(const uint2* pack, uint32_t x_desc, uint32_t desc_hi, int gt, int lane,
                                             uint32_t to_top, float (&acc)[BN / 8][4]) {
#pragma unroll
  for (int t0 = 0; t0 < 4; t0 += kGroup) {
    uint32_t a[kGroup][4];
    decode_group_issue<kBF16, BN, kGroup>(lane_pairs(pack, lane), x_desc, desc_hi, gt, t0, to_top, acc, a);
    ptx::wgmma_wait<0>();
  }
  hold_accumulators<BN>(acc);
}

// decode_gt_wg with one group left in flight (kWgRing): each TCTile's wgmma is its own group, and
// the decode of the next TCTile runs while it multiplies, into the other of two A register sets;
// wgmma_wait<1> after each commit retires the group before, whose registers the next decode
// overwrites. decode_stage drains the ring (wgmma_wait<0>) at the stage's end, before the block
// barrier lets the producer refill the stage's x slice. Measured 2% slower than serial groups of
// 1 and 7% slower than groups of 4 (H100, seventy-sixth session): kept for A/B runs only.
template <bool kBF16, int BN>
__device__ __forceinline__ void decode_gt_wg_ring(const uint2* pack, uint32_t x_desc, uint32_t desc_hi, int gt,
                                                  int lane, uint32_t to_top, float (&acc)[BN / 8][4],
                                                  uint32_t (&a)[2][4]) {
  const uint4* pk = lane_pairs(pack, lane);
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    decode_tctile<true>(pk, nullptr, 0, t, to_top, a[t & 1]);
    hold_accumulators<BN>(acc);
    ptx::wgmma_fence();
    ptx::wgmma_m64k16<kBF16, BN>(acc, a[t & 1], x_desc + (gt * BN * kGt * 2 + 32 * t) / 16, desc_hi);
    ptx::wgmma_commit();
    ptx::wgmma_wait<1>();
  }
}

// This lane's half-word of TCTile row `row` of a stage's two GroupTiles: its set bits in 16-bit
// fields, GroupTile 0 low and 1 high, as decode_stage's scan takes them. The second GroupTile's
// bitmap is read even when the stage holds only one; its field is then unused. (The fields are
// packed with a multiply-add: one FMA-pipe instruction, not a shift and an OR.)
__device__ __forceinline__ uint32_t row_bits(const uint32_t* bm32, int row, int lane) {
  return __popc(bm32[4 * 32 + 32 * row + lane]) * 65536u + __popc(bm32[32 * row + lane]);
}

// The set bits of a stage's TCTile rows above row `row` (0..3), packed as row_bits; the same
// value in every lane.
__device__ __forceinline__ uint32_t rows_above(const uint32_t* bm32, int row, int lane) {
  uint32_t before = 0;
#pragma unroll
  for (int w = 0; w < kWarps - 1; ++w)
    if (w < row) before += row_bits(bm32, w, lane);
  return __reduce_add_sync(kFull, before);
}

// Decodes and multiplies this warp's TCTile row of the stage's GroupTiles (one or two).
//   bm32: the stage's bitmaps as 2 x 128 half-words; vals: the two runs, the second at the
//   split of `pr` (stage_pair; kValueSlack readable elements past both); above: rows_above for
//   this warp's row where the producer warp counted it (kCounted); table: the shared address of
//   this row's field in the stage's row-table entries (kTable); else it is counted here; pack:
//   2 x kPackPerGt pairs (the second GroupTile's at kPackPerGt); xa: decode_gt's, or (kWg) x_desc:
//   the low word of the wgmma descriptor of the stage's x slice.
template <bool kBF16, int BN, bool kLean, bool kCounted, bool kTable, int kWg>
__device__ __forceinline__ void decode_stage(const uint32_t* bm32, const uint16_t* vals, const uint2 pr,
                                             const uint32_t* above, uint32_t table, const uint32_t (&xa)[BN / 8],
                                             uint32_t x_desc, uint2* pack,
                                             int warp, int lane, uint32_t to_top, float (&acc)[BN / 8][4]) {
  // Exclusive PopCount prefix of every 32-bit half-word of this warp's 16 words, relative to
  // its run, for both GroupTiles at once: the two counts travel packed in 16-bit fields (at
  // most 4096 each) through one 5-step scan.
  const uint32_t h0 = bm32[32 * warp + lane], h1 = bm32[4 * 32 + 32 * warp + lane];
  uint32_t before;
  if constexpr (kCounted)
    before = *above;
  else if constexpr (kTable)  // this row's entries of the stage's row table, GroupTile 0's and 1's
    before = ptx::lds_u16(table) + ptx::lds_u16(table + kTableBytes) * 65536u;
  else
    before = rows_above(bm32, warp, lane);
  const uint32_t cnt = __popc(h1) * 65536u + __popc(h0);
  uint32_t incl = cnt;
  incl = ptx::scan_up_add<1>(incl);
  incl = ptx::scan_up_add<2>(incl);
  incl = ptx::scan_up_add<4>(incl);
  incl = ptx::scan_up_add<8>(incl);
  incl = ptx::scan_up_add<16>(incl);
  const uint32_t excl = before + incl - cnt;  // per field: no borrow, incl >= cnt
  const uint32_t split = pr.y & 0xffff;
  // Publish {bits, prefix}: the decode fetches both with one broadcast load per two words.
  __syncwarp();  // every lane is done reading the previous stage's pairs
  const int slot = (lane & 1) * kPackStride + lane / 2;  // word lane/2, half lane%2
  if constexpr (kLean) {  // the prefix as the shared address of its first value, clamped once
    const uint32_t clamped = __vminu2(excl, pr.x);    // both GroupTiles' prefixes, field by field
    const uint32_t base = ptx::smem_addr(vals) - 4u;  // the decode reads values[e - 2]
    pack[slot] = make_uint2(h0, base + 2u * (clamped & 0xffff));
    pack[kPackPerGt + slot] = make_uint2(h1, base + 2u * (split + (clamped >> 16)));
  } else {
    pack[slot] = make_uint2(h0, excl & 0xffff);
    pack[kPackPerGt + slot] = make_uint2(h1, excl >> 16);
  }
  __syncwarp();
  if constexpr (kWg) {
    uint32_t desc_hi = ptx::wgmma_desc_hi_sw128(1024);
    // ptxas still moves it to a uniform register before every wgmma, but from one register: without
    // this it rebuilt it each time, 1-4 more instructions a stage (sm_90a SASS, BN = 32)
    asm volatile("" : "+r"(desc_hi));
    if constexpr (kWg == kWgPair) {
      uint32_t a0[4][4], a1[4][4];
      decode_group_issue<kBF16, BN, 4>(lane_pairs(pack, lane), x_desc, desc_hi, 0, 0, to_top, acc, a0);
      if (pr.y >> 16 == kPair)
        decode_group_issue<kBF16, BN, 4>(lane_pairs(pack + kPackPerGt, lane), x_desc, desc_hi, 1, 0, to_top, acc, a1);
      ptx::wgmma_wait<0>();
      hold_accumulators<BN>(acc);
    } else if constexpr (kWg == kWgRing) {
      uint32_t a[2][4];
      decode_gt_wg_ring<kBF16, BN>(pack, x_desc, desc_hi, 0, lane, to_top, acc, a);
      if (pr.y >> 16 == kPair) decode_gt_wg_ring<kBF16, BN>(pack + kPackPerGt, x_desc, desc_hi, 1, lane, to_top, acc, a);
      ptx::wgmma_wait<0>();
      hold_accumulators<BN>(acc);
    } else {
      decode_gt_wg<kBF16, BN, kWg>(pack, x_desc, desc_hi, 0, lane, to_top, acc);
      if (pr.y >> 16 == kPair) decode_gt_wg<kBF16, BN, kWg>(pack + kPackPerGt, x_desc, desc_hi, 1, lane, to_top, acc);
    }
  } else {
    decode_gt<kBF16, BN, kLean>(pack, vals, pr.x & 0xffff, xa, 0, lane, to_top, acc);
    if (pr.y >> 16 == kPair)
      decode_gt<kBF16, BN, kLean>(pack + kPackPerGt, vals + split, pr.x >> 16, xa, 1, lane, to_top, acc);
  }
}

// Resident blocks the register allocation must allow (__launch_bounds__' second argument). The
// lean sm_90 variants at BN <= 16 come with three register budgets: 9 blocks (40 registers; 10
// blocks of 5 warps), 8 (48) and 7 (56). Under 40 the compiler rebuilds lane constants every
// stage: SASS of the stage loop at BN = 8 / 16, 447 / 472 instructions at 40 registers, 419 / 447
// at 48, 419 / 435 at 56 (and 64 gains nothing more). The planner takes 56 (spmm_smbd.cu): the
// shorter loop measured faster than the 1-3 more resident blocks that 40 allowed (until v9 the
// cap was 40, when occupancy was this kernel's strongest lever). At 48, BN = 16 reloads two
// spilled registers a stage. The per-word clamped variant keeps 40 (at BN = 16, reached only
// through SPINFER_DECODE=safe, it spills 4 bytes). 0 (elsewhere): the compiler's choice, since
// a cap spilled the cp.async variants.
template <int BN, bool kBulk>
constexpr int kMinBlocks = kBulk && BN <= 16 ? 9 : 0;

// ---------------------------------------------------------------------------------------------
// The kernel. kBulk (sm_90): lane 0 of the producer warp posts the stage's byte count on its
// mbarrier and issues cp.async.bulk copies of the bitmaps and the value runs; the producer's
// lanes copy the x rows with cp.async and arrive when they land. Otherwise (sm_80): every
// thread issues 16-byte cp.async and groups are counted. kCount (SpmmPlan::count_rows): the
// producer warp also counts the bitmap rows above each decoding warp's (rows_above). kTable
// (SpmmPlan::row_table): the decoding warps read them from the weight's row table instead.
// kWg (SpmmPlan::wgmma): the warp-group MMA variant of the lean sm_90 kernel (groups of 4 only at
// BN = 8 and 16, where it keeps the 56-register budget; decode_gt_wg), whose producer brings each stage's x slice with tensor copies through x_map
// (encode_x_map) in the wgmma layout (Layout); x_map is unused elsewhere. kRows = 2
// (SpmmPlan::rows; kWg groups of 4 at BN >= 32): the block owns GroupTile rows 2 blockIdx.y and
// 2 blockIdx.y + 1, warps 0-3 decoding the first and 4-7 the second, each group its own wgmma on the
// stage's one x slice; the producer copies both rows' bitmaps and runs onto the stage's one mbarrier,
// and a block whose second row lies past the weight's leaves that warp group idle. Why and where:
// spmm_smbd.cu.
template <bool kBF16, int BN, bool kBulk, bool kLean, int kMinB = kMinBlocks<BN, kBulk>, bool kCount = false,
          bool kTable = false, int kWg = 0, int kRows = 1>
__global__ void __launch_bounds__((kThreads<kBulk, kRows>), kMinB)
    spmm_smbd_kernel(const SpmmArgs args, const int grid_k, const int k_per_split, const int splits,
                     const int n_stages, const __grid_constant__ CUtensorMap x_map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (kBulk) {
    __trap();  // never launched below sm_90 (the host checks); keeps sm_80 builds valid
  } else
#endif
#if defined(__CUDA_ARCH__) && !defined(SPINFER_WGMMA)
  if constexpr (kWg) {
    __trap();  // wgmma is sm_90a's: the host launches this variant on sm_90 only
  } else
#endif
  {
    static_assert(!kCount || (kBulk && (BN <= 16 || kWg) && kRows == 1),
                  "the producer counts rows for the sm_90 loader at BN <= 16, and for wgmma blocks of one row");
    static_assert(!kTable || (kBulk && kLean && !kCount), "the row table is read by the lean sm_90 decode");
    static_assert(!kWg || (kBulk && kLean && (BN >= 32 || (kWg == 4 && kMinB == 7))),
                  "wgmma: the lean sm_90 kernel; at BN <= 16 groups of 4 at the default register budget");
    static_assert(kRows == 1 || (kRows == 2 && (kWg == 4 || kWg == kWgPair) && BN >= 32),
                  "two GroupTile rows: wgmma groups of 4 at BN >= 32");
    using L = Layout<BN, (kWg > 0), kRows>;
    const L lay(args.value_cap, n_stages, args.n);
    const int S = lay.stages;
    unsigned char* smem;
    if constexpr (kWg) {
      // the swizzle's period; the runtime guarantees 16 bytes, so the base moves up to 1008 on
      extern __shared__ __align__(1024) unsigned char smem_wg[];
      smem = smem_wg + ((1024u - (ptx::smem_addr(smem_wg) & 1023u)) & 1023u);
    } else {
      extern __shared__ __align__(16) unsigned char smem_16[];
      smem = smem_16;
    }
    __shared__ __align__(8) uint64_t s_full[kMaxStages];  // bulk: the stage's bytes have landed
    __shared__ __align__(16) uint16_t s_table[kTable ? kMaxStages : 1][kPair * kTableBytes / 2];  // row-table entries
    __shared__ __align__(16) uint2 s_pack[kWarps * kRows][kPair * kPackPerGt];
    // kCount: rows_above of each stage's TCTile rows, counted once by the producer warp
    __shared__ uint32_t s_above[kCount ? kMaxStages : 1][kWarps];
    __shared__ int s_is_last;

    // kWg: the warp index broadcast from lane 0, so ptxas knows it (and the loop the decoding warps
    // run) warp-uniform and may keep the wgmma descriptors in uniform registers.
    const int tid = threadIdx.x, warp = kWg ? __shfl_sync(kFull, tid / 32, 0) : tid / 32, lane = tid % 32;
    // A decoding warp's GroupTile row of the block (rg) and TCTile row in it (wrow).
    const int rg = kRows == 1 ? 0 : warp / kWarps, wrow = kRows == 1 ? warp : warp % kWarps;
    const BlockWork b = block_work<kRows>(args, BN, grid_k, k_per_split);
    const int np = (b.nk + kPair - 1) / kPair;  // stages' worth of GroupTile pairs
    const int off_stride = L::offsets_stride(k_per_split) / 4;  // ints from one row's offsets to the next's
    int* s_off = reinterpret_cast<int*>(smem + lay.offsets_offset());
    constexpr int kBlock = kThreads<kBulk, kRows>;
    load_offsets<kRows>(args, b, grid_k, s_off, off_stride, tid, kBlock);
    const int64_t first_gtile = static_cast<int64_t>(b.row) * grid_k + b.g_begin;  // row r's: r * grid_k on

    if constexpr (kBulk) {
      if (tid == 0) {
        // A stage's phase: the producer's byte count for the bulk copies, and (but kWg, whose x
        // copies count their bytes, without kTable) one arrival from each producer lane once its
        // x copies and row-table entries have landed.
        for (int st = 0; st < S; ++st) ptx::mbarrier_init(&s_full[st], kWg && !kTable ? 1 : 1 + 32);
        ptx::fence_mbarrier_init();
      }
      if (kCount && tid < kMaxStages) s_above[tid][0] = 0u;  // nothing above row 0
    }
    __syncthreads();
    // The stage table (stage_pair), made by the decoding warps while the producer issues its first
    // copies; the first barrier of the stage loop publishes it.
    uint2* s_pairs = reinterpret_cast<uint2*>(smem + lay.pairs_offset(k_per_split));
    const int pairs_stride = L::pairs_stride(k_per_split) / 8;  // row r's table: r * pairs_stride entries on
    if constexpr (kRows == 1) {  // (the one-row form: see load_offsets)
      if (tid < kWarps * 32)
        for (int q = tid; q < np; q += kWarps * 32) s_pairs[q] = stage_pair(pair_runs(s_off, b.nk, q, args.value_cap));
    } else if (tid < kWarps * kRows * 32) {
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        for (int q = tid; q < np; q += kWarps * kRows * 32)
          s_pairs[r * pairs_stride + q] = stage_pair(pair_runs(s_off + r * off_stride, b.nk, q, args.value_cap));
    }

    // The producer warp. Bitmaps and value runs: bulk copies that lane 0 issues and counts on the
    // stage's mbarrier. The x rows: 16-byte cp.async from every lane (lane l takes chunk l % 16
    // of rows l / 16, l / 16 + 2, ...), each lane arriving on the mbarrier once its copies land.
    // A bulk copy per x row cost the warp ~10 instructions (the operands go to uniform registers
    // one lane at a time): 11% of the kernel's instructions at N = 32 (ncu), and one process
    // measured N = 16 / 32 1-5% faster with cp.async, N = 1 the same (docs/kernels.md).
    // with_x = false leaves the x rows to issue_x: the first stages' weights go out before
    // griddep_wait (launch.cuh), their x rows after it.
    const uint64_t policy = ptx::l2_stream_policy(args.evict_first);  // bitmaps and values
    // kWg: the bytes of a stage's x tensor copies, 2 boxes of 64 columns x min(BN, N) tokens
    // (encode_x_map; a box's columns past K arrive as zeros and count).
    const int x_tx = kWg ? kPair * kGt * 2 * min(BN, args.n) : 0;
    auto issue_x = [&](int stage, int p) {
      const int gts = min(kPair, b.nk - kPair * p);
      const int k0 = (b.g_begin + kPair * p) * kGt;
      constexpr int kChunks = kPair * kGt / 8;  // 16-byte chunks per x row
      constexpr int kRowStep = 32 / kChunks;    // rows between a lane's copies
      const int cc = lane % kChunks;
      if constexpr (kWg) {  // one tensor copy a GroupTile, both (past K or the split: zeros or unused)
        if (lane < kPair)
          ptx::cp_async_bulk_tensor_2d_g2s(smem + stage * lay.stage_bytes + lay.x_offset + lane * L::kXTileBytes,
                                           &x_map, k0 + kGt * lane, b.n0, &s_full[stage]);
        if constexpr (!kTable) return;
      } else if (cc < gts * kGt / 8) {
        const char* src =
            static_cast<const char*>(args.x) + (int64_t(b.n0 + lane / kChunks) * args.kp + k0 + cc * 8) * 2;
        uint32_t dst = ptx::smem_addr(smem + stage * lay.stage_bytes + lay.x_offset) +
                       ((lane / kChunks) * kXStride + cc * 8) * 2;
#pragma unroll 4
        for (int row = lane / kChunks; row < b.valid_rows; row += kRowStep) {
          if (args.x_l1)  // through L1, where the planner expects the SM's other blocks to reuse it
            ptx::cp_async_ca_16(dst, src);
          else
            ptx::cp_async_cg_16(dst, src);
          src += int64_t(args.kp) * 2 * kRowStep;
          dst += kRowStep * kXStride * 2;
        }
      }
      if constexpr (kTable)  // the stage's GroupTiles' row-table entries, one lane each
        if (lane < gts)
          ptx::cp_async_ca_8(ptx::smem_addr(s_table[stage]) + kTableBytes * lane,
                             args.row_offset + 4 * (first_gtile + kPair * p + lane));
      ptx::cp_async_mbarrier_arrive_noinc(&s_full[stage]);
    };
    auto issue_bulk = [&](int stage, int p, bool with_x) {
      unsigned char* st = smem + stage * lay.stage_bytes;
      if constexpr (kRows == 1) {  // (the one-row form: see load_offsets)
        const PairRuns r = pair_runs(s_off, b.nk, p, args.value_cap);
        if (lane == 0) {
          ptx::fence_proxy_async_shared();  // the generic reads of this buffer come before the copy
          ptx::mbarrier_arrive_expect_tx(&s_full[stage], r.gts * kBitmapBytes + r.total * 2 + x_tx);
          ptx::cp_async_bulk_g2s(st, args.bitmap + (first_gtile + kPair * p) * kWordsPerGt, r.gts * kBitmapBytes,
                                 &s_full[stage], policy);
          if (r.total > 0)
            ptx::cp_async_bulk_g2s(st + L::kValueOffset,
                                   static_cast<const char*>(args.values) + int64_t(s_off[kPair * p]) * 2, r.total * 2,
                                   &s_full[stage], policy);
        }
      } else if (lane == 0) {  // both rows' bitmaps and runs, counted on the one mbarrier
        PairRuns r[kRows];
        int bytes = x_tx;
#pragma unroll
        for (int q = 0; q < kRows; ++q) {
          r[q] = pair_runs(s_off + q * off_stride, b.nk, p, args.value_cap);
          if (q < b.rows) bytes += r[q].gts * kBitmapBytes + r[q].total * 2;
        }
        ptx::fence_proxy_async_shared();
        ptx::mbarrier_arrive_expect_tx(&s_full[stage], bytes);
#pragma unroll
        for (int q = 0; q < kRows; ++q) {
          if (q >= b.rows) break;  // a row past the weight's (the bottom edge): nothing to copy
          ptx::cp_async_bulk_g2s(st + q * L::kBitmapRegion,
                                 args.bitmap + (first_gtile + int64_t(q) * grid_k + kPair * p) * kWordsPerGt,
                                 r[q].gts * kBitmapBytes, &s_full[stage], policy);
          if (r[q].total > 0)
            ptx::cp_async_bulk_g2s(st + L::kValueOffset + q * lay.value_bytes,
                                   static_cast<const char*>(args.values) + int64_t(s_off[q * off_stride + kPair * p]) * 2,
                                   r[q].total * 2, &s_full[stage], policy);
        }
      }
      __syncwarp();  // the byte count is posted before any lane's arrival can complete the phase
      if (with_x) issue_x(stage, p);
    };

    auto issue_cp_async = [&](int stage, int p) {  // all threads
      unsigned char* st = smem + stage * lay.stage_bytes;
      const PairRuns r = pair_runs(s_off, b.nk, p, args.value_cap);
      const char* g_bitmap = reinterpret_cast<const char*>(args.bitmap + (first_gtile + kPair * p) * kWordsPerGt);
      if (tid < r.gts * kBitmapBytes / 16) ptx::cp_async_cg_16(st + tid * 16, g_bitmap + tid * 16);
      const char* g_vals = static_cast<const char*>(args.values) + int64_t(s_off[kPair * p]) * 2;
      for (int c = tid; c < r.total / 8; c += kBlock)
        ptx::cp_async_cg_16(st + L::kValueOffset + c * 16, g_vals + c * 16);
      const int k0 = (b.g_begin + kPair * p) * kGt;
      constexpr int kChunks = kPair * kGt / 8;  // 16-byte chunks per x row
      for (int c = tid; c < b.valid_rows * kChunks; c += kBlock) {
        const int row = c / kChunks, cc = c % kChunks;
        if (cc < r.gts * kGt / 8)
          ptx::cp_async_cg_16(st + lay.x_offset + (row * kXStride + cc * 8) * 2,
                              static_cast<const char*>(args.x) + (int64_t(b.n0 + row) * args.kp + k0 + cc * 8) * 2);
      }
    };

    float acc[BN / 8][4];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

    // This lane's row address for ldmatrix.x4, relative to its stage: matrix lane/8 is (TCTile
    // +lane/16, k half (lane/8)%2), row lane%8 of each n8 block; tokens past N read the last
    // valid token's row (their output columns are discarded). One add per stage and n8 block
    // where a compare and a select against a row of zeros ran before.
    uint32_t x_lane[BN / 8];
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
      x_lane[nb] = lay.x_offset + min(nb * 8 + lane % 8, b.valid_rows - 1) * kXStride * 2 +
                   (16 * (lane / 16) + 8 * ((lane / 8) % 2)) * 2;
    // Moves this lane's two bits of a BitmapTile half-word to bits 30 and 31 (decode_gt): pinned
    // in a register, where the compiler rebuilt it from the lane index every stage.
    uint32_t to_top = 1u << (30 - 2 * (lane & 15));
    asm volatile("" : "+r"(to_top));
    auto compute = [&](int stage, int p) {
      const unsigned char* st = smem + stage * lay.stage_bytes;
      uint32_t xa[BN / 8];
#pragma unroll
      for (int nb = 0; nb < BN / 8; ++nb) xa[nb] = ptx::smem_addr(st) + x_lane[nb];
      const uint32_t x_desc = kWg ? ptx::wgmma_desc_lo(ptx::smem_addr(st) + lay.x_offset, 16) : 0u;
      decode_stage<kBF16, BN, kLean, kCount, kTable, kWg>(
          reinterpret_cast<const uint32_t*>(st + rg * L::kBitmapRegion),
          reinterpret_cast<const uint16_t*>(st + L::kValueOffset + rg * lay.value_bytes), s_pairs[rg * pairs_stride + p],
          &s_above[stage][wrow], ptx::smem_addr(s_table[kTable ? stage : 0]) + 2u * wrow, xa, x_desc, s_pack[warp],
          wrow, lane, to_top, acc);
    };

    // Stage p is consumed while stages p+1 .. p+S-1 are in flight; the prefetch at step p
    // refills the stage consumed at step p-1. The producer and the decoding warps run loops of
    // their own that meet at the same block barrier once a step (ptx::bar_sync_block, the form of
    // the barrier that may be reached from different code): one shared loop cost the decoding
    // warps the producer's test and stage bookkeeping every step.
    const bool producer = kBulk && warp == kWarps * kRows;
    // (the 40- and 48-register caps at BN <= 16 keep the arrival: the ticket's code spilled them)
    constexpr bool kTicket = kBulk && (kMinB == 0 || kMinB == 7);
    if constexpr (kBulk) {
      if (producer) {
        // args.ticket: the split-K reducer is chosen as each block's last stage starts, and the
        // reducer's producer lane waits for the other partials while the last stage decodes
        // (epilogue.cuh, take_reducer_ticket), off the path between the loop and the sum.
        const bool ticketed = kTicket && args.ticket && splits > 1;
        auto take_ticket = [&] {
          const int64_t tile = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
          if (lane == 0) s_is_last = take_reducer_ticket(args.counters, tile, splits);
          __syncwarp();
        };
        // kCount: once stage q has landed, the producer counts the set bits of its TCTile
        // rows 0-2 (rows_above for each decoding warp's row) into s_above, and the next block
        // barrier publishes them. Otherwise every decoding warp counts the rows above its own,
        // 6 predicated loads and PopCounts and a reduction a stage whatever its row: ~20 of a
        // stage's ~408 instructions (BN = 8, sm_90a SASS), and a chain of loads and a reduction
        // before each stage's scan.
        auto count_rows = [&](int q) {
          const int c = q % S;
          ptx::mbarrier_wait_parity(&s_full[c], (q / S) & 1);
          const uint32_t* bm32 = reinterpret_cast<const uint32_t*>(smem + c * lay.stage_bytes);
          uint32_t run = 0, above[kWarps - 1];
#pragma unroll
          for (int r = 0; r < kWarps - 1; ++r) {
            run += row_bits(bm32, r, lane);
            above[r] = __reduce_add_sync(kFull, run);  // rows_above(bm32, r + 1, lane)
          }
          if (lane == 0)
#pragma unroll
            for (int r = 0; r < kWarps - 1; ++r) s_above[c][r + 1] = above[r];
        };
        if (kWg && lane == 0) ptx::prefetch_tensormap(&x_map);  // the first x copy waits on it otherwise
        for (int st = 0; st < S - 1 && st < np; ++st) issue_bulk(st, st, false);
        ptx::griddep_wait();  // x is the previous kernel's output
        for (int st = 0; st < S - 1 && st < np; ++st) issue_x(st, st);
        if (kCount && np > 0) count_rows(0);  // waits for stage 0
        if (ticketed && np == 0) take_ticket();
        for (int p = 0, ps = S - 1; p < np; ++p) {
          ptx::bar_sync_block();  // all warps are done with stage ps, which the prefetch overwrites
          if (ticketed && p == np - 1) take_ticket();  // the decoding warps start the last stage
          // stagger (BN = 8): stage S - 1 is requested once stage 0 has landed. All blocks of a
          // one-wave grid start together, and with their first two stages requested at once each
          // block's first landed 3-5 us after its start, the DRAM serving the second stages too.
          // (kCount has waited for stage 0 already; wider tiles measured no gain from it.)
          if constexpr (BN == 8 && !kCount)
            if (p == 0 && args.stagger) ptx::mbarrier_wait_parity(&s_full[0], 0u);
          if (p + S - 1 < np) issue_bulk(ps, p + S - 1, true);
          if (++ps == S) ps = 0;
          if (kCount && p + 1 < np) count_rows(p + 1);  // its slot's counts were last read at step p + 1 - S
        }
      } else {
        uint32_t full = ptx::smem_addr(s_full);
        asm volatile("" : "+r"(full));  // kept in a register: rebuilt from the CTA's shared window every stage
        uint32_t parity = 0;
        // (a warp group whose GroupTile row lies past the weight's, at the bottom edge, only meets
        // the barriers: its accumulators stay zero and its rows are never stored)
        const bool decodes = kRows == 1 || rg < b.rows;
        for (int p = 0, cs = 0; p < np; ++p) {
          ptx::bar_sync_block();
          if (decodes) {
            ptx::mbarrier_wait_parity(full + 8u * cs, parity);
            compute(cs, p);
          }
          if (++cs == S) cs = 0, parity ^= 1u;
        }
      }
    } else {
      // A group is committed every step (empty near the end) so wait_group's count stays
      // uniform: S-2 younger groups may still be in flight when stage p must be complete.
      ptx::griddep_wait();  // this loader issues x with the weights
      for (int st = 0; st < S - 1; ++st) {
        if (st < np) issue_cp_async(st, st);
        ptx::cp_async_commit_group();
      }
      int cs = 0, ps = S - 1;
      for (int p = 0; p < np; ++p) {
        ptx::cp_async_wait_group_dynamic(S - 2);
        // Stage p is visible to all threads, and all threads are done with stage ps, whose
        // buffer the prefetch below overwrites.
        __syncthreads();
        const int pf = p + S - 1;
        if (pf < np) issue_cp_async(ps, pf);
        ptx::cp_async_commit_group();
        compute(cs, p);
        ps = cs;
        if (++cs == S) cs = 0;
      }
      ptx::cp_async_wait_group<0>();
    }
    ptx::griddep_launch_dependents();  // the next layer may start its prologue as blocks drain
    ptx::griddep_wait();  // (the decoding warps) no global write before the previous kernel is done
    const TileOut out{args.y, args.bias, args.workspace, args.counters, args.m, args.n};
    constexpr bool kVectorSum = kMinB == 0 || kMinB == 7;  // not under the 40 / 48-register caps: see store_tile
    const int64_t tile = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
    const int64_t split_stride = static_cast<int64_t>(gridDim.x) * gridDim.y * BN * kGt * kRows;
    store_tile<kBF16, BN, kGt * kRows, kBlock, kVectorSum>(out, b.row * kGt, warp * 16 + lane / 4, b.n0, tile,
                                                           split_stride, b.split, splits, acc, lane, tid, &s_is_last,
                                                           !producer, kTicket && args.ticket);
  }
}

// ---------------------------------------------------------------------------------------------
// The x tensor map of the wgmma variant (spmm_smbd.cu): x [n, kp] in 128-byte-swizzled boxes of 64
// columns x min(bn, n) tokens, so a copy writes one GroupTile's region of Layout<BN, true>'s x
// slice (tokens past n and columns past kp arrive as zeros).
cudaError_t encode_x_map(CUtensorMap* map, const void* x, int n, int kp, int bn, bool bf16);

// Host side of one (dtype, BN) instantiation; instantiated in spmm_smbd_{fp16,bf16}.cu so the
// two dtypes compile in parallel.
template <int BN>
int smem_bytes(int k_per_split, int value_cap, int stages, int n, bool wgmma, int rows) {
  if (wgmma && rows == 2) return Layout<BN, true, 2>(value_cap, stages, n).smem_bytes(k_per_split);
  return wgmma ? Layout<BN, true>(value_cap, stages, n).smem_bytes(k_per_split)
               : Layout<BN>(value_cap, stages, n).smem_bytes(k_per_split);
}

// Threads a block of this plan's kernel.
inline int block_threads(const SpmmPlan& plan) {
  return !plan.bulk ? kThreads<false> : plan.rows == 2 ? kThreads<true, 2> : kThreads<true>;
}

// The kernel variant a plan launches.
template <bool kBF16, int BN>
auto kernel_for(const SpmmPlan& plan) {
  if constexpr (BN == 128) {  // wgmma groups of 4 only (spmm_smbd_plan), kWgPair or not: one or two GroupTile rows a block
    if (plan.wgmma == kWgPair)
      return plan.rows == 2 ? spmm_smbd_kernel<kBF16, 128, true, true, 0, false, false, kWgPair, 2>
                            : spmm_smbd_kernel<kBF16, 128, true, true, 0, false, false, kWgPair>;
    return plan.rows == 2 ? spmm_smbd_kernel<kBF16, 128, true, true, 0, false, false, 4, 2>
                          : spmm_smbd_kernel<kBF16, 128, true, true, 0, false, false, 4>;
  } else {
    if (!plan.bulk)
      return plan.lean ? spmm_smbd_kernel<kBF16, BN, false, true> : spmm_smbd_kernel<kBF16, BN, false, false>;
    if (!plan.lean) return spmm_smbd_kernel<kBF16, BN, true, false>;
    if constexpr (BN >= 32)
      if (plan.wgmma) {
        if constexpr (BN == 32) {  // the rows above from the producer or the row table (one row a block)
          if (plan.wgmma == 4 && plan.row_table) return spmm_smbd_kernel<kBF16, BN, true, true, 0, false, true, 4>;
          if (plan.wgmma == 4 && plan.count_rows) return spmm_smbd_kernel<kBF16, BN, true, true, 0, true, false, 4>;
          if (plan.wgmma == kWgPair && plan.row_table)
            return spmm_smbd_kernel<kBF16, BN, true, true, 0, false, true, kWgPair>;
          if (plan.wgmma == kWgPair && plan.count_rows)
            return spmm_smbd_kernel<kBF16, BN, true, true, 0, true, false, kWgPair>;
        }
        if (plan.wgmma == 4)
          return plan.rows == 2 ? spmm_smbd_kernel<kBF16, BN, true, true, 0, false, false, 4, 2>
                                : spmm_smbd_kernel<kBF16, BN, true, true, 0, false, false, 4>;
        if (plan.wgmma == kWgPair)
          return plan.rows == 2 ? spmm_smbd_kernel<kBF16, BN, true, true, 0, false, false, kWgPair, 2>
                                : spmm_smbd_kernel<kBF16, BN, true, true, 0, false, false, kWgPair>;
        if (plan.wgmma == kWgRing) return spmm_smbd_kernel<kBF16, BN, true, true, 0, false, false, kWgRing>;
        if (plan.wgmma == 2) return spmm_smbd_kernel<kBF16, BN, true, true, 0, false, false, 2>;
        return spmm_smbd_kernel<kBF16, BN, true, true, 0, false, false, 1>;
      }
    if constexpr (BN <= 16) {
      if (plan.wgmma && plan.min_blocks == 7) {  // groups of 4 only, at the default register budget
        if (plan.row_table) return spmm_smbd_kernel<kBF16, BN, true, true, 7, false, true, 4>;
        if (plan.count_rows) return spmm_smbd_kernel<kBF16, BN, true, true, 7, true, false, 4>;
        return spmm_smbd_kernel<kBF16, BN, true, true, 7, false, false, 4>;
      }
      if (plan.row_table && plan.min_blocks == 7) return spmm_smbd_kernel<kBF16, BN, true, true, 7, false, true>;
      if (plan.count_rows) {
        if (plan.min_blocks == 8) return spmm_smbd_kernel<kBF16, BN, true, true, 8, true>;
        if (plan.min_blocks == 7) return spmm_smbd_kernel<kBF16, BN, true, true, 7, true>;
        return spmm_smbd_kernel<kBF16, BN, true, true, 9, true>;
      }
      if (plan.min_blocks == 8) return spmm_smbd_kernel<kBF16, BN, true, true, 8>;
      if (plan.min_blocks == 7) return spmm_smbd_kernel<kBF16, BN, true, true, 7>;
    }
    return spmm_smbd_kernel<kBF16, BN, true, true>;
  }
}

// Blocks of this plan's kernel that fit on one SM at its shared memory (CUDA's occupancy
// calculator), or 0 where the query fails.
template <bool kBF16, int BN>
int resident_blocks(const SpmmPlan& plan) {
  auto kernel = kernel_for<kBF16, BN>(plan);
  int blocks = 0;
  if (allow_smem_at_least(kernel, plan.smem_bytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, block_threads(plan), plan.smem_bytes) !=
          cudaSuccess) {
    (void)cudaGetLastError();  // a failed query is not the caller's error; the launch reports its own
    return 0;
  }
  return blocks;
}

template <bool kBF16, int BN>
cudaError_t launch(const SpmmArgs& args, const SpmmPlan& plan, cudaStream_t stream) {
  auto kernel = kernel_for<kBF16, BN>(plan);
  cudaError_t err = allow_smem_at_least(kernel, plan.smem_bytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(plan.n_tiles, (plan.grid_m + plan.rows - 1) / plan.rows, plan.splits);
  // The bulk loader hints its copies itself (ptx::l2_stream_policy); the cp.async loader gets a
  // window over the values, most of the stream.
  const StreamWindow window = plan.bulk ? StreamWindow{} : stream_window(args.values, args.nvalues * 2);
  CUtensorMap x_map{};
  if (plan.wgmma) {
    err = encode_x_map(&x_map, args.x, args.n, args.kp, BN, kBF16);
    if (err != cudaSuccess) return err;
  }
  return launch_kernel_window(kernel, grid, block_threads(plan), plan.smem_bytes, stream, plan.pdl, window, args,
                              plan.grid_k, plan.k_per_split, plan.splits, plan.stages, x_map);
}

#define SPINFER_SMBD_FOR_TILES(X, BF16) X(BF16, 8) X(BF16, 16) X(BF16, 32) X(BF16, 64) X(BF16, 128)
#define SPINFER_SMBD_INSTANTIATE_ONE(BF16, BN)                                       \
  template cudaError_t launch<BF16, BN>(const SpmmArgs&, const SpmmPlan&, cudaStream_t); \
  template int resident_blocks<BF16, BN>(const SpmmPlan&);
#define SPINFER_SMBD_EXTERN_ONE(BF16, BN)                                                   \
  extern template cudaError_t launch<BF16, BN>(const SpmmArgs&, const SpmmPlan&, cudaStream_t); \
  extern template int resident_blocks<BF16, BN>(const SpmmPlan&);

}  // namespace smbd
}  // namespace spinfer
