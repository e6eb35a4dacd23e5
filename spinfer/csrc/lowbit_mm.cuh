// The fused weight-only low-bit kernel: y[N, M] = x[N, K] @ W[M, K]^T, W = (q - zero) * scale
// with q at 1, 2, 4 or 8 bits, dequantized in registers straight into mma.m16n8k16 A fragments.
//
// Read top to bottom:
//  * One block of two groups of 4 warps owns 64 output rows and a tile of BN tokens; warp w of
//    a group owns rows 16w .. 16w+15 and walks a range of 128-column chunks of K (all, or a
//    split-K share), each group taking half of every stage. In the balanced schedule a block's
//    range runs on across row blocks instead (Schedule, below). With row pairs
//    (kLowbitRowPairs, RB = 2) a block owns 128 rows: each group takes one 64-row block and
//    every chunk of each stage, and both share the stage's activation slice, so x is copied
//    from L2 half as often (lowbit_mm.cu, use_row_pairs, says where that pays).
//  * A 3-stage cp.async ring brings, per stage of 1 or 2 chunks, the block's packed weight
//    tile (one contiguous 4..8 KB span: the format stores 64-row x stage tiles), their
//    scale and zero records and the matching activation slice to shared memory, so 2 stages of
//    weight bytes per block are always in flight: the kernel streams each weight byte once and is fast
//    only if HBM never waits on it. Contiguous tiles matter: with row-major weights each
//    stage touched 64 separate 128-byte spans and HBM delivered 1.0-1.8 TB/s instead of ~2.7.
//    On sm_90 at 4 bits with 32-token tiles the weight tiles come in one bulk copy per stage
//    and the activation slice in one tensor copy per chunk instead of 16-byte cp.async from
//    every thread (bulk_loader, BULK, encode_x_map).
//  * The packed format puts, inside every 128-column chunk of a row, lane t's values for the
//    8 k16 tiles of the chunk into `bits` consecutive words (spinfer/quant/lowbit.py,
//    `fragment_order`): a lane reads its share of a row with one 4..32-byte shared load and
//    needs no shuffle.
//  * In a word of V = 32/bits values, value s and value s + V/2 sit 16 bits apart, so one
//    LOP3 turns them into a half2 (1024 + q for fp16, 128 + q for bf16: the "magic number"
//    conversion), one HSUB2 makes it exactly q, one HFMA2 applies (q - zero) * scale as
//    q * scale + (-zero * scale).
//  * fp32 accumulation; the shared epilogue (epilogue.cuh) adds bias and casts or reduces
//    split-K partials deterministically.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cuda.h>  // CUtensorMap

#include <atomic>
#include <cstring>

#include "dtype.cuh"
#include "epilogue.cuh"
#include "launch.cuh"
#include "lowbit_mm.h"
#include "ptx.cuh"
#include "schedule.cuh"

// Per-block timestamps for scripts/timeline_lowbit.cu, compiled in only there: block entry,
// first stage ready, main loop done, output stored (%globaltimer, ns), and the SM.
#ifdef SPINFER_TIMELINE
__device__ unsigned long long spinfer_timeline[1 << 16][5];
#define SPINFER_STAMP(slot, value)                                                                    \
  do {                                                                                                \
    if (threadIdx.x == 0)                                                                             \
      spinfer_timeline[(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x][slot] = (value); \
  } while (0)
__device__ __forceinline__ unsigned long long timeline_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define SPINFER_MARK(slot) SPINFER_STAMP(slot, timeline_now())
#else
#define SPINFER_MARK(slot) \
  do {                     \
  } while (0)
#endif

namespace spinfer {
namespace lowbit {

constexpr int kChunk = 128;   // K columns per chunk: 8 k16 tiles
constexpr int kWarps = 4;               // warps of one group: 16 rows each
constexpr int kBlockRows = 16 * kWarps;
// 2 stages in flight. 3 stages measured best twice on 28672x8192 4-bit: going from 4 to 3
// (with not copying padded token rows) took N=1 from 76 to 69 us (docs/quant.md); with two warp
// groups, 4 stages at BN = 8 measured 61 us against 57 and 5 stages 71 us, and the other issue
// shapes moved the same way, although ncu shows warps waiting on the copies.
constexpr int kStages = 3;
// Blocks per SM of the balanced schedule (see Schedule). H100, 4-bit g128, one lease: with 2
// blocks of 5 / 4 / 3 stages 28672x8192 at N = 16 took 81.5 / 80.8 / 79.6 us (92.4 one block
// per row block) and 14336x4096 at N = 1 23.4 / 22.4 / 21.6 (19.7): more stages in flight
// only lengthen the wait for the first one, so the balanced variant keeps kStages.
constexpr int kBalancedPerSM = 2;

// Chunks per stage: 256 columns (128 at 8 bits) keep a stage's weights at 4..8 KB per block.
template <int BITS>
__host__ __device__ constexpr int chunks_per_stage() {
  return BITS == 8 ? 1 : 2;
}

// Warp groups of a block: two groups of 4 warps, each taking half of every stage (one of its
// two chunks below 8 bits, half of its k16 tiles at 8 bits); the two groups' accumulators are
// summed before the epilogue. ncu on 28672x8192 4-bit N=1 with one group: 448 blocks gave 3.25
// warps per scheduler, no eligible warp in 44% of cycles and DRAM at 58%; shared memory allows
// 5 blocks per SM, so the layer has too few blocks, not too little memory. Two groups double
// the warps per block at the same shared memory and nearly the same instructions. Measured in
// one lease each (geomean x cuBLAS of the four issue shapes): at BN = 32, where shared memory
// (78 KB a block below 8 bits) allows only 2 blocks, N = 32 went 1.23x -> 1.32x at 4 bits and
// 1.24x -> 1.45x at 2 bits; 8 bits went 1.53/1.46/1.23/0.96x -> 1.55/1.48/1.28/1.08x at
// N = 1/8/16/32.
constexpr int kGroups = 2;
constexpr int kThreads = 32 * kWarps * kGroups;
// Resident blocks the register allocation must allow (__launch_bounds__): with 256 threads
// a block of 66-register threads would fit only 3 per SM, one short of a 448-block layer's
// single wave. 4 caps BN=8 at 64 registers; BN=16 gets 3 (85) below 8 bits, where 4 spilled
// 8-20 bytes and measured 1.65x against 1.72x at N = 16, and 4 at 8 bits, where 3 left
// 28672x8192 two waves (136 against 124 us, despite 20 bytes of spills at 4); BN=32 gets 2
// (~110 registers).
template <int BITS, int BN>
constexpr int kMinBlocks = BN == 8 || (BN == 16 && BITS == 8) ? 4 : BN == 16 ? 3 : 2;

// Packed weight rows sit unpadded in shared memory; instead the 16-byte pieces of row r are
// XOR-swizzled by piece_swizzle<BITS>(r) so the lanes of one shared-load phase hit distinct
// banks. A lane reads `BITS` words at byte 4*BITS*t of its row's chunk; per phase: 8-bit,
// 16 B loads, rows g, g+1 (128 B rows: swap odd pieces of odd rows); 4-bit, 16 B, rows g, g+1
// (flip the row half); 2-bit, 8 B, rows g..g+3 (64 B rows: flip 32 B halves of rows 2, 3);
// 1-bit, 4 B, rows g..g+7 (32 B rows: swap the pieces of rows 4..7).
template <int BITS>
__host__ __device__ constexpr int weight_row_bytes() {
  return (BITS == 8 ? 1 : 2) * 128 * BITS / 8;
}
// The bulk loader (LowbitPlan::bulk_weights, sm_90): thread 0 copies each stage's weight tiles in
// one bulk copy each, as the format stores them (unswizzled: the 4- and 8-bit loads of rows g and
// g + 1 of a phase meet on the same banks, 2 ways), and its activation slice in one tensor copy
// per chunk (Layout, encode_x_map), instead of 16-byte cp.async from every thread. It pays where
// the activation slice is at least twice a 64-row weight tile's bytes (BN >= 8 x bits; of the
// widths it is built for, 4 bits at BN = 32), where the copies it saves are mostly activation
// copies. H100, one process, the two loaders on the same plan, least of 6 shuffled rounds
// (docs/quant.md, twenty-sixth session), eight Llama shapes: 4-bit BN = 32 (N = 32) bulk ahead
// on the 28672-row layers (28672x8192 76.0 against 81.1 us, 28672x4096 42.4 / 44.6) and on the
// unpaired 8192x28672 (70.4 / 75.7); at BN <= 16 cp.async ahead or within 1% on every layer
// (4-bit 14336x4096 N = 1 / 8 / 16: 16.3 / 16.1 / 19.6 against 17.3 / 17.6 / 20.6 us; 8-bit
// 28672x8192 N = 16 91.2 against 95.9), and at 8 bits at every tile (x a quarter to half the
// weights' bytes). A probe that read the unswizzled tiles at swizzled addresses (wrong results,
// conflict-free timing: the most a pre-swizzled format could give) left cp.async ahead at
// BN <= 16 too. 1 and 2 bits, bound by instruction issue, measured slower with bulk weight
// copies (twenty-fourth session) and keep cp.async.
__host__ __device__ constexpr bool bulk_loader(int bits, int bn) { return bits >= 4 && bn >= 8 * bits; }

template <int BITS>
__device__ __forceinline__ int piece_swizzle(int r) {
  if constexpr (BITS == 8) return r & 1;
  else if constexpr (BITS == 4) return (r & 1) << 2;
  else if constexpr (BITS == 2) return ((r >> 1) & 1) << 1;
  else return (r >> 2) & 1;
}

// One stage: [RB x 64 weight rows][row bytes] [RB tiles][U*NG segments][64 words of a record] then the
// activation slice: [BN][x stride] with cp.async, or with tensor copies of the activations
// (TMA_X: the bulk loader) one [BN][x stride] region per chunk, the stride a
// chunk's columns + 16.
// Either way the x stride is 16 halves more than the columns a row holds: row g's 8-byte
// B-fragment loads start 32 bytes after row g-1's (mod 128), so a half-warp (4 rows x 4 lanes)
// covers all 32 banks once. A tensor copy writes its box densely, so the box itself is 16 columns
// wider than a chunk (encode_x_map): the extra columns, the next chunk's or zeros past K, are
// never read. (The 128-byte swizzle instead needs 1 KB-aligned stages and an XOR per load, which
// the compiler turned into one more IADD3 per B fragment.)
// RB row blocks per block (row pairs: RB = 2): the weight and scale regions hold RB x 64 rows, the
// activation slice is shared.
template <int BITS, int BN, int NG, bool CROSS = false, int RB = 1, bool TMA_X = false>
struct Layout {
  static constexpr int U = chunks_per_stage<BITS>();
  static constexpr int kCols = U * kChunk;
  static constexpr int kTileRows = RB * kBlockRows;
  static constexpr int kWStride = weight_row_bytes<BITS>();
  static constexpr int kPairs = U * NG;  // segments (scale groups) of a stage: a record each (lowbit_mm.h)
  static constexpr int kSzOffset = kTileRows * kWStride;
  // Tensor copies write to 128-byte-aligned addresses.
  static constexpr int kAlign = TMA_X ? 128 : 16;
  static constexpr int kXOffset = kSzOffset + (kTileRows * kPairs * 4 + kAlign - 1) / kAlign * kAlign;
  static constexpr int kXStride = (TMA_X ? kChunk : kCols) + 16;
  static constexpr int kXChunkBytes = TMA_X ? BN * kXStride * 2 : kChunk * 2;  // between chunks' x
  static constexpr int kXBytes = (TMA_X ? U : 1) * BN * kXStride * 2;
  static constexpr int kStageBytes = kXOffset + kXBytes;
  // Where the second warp group's accumulators are summed into the first's when a tile is
  // flushed: the balanced schedule (CROSS) flushes while stages are in flight, so it has a region
  // after the stages; otherwise the flush is at the end and uses the idle stage buffers. (A first
  // version with the region in every variant and a range computed by divisions in every block
  // measured ~1 us slower on 14336x4096, one block per row block.)
  static constexpr int kRedOffset = kStages * kStageBytes;
  static constexpr int kRedBytes = BN * kBlockRows * 4;
  static constexpr int kSmemBytes = kRedOffset + (CROSS ? kRedBytes : 0);
  static_assert(kRedBytes <= kRedOffset, "room for one group's accumulators in the stage buffers");
  static_assert(kWStride % 16 == 0 && kXOffset % kAlign == 0 && kStageBytes % kAlign == 0 &&
                    kXChunkBytes % kAlign == 0,
                "aligned regions");
};

// The magic-number constants of a dtype (unpack_pair) on top of its pair arithmetic (dtype.cuh).
template <bool kBF16>
struct Num;
template <>
struct Num<false> : Packed<false> {
  static constexpr uint32_t kMagic = 0x64006400u;  // half2(1024, 1024)
  static constexpr float kMagicValue = 1024.f;
  // Integer zero points the A fragments subtract exactly (integer_zero): magic + z in [0, 2047].
  static constexpr float kZeroLo = -1024.f, kZeroHi = 1023.f;
};
template <>
struct Num<true> : Packed<true> {
  static constexpr uint32_t kMagic = 0x43004300u;  // bfloat162(128, 128)
  static constexpr float kMagicValue = 128.f;
  static constexpr float kZeroLo = -128.f, kZeroHi = 127.f;  // magic + z in [0, 255]
};

// Values s and s + V/2 of a packed word as an exact half2/bfloat162 of q - zi, zi an integer
// zero point: one LOP3 (the magic-number conversion: 0x6400 | q is 1024 + q in fp16, 0x4300 | q
// is 128 + q in bf16) and one HSUB2 of zc = magic + zi (both exact, so the difference is).
// Odd pairs skip their shift where the dtype allows (kInPlace): masking the value in place, one
// width up, gives magic + 2^BITS q, still an exact integer inside the mantissa (fp16 at 1, 2 and
// 4 bits: 1024 + 16q <= 1264 < 2048; bf16 at 1 and 2 bits: 128 + 4q <= 140 < 256), and one
// HFMA2 by 2^-BITS plus zo = -(magic 2^-BITS + zi) gives q - zi exactly (one rounding of an exact
// result). A word then costs one shift per two pairs instead of one per pair: at 2 and 1 bits
// (8 and 16 pairs a word) that is 3 and 7 shifts instead of 7 and 15. Feeding 1024 + q to the
// tensor cores and correcting per segment would save the HSUB2, but measured on H100 it loses ~3
// digits to the accumulation of the large offset (1-bit rows failed the 2e-3 bound) and did not
// change the kernel's speed.
template <bool kBF16, int BITS>
constexpr bool kInPlace = BITS <= 2 || (!kBF16 && BITS == 4);

template <bool kBF16, int BITS>
__device__ __forceinline__ uint32_t unpack_pair(uint32_t word, int s, uint32_t zc, uint32_t zo) {
  constexpr uint32_t kMask = ((1u << BITS) - 1u) * 0x00010001u;
  if constexpr (kInPlace<kBF16, BITS>) {
    const uint32_t base = word >> (BITS * (s & ~1));
    if (s & 1)  // 2^-BITS is exact in both dtypes; the constant folds to an immediate
      return Num<kBF16>::fma(ptx::and_or(base, kMask << BITS, Num<kBF16>::kMagic), Num<kBF16>::splat(1.f / (1 << BITS)),
                             zo);
    return Num<kBF16>::sub(ptx::and_or(base, kMask, Num<kBF16>::kMagic), zc);
  } else if constexpr (kBF16 && BITS == 8) {
    // bf16 holds every integer up to 256 exactly, so q - zi is exact, but 128 + q (the magic
    // number) only for q < 128. So q = l + 128 b (l its low 7 bits) and zi = zl + 128 zb:
    //   q - zi = ((128 + l) - zc) + 128 (b - zb),   zc = 128 + zl (segment_zero)
    // where zo = zb ? -128 : 0 (bits 0xC300 or 0) and 128 (b - zb) is one LOP3 of b's mask (a
    // PRMT that replicates bit 7 of values s and s + 2 across their halves), zo and the
    // immediate 128: mask ? (zo ? 0 : 128) : zo. (As (mask & (zo | 128)) ^ zo the compiler kept
    // zo | 128 in registers, and the 16-token tiles spilled.) Every intermediate is an integer
    // of magnitude <= 255: exact.
    const uint32_t low = ptx::and_or(word >> (BITS * s), 0x007f007fu, Num<true>::kMagic);
    const uint32_t mask = ptx::prmt(word, 0u, s ? 0xBB99u : 0xAA88u);
    const uint32_t high = (mask & 0x43004300u & ~zo) | (~mask & zo);
    return Num<true>::add(Num<true>::sub(low, zc), high);
  } else {
    return Num<kBF16>::sub(ptx::and_or(word >> (BITS * s), kMask, Num<kBF16>::kMagic), zc);
  }
}

// The odd pairs' addend zo = -(magic 2^-BITS + zi) = magic (1 - 2^-BITS) - zc, as one half of
// the dtype: fp16 1024 (1 - 2^-BITS) = 512 / 768 / 960 at 1 / 2 / 4 bits, bf16 64 / 96.
template <bool kBF16, int BITS>
constexpr float kOddBias = Num<kBF16>::kMagicValue - Num<kBF16>::kMagicValue / (1 << BITS);

// The integer zero points zi that the A fragments subtract exactly (see unpack_pair): |q - zi|
// and zc must be exact integers in the weight dtype, zc = magic + zi (bf16 at 8 bits: see
// segment_zero). The rest of a zero, z - zi (0 for RTN and GPTQ weights, fractional for HQQ),
// is applied on the accumulators through sum(x). spinfer/quant/lowbit.py's exact_integer_zeros
// states the same ranges.
template <bool kBF16, int BITS>
constexpr float kZeroLo = kBF16 && BITS == 8 ? 0.f : Num<kBF16>::kZeroLo;
template <bool kBF16, int BITS>
constexpr float kZeroHi = kBF16 && BITS == 8 ? 255.f : Num<kBF16>::kZeroHi;

// zi for one zero z. NaN clamps to a number; z - zi stays NaN.
template <bool kBF16, int BITS>
__device__ __forceinline__ float integer_zero(float z) {
  return fminf(fmaxf(rintf(z), kZeroLo<kBF16, BITS>), kZeroHi<kBF16, BITS>);
}

// A segment's zero constants for rows g and g + 8 (one in each half, as the scale-zero words
// hold them): zc2 = magic + zi and zi2 = zi in the dtype, and for bf16 at 8 bits zo2 = zb ? -128
// : 0 (unpack_pair), with zc2 = 128 + zl. zz: the zeros; clamped to kZeroLo..kZeroHi unless the
// host found them exact (integer_zeros). Adding the magic rounds a zero below it to an integer as
// rintf does (ties to even), since the sum's unit is 1.
struct SegmentZero {
  uint32_t zc2, zo2, zi2;
};
template <bool kBF16, int BITS>
__device__ __forceinline__ SegmentZero segment_zero(uint32_t zz, bool clamp) {
  using N = Num<kBF16>;
  const uint32_t zr = clamp ? N::clamp(zz, N::splat(kZeroLo<kBF16, BITS>), N::splat(kZeroHi<kBF16, BITS>)) : zz;
  const uint32_t zc = N::add(zr, N::kMagic);
  if constexpr (kBF16 && BITS == 8) {
    // zeros of 128 and up are integers in bf16 already: zc = zi = 128 + zl, zo = -128
    const uint32_t ge = N::ge_mask(zr, N::splat(128.f));
    return {(zr & ge) | (zc & ~ge), ge & 0xC300C300u, (zr & ge) | (N::sub(zc, N::kMagic) & ~ge)};
  } else {
    return {zc, 0u, N::sub(zc, N::kMagic)};
  }
}

// The same constants from 4-bit integer zeros (LowbitArgs::nibble_zeros): rows g and g + 8's at bits
// `shift` and shift + 16 of zw, put into the magic's low mantissa bits, which gives magic + z
// exactly (z <= 15, and the magic's unit is 1): a shift and a LOP3 where the dtype's zeros take
// a PRMT and an HADD2.
template <bool kBF16>
__device__ __forceinline__ SegmentZero nibble_zero(uint32_t zw, int shift) {
  using N = Num<kBF16>;
  const uint32_t zc = ptx::and_or(zw >> shift, 0x000F000Fu, N::kMagic);
  return {zc, 0u, N::sub(zc, N::kMagic)};
}

// A segment's per-row constants for unpack_pair, zc[h] and zo[h] (rows g and g + 8: halves 0 and 1 of
// z2's pairs), each with the same value in both halves. kFold (in-place decodes only): zo for both
// rows in one HADD2, and each row's constants as broadcasts that ptxas folds into the decode's HADD2 /
// HFMA2 as operand selectors (R.H0_H0 / R.H1_H1), 2 PRMT and an HADD2 fewer a segment than the PRMT
// form. Which kernels fold where is measured (their call sites).
template <bool kBF16, int BITS, bool kFold>
__device__ __forceinline__ void row_constants(const SegmentZero& z2, uint32_t (&zc)[2], uint32_t (&zo)[2]) {
  using N = Num<kBF16>;
  if constexpr (kFold) {
    static_assert(kInPlace<kBF16, BITS>, "the folded form is the in-place decode's");
    const uint32_t zo2 = N::sub(N::splat(kOddBias<kBF16, BITS>), z2.zc2);  // e.g. fp16 4-bit 960 - (1024 + z)
#pragma unroll
    for (int h = 0; h < 2; ++h) zc[h] = N::broadcast(z2.zc2, h), zo[h] = N::broadcast(zo2, h);
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      zc[h] = ptx::prmt(z2.zc2, z2.zc2, h ? 0x3232 : 0x1010);
      if constexpr (kInPlace<kBF16, BITS>) zo[h] = N::sub(N::splat(kOddBias<kBF16, BITS>), zc[h]);
      if constexpr (kBF16 && BITS == 8) zo[h] = ptx::prmt(z2.zo2, z2.zo2, h ? 0x3232 : 0x1010);
    }
  }
}

// A lane's NW words (all BITS of a chunk, or half of them) at byte `offset` of row `r` (whose
// first byte is `row`), swizzled or (bulk copies) as the format stores it.
template <int BITS, int NW>
__device__ __forceinline__ void load_words(uint32_t (&dst)[NW], const unsigned char* row, int r, int offset,
                                           bool swizzled) {
  const int sw = swizzled ? piece_swizzle<BITS>(r) : 0;
  auto at = [&](int o) { return row + (((o >> 4) ^ sw) << 4) + (o & 15); };
  if constexpr (NW >= 4) {
#pragma unroll
    for (int i = 0; i < NW; i += 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(at(offset + 4 * i));
      dst[i] = v.x, dst[i + 1] = v.y, dst[i + 2] = v.z, dst[i + 3] = v.w;
    }
  } else if constexpr (NW == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(at(offset));
    dst[0] = v.x, dst[1] = v.y;
  } else {
    dst[0] = *reinterpret_cast<const uint32_t*>(at(offset));
  }
}

// The schedule (schedule.cuh): a unit is one stage (K / 256 per row block, K / 128 at 8 bits) of
// one 64-row block; the packed format stores the units in schedule order, so a block's weights
// are one contiguous stream. The balanced schedule runs kBalancedPerSM blocks per SM. The
// one-block-per-row grid may split only its tail rows (LowbitArgs::tail_*): a 1-D grid of the
// whole rows, then each tail row's splits.

// CROSS: ranges may cross row blocks (the balanced schedule); without it a block's range is
// one row block's stages, and the kernel keeps none of the bookkeeping for more.
// RB: 64-row blocks per block (1, or 2 without CROSS: row pairs).
// The kernel's body (lowbit_mm_kernel below). BULK (bulk_loader): each stage's weight tiles come
// in one bulk copy (LowbitPlan::bulk_weights), read unswizzled, and its activation slice in one
// tensor copy per chunk through x_map (encode_x_map); otherwise 16-byte cp.async from every
// thread, the weights into swizzled rows.
// NIB: the records hold 4-bit integer zeros (LowbitArgs::nibble_zeros; 1, 2 and 4 bits). A
// compile-time choice: read from the arguments, the record stride and the slots' sources were
// run-time values, and the 1- and 2-bit kernels of 8-token tiles lost 2-6% (H100, docs/quant.md,
// sixty-eighth session).
template <bool kBF16, int BITS, int BN, int NG, bool CROSS, int RB, bool BULK, bool NIB>
__device__ __forceinline__ void lowbit_mm_body(const LowbitArgs& args, const int chunks, const int64_t split_stride,
                                               const int iters_per_split, const CUtensorMap* x_map) {
  static_assert(RB == 1 || (RB == 2 && !CROSS), "row pairs only in the one-block-per-tile grids");
  static_assert(!NIB || BITS <= 4, "4-bit zeros at 1, 2 and 4 bits only");
  constexpr int kRecordWords = record_words(NIB);
  static_assert(!BULK || bulk_loader(BITS, BN), "the bulk loader's kernels are built where it pays");
  constexpr bool tma_x = BULK;  // the activations' tensor copies
  using L = Layout<BITS, BN, NG, CROSS, RB, tma_x>;
  constexpr int kTileRows = L::kTileRows;  // output rows of a block's tile
  constexpr int U = L::U;
  constexpr int kTilesPerWord = 8 / BITS;  // k16 tiles whose values one word holds (8-bit: 1)
  constexpr int kRowBytes = U * kChunk * BITS / 8;  // a weight row's bytes per stage
  extern __shared__ __align__(128) unsigned char smem[];  // (the tensor copies' alignment)
  __shared__ int s_is_last;
  SPINFER_MARK(0);

  const int tid = threadIdx.x, warp = tid / 32 % kWarps, lane = tid % 32;
  const int group = tid / (32 * kWarps);  // the warp group: which half of each stage it takes
  // Bulk weight copies: stage buffer s's tile lands on s_full[s]. Thread 0 initializes the
  // barriers and issues every copy; the other threads first wait on them after the main loop's
  // first block barrier, which orders the initialization before that. A compile-time choice: as
  // a runtime flag (one kernel for both loaders) the 4-bit kernel measured 2.2% slower (geomean,
  // four issue shapes x N = 1-32; 14336x4096 N = 1 18.3 against 17.6 us), 8-bit 0.5%.
  constexpr bool bulk = BULK;
  __shared__ __align__(8) uint64_t s_full[bulk ? kStages : 1];
  if (bulk && tid == 0) {  // (bulk is constexpr; the branch compiles away without it)
#pragma unroll
    for (int s = 0; s < kStages; ++s) ptx::mbarrier_init(&s_full[s], 1);
    ptx::fence_mbarrier_init();
    if (tma_x) ptx::prefetch_tensormap(x_map);  // the first activation copy waits on it otherwise
  }
  const int g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * BN;
  const int valid_rows = min(BN, args.n - n0);
  const int x_rows = min(BN, args.n);  // token rows of the tensor copies' box (encode_x_map)
  const int total_iters = (chunks + U - 1) / U;  // stages per row block
  const int row_blocks = (args.m + kBlockRows - 1) / kBlockRows;  // of 64 rows (the format's tiles)
  // The first unit's row block and stage in it, and how many units. Without CROSS the grid is
  // (token tiles, row blocks, splits) and a split is iters_per_split stages: no division, which
  // every block would pay before its first copy.
  int row_first, it_begin, iters;
  // Not CROSS: this block's row block, split and splits, from the grid and the split tail rows
  // (LowbitArgs); derived again at the end rather than kept in registers through the loop.
  auto tile_of_block = [&](int& row, int& split, int& splits) {
    row = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    if (args.tail_splits > 1 && row >= args.tail_first) {
      const unsigned j = row - args.tail_first;
      row = args.tail_first + static_cast<int>(j / args.tail_splits);
      split = static_cast<int>(j % args.tail_splits), splits = args.tail_splits;
    }
  };
  if constexpr (CROSS) {
    const Range range(Schedule(row_blocks, total_iters));
    row_first = range.row, it_begin = range.stage, iters = range.units;
  } else {
    int split, splits;
    tile_of_block(row_first, split, splits);
    const int per_split = args.tail_splits > 1 && blockIdx.y >= args.tail_first ? args.tail_iters : iters_per_split;
    it_begin = split * per_split;
    iters = max(0, min(total_iters, it_begin + per_split) - it_begin);
  }
  // The stage this block starts at, its copy cursors wrapping back to the range's first stage
  // after the last (kLowbitRotate, lowbit_mm.h): row blocks read different column offsets at once.
  const int rot = !CROSS && args.rotate > 0 && iters > 1 ? (row_first * args.rotate) % iters : 0;

  // All threads: 16-byte copies of weights and activations, 4-byte copies of (scale, zero)
  // pairs. Weight tiles are padded to 64 rows and whole stages in the format; scales of rows
  // past M and tokens past N are zero-filled, so padded rows compute 0 and are never stored.
  // Per-thread copy slots, fixed for the whole kernel, are one base offset plus compile-time
  // steps: a thread's weight pieces are kWRowStep rows apart (a multiple of the swizzle period)
  // and its x pieces kXRowStep token rows apart. Per-slot offsets kept in arrays were
  // rematerialized from the thread index at every stage (~90 of a stage's ~450 instructions,
  // SASS of 4-bit BN=8); a runtime-bounded `for (p = tid; ...)` loop cost ~700 IMAD a stage.
  // With RB = 2 the slots of the second 64 rows read the second row block's tile, rb_stride
  // bytes on in the stream (the same stage of the next row block); where the layer has no
  // second row block they read the first one's again: finite values for rows never stored.
  constexpr int kWPieces = kRowBytes / 16;
  constexpr int kWTileSlots = kBlockRows * kWPieces;  // of one 64-row tile
  constexpr int kWSlots = RB * kWTileSlots;
  constexpr int kWCopies = (kWSlots + kThreads - 1) / kThreads;
  constexpr int kWRowStep = kThreads / kWPieces;
  static_assert((kWSlots % kThreads == 0 || kWCopies == 1) && kWRowStep % 8 == 0, "whole weight copy rounds");
  static_assert(kWTileSlots % kThreads == 0 || kThreads % kWTileSlots == 0, "a copy round stays in one tile");
  const int w_row = tid / kWPieces;
  const int w_dst = w_row * L::kWStride + ((tid % kWPieces) ^ piece_swizzle<BITS>(w_row)) * 16;
  const int64_t rb_stride =
      RB == 2 && RB * row_first + 1 < row_blocks ? static_cast<int64_t>(total_iters) * kBlockRows * kRowBytes : 0;
  const unsigned char* w_src =
      reinterpret_cast<const unsigned char*>(args.qweight) +
      (static_cast<int64_t>(RB * row_first) * total_iters + it_begin) * kBlockRows * kRowBytes +
      (tid % kWTileSlots) * 16 + (tid / kWTileSlots) * rb_stride;
  // A stage's scales and zeros: for each 64-row tile of the block, slot p = (tile * 64 + w) *
  // kPairs + segment holds word w of the segment's record (lowbit_mm.h), so a lane's words of
  // neighbouring segments are neighbours (one wider read, as for the pairs before), and the same
  // layout holds both kinds of zeros: 4-bit zero word 32 + i goes to slots 32 + 8 b + i (b = 0..3:
  // copied four times), where the dtype's zeros of rows 16 b + i (+ 8) sit. So a lane reads its
  // zero word at one offset either way.
  constexpr int kSzSlots = kTileRows * L::kPairs;  // 64 at 8 bits: half the threads copy one
  constexpr int kSzCopies = (kSzSlots + kThreads - 1) / kThreads;
  static_assert(kThreads % L::kPairs == 0, "a thread's slots are of one segment");
  const uint32_t* sz_row[kSzCopies];  // this slot's word of its tile's record of group 0 (nullptr: none)
  // the thread's segment's column offset inside a stage (u, j): the same for all its slots
  const int sz_col = (tid % L::kPairs / NG) * kChunk + tid % L::kPairs % NG * (kChunk / NG);
  // The slots' words in the block's first row block. The balanced schedule (CROSS, one 64-row tile
  // a row block) moves them on by a row block's records as its range crosses into the next (a
  // recomputation there kept the slot's word in a register through the loop, and the 32-token
  // kernels spilled).
#pragma unroll
  for (int i = 0; i < kSzCopies; ++i) {
    const int p = tid + i * kThreads, tile = RB * row_first + p / (kRecordTileRows * L::kPairs);
    const int slot = p / L::kPairs % kRecordTileRows;
    const int w = slot < kRecordScaleWords || !NIB ? slot : zero_word_of(slot % 8, true);
    sz_row[i] = p < kSzSlots && tile * kRecordTileRows < args.m
                    ? reinterpret_cast<const uint32_t*>(args.scale_zero) + record_word(tile, 0, args.groups, kRecordWords) + w
                    : nullptr;
  }

  // x: a stage's activation rows are whole 16-byte pieces of columns that exist (stages never
  // cross kp, a multiple of the stage width).
  constexpr int kXPieces = L::kCols / 8;  // 16-byte pieces per activation row per stage
  constexpr int kXCopies = (BN * kXPieces + kThreads - 1) / kThreads;
  constexpr int kXRowStep = kThreads / kXPieces;
  static_assert(kThreads % kXPieces == 0, "x pieces tile the block");
  const int x_row = tid / kXPieces;
  const int x_dst = (x_row * L::kXStride + (tid % kXPieces) * 8) * 2;
  const char* x_src = static_cast<const char*>(args.x) +
                      (static_cast<int64_t>(n0 + x_row) * args.kp + (tid % kXPieces) * 8) * 2;  // column 0
  const int64_t x_step = static_cast<int64_t>(kXRowStep) * args.kp * 2;  // bytes between a thread's x rows

  // issue_w(st, idx) and issue_x(st, idx) fill the stage buffer at shared address st with the
  // next stage's weights and scales, and its activations: separate, so the first stages' weights
  // can be requested before griddep_wait (launch.cuh). Stages are issued in order. Without
  // CROSS a block's range is iters stages from it_begin, issued from stage rot on and wrapping
  // (kLowbitRotate): the next stage is stage idx of the range, a 32-bit index that wraps with a
  // compare (next_idx), and a source is its base plus idx stages, one IMAD.WIDE.
  // Pointer cursors, which advanced by a stage and wrapped by a 64-bit product, took 48 of the
  // 213 instructions of a 2-bit BN = 8 stage for its three copies (SASS, twenty-third session).
  // CROSS ranges cross row blocks: their cursors advance, and at the end of a row block the
  // activation and scale cursors go back to column 0 of the next one (rot is 0 there).
  auto next_idx = [&](const int idx) { return idx + 1 == iters ? 0 : idx + 1; };
  const unsigned char* w_next = w_src;  // CROSS only
  const char* x_next = x_src + it_begin * L::kCols * 2;  // CROSS: the cursor; else the base
  int col_next = it_begin * L::kCols;   // first column of the next weight stage (CROSS; else the base)
  int x_stage = it_begin;               // stage in its row of the next activation slice (CROSS)
  auto issue_w = [&](const uint32_t st, const int idx) {
    // The stage's weight tile (64 rows x U chunks) is one contiguous span of qweight.
    const unsigned char* w_at =
        CROSS ? w_next : w_src + static_cast<uint64_t>(static_cast<uint32_t>(idx)) * (kBlockRows * kRowBytes);
    const int col0 = CROSS ? col_next : col_next + idx * L::kCols;
    if constexpr (bulk) {
      if (tid == 0) {  // w_at is thread 0's slot: the tile's first byte
        const uint32_t off = st - ptx::smem_addr(smem);
        uint64_t* bar = &s_full[off / L::kStageBytes];
        ptx::fence_proxy_async_shared();  // the block's reads of this buffer come before the copies
        // The stage's weight tiles and (tma_x: issue_x, after it) its activation slice.
        ptx::mbarrier_arrive_expect_tx(bar, RB * kBlockRows * kRowBytes + (tma_x ? U * x_rows * L::kXStride * 2 : 0));
#pragma unroll
        for (int r = 0; r < RB; ++r)
          ptx::cp_async_bulk_g2s(smem + off + r * kBlockRows * L::kWStride, w_at + r * rb_stride,
                                 kBlockRows * kRowBytes, bar);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kWCopies; ++i) {
        if (kWSlots % kThreads != 0 && tid >= kWSlots) break;  // 1-bit with two groups: 128 pieces
        const int c = i * kThreads;  // the round's first slot (unrolled: a constant)
        ptx::cp_async_cg_16(st + w_dst + i * kWRowStep * L::kWStride,
                            w_at + (c % kWTileSlots) * 16 + (c / kWTileSlots) * rb_stride);
      }
    }
    {
      // Group of the thread's columns (one for all its slots): group sizes are powers of two, and
      // per-channel groups (size K) come with a shift that gives 0; padding columns clamp to the
      // last group.
      const int col = col0 + sz_col;
      const int64_t at = static_cast<int64_t>(min(col >> args.group_shift, args.groups - 1)) * kRecordWords;
#pragma unroll
      for (int i = 0; i < kSzCopies; ++i) {
        if (kSzSlots % kThreads != 0 && tid + i * kThreads >= kSzSlots) continue;  // no slot
        const bool ok = sz_row[i] != nullptr && col < args.kp;
        ptx::cp_async_ca_4(st + L::kSzOffset + (tid + i * kThreads) * 4, ok ? sz_row[i] + at : args.scale_zero, ok);
      }
    }
    if constexpr (CROSS) {
      w_next += kBlockRows * kRowBytes, col_next += L::kCols;
      if (col_next == args.kp) {  // the next row block (a range ends in the last one: no copy past it)
        col_next = 0;
#pragma unroll
        for (int i = 0; i < kSzCopies; ++i)
          if (sz_row[i] != nullptr) sz_row[i] += static_cast<int64_t>(args.groups) * kRecordWords;
      }
    }
  };
  auto issue_x = [&](const uint32_t st, const int idx) {
    if constexpr (tma_x) {
      // One tensor copy per chunk: x_rows tokens x 144 columns (Layout); tokens past N arrive as
      // zeros. The stage's mbarrier expects its bytes (issue_w) and thread 0 fenced the buffer there.
      if (tid == 0) {
        const uint32_t off = st - ptx::smem_addr(smem);
        const int col = (CROSS ? x_stage : it_begin + idx) * L::kCols;
#pragma unroll
        for (int u = 0; u < U; ++u)
          ptx::cp_async_bulk_tensor_2d_g2s(smem + off + L::kXOffset + u * L::kXChunkBytes, x_map, col + u * kChunk, n0,
                                           &s_full[off / L::kStageBytes]);
      }
    } else {
      const char* x_at = CROSS ? x_next : x_next + static_cast<uint64_t>(static_cast<uint32_t>(idx)) * (L::kCols * 2);
#pragma unroll
      for (int i = 0; i < kXCopies; ++i) {
        if (x_row + i * kXRowStep >= valid_rows) break;  // rows past N stay zero
        ptx::cp_async_cg_16(st + L::kXOffset + x_dst + i * kXRowStep * L::kXStride * 2, x_at + i * x_step);
      }
    }
    if constexpr (CROSS) {
      x_next += L::kCols * 2;
      if (++x_stage == total_iters) x_stage = 0, x_next = x_src;
    }
  };

  float acc[BN / 8][4];
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

  const int my_row = (RB == 2 ? group * kBlockRows : 0) + warp * 16 + g;  // and my_row + 8, in the tile
  // Rows my_row and my_row + 8 are rows 16 warp + g (+ 8) of 64-row tile `group` (RB = 2) or 0:
  // their scale word in a record is 8 warp + g, their zero word 32 on, and their 4-bit zeros sit at
  // bit 4 warp of it (lowbit_mm.h; written with warp and g, not with my_row's signed / and %,
  // whose sign handling the compiler kept in the loop: the 2-bit row-pair kernel's loop took 13%
  // more instructions). The launch's integer zeros at 1, 2 and 4 bits are 4-bit ones, so the
  // shift is taken unconditionally where they are.
  static_assert(scale_word_of(16 * 3 + 5) == 8 * 3 + 5 && zero_word_of(16 * 3 + 5, false) == 32 + 8 * 3 + 5 &&
                    zero_shift_of(16 * 3 + 5, true) == 4 * 3, "record words of row 16 warp + g");
  const int rec_tile = RB == 2 ? group : 0, sc_word = 8 * warp + g, z_shift = 4 * warp;
  // Scale and zero are applied per segment (128/NG columns, inside one group). The A fragments
  // hold the exact integers q - zi (zi: the zero point's integer part, see integer_zero), so
  // for one row and token
  //   sum_k (q_k - z) s x_k = s * (sum_k (q_k - zi) x_k - (z - zi) * sum_k x_k)
  // and for integer zero points (RTN, GPTQ) the segment ends with one FFMA per accumulator.
  // Only a segment whose rows have a fractional zero (HQQ) needs sum_k x_k: a second mma per 16
  // tokens against a ones matrix, reusing the B-fragment registers as its A operand. Before,
  // every segment paid that mma, its operand moves and two shuffles per 8 tokens, and the
  // difference sum q x - z sum x cancelled most of its digits.
  // What a warp group computes of a stage: with RB = 2 every chunk of its own row block;
  // otherwise, below 8 bits (two chunks) chunk `group`, and at 8 bits (one chunk) tiles
  // 4 * group .. 4 * group + 3 of it, and with them the segments (groups of scales) that hold
  // them: g128 splits its one segment, g64 and g32 give each group whole segments.
  static_assert(RB == 2 || U == kGroups || U == 1, "a group takes one chunk, or half of the only one");
  constexpr int kSplitTiles = RB == 1 && U == 1 ? 2 : 1;
  constexpr int kTiles = 8 / kSplitTiles;                             // k16 tiles a group takes
  constexpr int kSegs = NG / kSplitTiles > 0 ? NG / kSplitTiles : 1;  // segments it meets
  static_assert(kSplitTiles == 1 || BITS == 8, "only 8-bit words hold one tile each");
  constexpr int kXTiles = BN >= 16 ? BN / 16 : 1;  // 16-token groups of the x-sum mma
  constexpr uint32_t kOnes = kBF16 ? 0x3f803f80u : 0x3c003c00u;
  // Chunk u of the stage at `offset`, from k16 tile tile0 on. group, u and tile0 are address
  // terms only: the loops below stay unrolled.
  auto compute_chunk = [&](const int offset, const int u, const int tile0) {
    const unsigned char* st = smem + offset;
    // This lane's B fragments: token row g, columns 4t.. of each k16 tile (of chunk u, below).
    const unsigned char* xrow = st + L::kXOffset + (g * L::kXStride + 4 * t) * 2;
    uint32_t w[2][BITS / kSplitTiles];
#pragma unroll
    for (int h = 0; h < 2; ++h)
      load_words<BITS>(w[h], st + (my_row + 8 * h) * L::kWStride, my_row + 8 * h,
                       u * (kRowBytes / U) + 4 * BITS * t + 4 * (tile0 / kTilesPerWord), !bulk);
#pragma unroll
    for (int jj = 0; jj < kSegs; ++jj) {
      const int j = kSplitTiles == 2 ? group * (NG / 2) + jj : jj;  // the chunk's segment
      float sc[2];
      uint32_t zc[2], zo[2] = {0u, 0u};  // zo: the odd pairs' addend (kInPlace only)
      // The segment's scale word and zero word of rows my_row and my_row + 8 (the slots' layout, above).
      const uint32_t* words = reinterpret_cast<const uint32_t*>(st + L::kSzOffset) + u * NG + j +
                              (rec_tile * kRecordTileRows + sc_word) * L::kPairs;
      const uint32_t sw = words[0], zw = words[kRecordScaleWords * L::kPairs];
#pragma unroll
      for (int h = 0; h < 2; ++h) sc[h] = Num<kBF16>::to_float(static_cast<uint16_t>(h ? sw >> 16 : sw & 0xffffu));
      // The common case, integer zero points (RTN, GPTQ), decoded in the weight dtype for both
      // rows at once: zc = magic + z, exact for the zeros integer_zero keeps as they are.
      // args.integer_zeros says the host checked that every zero of the layer is one of those
      // (LowBitWeight.integer_zeros); otherwise, with z clamped to integer_zero's range, zc and
      // zc - magic are exact and give back z exactly when integer_zero(z) == z, and a warp whose
      // segment holds any other zero takes the fp32 decode and the x-sum path below. Against
      // converting each zero to fp32, rounding and clamping it (SASS: ~25 instructions per
      // segment), the check is ~10; skipping it (clamp, compare, vote) measured 4-5% faster at 1
      // and 2 bits (geomean; up to 8%), where a stage has two segments (docs/quant.md).
      // The segment from its zc2 (see above) on; sum_path: its zeros go through sum(x). Each call
      // passes its own zc2 and the lambda is inlined, so the integer_zeros copy has no check.
      // zz: {z row g, z row g + 8} in the dtype, read by the sum path only.
      auto segment = [&](const SegmentZero z2, const uint32_t zz, const bool sum_path) {
        // Folded where the decode is in place (measured 1-2% faster at 2 bits, N = 8 / 16; docs/quant.md,
        // forty-ninth session); at 8 bits the folded form spilled (fp16, 16-token tiles).
        row_constants<kBF16, BITS, kInPlace<kBF16, BITS>>(z2, zc, zo);
        float part[BN / 8][4];
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) part[nb][e] = 0.f;
        // The segment's tiles, with or without the x-sum mma. Both calls below pass a constant
        // and the lambda is inlined, so each branch is straight-line code without the test.
        float xsum[kXTiles][4];  // written and read only by the x-sum branch
        auto tiles = [&](const bool with_xsum) {
#pragma unroll
          for (int tile = jj * (kTiles / kSegs); tile < (jj + 1) * (kTiles / kSegs); ++tile) {  // of the group's
            const int wi = tile / kTilesPerWord, s0 = 2 * (tile % kTilesPerWord);
            uint32_t a[4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              a[h] = unpack_pair<kBF16, BITS>(w[h][wi], s0, zc[h], zo[h]);
              a[h + 2] = unpack_pair<kBF16, BITS>(w[h][wi], s0 + 1, zc[h], zo[h]);
            }
            uint32_t b[BN / 8][2];
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb) {
              // a plain load, so the compiler can hoist it above earlier mma (asm volatile cannot be)
              const uint2 v = *reinterpret_cast<const uint2*>(
                  xrow + (nb * 8 * L::kXStride + 16 * (tile0 + tile)) * 2 + u * L::kXChunkBytes);
              b[nb][0] = v.x, b[nb][1] = v.y;
              ptx::mma_m16n8k16<kBF16>(part[nb], a, b[nb][0], b[nb][1]);
            }
            if (with_xsum) {
#pragma unroll
              for (int p = 0; p < kXTiles; ++p) {
                // A = x rows (tokens 16p + g and 16p + 8 + g): exactly the B fragments just loaded.
                const uint32_t hi0 = BN >= 16 ? b[(2 * p + 1) % (BN / 8)][0] : 0u;
                const uint32_t hi1 = BN >= 16 ? b[(2 * p + 1) % (BN / 8)][1] : 0u;
                const uint32_t ax[4] = {b[2 * p % (BN / 8)][0], hi0, b[2 * p % (BN / 8)][1], hi1};
                ptx::mma_m16n8k16<kBF16>(xsum[p], ax, kOnes, kOnes);
              }
            }
          }
        };
        if (sum_path) {
          float zf[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float z = Num<kBF16>::to_float(static_cast<uint16_t>(h ? zz >> 16 : zz & 0xffffu));
            const float zi = integer_zero<kBF16, BITS>(z);
            zf[h] = z - zi;
            // segment_zero's constants from zi in fp32 (the same values; as a call to it with zi
            // packed, this path spilled the hot kernels of other widths: 1, 2 and 4 bits at 8-16
            // tokens, 4-8 bytes)
            if constexpr (kBF16 && BITS == 8) {
              zc[h] = Num<kBF16>::splat(zi >= 128.f ? zi : Num<kBF16>::kMagicValue + zi);
              zo[h] = zi >= 128.f ? 0xC300C300u : 0u;
            } else {
              zc[h] = Num<kBF16>::splat(Num<kBF16>::kMagicValue + zi);  // exact: an integer below 2048 / 256
              zo[h] = Num<kBF16>::splat(kOddBias<kBF16, BITS> - Num<kBF16>::kMagicValue - zi);  // kInPlace only
            }
          }
#pragma unroll
          for (int p = 0; p < kXTiles; ++p)
#pragma unroll
            for (int e = 0; e < 4; ++e) xsum[p][e] = 0.f;
          tiles(true);
          // Segment end: acc += s * part - s * (z - zi) * xsum, per row h and token.
          const float cz[2] = {sc[0] * zf[0], sc[1] * zf[1]};
#pragma unroll
          for (int nb = 0; nb < BN / 8; ++nb) {
            // Token nb*8 + 2t + e's sum sits in xsum[nb/2] row (nb%2)*8 + 2t + e, column 0: lane
            // 4*(2t+e), register 0 (rows 0-7) or 2 (rows 8-15).
            float xt[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) xt[e] = __shfl_sync(0xffffffffu, xsum[nb / 2][(nb % 2) * 2], 4 * (2 * t + e));
#pragma unroll
            for (int e = 0; e < 4; ++e)
              acc[nb][e] = fmaf(sc[e / 2], part[nb][e], fmaf(-cz[e / 2], xt[e % 2], acc[nb][e]));
          }
        } else {
          tiles(false);
#pragma unroll
          for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nb][e] = fmaf(sc[e / 2], part[nb][e], acc[nb][e]);
        }
      };
      if (args.integer_zeros) {  // uniform over the launch; a copy of the segment without the check
        // (at 1, 2 and 4 bits the launch's integer zeros are the records' 4-bit ones)
        segment(NIB ? nibble_zero<kBF16>(zw, z_shift) : segment_zero<kBF16, BITS>(zw, false), zw, false);
      } else {
        // (4-bit zeros come here only where a launch forces the sums)
        const uint32_t zz = NIB ? nibble_zero<kBF16>(zw, z_shift).zi2 : zw;
        const SegmentZero z2 = segment_zero<kBF16, BITS>(zz, true);
        const bool exact = Num<kBF16>::equal(z2.zi2, zz);
        // Warp-uniform: the mma are warp-wide, so one fractional row brings the whole warp.
        segment(z2, zz, __any_sync(0xffffffffu, !exact) || args.force_xsum);
      }
    }
  };
  auto compute = [&](const int offset) {
    if constexpr (RB == 2) {
#pragma unroll
      for (int u = 0; u < U; ++u) compute_chunk(offset, u, 0);
    } else {
      compute_chunk(offset, kSplitTiles == 1 ? group : 0, kSplitTiles == 2 ? group * kTiles : 0);
    }
  };

  // Token rows past N are zeroed once in every stage and never copied (at N = 1 that is 7 of
  // the 8 rows of the x tile). The tensor copies' boxes are x_rows high, so where N < BN they do
  // the same in each chunk's region; a last tile that N only partly fills they write as zeros.
  {
    constexpr int kRegions = tma_x ? U : 1;
    constexpr int kRegionStride = tma_x ? L::kXChunkBytes : 0;
    const int first = tma_x ? x_rows : valid_rows;
    const int per_region = (BN - first) * L::kXStride / 2;  // words
    for (int idx = tid; idx < kStages * kRegions * per_region; idx += kThreads) {
      const int region = idx / per_region;  // stage * kRegions + chunk
      reinterpret_cast<uint32_t*>(smem + (region / kRegions) * L::kStageBytes + L::kXOffset +
                                  (region % kRegions) * kRegionStride + first * L::kXStride * 2)[idx % per_region] = 0u;
    }
  }

  // The end of a row block's units in this block: the second group's accumulators join the
  // first's, and the tile is stored (splits == 1) or left as split `split` of the `splits` blocks
  // that share the row, which the last of them to arrive sums (epilogue.cuh).
  const TileOut out{args.y, args.bias, args.workspace, args.counters, args.m, args.n};
  float* red = reinterpret_cast<float*>(smem + (CROSS ? L::kRedOffset : 0));
  const int slot = tid % (32 * kWarps);
  auto flush = [&](const int row, const int split, const int splits) {
    if constexpr (RB == 2) {  // each group holds its own rows: no sum
      store_tile<kBF16, BN, kTileRows, kThreads>(out, row * kTileRows, my_row, n0,
                                                 static_cast<int64_t>(row) * gridDim.x + blockIdx.x, split_stride,
                                                 split, splits, acc, lane, tid, &s_is_last);
      return;
    }
    if constexpr (!CROSS) __syncthreads();  // every warp is done with the stage buffers
    if (group == 1)
#pragma unroll
      for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[(nb * 4 + e) * (32 * kWarps) + slot] = acc[nb][e];
    __syncthreads();
    if (group == 0)
#pragma unroll
      for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nb][e] += red[(nb * 4 + e) * (32 * kWarps) + slot];
    store_tile<kBF16, BN, kBlockRows, kThreads>(out, row * kBlockRows, my_row, n0,
                                                static_cast<int64_t>(row) * gridDim.x + blockIdx.x, split_stride,
                                                split, splits, acc, lane, tid, &s_is_last, group == 0);
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nb][e] = 0.f;
  };
  // The balanced schedule's flush of row block `row`: this block's split among the blocks whose
  // ranges meet the row, unless it had the whole row.
  auto flush_shared = [&](const int row, const bool whole) {
    int split = 0, splits = 1;
    if (!whole) Schedule(row_blocks, total_iters).shares_of_row(row, split, splits);
    flush(row, split, splits);
  };

  // Stage i is consumed while stage i+1 is in flight. A group is committed every iteration
  // (empty near the end) so wait_group's count stays uniform.
  // The buffers computed (rd) and filled (wr) this iteration, as byte offsets that wrap.
  const uint32_t smem_base = ptx::smem_addr(smem);
  int rd = 0, wr = 0;
  auto next = [](int off) { return off + L::kStageBytes == L::kRedOffset ? 0 : off + L::kStageBytes; };
  // The first stages' weights go out before the wait for the previous kernel (programmatic
  // dependent launch), their activations after it; stage st's copies all belong to commit
  // group st or an earlier one, so the waits below are unchanged. idx: the range's stage that
  // issue_w copies next (not CROSS); in the loop issue_x copies the same one.
  int idx = rot;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st)
    if (st < iters) issue_w(smem_base + st * L::kStageBytes, idx), idx = next_idx(idx);
  ptx::griddep_wait();
  int x_idx = rot;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < iters) issue_x(smem_base + wr, x_idx), x_idx = next_idx(x_idx);
    ptx::cp_async_commit_group();
    wr = next(wr);
  }
  int row = row_first, stage_in_row = it_begin;  // of the stage computed (CROSS)
  int rd_stage = 0;         // rd's stage buffer: its bulk-copy barrier (bulk only)
  uint32_t rd_parity = 0;   // the phase of that barrier stage i completes
  for (int i = 0; i < iters; ++i) {
    ptx::cp_async_wait_group<kStages - 2>();
    // Stage i's cp.async copies are visible to all threads, and all threads are done with stage
    // i-1, whose buffer the prefetch below overwrites.
    __syncthreads();
    if (i == 0) SPINFER_MARK(1);
    if (i + kStages - 1 < iters) issue_w(smem_base + wr, idx), issue_x(smem_base + wr, idx), idx = next_idx(idx);
    ptx::cp_async_commit_group();
    if constexpr (bulk) {  // and its weight tile
      ptx::mbarrier_wait_parity(&s_full[rd_stage], rd_parity);
      if (++rd_stage == kStages) rd_stage = 0, rd_parity ^= 1u;
    }
    compute(rd);
    rd = next(rd), wr = next(wr);
    if (CROSS && ++stage_in_row == total_iters && i + 1 < iters) {  // a row block ends, not the last
      flush_shared(row, row != row_first || it_begin == 0);
      ++row, stage_in_row = 0;
    }
  }
  SPINFER_MARK(2);
  ptx::griddep_launch_dependents();  // the next layer may start its prologue as blocks drain
  // Every issued copy has been waited for: the last stages commit empty groups.
  if constexpr (CROSS) {
    const int64_t unit_end = static_cast<int64_t>(row_first) * total_iters + it_begin + iters;
    const int row_last = static_cast<int>(floor_div(unit_end - 1, total_iters));
    flush_shared(row_last,
                 (row_last != row_first || it_begin == 0) && unit_end == static_cast<int64_t>(row_last + 1) * total_iters);
  } else {
    int row, split, splits;
    tile_of_block(row, split, splits);
    flush(row, split, splits);
  }
  SPINFER_MARK(3);
#ifdef SPINFER_TIMELINE
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  SPINFER_STAMP(4, smid);
#endif
}

// x_map: the activations' tensor map (BULK; encode_x_map), a kernel parameter
// so that the copies can name it (__grid_constant__); unused by the other kernels.
template <bool kBF16, int BITS, int BN, int NG, int MIN_BLOCKS, bool CROSS, int RB, bool BULK, bool NIB>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS)
    lowbit_mm_kernel(const LowbitArgs args, const int chunks, const int64_t split_stride, const int iters_per_split,
                     const __grid_constant__ CUtensorMap x_map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (BULK) {
    __trap();  // never launched below sm_90 (the planner checks); keeps sm_80 builds small
  } else
#endif
  {
    lowbit_mm_body<kBF16, BITS, BN, NG, CROSS, RB, BULK, NIB>(args, chunks, split_stride, iters_per_split, &x_map);
  }
}

// The activations' tensor map for the bulk loader (lowbit_mm.cu): x [n][kp], boxes of min(bn, n)
// tokens x (128 + 16) columns (Layout), unswizzled, zeros past n and kp. Below bn tokens the box
// is only n high: H100, 4-bit g128 at N = 1, boxes of 8 rows (7 filled with zeros by the copy)
// took 14336x4096 from 17.5 to 22.2 us; the kernel zeroes the rows past n once instead.
cudaError_t encode_x_map(CUtensorMap* map, const void* x, int n, int kp, int bn, bool bf16);

// Host side of one (dtype, bits) pair: the BN, NG and schedule variants, instantiated in
// lowbit_mm_{fp16,bf16}_{1,2,4,8}.cu so nvcc builds them in parallel.
template <bool kBF16, int BITS, int BN, int NG, int V>
struct Launcher {
  static constexpr bool BALANCED = V == kLowbitBalanced;
  static constexpr int RB = V == kLowbitRowPairs ? 2 : 1;
  static constexpr int kSmem = Layout<BITS, BN, NG, BALANCED, RB>::kSmemBytes;  // the cp.async loader's
  static constexpr int kSmemBulk = Layout<BITS, BN, NG, BALANCED, RB, true>::kSmemBytes;
  static constexpr int smem(bool bulk) { return bulk ? kSmemBulk : kSmem; }
  // Row pairs: the register cap allows as many resident blocks as H100's shared memory (228 KB
  // an SM, 1 KB reserved per block) holds, and at BN >= 16 no more than 2: with 3 (80
  // registers) the 1-, 2- and 8-bit variants spilled 8-20 bytes. H100, N = 16, six Llama
  // shapes, time of the per-tile kernel over the paired one in the same process, cap 3 -> 2:
  // 8-bit 0.96-1.15 -> 1.01-1.13, 1-bit 0.94-1.10 -> 0.96-1.15, 2-bit 0.90-1.12 -> 0.92-1.12.
  static constexpr int kSmemPerSM = 228 * 1024, kSmemReservedPerBlock = 1024;  // H100 (sm_90)
  // (From the cp.async layout: where the bulk one is larger it is by < 2 KB, which changes no
  // variant's resident blocks under these caps.)
  static constexpr int kSmemBlocks = kSmemPerSM / (kSmem + kSmemReservedPerBlock);
  static constexpr int kRowPairCap = BN == 8 ? kMinBlocks<BITS, BN> : 2;
  static constexpr int kRowPairBlocks = kSmemBlocks < kRowPairCap ? kSmemBlocks : kRowPairCap;
  // The host sizes split-K workspaces and grids by lowbit_tile_rows (lowbit_mm.h).
  static_assert(Layout<BITS, BN, NG, BALANCED, RB>::kTileRows == lowbit_tile_rows(V), "one tile height");
  static constexpr int kMinB = BALANCED ? kBalancedPerSM : RB == 2 ? kRowPairBlocks : kMinBlocks<BITS, BN>;
  // The kernel for a loader and kind of zeros: the bulk loader's exists where it pays
  // (bulk_loader), 4-bit zeros at 1, 2 and 4 bits.
  static auto kernel(bool bulk, bool nib) {
    if constexpr (BITS <= 4) {
      if constexpr (bulk_loader(BITS, BN))
        if (bulk) return nib ? lowbit_mm_kernel<kBF16, BITS, BN, NG, kMinB, BALANCED, RB, true, true>
                             : lowbit_mm_kernel<kBF16, BITS, BN, NG, kMinB, BALANCED, RB, true, false>;
      return nib ? lowbit_mm_kernel<kBF16, BITS, BN, NG, kMinB, BALANCED, RB, false, true>
                 : lowbit_mm_kernel<kBF16, BITS, BN, NG, kMinB, BALANCED, RB, false, false>;
    } else {
      if constexpr (bulk_loader(BITS, BN))
        if (bulk) return lowbit_mm_kernel<kBF16, BITS, BN, NG, kMinB, BALANCED, RB, true, false>;
      return lowbit_mm_kernel<kBF16, BITS, BN, NG, kMinB, BALANCED, RB, false, false>;
    }
  }
  static cudaError_t launch(const LowbitArgs& args, const LowbitPlan& plan, cudaStream_t stream) {
    const bool bulk = bulk_loader(BITS, BN) && plan.bulk_weights;
    const bool nib = BITS <= 4 && args.nibble_zeros;
    if (cudaError_t err = allow_smem(bulk, nib); err != cudaSuccess) return err;
    // Balanced: (token tiles, blocks); else (token tiles, row blocks, splits) of
    // plan.iters_per_split stages each.
    // With split tail rows: (1, whole rows + tail rows x their splits).
    const dim3 grid = BALANCED               ? dim3(plan.n_tiles, plan.grid_blocks)
                      : plan.tail_splits > 1 ? dim3(1, plan.grid_blocks)
                                             : dim3(plan.n_tiles, plan.row_blocks, plan.splits);
    const int64_t split_stride = static_cast<int64_t>(plan.n_tiles) * plan.row_blocks * BN * lowbit_tile_rows(V);
    LowbitArgs a = args;
    a.tail_first = plan.tail_first, a.tail_splits = plan.tail_splits, a.tail_iters = plan.tail_iters;
    CUtensorMap x_map;
    std::memset(&x_map, 0, sizeof x_map);  // the cp.async loader never reads it
    if (bulk)
      if (cudaError_t err = encode_x_map(&x_map, args.x, args.n, args.kp, BN, kBF16); err != cudaSuccess) return err;
    return launch_kernel_window(kernel(bulk, nib), grid, kThreads, smem(bulk), stream, plan.pdl,
                                stream_window(args.qweight, lowbit_qweight_bytes(args.m, args.kp, BITS)), a,
                                plan.chunks, split_stride, plan.iters_per_split, x_map);
  }
  // The dynamic shared-memory opt-in, once per device and kernel (a driver call costs microseconds).
  static cudaError_t allow_smem(bool bulk, bool nib) {
    static std::atomic<uint64_t> done[2][2] = {{0, 0}, {0, 0}};
    return allow_smem_once(kernel(bulk, nib), smem(bulk), done[bulk][nib]);
  }
  // (the planner's occupancy: of the 4-bit-zero kernels at 1, 2 and 4 bits, what RTN and GPTQ weights run)
  static int blocks_per_sm(bool bulk) {
    const auto k = kernel(bulk, BITS <= 4);
    if (cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem(bulk)) != cudaSuccess) return 1;
    int blocks = 1;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k, kThreads, smem(bulk)) != cudaSuccess) return 1;
    return blocks > 0 ? blocks : 1;
  }
};

template <bool kBF16, int BITS, int BN, int V>
cudaError_t launch_ng(int ng, const LowbitArgs& args, const LowbitPlan& plan, cudaStream_t stream) {
  switch (ng) {
    case 4: return Launcher<kBF16, BITS, BN, 4, V>::launch(args, plan, stream);
    case 2: return Launcher<kBF16, BITS, BN, 2, V>::launch(args, plan, stream);
    default: return Launcher<kBF16, BITS, BN, 1, V>::launch(args, plan, stream);
  }
}
template <bool kBF16, int BITS, int BN, int V>
int blocks_per_sm_ng(int ng, bool bulk) {
  switch (ng) {
    case 4: return Launcher<kBF16, BITS, BN, 4, V>::blocks_per_sm(bulk);
    case 2: return Launcher<kBF16, BITS, BN, 2, V>::blocks_per_sm(bulk);
    default: return Launcher<kBF16, BITS, BN, 1, V>::blocks_per_sm(bulk);
  }
}
template <bool kBF16, int BITS, int V>
cudaError_t launch_bn(const LowbitArgs& args, const LowbitPlan& plan, cudaStream_t stream) {
  switch (plan.bn) {
    case 8: return launch_ng<kBF16, BITS, 8, V>(plan.ng, args, plan, stream);
    case 16: return launch_ng<kBF16, BITS, 16, V>(plan.ng, args, plan, stream);
    default: return launch_ng<kBF16, BITS, 32, V>(plan.ng, args, plan, stream);
  }
}
template <bool kBF16, int BITS, int V>
int blocks_per_sm_bn(int bn, int ng, bool bulk) {
  switch (bn) {
    case 8: return blocks_per_sm_ng<kBF16, BITS, 8, V>(ng, bulk);
    case 16: return blocks_per_sm_ng<kBF16, BITS, 16, V>(ng, bulk);
    default: return blocks_per_sm_ng<kBF16, BITS, 32, V>(ng, bulk);
  }
}

// The entry points of one (dtype, bits) pair, for the runtime tile width, groups per chunk and
// schedule variant.
template <bool kBF16, int BITS>
cudaError_t launch(const LowbitArgs& args, const LowbitPlan& plan, cudaStream_t stream) {
  switch (plan.variant) {
    case kLowbitBalanced: return launch_bn<kBF16, BITS, kLowbitBalanced>(args, plan, stream);
    case kLowbitRowPairs: return launch_bn<kBF16, BITS, kLowbitRowPairs>(args, plan, stream);
    default: return launch_bn<kBF16, BITS, kLowbitPerTile>(args, plan, stream);
  }
}
// Resident blocks of a variant with the loader `bulk` picks (the planner passes its device's
// default, so a forced cp.async loader runs the default's plan).
template <bool kBF16, int BITS>
int blocks_per_sm(int bn, int ng, int variant, bool bulk) {
  switch (variant) {
    case kLowbitBalanced: return blocks_per_sm_bn<kBF16, BITS, kLowbitBalanced>(bn, ng, bulk);
    case kLowbitRowPairs: return blocks_per_sm_bn<kBF16, BITS, kLowbitRowPairs>(bn, ng, bulk);
    default: return blocks_per_sm_bn<kBF16, BITS, kLowbitPerTile>(bn, ng, bulk);
  }
}

#define SPINFER_LOWBIT_INSTANTIATE(BF16, BITS)                                                        \
  template cudaError_t launch<BF16, BITS>(const LowbitArgs&, const LowbitPlan&, cudaStream_t); \
  template int blocks_per_sm<BF16, BITS>(int, int, int, bool);
#define SPINFER_LOWBIT_EXTERN(BF16, BITS)                                                                    \
  extern template cudaError_t launch<BF16, BITS>(const LowbitArgs&, const LowbitPlan&, cudaStream_t); \
  extern template int blocks_per_sm<BF16, BITS>(int, int, int, bool);
#define SPINFER_LOWBIT_FOR_BITS(X, BF16) X(BF16, 1) X(BF16, 2) X(BF16, 4) X(BF16, 8)

}  // namespace lowbit
}  // namespace spinfer
