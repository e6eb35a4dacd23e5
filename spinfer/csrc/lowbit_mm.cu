// Planning and dispatch of the fused low-bit kernel: tile width by N, the schedule (split-K by
// occupancy, or the balanced one) by the planner's rule or the caller.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "lowbit_gemv.cuh"
#include "tensor_map.h"

namespace spinfer {
namespace lowbit {
SPINFER_LOWBIT_FOR_BITS(SPINFER_LOWBIT_EXTERN, false)
SPINFER_LOWBIT_FOR_BITS(SPINFER_LOWBIT_EXTERN, true)
SPINFER_GEMV_EXTERN(false, 1)
SPINFER_GEMV_EXTERN(false, 2)
SPINFER_GEMV_EXTERN(false, 4)
SPINFER_GEMV_EXTERN(false, 8)
SPINFER_GEMV_EXTERN(true, 1)
SPINFER_GEMV_EXTERN(true, 2)
SPINFER_GEMV_EXTERN(true, 4)
SPINFER_GEMV_EXTERN(true, 8)

namespace {

// f(std::integral_constant<int, B>) for the runtime width B (1, 2, 4, anything else 8): the one
// dispatch from a width to the kernels' template instances.
template <typename F>
auto by_bits(int bits, F f) {
  switch (bits) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

template <bool kBF16>
int query_blocks_per_sm(int bits, int bn, int ng, int variant, bool bulk) {
  return by_bits(bits, [&](auto b) { return blocks_per_sm<kBF16, b()>(bn, ng, variant, bulk); });
}

// Whether the device's default loader for this width and token tile is the bulk one (sm_90,
// lowbit::bulk_loader); SPINFER_LOADER=cp_async overrides the launch only (lowbit_mm_plan).
bool bulk_default(int major, int bits, int bn) { return major >= 9 && bulk_loader(bits, bn); }

// Resident blocks per SM of a kernel variant on a device, with the device's default loader: an
// occupancy query costs microseconds, so it is asked once.
int blocks_per_sm_for(int device, bool bf16, int bits, int bn, int ng, int variant) {
  return asked_once(std::make_tuple(device, bf16, bits, bn, ng, variant), [&] {
    int major = 8;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    const bool bulk = bulk_default(major, bits, bn);
    return bf16 ? query_blocks_per_sm<true>(bits, bn, ng, variant, bulk)
                : query_blocks_per_sm<false>(bits, bn, ng, variant, bulk);
  });
}

// Resident blocks per SM of the GEMV kernel, asked once per device, dtype, width and groups.
int gemv_blocks_per_sm_for(int device, bool bf16, int bits, int ng, int ring, int warps = kGemvWarps) {
  return asked_once(std::make_tuple(device, bf16, bits, ng, ring, warps), [&] {
    return by_bits(bits, [&](auto b) {
      return bf16 ? gemv_blocks_per_sm<true, b()>(ng, ring, warps) : gemv_blocks_per_sm<false, b()>(ng, ring, warps);
    });
  });
}

// Rows short enough that a block of 8 warps gives each at most 2 stages (256 columns each below 8
// bits, 128 at 8): K <= 4096 on the padded K below 8 bits (2048 at 8, where only a forced ring
// runs the GEMV's ring). There the GEMV's ring has 4 warps a block
// (kGemvShortWarps): each warp takes twice the stages, after one first-load latency, and twice
// the blocks fit an SM (14336x4096: 896 blocks in one wave of 8 an SM, not 1.7 waves of 4).
// Why (H100, one process, least of 3 shuffled rounds, N = 1, us, registers / ring of 8 warps /
// ring of 4; docs/quant.md, forty-sixth session): 4-bit g128 14336x4096 15.9 / 15.5 / 15.2,
// 28672x4096 26.0 / 25.6 / 25.2, 6144x4096 9.4 / 9.3 / 9.0, 11008x2048 9.6 / 8.8 / 8.5; 2-bit g128
// 14336x4096 13.1 / 12.3 / 11.5, 28672x4096 20.4 / 18.9 / 17.8; 4-bit g256 14336x4096 15.5 / 15.3 /
// 14.4. The losses, 0.1-0.2 us, are on the smallest layers: 4096x4096 (256 blocks, 8 warps an SM
// with 4 a block) at 1 and 2 bits and 4-bit g256, 4096x2048 at 1 bit. On longer rows 4 warps lost (4096x14336 4-bit 15.4 / 15.1 / 16.0, 28672x8192 46.0 / 46.0 /
// 46.8), and deeper rings (3 or 4 slots) lost everywhere. End to end (benchmarks/ab_e2e.py, four
// Llama-8B layers, batch 1, x dense, same process, against the previous rule): w4 2.71 -> 2.74x,
// w2 g64 3.21 -> 3.26x, w2 g128 3.46 -> 3.60x.
bool gemv_short_rows(int kp, int bits) { return kp <= 2 * kGemvWarps * (bits == 8 ? 1 : 2) * kChunk; }

// The GEMV's loader (lowbit_gemv.cuh): a warp's ring of kGemvRingSlots shared-memory slots at 1, 2
// and 4 bits, the registers (0) at 8 bits. The planner runs the ring only where its resident blocks
// leave no tail rows to split (the ring has no split variant); there the registers and their split.
// SPINFER_LOWBIT_RING=0 / 2 forces either, the ring without the split. `forced`: set where
// SPINFER_LOWBIT_RING chose.
// Why (H100, docs/quant.md, thirty-seventh to thirty-ninth and forty-sixth sessions): alone, the
// ring is faster at 1, 2 and 4 bits on every layer measured. Until the forty-sixth session it ran
// only on rows of at least 8192 columns whose row blocks fill a wave of the register loader's slots
// (and with groups of 64 below 4 bits), because a CUDA graph holding a ring launch ran its other
// kernels slower; the cause was the ring's cp.async stream evicting L2 under the normal policy, and
// its launch now marks the weights streaming (an access-policy window, launch.cuh: StreamWindow).
// With that window and the 4-warp blocks on short rows, the ring on every layer measured (one
// process, least of 3 rounds, N = 1, nine layers of 2048-14336 rows and 5120-18944 columns that the
// old rule kept on the registers, geomean x cuBLAS registers -> ring): 4-bit g128 2.84 -> 2.97,
// g256 2.93 -> 3.05, 2-bit g128 3.71 -> 3.88, 1-bit g128 3.86 -> 3.98, no layer slower (13824x5120
// 4-bit 20.4 -> 18.3 us); end to end, four Llama-8B layers, batch 1, x dense, the old rule (with
// the short rows on the ring) against the ring everywhere: w4 2.752 -> 2.760, w2 g128 3.576 -> 3.655.
// 8 bits measured faster on the registers (1.87 against 1.84x with the ring of 8, 1.77x with 4).
int gemv_ring_slots(int bits, bool* forced) {
  const char* env = std::getenv("SPINFER_LOWBIT_RING");
  *forced = env != nullptr;
  if (env) return std::atoi(env) == kGemvRingSlots ? kGemvRingSlots : 0;
  return bits == 8 ? 0 : kGemvRingSlots;
}

// The GEMV's warps a block on the ring (always kGemvWarps on the registers): kGemvShortWarps on short
// rows, and on longer ones unless its grid of row blocks would fill under 3/4 of a wave of its
// resident blocks (slots4: SMs x resident 4-warp blocks) or run a second wave of under a quarter
// of them. The row blocks are the same either way. A 4-warp block gives each warp twice the stages
// after one first-load latency, and more of them fit an SM (twice as many at 4 bits, 9 against 4
// at 1 and 2 bits with groups of 128, 7 against 4 at 2-bit g64: kGemvMinBlocksFor and the
// registers). They lose where the grid leaves SMs with few warps: a layer under a wave (8192x28672,
// 4096x14336), or the few blocks of a short second wave that then stream alone, 4 warps each, with
// twice the stages (2-bit g64 16384x8192: 1024 blocks, 1.11 waves of 924 slots, 8-warp blocks 1.94
// waves of 528). Fitted to one process, least of 3 shuffled rounds, N = 1, 8 layers x 5 widths
// (docs/quant.md, seventy-first session; us, 8 / 4 warps, the rule's choice marked):
//   2-bit g64: 28672x8192 30.2 / *29.2, 57344x8192 55.1 / *52.6, 27648x5120 21.8 / *20.4, 14336x5120
//              13.6 / *12.6; *19.4 / 21.2 on 16384x8192, *29.1 / 30.3 on 8192x28672, *10.9 / 12.5
//              on 4096x14336;
//   2-bit g128: 57344x8192 55.9 / *53.6, 27648x5120 21.7 / *20.6, 14336x5120 13.4 / *12.8 (0.75 waves);
//   4-bit g128: 27648x5120 30.0 / *28.4, 14336x5120 18.4 / *17.0, 57344x8192 82.0 / *84.0 (the rule's
//              one loss, 2.4%: 3.39 waves either way of its 1056 slots);
//   the other cells level within 1% (14336x8192 at 1 bit: 17.5 / *17.7 and 19.4 / *19.6).
// Before the seventy-first session only short rows took 4 warps. SPINFER_GEMV_WARPS=4|8 forces
// either on the ring.
int gemv_warps(int k, int bits, int ring, int64_t row_blocks, int64_t slots4) {
  if (ring == 0) return kGemvWarps;
  if (const char* env = std::getenv("SPINFER_GEMV_WARPS")) return std::atoi(env) == kGemvShortWarps ? kGemvShortWarps : kGemvWarps;
  if (gemv_short_rows(k, bits)) return kGemvShortWarps;
  const bool under_filled = 4 * row_blocks < 3 * slots4;
  const bool short_second_wave = row_blocks > slots4 && 4 * row_blocks < 5 * slots4;
  return under_filled || short_second_wave ? kGemvWarps : kGemvShortWarps;
}

// Whether one token runs on the GEMV kernel (lowbit_gemv.cuh) rather than the fused one: wherever
// it exists (gemv_supported: 1 and 2 bits at group sizes >= 64, 4 bits at >= 128, 8 bits at
// >= 64), at any K.
// 1 and 2 bits and the groups of 64 came in the thirty-second session: H100, one process, least of
// 3 shuffled rounds, the four issue shapes at N = 1, geomean x cuBLAS fused -> GEMV: 1-bit g128
// 3.82 -> 4.44, g64 3.51 -> 3.81, 2-bit g128 3.71 -> 4.25, 8-bit g64 1.73 -> 1.79 (8192x28672 2%
// slower); 2-bit g64 over those and three end-to-end layers 2.92 -> 3.11, faster on the 4096-wide
// layers (4096x4096 9.9 -> 7.6 us) and 6-10% slower on the 28672- and 8192x28672 ones (28672x8192
// 38.0 -> 40.3 us, docs/quant.md). 1-bit g32, whose stage also fits, was slower: 2.98 -> 2.85.
// 4 and 8 bits at groups >= 128 came in the thirtieth session: H100, one process, least of 3
// shuffled rounds, 16 Llama-family layers at N = 1, x cuBLAS fused -> GEMV (docs/quant.md):
// geomean 4-bit g128 2.421 -> 2.679, 8-bit 1.643 -> 1.781; 29 of the 32 cells
// faster (4096x4096 4-bit 10.4 -> 8.2 us, 14336x4096 16.6 -> 16.1), the other three 1-3.4% slower
// (4-bit 8192x28672 50.9 / 51.3 us and 18944x3584, 8-bit 13824x5120 30.1 / 31.1), with no count of
// waves or stages that separates them. SPINFER_LOWBIT_GEMV=1 / 0 forces it where it exists / off.
// The fused kernel's own overrides ask for the fused kernel: a split factor from the caller
// (tuning) or SPINFER_LOWBIT_SPLITS, a token tile (SPINFER_LOWBIT_BN), row pairs
// (SPINFER_LOWBIT_PAIRS).
bool use_gemv(int n, int bits, int ng, bool caller_splits, int device, bool bf16, int* resident) {
  if (n != 1 || !gemv_supported(bits, ng)) return false;
  const char* env = std::getenv("SPINFER_LOWBIT_GEMV");
  if (env && env[0] == '0') return false;
  if (!(env && env[0] == '1') &&
      (caller_splits || std::getenv("SPINFER_LOWBIT_BN") || std::getenv("SPINFER_LOWBIT_PAIRS")))
    return false;
  *resident = gemv_blocks_per_sm_for(device, bf16, bits, ng, 0);
  return true;
}

// Whether the GEMV splits its tail rows: where a row block's weights (16 rows x K) are at least
// 80 KB (128 KB at 8 bits), so that the tail blocks, streaming alone one an SM, take long against
// a split's own costs (its partials, a fence, an atomic and the last arrival's sum). Measured, H100,
// one process, least of 2 rounds, N = 1, us, off -> split slots / tail ways (3 on these 8192-row
// layers: 512 row blocks, 1.29 waves of 396 slots; docs/quant.md, thirty-fifth session), with a
// row block's bytes in KiB, layers 8192 x K:
//   4 bits: x28672 (224) 56.0 -> 49.2, x14336 (112) 30.8 -> 28.6, x12288 (96) 26.6 -> 25.2,
//           x10240 (80) 23.7 -> 23.1; x8192 (64) 19.3 -> 19.8;
//   2 bits g64: x28672 (112) 42.7 -> 38.3, x24576 (96) 37.1 -> 33.7, x20480 (80) 32.0 -> 29.8;
//           x14336 (56) 22.6 -> 23.6, x8192 (32) 16.1 -> 17.1;
//   8 bits: x28672 (448) 91.6 -> 85.2, x14336 (224) 46.6 -> 45.4, x8192 (128) 28.8 -> 28.6;
//           x6144 (96) 22.5 -> 23.3, x5120 (80) 20.3 -> 21.2;
//   1 bit: x28672 (56) 32.2 -> 35.2, x14336 (28) 18.5 -> 20.9;
// and the short rows lose everywhere: 14336x4096 (2 ways) at 4 bits (32 KB) 16.1 -> 17.8, 8 bits
// (64 KB) 25.0 -> 26.4. Why 8 bits needs longer rows was not found.
bool gemv_tail_pays(int64_t row_block_bytes, int bits) {
  return row_block_bytes >= (bits == 8 ? 128 : 80) * 1024;
}

template <bool kBF16>
cudaError_t launch_for(const LowbitArgs& a, const LowbitPlan& p, cudaStream_t s) {
  return by_bits(a.bits, [&](auto b) {
    return p.variant == kLowbitGemv ? launch_gemv<kBF16, b()>(a, p, s) : launch<kBF16, b()>(a, p, s);
  });
}

// Split-K factor, from same-process sweeps on H100 (docs/quant.md). A layer that already gives
// every SM a block runs unsplit (14336x4096 at 4 bits: 19 us unsplit, 22-26 us with 2-8
// splits). Narrower layers split to about 2 blocks per SM, keeping at least 4 stages per split
// and every block resident. 4 bits, N = 1 / 8 / 16, one process: 4096x14336 (64 row blocks)
// 21.2 / 23.0 / 27.6 us with 2 splits, 19.0 / 21.1 / 26.0 with 4, 20.4 / 22.3 / 29.2 with 6 (the
// old rule's ~2.5 blocks per SM; unsplit ~31 / 33 / 39 in an earlier lease); 8192x28672 (128)
// 54 / 61 / 80 us with 2 or 3 splits, 55 / 62 / 97 with 4.
// One split more where that spreads the blocks more evenly over the SMs: a block is bound by
// latency, so the SMs holding one block more than the others set the end (docs/quant.md,
// twenty-seventh session). H100, one process, least of 4 shuffled rounds, 4-bit N = 1 / 16:
// 6144x4096 (96 row blocks) 12.5 / 14.1 us with round(2 x 132 / 96) = 3 splits (288 blocks: 24
// SMs hold 3, 108 hold 2), 11.8 / 12.7 with 4 (384: 120 SMs hold 3); 8-bit 15.6 / 16.4 against
// 15.2 / 15.3. Where round(2 SMs / blocks) already spreads them evenly (64, 80, 112, 128 row
// blocks) it stays; fewer splits than that, where they spread more evenly, lost (3584x18944, 56
// row blocks: 4 instead of 5 splits, 2-bit N = 1 21.4 against 20.4 us).
constexpr int kMaxGridZ = 65535;  // splits: the grid's z dimension

int choose_splits(int base_blocks, int sms, int slots, int total_iters) {
  if (base_blocks >= sms) return 1;
  constexpr int kMinItersPerSplit = 4;
  const int cap = std::max(1, std::min(slots / base_blocks, total_iters / kMinItersPerSplit));
  const int want = std::min((4 * sms + base_blocks) / (2 * base_blocks), cap);  // round(2 * sms / base_blocks)
  if (want == cap) return want;
  // A count's blocks (splits of ceil(total / s) stages, none empty: lowbit_mm_plan) and how evenly
  // they spread: blocks / (sms x ceil(blocks / sms)), compared as fractions.
  auto blocks = [&](int s) {
    const int per = (total_iters + s - 1) / s;
    return static_cast<int64_t>(base_blocks) * ((total_iters + per - 1) / per);
  };
  const int64_t b0 = blocks(want), b1 = blocks(want + 1);
  const int64_t busiest0 = (b0 + sms - 1) / sms, busiest1 = (b1 + sms - 1) / sms;
  return b1 * busiest0 > b0 * busiest1 ? want + 1 : want;
}

// Whether a layer's row pairs (128-row tiles, all token tiles) make at least 3/4 of a wave: the
// planner then runs them unsplit (lowbit_mm_plan), and at N <= 8 use_row_pairs leaves 1 and 2 bits
// unpaired there.
bool pairs_near_a_wave(int row_pairs, int n_tiles, int sms) { return 4 * row_pairs * n_tiles >= 3 * sms; }

// Row pairs (lowbit_mm.cuh: a block of 128 rows whose two 64-row halves share each activation
// slice, so x is copied from L2 half as often) against one block per 64 rows. Pairs save x's
// copies, which weigh more as N grows, but halve the blocks: a layer with fewer pairs than SMs
// leaves SMs idle or, split to fill them, makes up with more and shorter splits. The rule:
//  * N <= 8 (BN = 8) at 4 and 8 bits: never. H100, one process, least of 6 shuffled rounds
//    (twenty-sixth session), 4-bit N = 8 on the two layers the old rule paired (pairs filling
//    the SMs): 28672x8192 49.9 against 48.5 us unpaired, 28672x4096 27.0 / 26.3.
//  * N <= 8 at 1 and 2 bits, bound by instruction issue (a paired warp group takes twice the work
//    per stage for the same copies and loop): where the paired grid is split anyway (under 3/4
//    of a wave of pairs), into splits of >= 16 stages (twenty-second session: 8192x28672, 4
//    splits of 28, 1-bit N = 1 / 8 41.9 / 42.9 -> 39.1 / 39.9 us; forced pairs near or over a
//    wave lost 8-11%).
//  * N > 8 (BN = 16, 32): where the pairs fill every SM (28672-row layers: 224 pairs), or
//    where the split the pairs would need keeps >= 16 stages, except with the bulk loader,
//    whose tensor-copied activations leave pairs little to save. H100, same runs as the first
//    point, paired against unpaired, us: 4-bit N = 16 28672x8192 52.2 / 57.2, 8192x28672 (4
//    splits of 28) 52.2 / 52.8, 14336x4096 (112 pairs: 2 splits of 8) 19.6 / 18.8, 4096x14336
//    (8 of 7) 19.5 / 18.9, 4096x4096 11.5 / 10.9; 8-bit N = 16 28672x8192 91.2 / 93.7, 14336x4096
//    (2 of 16) 26.6 / 26.9, 8192x8192 (4 of 16) 30.1 / 30.6, 4096x14336 (8 of 14) 28.1 / 27.3;
//    8-bit N = 32 8192x28672 (4 of 56) 97.0 / 99.8, 4096x4096 (8 of 4) 16.3 / 14.7; 4-bit N = 32
//    (bulk) 28672x8192 76.0 / 78.3, 28672x4096 42.4 / 45.7, 8192x28672 72.8 / 70.4, 14336x4096
//    25.7 / 24.5, 4096x14336 27.7 / 24.5, 8192x8192 29.1 / 27.0.
// `splits` > 0: the caller's split factor; 0: the planner's. `bulk`: the device's default loader
// for the tile (the plan is the same under SPINFER_LOADER=cp_async). The occupancy of the paired
// variant is asked (of a cache, under a lock) only where the stage rule needs it.
bool use_row_pairs(int m, int n, int bits, int bn, int ng, int n_tiles, int total_iters, int splits, int sms,
                   int device, bool bf16, bool bulk) {
  if (const char* env = std::getenv("SPINFER_LOWBIT_PAIRS")) return env[0] == '1';  // A/B runs, tests
  const int tile_rows = lowbit_tile_rows(kLowbitRowPairs);
  const int row_pairs = (m + tile_rows - 1) / tile_rows;
  if (bn == 8 && bits >= 4) return false;
  if (bn == 8 && (splits == 1 || (splits == 0 && pairs_near_a_wave(row_pairs, n_tiles, sms)))) return false;  // unsplit
  if (bn >= 16 && row_pairs * n_tiles >= sms) return true;
  if (bulk) return false;
  const int s = splits > 0 ? splits
                           : choose_splits(row_pairs * n_tiles, sms,
                                           sms * blocks_per_sm_for(device, bf16, bits, bn, ng, kLowbitRowPairs),
                                           total_iters);
  return (total_iters + s - 1) / s >= 16;
}

}  // namespace

cudaError_t encode_x_map(CUtensorMap* map, const void* x, int n, int kp, int bn, bool bf16) {
  // kp columns, n tokens. A box is one chunk's columns and the 16 that pad its rows in shared
  // memory (Layout::kXStride).
  return encode_matrix_map(map, x, bf16, kp, n, static_cast<uint64_t>(kp) * 2, kChunk + 16,
                           static_cast<uint32_t>(std::min(bn, n)));
}

}  // namespace lowbit

LowbitPlan lowbit_mm_plan(int m, int n, int kp, int bits, int group_size, int device, bool bf16,
                          int splits_wanted) {
  using namespace lowbit;
  LowbitPlan p{};
  p.bn = n <= 8 ? 8 : n <= 16 ? 16 : 32;
  if (const char* env = std::getenv("SPINFER_LOWBIT_BN")) {  // 8, 16 or 32: for A/B runs and tests
    const int forced = std::atoi(env);
    if (forced == 8 || forced == 16 || forced == 32) p.bn = forced;
  }
  p.n_tiles = (n + p.bn - 1) / p.bn;
  p.chunks = kp / kChunk;
  // Groups of 32 and 64 split a 128-column chunk; every other size (128, 256, per-channel K)
  // gives one group per chunk.
  p.ng = group_size == 32 ? 4 : group_size == 64 ? 2 : 1;
  int sms = 1, major = 8;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  p.pdl = use_pdl(major);
  const bool bulk_tile = bulk_default(major, bits, p.bn);  // the device's loader for the tile (plans follow it)
  p.bulk_weights = bulk_tile && use_bulk_loader(major);
  const int u = bits == 8 ? 1 : 2;  // chunks_per_stage<bits>()
  const int total_iters = (p.chunks + u - 1) / u;
  int splits = 0;  // split-K factor, or -1: the balanced schedule
  if (const char* env = std::getenv("SPINFER_LOWBIT_SPLITS")) splits = std::max(-1, std::atoi(env));
  if (splits_wanted != 0) splits = std::max(-1, splits_wanted);
  const bool rule = splits == 0;  // the planner's own choice, not the caller's or SPINFER_LOWBIT_SPLITS
  if (int resident = 0; use_gemv(n, bits, p.ng, !rule, device, bf16, &resident)) {
    p.variant = kLowbitGemv;
    p.bn = 8, p.bulk_weights = false;  // (reported only)
    p.row_blocks = p.grid_blocks = (m + kGemvRows - 1) / kGemvRows;
    p.splits = 1, p.iters_per_split = total_iters;
    // Split tail rows where a row block is long (gemv_tail_pays): the rows past the last whole
    // wave of resident slots run split (schedule.cuh, tail_split), each split at least a stage a
    // warp, so they fill the slots the wave leaves instead of streaming one block an SM.
    // SPINFER_LOWBIT_TAIL as for the fused kernel: 0 off, S > 0 forces S splits at any length.
    const char* env = std::getenv("SPINFER_LOWBIT_TAIL");
    const int wanted = env ? std::atoi(env) : 0;
    const bool tail = env ? wanted > 0 : gemv_tail_pays(int64_t{kGemvRows} * total_iters * u * kChunk * bits / 8, bits);
    auto tail_for = [&](int slots) {
      return tail ? tail_split(p.row_blocks, slots, INT32_MAX, total_iters, wanted, kGemvWarps) : TailSplit{0, 0, 0};
    };
    TailSplit t = tail_for(sms * resident);
    // The shared-memory ring where it pays (gemv_ring_slots) and its own resident blocks leave no
    // tail rows to split; forced (SPINFER_LOWBIT_RING=2), it runs without the split.
    bool forced = false;
    p.gemv_warps = kGemvWarps;
    if (const int ring = gemv_ring_slots(bits, &forced); ring > 0) {
      auto resident_for = [&](int w) { return gemv_blocks_per_sm_for(device, bf16, bits, p.ng, ring, w); };
      const int warps = gemv_warps(kp, bits, ring, p.row_blocks, int64_t{sms} * resident_for(kGemvShortWarps));
      const int ring_resident = resident_for(warps);
      if (forced || tail_for(sms * ring_resident).splits <= 1) {
        p.gemv_ring = ring, p.gemv_warps = warps, resident = ring_resident, t = TailSplit{0, 0, 0};
      }
    }
    p.blocks_per_sm = resident;
    if (t.splits > 1) {
      p.tail_first = t.first, p.tail_splits = t.splits, p.tail_iters = t.iters;
      p.grid_blocks = t.first + (p.row_blocks - t.first) * t.splits;
      p.splits = t.splits;
      p.counters = p.row_blocks;
      p.workspace_floats = static_cast<int64_t>(p.splits) * p.row_blocks * kGemvRows;
    }
    return p;
  }
  const bool pairs =
      splits >= 0 &&
      use_row_pairs(m, n, bits, p.bn, p.ng, p.n_tiles, total_iters, splits, sms, device, bf16, bulk_tile);
  const int tiled = pairs ? kLowbitRowPairs : kLowbitPerTile;  // the variant unless balanced below
  p.row_blocks = (m + lowbit_tile_rows(tiled) - 1) / lowbit_tile_rows(tiled);
  const int64_t units = static_cast<int64_t>(p.row_blocks) * total_iters;
  const int resident = blocks_per_sm_for(device, bf16, bits, p.bn, p.ng, tiled);
  if (splits == 0) {
    // The balanced schedule at 9 <= N <= 32 (token tile 16 or 32, one tile) where a layer has
    // more row blocks than the schedule has blocks. There one block per row block takes more
    // than a wave at 4 and 2 bits (3 resident blocks per SM at BN = 16, 2 at BN = 32) or leaves
    // SMs unevenly loaded. H100, one process, 28672x8192 N = 16 / 32, one block per row block
    // -> balanced, us: 4-bit g128 90.4 / 112.0 -> 78.5 / 110.9 (A-B-A-B), 8-bit 123.3 / 162.7 ->
    // 110.6 / 141.1, 2-bit g64 85.0 / 106.8 -> 67.6 / 98.8. At N <= 8 it gains less in isolation
    // (4-bit N = 1 / 8 57.1 / 64.5 -> 56.1 / 60.6) and the end-to-end decode (CUDA graphs, PDL;
    // its gate_up 28672x4096 took 33.6 / 36.5 -> 33.6 / 35.9 alone) ran 1.3% slower at batch 1
    // and 0.5% at batch 8 with it. With fewer row blocks than the schedule has blocks, ranges are
    // shorter than a row and most tiles are split: 14336x4096 N = 1 / 8 / 16 / 32 20.1 / 22.4 /
    // 25.4 / 36.7 -> 21.5 / 23.4 / 28.3 / 41.1. SPINFER_LOWBIT_BALANCED=0 leaves the rule out.
    const char* env = std::getenv("SPINFER_LOWBIT_BALANCED");
    const bool allowed = !(env && env[0] == '0');
    if (allowed && !pairs && p.bn >= 16 && p.n_tiles == 1 && p.row_blocks > sms * kBalancedPerSM) splits = -1;
    // Row pairs that make at least 3/4 of a wave run unsplit, leaving SMs idle rather than
    // summing partials: H100, same process, 128-row tiles split 2 ways (choose_splits) -> unsplit,
    // us, N = 16 / 32: 4-bit 14336x4096 (112 pairs) 24.1 / 33.8 -> 22.6 / 29.6, 16384x4096 (128)
    // 25.9 / 34.7 -> 22.9 / 30.1, 12800x4096 (100) 23.4 / 33.2 -> 22.4 / 29.2; 8-bit +3-15%,
    // 2-bit at N = 32 +2-3%. use_row_pairs still judges 1 and 2 bits by the split rule's
    // stages: at N = 16 they run unpaired on those layers (2-bit 14336x4096 21.2 us; paired
    // and unsplit 23.3).
    else if (pairs && pairs_near_a_wave(p.row_blocks, p.n_tiles, sms)) splits = 1;
    else splits = choose_splits(p.row_blocks * p.n_tiles, sms, sms * resident, total_iters);
  }
  p.variant = splits < 0 ? kLowbitBalanced : tiled;
  p.blocks_per_sm = splits < 0 ? blocks_per_sm_for(device, bf16, bits, p.bn, p.ng, kLowbitBalanced) : resident;
  if (p.variant == kLowbitBalanced) {
    const int per_sm = std::min(p.blocks_per_sm, kBalancedPerSM);
    const BalancedGrid g = balanced_grid(sms, per_sm, p.n_tiles, p.row_blocks, units);
    p.grid_blocks = g.blocks;
    p.splits = g.shares;
  } else {
    p.iters_per_split = (total_iters + std::min(splits, kMaxGridZ) - 1) / std::min(splits, kMaxGridZ);
    p.splits = (total_iters + p.iters_per_split - 1) / p.iters_per_split;  // no empty splits
    p.grid_blocks = p.row_blocks * p.splits;
  }
  if (rule && p.variant != kLowbitBalanced && p.splits == 1 && p.n_tiles == 1) {
    // Split tail rows (schedule.cuh). SPINFER_LOWBIT_TAIL: 0 turns the split off, S > 0 forces S
    // splits (A/B runs, tests).
    const char* env = std::getenv("SPINFER_LOWBIT_TAIL");
    const int wanted = env ? std::atoi(env) : 0;
    const TailSplit t =
        env && wanted <= 0 ? TailSplit{0, 0, 0} : tail_split(p.row_blocks, sms, resident, total_iters, wanted);
    if (t.splits > 1) {
      p.tail_first = t.first, p.tail_splits = t.splits, p.tail_iters = t.iters;
      p.grid_blocks = t.first + (p.row_blocks - t.first) * t.splits;
      p.splits = t.splits;  // the most that share a tile: sizes the workspace
    }
  }
  if (p.splits > 1) {
    p.counters = p.n_tiles * p.row_blocks;
    p.workspace_floats = static_cast<int64_t>(p.splits) * p.counters * p.bn * lowbit_tile_rows(p.variant);
  }
  return p;
}

cudaError_t lowbit_mm_run(const LowbitArgs& a, const LowbitPlan& p, cudaStream_t stream) {
  return a.bf16 ? lowbit::launch_for<true>(a, p, stream) : lowbit::launch_for<false>(a, p, stream);
}

}  // namespace spinfer
