// Planning and dispatch of the SMBD SpMM kernel: tile width by N, split-K by SM count.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "spmm_smbd.cuh"
#include "tensor_map.h"

namespace spinfer {
namespace smbd {
SPINFER_SMBD_FOR_TILES(SPINFER_SMBD_EXTERN_ONE, false)
SPINFER_SMBD_FOR_TILES(SPINFER_SMBD_EXTERN_ONE, true)

cudaError_t encode_x_map(CUtensorMap* map, const void* x, int n, int kp, int bn, bool bf16) {
  return encode_matrix_map(map, x, bf16, kp, n, static_cast<uint64_t>(kp) * 2, kGt,
                           static_cast<uint32_t>(std::min(bn, n)), CU_TENSOR_MAP_SWIZZLE_128B);
}

namespace {

// Calls F<BN>::run(args...) for the runtime tile width.
template <template <int> class F, typename... A>
auto by_tile(int bn, A... a) {
  switch (bn) {
    case 8: return F<8>::run(a...);
    case 16: return F<16>::run(a...);
    case 32: return F<32>::run(a...);
    case 64: return F<64>::run(a...);
    default: return F<128>::run(a...);
  }
}
template <int BN>
struct SmemF {
  static int run(int kps, int cap, int stages, int n, bool wgmma, int rows) {
    return smem_bytes<BN>(kps, cap, stages, n, wgmma, rows);
  }
};
template <int BN>
struct LaunchF {
  static cudaError_t run(const SpmmArgs* a, const SpmmPlan* p, cudaStream_t s) {
    return a->bf16 ? launch<true, BN>(*a, *p, s) : launch<false, BN>(*a, *p, s);
  }
};
template <int BN>
struct ResidentF {
  static int run(const SpmmPlan* p, bool bf16) {
    return bf16 ? resident_blocks<true, BN>(*p) : resident_blocks<false, BN>(*p);
  }
};

// Resident blocks per SM of a plan's kernel, from the occupancy calculator, kept per (device,
// dtype, variant (loader, decode, row count), shared memory).
int resident_blocks_cached(const SpmmPlan& p, bool bf16, int device) {
  const int variant = p.bulk * 2 + p.lean + 4 * p.count_rows + 8 * p.row_table + 16 * p.wgmma + 128 * p.rows;
  const std::array<int, 6> key{device, bf16, p.bn, variant, p.min_blocks, p.smem_bytes};
  return asked_once(key, [&] { return by_tile<ResidentF>(p.bn, &p, bf16); });
}

// GroupTiles per split for a split-K factor: whole pairs (the pipeline moves GroupTiles in
// pairs), so only the last stage of the last split can be odd.
int per_split(int grid_k, int splits) {
  int k_per_split = (grid_k + splits - 1) / splits;
  if (k_per_split < grid_k) k_per_split = (k_per_split + 1) / 2 * 2;
  return k_per_split;
}

// Split-K factor (docs/kernels.md, fourteenth and fifteenth sessions). A launch ends with its
// last blocks, so the rule counts the rounds of resident blocks a grid needs, ceil(blocks /
// (margin x the device's resident blocks)), and takes the split count with the least
// (GroupTiles per split + 4) x rounds, the 4 being a round's fixed cost in GroupTiles (its first
// stages). A grid of 1.13 rounds ran 25% slower than one of 1 (28672x8192 at N = 1, 3 splits
// against 2). The margin is 1: fitted with the 40-register kernel it was 0.9, which with the
// 56-register one (fewer resident blocks) sent grids of 0.9-1 rounds to fewer splits, e.g.
// 14336x4096 to 3 splits where 4 run 10% faster at N = 16; same process, 1 against 0.9, geomean
// over the issue's shapes at N = 1-32: 1.252 / 1.247x at 50%, 1.350 / 1.335x at 70%, 1.045 /
// 1.021x at 30% (SPINFER_SPLIT_MARGIN, per mille, overrides: A/B runs). Splits keep at least
// min(28, grid_k / 8) GroupTiles: 4096x14336 ran 15-35% slower with 25 splits of 9 than with 8
// of 28. `resident(k_per_split)` gives the blocks per SM of the kernel at that split's shared
// memory.
//
// cap (tenths of a block per SM; 0: none; streaming launches, stream_cap): the most splits whose
// grid keeps at most that many blocks per SM (and fits the resident slots), where one split
// does; the cost rule otherwise.
//
// fluid (decode-bound launches, decode_bound): the cost counts rounds as the fraction
// blocks / slots and adds one block's length for the last one,
// (kps + kFluidFixed) x blocks / slots + kps; `fixed` and `margin` are the rounds' and do not apply.
// kFluidFixed (a block's fixed cost in GroupTiles) and the last block's weight of 1 were fitted
// offline on the sweep below (13 of its 15 cases at 70% and BN <= 16 got their best measured count).
// Where the decode's issue sets the pace, a grid of one full round (every SM 6 or 7 long blocks)
// ran slower than grids of 1.4-2.4 rounds of shorter blocks, whose blocks fill the SMs that finish
// first: H100, same process, least of 2 rounds, 70% sparsity, split counts 1-10 forced
// (docs/kernels.md, eighty-fourth session): 28672x8192 at N = 1 2 splits (the rounds rule's, 896
// blocks) 88.3 us against 5 (2240) 83.4, 8192x28672 7 splits (896) 88.0 against 10 (1280) 85.1
// (this cost gives it 16, 85.3-85.5; 12 measured 83.7). Against v23's rule, four issue shapes x
// N = 1-32 at 70%: 1.531 -> 1.550x cuBLAS. At 30-50% sparsity the same grids ran slower
// (8192x28672 at 50%: 4 splits 97.2, 10 118.0), so those keep the rounds.
constexpr double kFluidFixed = 10.0;
template <typename Resident>
int choose_splits(const SpmmPlan& p, Resident resident, int sms, double margin, double fixed, int cap,
                  bool fluid = false) {
  const int min_per_split = std::max(1, std::min(28, p.grid_k / 8));
  const int max_splits = std::max(1, p.grid_k / min_per_split);
  const int64_t base = static_cast<int64_t>((p.grid_m + p.rows - 1) / p.rows) * p.n_tiles;  // blocks a split
  const auto within_cap = [&](int kps, int splits) {
    return base * splits * 10 <= static_cast<int64_t>(std::min(cap, 10 * resident(kps))) * sms;
  };
  if (cap > 0 && within_cap(per_split(p.grid_k, 1), 1)) {
    int fits = 1;
    for (int s = 2, last = 1; s <= max_splits; ++s) {
      const int kps = per_split(p.grid_k, s), splits = (p.grid_k + kps - 1) / kps;
      if (splits == last) continue;
      last = splits;
      if (!within_cap(kps, splits)) break;  // larger s: larger grids
      fits = splits;
    }
    return fits;
  }
  int best = 1;
  double best_cost = 0;
  for (int s = 1, last = 0; s <= max_splits; ++s) {
    const int kps = per_split(p.grid_k, s), splits = (p.grid_k + kps - 1) / kps;
    if (splits == last) continue;  // the same grid as a smaller s
    last = splits;
    const int slots = resident(kps) * sms;
    if (slots <= 0) continue;  // the query failed: keep what the other counts give (none: 1)
    const double blocks = static_cast<double>(base * splits);
    const double cost = fluid ? (kps + kFluidFixed) * blocks / slots + kps
                              : (kps + fixed) * std::ceil(blocks / (margin * slots));
    if (best_cost == 0 || cost < best_cost) best = splits, best_cost = cost;
  }
  return best;
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

// The rule's cap on blocks per SM, in tenths (choose_splits): 40 for the sm_90 loader's 8-token
// tile where the longest GroupTile run holds at least 45% of its values (about 40% sparsity and
// less), else none. There a launch streams weights at near the copy bandwidth, and a grid of 3-4
// blocks per SM with more GroupTiles each ran faster than one filling the round of 7 resident
// blocks (fewer blocks to start, fewer split-K partials to sum); at 70% sparsity, where the
// decode's issue rate bounds the kernel, the full round won. H100, same process, least of 3
// rounds, split counts 1-12 at N = 1 and 8: at 50% 6144x4096 4 splits (384 blocks) 18.4 us and 5
// (480, the cap's) 18.5 against the cost rule's 8, 20.4; 28672x4096 unsplit (448) 55.8 against 2,
// 59.7; 14336x4096 2 splits (448) 33.2 against 4, 34.6; 4096x14336 8 splits (512) 31.7 but 7
// (448) 33.4, so a cap of 3.5 blocks lost there; at 70% 28672x4096 unsplit 54.9 against 2, 49.3
// (docs/kernels.md, forty-fourth session). Measured on the H100 only: the other loader keeps the
// cost rule. SPINFER_SPLIT_CAP (tenths; 0: the cost rule) overrides (A/B runs, tests).
//
// At BN = 16 the same cap where the longest run holds at least 60% of a GroupTile (about 40%
// sparsity and less): at 30% the 16-token tile streams the weight as the 8-token one does, and one
// split (448 blocks) beat the cost rule's 4 (1792): H100, same process, least of 2 rounds, 28672x8192
// 124.6 against 130.0 us, 28672x4096 66.0 against 71.6, 8192x28672 4 splits 126.8 against 5, 128.8
// (docs/kernels.md, eighty-fourth session); at 50% one split lost (28672x8192 108.5 against 103.9).
// SPINFER_SPLIT_RULE=23 keeps the caps and the rounds of kernel v23 (A/B runs).
int stream_cap(const SpmmPlan& p, bool v23) {
  if (!p.bulk) return 0;
  if (p.bn == 8 && p.value_cap * 20 >= kMaxValues * 9) return 40;
  return !v23 && p.bn == 16 && p.value_cap * 5 >= kMaxValues * 3 ? 40 : 0;
}

// Launches whose decode's issue sets the pace (choose_splits' fluid rounds): the 8- and 16-token
// tiles of the sm_90 loader where the longest run is at most 40% of a GroupTile (about 60% sparsity
// and more; measured on the H100 only, so the other loader keeps the rounds). At BN =
// 32 the rounds chose as well or better (70%, five layers, the same sweep).
bool decode_bound(const SpmmPlan& p, bool v23) {
  return !v23 && p.bulk && p.bn <= 16 && p.value_cap * 5 <= kMaxValues * 2;
}

// The rule's split count, kept per (device, dtype, variant, stages, value buffer, grid): the rule
// asks the occupancy of up to 16 candidates, so an eager call looks up one entry instead.
int splits_cached(const SpmmPlan& p, bool bf16, int device, int n, int sms) {
  static std::mutex mutex;
  const int margin = std::max(1, env_int("SPINFER_SPLIT_MARGIN", 1000));  // per mille (A/B runs)
  const int fixed = std::max(0, env_int("SPINFER_SPLIT_FIXED", 40));     // tenths of a GroupTile (A/B runs)
  const bool v23 = env_int("SPINFER_SPLIT_RULE", 0) == 23;  // the rule of kernel v23 (A/B runs)
  const int cap = std::max(0, env_int("SPINFER_SPLIT_CAP", stream_cap(p, v23)));  // tenths of a block per SM
  const bool fluid = decode_bound(p, v23);
  static std::map<std::array<int, 15>, int> cache;
  const int variant = p.bulk * 2 + p.lean + 4 * p.count_rows + 8 * p.row_table + 16 * p.wgmma + 128 * p.rows;
  const std::array<int, 15> key{device, bf16, p.bn, variant, p.min_blocks, p.stages, p.value_cap,
                                p.grid_m, p.n_tiles, p.grid_k, std::min(n, p.bn), margin, fixed, cap, fluid};
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
  }
  const auto resident = [&](int k_per_split) {
    SpmmPlan q = p;
    q.smem_bytes = by_tile<SmemF>(p.bn, k_per_split, p.value_cap, p.stages, n, p.wgmma > 0, p.rows);
    return resident_blocks_cached(q, bf16, device);
  };
  const int splits = choose_splits(p, resident, sms, margin / 1000.0, fixed / 10.0, cap, fluid);
  const std::lock_guard<std::mutex> lock(mutex);
  return cache[key] = splits;
}

}  // namespace
}  // namespace smbd

SpmmPlan spmm_smbd_plan(int m, int n, int kp, int max_run, bool bf16, int device, int splits_wanted,
                        bool row_table) {
  using namespace smbd;
  SpmmPlan p{};
  // Past 64 tokens a 128-token tile, one decode of each GroupTile for 128 tokens (wgmma m64n128k16),
  // where the wgmma form with groups of 4 runs (checked below; elsewhere 64-token tiles). H100, same
  // process, least of 2 rounds, 4 issue shapes x N = 65 / 128 / 256 / 512 (eightieth session,
  // docs/kernels.md): every one of 32 cases faster than 64-token tiles, geomean x cuBLAS 0.497 ->
  // 0.622 at 50% and 70% sparsity (28672x8192 N = 128 at 50%: 274 -> 234 us; N = 65 262 -> 210).
  // SPINFER_BN forces a tile (A/B runs and tests).
  p.bn = n <= 8 ? 8 : n <= 16 ? 16 : n <= 32 ? 32 : n <= 64 ? 64 : 128;
  if (const int forced = env_int("SPINFER_BN", 0);
      forced == 8 || forced == 16 || forced == 32 || forced == 64 || forced == 128)
    p.bn = forced;
  p.n_tiles = (n + p.bn - 1) / p.bn;
  p.grid_m = (m + kGt - 1) / kGt;
  p.grid_k = kp / kGt;
  int sms = 1, major = 8;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  p.bulk = use_bulk_loader(major);
  p.pdl = use_pdl(major);
  // Decode variant: the lean decode (prefix published as a shared address, clamped once per
  // GroupTile) against the per-word clamped one, same-process A/B on H100. It was 4-11% faster
  // at BN <= 16 and 3-10% slower at BN = 32 when it came (v6); since v9 (fewer registers, no
  // spills) it is also faster at BN = 32 and 64 (docs/kernels.md, fifteenth session).
  // SPINFER_DECODE=lean|safe overrides.
  p.lean = true;
  if (const char* decode = std::getenv("SPINFER_DECODE")) p.lean = std::strcmp(decode, "safe") != 0;
  p.stages = std::min(kMaxStages, std::max(2, env_int("SPINFER_STAGES", 2)));
  const int cap = env_int("SPINFER_VALUE_CAP", max_run);
  p.value_cap = std::max(8, std::min(kMaxValues, (cap + 7) / 8 * 8));
  // Register budget (spmm_smbd.cuh, kMinBlocks): 56 registers, the fewest instructions, even
  // where 40 or 48 would keep more blocks resident. H100, same process, 5 shapes x N = 1 / 8 / 16
  // (the split rule, then with its 0.9 margin, counting each budget's resident blocks), geomean
  // x cuBLAS with 40 / 48 / 56 registers: 50% 1.210 / 1.246 / 1.261, 70% 1.288 / 1.348 / 1.361
  // (28672x8192 N = 1: 103.6 / 95.8 / 89.5 us), 30% 1.004 / 1.013 / 1.018; 56 is 1.6% from the
  // best budget per case on average at 70%, 0.5% at 50%, its worst case 14336x4096 at 70% (8%
  // behind 48, 3-6% behind 40).
  // Choosing by resident blocks (the most registers that keep as many blocks) or by the split
  // rule's rounds weighted by instructions did worse (docs/kernels.md, fifteenth session).
  // SPINFER_MIN_BLOCKS=7|8|9 forces one (A/B runs, tests).
  const int forced_budget = env_int("SPINFER_MIN_BLOCKS", 0);
  const bool budgets = p.bulk && p.lean && p.bn <= 16;
  const bool forced = budgets && (forced_budget == 7 || forced_budget == 8 || forced_budget == 9);
  p.min_blocks = !budgets ? 0 : forced ? forced_budget : 7;
  // The warp-group MMA variant (spmm_smbd.cuh, decode_gt_wg) at BN = 32, 64 and 128 on sm_90 with
  // the lean decode, where the driver makes tensor maps: groups of 4 TCTiles (a GroupTile), or
  // (SPINFER_WGMMA=0|1|2|3|4|5, A/B runs and tests) 1 or 2, 1 with one group in flight (3), plain
  // groups of 4 (4), overlapped groups of 4 (5), or mma.sync (0). H100, same process,
  // least of 2 rounds, 4 issue shapes x N = 24 / 32 / 64 (seventy-sixth session, docs/kernels.md),
  // geomean x cuBLAS at 50% / 70% sparsity: mma.sync 0.963 / 0.996, groups of 1 1.068 / 1.153, the
  // ring 1.046 / 1.134, groups of 4 1.121 / 1.192.
  // At BN = 8 and 16 groups of 4 at the default register budget, with the row count or the row
  // table as the planner chose them. H100, same process, least of 2 rounds, 4 issue shapes x
  // N = 1 / 8 / 16 (seventy-seventh session, docs/kernels.md), geomean x cuBLAS against mma.sync:
  // 50% sparsity 1.418 -> 1.452, 70% 1.527 -> 1.597 (N = 16 up to +10%, N = 1 0-3%; one case of
  // twenty-four slower, 14336x4096 N = 16 at 50%, 33.7 -> 34.8 us). SPINFER_WGMMA_SMALL=0, or
  // SPINFER_WGMMA=0 (mma.sync everywhere), keeps mma.sync there.
  // At BN = 128 the groups of 4 overlap a stage's two GroupTiles (kWgPair): the second is decoded
  // while the first's wgmma group runs, one wait a stage where plain groups of 4 wait before each
  // decode (18% of the stall samples at N = 128). H100, same process, least of 2 rounds, 4 issue
  // shapes x N = 128 / 256 (eighty-first session, docs/kernels.md): 11-15% faster in every case at
  // 50% and 70% (28672x8192 N = 128 at 50%: 233.2 -> 209.8 us). At BN = 64 they are taken where a
  // block holds one GroupTile row, and at BN = 32 where their grid is split (below). SPINFER_WGMMA=4
  // forces plain groups, 5 the overlap.
  const bool wgmma_ok = p.bulk && p.lean && major == 9 && tensor_map_encoder() != nullptr;
  const int forced_group = env_int("SPINFER_WGMMA", -1);  // < 0: the planner's
  if (p.bn >= 32) {
    const int group = forced_group >= 0 ? forced_group : p.bn == 128 ? kWgPair : 4;
    // 3: kWgRing; 5: kWgPair (groups of 4 overlapping a stage's two GroupTiles)
    p.wgmma = !wgmma_ok || group <= 0 ? 0 : group == kWgPair ? kWgPair : group >= 4 ? 4 : group;
  } else {
    const bool small = forced_group != 0 && env_int("SPINFER_WGMMA_SMALL", 1) > 0;
    p.wgmma = wgmma_ok && p.min_blocks == 7 && small ? 4 : 0;
  }
  // BN = 128 exists as wgmma groups of 4 only, plain or overlapped (the group rule is BN = 64's)
  if (p.bn == 128 && p.wgmma != 4 && p.wgmma != kWgPair) {
    p.bn = 64;
    p.n_tiles = (n + p.bn - 1) / p.bn;
  }
  // Two GroupTile rows a block (wgmma groups of 4 at BN >= 32; spmm_smbd.cuh, kRows): the rows' two
  // warp groups share one x slice a stage and one producer warp, so a row costs less shared memory
  // (but its block more registers). Taken at BN = 64 where that keeps more GroupTile rows resident
  // on an SM than blocks of one row do (the occupancy calculator, at a split of 32 GroupTiles, about
  // what the split rule gives at these N): at 30% and 50% sparsity, 2 blocks of two rows against 3
  // of one. H100, same process, least of 2 rounds, 4 issue shapes x N = 24 / 32 / 48 / 64
  // (seventy-eighth session, docs/kernels.md): N = 48 / 64 3-8% faster at 30 and 50% (28672x8192
  // at 50%, N = 64: 152.5 -> 142.8 us), N = 24 / 32 (BN = 32, where the rows resident went 5 -> 6 at
  // 50%) from 1.5% slower to 1.8% faster, at 70% (rows resident level) up to 5% slower; so BN = 32
  // keeps blocks of one row. SPINFER_SMBD_ROWS=1|2 forces one (A/B runs and tests).
  p.rows = 1;
  if ((p.wgmma == 4 || p.wgmma == kWgPair) && p.bn >= 32) {
    const int forced_rows = env_int("SPINFER_SMBD_ROWS", 0);
    if (forced_rows == 1 || forced_rows == 2) {
      p.rows = forced_rows;
    } else if (p.bn >= 64) {
      const auto resident_rows = [&](int rows) {
        SpmmPlan q = p;
        q.rows = rows;
        q.smem_bytes = by_tile<SmemF>(p.bn, std::min(p.grid_k, 32), p.value_cap, p.stages, n, true, rows);
        return rows * resident_blocks_cached(q, bf16, device);
      };
      if (resident_rows(2) > resident_rows(1)) p.rows = 2;
    }
  }
  // At BN = 64 the overlapped groups (kWgPair) where a block holds one GroupTile row (the rule above
  // gives 70% sparsity one): H100, same process, least of 2 rounds, 4 issue shapes x N = 40 / 64,
  // geomean x cuBLAS 1.124 -> 1.144 at 70% (eighty-first session, docs/kernels.md), and with the rule
  // against SPINFER_WGMMA=4 on the next lease 1.127 -> 1.143, each of the 8 cases 0.9-2.4% faster
  // (eighty-second); with one row forced at 30% / 50%, 1.009 / 1.043 -> 1.018 / 1.053. With two rows
  // they were slower (1.036 / 1.076 -> 1.030 / 1.061), so blocks of two rows keep plain groups.
  if (forced_group < 0 && p.wgmma == 4 && p.bn == 64 && p.rows == 1) p.wgmma = kWgPair;
  // Who counts the rows above each decoding warp's row (spmm_smbd.cuh, rows_above). Set before the
  // split choice, which asks CUDA for the occupancy of the kernel that will run (the count's table
  // adds static shared memory). The kernels that have the producer's count and the row table: the
  // lean sm_90 kernel at BN <= 16, and its wgmma groups of 4 (plain or overlapped) with one GroupTile
  // row a block at BN = 32.
  // - The producer warp, once a stage (kCount), at BN = 16 and 32, and at BN = 8 where the longest run
  //   is at least 60% of a GroupTile (about 40% sparsity or less). H100, v14 (every warp counts)
  //   against the producer counting at every BN <= 16, separate processes, least of 3 rounds, four
  //   issue shapes, three rounds (docs/kernels.md, fiftieth session): N = 16 1-9% faster at 30, 50 and
  //   70% sparsity; N = 1 and 8 1-6% faster at 30%, but 0.4% slower at 50% and 0.7% at 70%, where the
  //   count's wait for the stage moves onto the block barrier; those keep v14's code. At BN = 32 each
  //   decoding warp counted its own (a chain of loads, PopCounts and a reduction before each stage's
  //   scan, up to 20 of ~430 instructions a stage for the warp of the last TCTile row). H100, same
  //   process, least of 2 rounds, 7 layers x N = 24 / 32 (eighty-sixth session), geomean x cuBLAS,
  //   the warps' count -> the producer's -> the row table: 30% 1.037 -> 1.074 -> 1.030, 50% 1.164 ->
  //   1.194 -> 1.190, 70% 1.217 -> 1.238 -> 1.240 (28672x8192 N = 32 at 30%: 135.7 -> 128.5 us).
  //   SPINFER_COUNT_ROWS=0|1 overrides.
  // - Where the producer does not count, the decoding warps read them from the weight's row table
  //   (TCABME.row_offset, copied with each stage) instead of counting three rows of both GroupTiles
  //   every stage: the BN = 8 stage 408 -> 391 instructions. H100, same process, least of 3 rounds,
  //   seven layers x N = 1 / 8 (fifty-fourth session, docs/kernels.md): 70% sparsity 1.466 -> 1.491x,
  //   50% 1.350 -> 1.373x; end to end at batch 1 +2.3%. Where the producer counts (and so waits for
  //   the stage before the barrier) a probe measured the count faster than the table, so those keep
  //   it; at BN = 32 it lost to the count at 30% and tied it at 70% (above). The BN = 8 / 16 kernels
  //   have it at the default register budget only. SPINFER_ROW_TABLE=0 turns it off, and the decoding
  //   warps count.
  const bool wg32 = p.bn == 32 && p.rows == 1 && (p.wgmma == 4 || p.wgmma == kWgPair);
  const bool counts = budgets || wg32;  // the kernel has the producer's count and the row table
  p.count_rows = counts && (p.bn >= 16 || p.value_cap * 5 >= kMaxValues * 3);
  if (const char* env = std::getenv("SPINFER_COUNT_ROWS")) p.count_rows = counts && env[0] == '1';
  p.row_table = row_table && (wg32 || (budgets && p.min_blocks == 7)) && !p.count_rows &&
                env_int("SPINFER_ROW_TABLE", 1) != 0;
  // At BN = 32 the overlapped groups where the split rule splits their grid. They hold 74 registers
  // to plain groups' 58 (sm_90a fp16): 4 resident blocks where plain groups keep 5-6 at 50-70%. With
  // the same split count they ran 5-8% faster on the 4096-wide layers (H100, same process, least of
  // 2 rounds, 4 issue shapes x N = 24 / 32, eighty-third session, docs/kernels.md: 4096x14336 N = 24
  // at 70% 36.8 -> 34.5 us). On 28672x8192 at 50-70% the rule gives them one split (448 blocks: 3 or
  // 4 blocks of 128 GroupTiles an SM, so some SMs work a third longer) where plain groups' 5-6
  // resident blocks get 4-5 (1792-2240 blocks of 26-32 GroupTiles): 108.3 -> 119.2 us at 70%, and
  // 110.9 with 5 splits forced. So an unsplit grid keeps plain groups. The rule against plain groups
  // everywhere, 7 layers x N = 24 / 32 (the four issue shapes, 28672x4096, 4096x4096, 6144x4096),
  // geomean x cuBLAS: 30% 1.022 -> 1.042, 50% 1.111 -> 1.162, 70% 1.165 -> 1.206; no case slower
  // past the A/B's noise (4096x4096 N = 32 at 50%: 20.5 -> 18.8 us).
  if (forced_group < 0 && p.wgmma == 4 && p.bn == 32 && p.rows == 1) {
    SpmmPlan q = p;
    q.wgmma = kWgPair;
    if (splits_cached(q, bf16, device, n, sms) > 1) p.wgmma = kWgPair;
  }
  int splits = 0;
  if (const int forced = env_int("SPINFER_SPLITS", 0); forced > 0) splits = std::min(forced, p.grid_k);
  if (splits_wanted > 0) splits = std::min(splits_wanted, p.grid_k);
  if (splits == 0) splits = splits_cached(p, bf16, device, n, sms);
  p.k_per_split = per_split(p.grid_k, splits);
  p.splits = (p.grid_k + p.k_per_split - 1) / p.k_per_split;  // no empty splits
  p.smem_bytes = by_tile<SmemF>(p.bn, p.k_per_split, p.value_cap, p.stages, n, p.wgmma > 0, p.rows);
  // Activation slices through L1 (cp.async.ca, sm_90 loader) where a stage's slice, 2 x 64
  // columns x BN tokens, is at most half its compressed weight bytes (two bitmaps and two runs,
  // value_cap for the run): the blocks on an SM read the same slices, and L1 serves a block the
  // slice another fetched (the twentieth session put x at 4-9% of the time at N = 16 / 32). H100,
  // same process, least of 3 rounds, four issue shapes x N = 1-32 (docs/kernels.md, v12):
  // everywhere against never, 30% sparsity +2.3%, 50% +0.9%, 70% -0.7%: +2-8% at N = 8 / 16 at
  // 30-50%, but -1 to -3.5% where the slice is over half the weights (N = 16 at 70%, N = 32 at
  // 50-70%; not explained). With the rule: 30% +1.3%, 50% +1.2%, 70% +0.1% (28672x8192 N = 16 at
  // 50% 124.4 -> 118.4 us); N = 1 moves nothing. SPINFER_SPMM_XL1=0|1 forces it (A/B runs, tests).
  const int x_bytes = kPair * kGt * p.bn * 2, w_bytes = kPair * (kBitmapBytes + 2 * p.value_cap);
  p.x_l1 = p.bulk && 2 * x_bytes <= w_bytes;
  if (const char* env = std::getenv("SPINFER_SPMM_XL1")) p.x_l1 = p.bulk && env[0] == '1';
  // At BN = 8, where the producer does not count rows (which waits for the first stage anyway),
  // it requests a block's second stage once the first has landed. Blocks that asked for both at
  // once (8-11 MB for a one-wave grid) saw their first land 3.2-5.2 us after their start, the DRAM
  // serving everyone's second stage in the same queue (docs/kernels.md, fifty-second session).
  // H100, same process, least of 3 rounds, seven layers x N = 1 / 8 (fifty-third session), three
  // leases: 70% sparsity +0.4 to +0.9%, 50% +0.8 to +1.0% (4096x4096 N = 1 15.6 -> 15.0 us); at
  // N = 16 / 32 / 64 it measured level, so wider tiles keep their code. SPINFER_STAGGER=0|1 overrides
  // (A/B runs, tests; BN = 8 without the count only).
  const bool staggers = p.bulk && p.bn == 8 && !p.count_rows;
  p.stagger = staggers;
  if (const char* env = std::getenv("SPINFER_STAGGER")) p.stagger = staggers && env[0] == '1';
  // Split-K's reducer by ticket (epilogue.cuh, take_reducer_ticket): chosen as the blocks' last
  // stages start, its producer lane waiting for the other partials while its last stage decodes,
  // where the last arrival's fence and atomic ran between its loop and its sum. The 40- and
  // 48-register variants (SPINFER_MIN_BLOCKS=8|9) keep the arrival: the ticket's code spilled them.
  // SPINFER_SPLIT_TICKET=0 keeps it everywhere (A/B runs, tests).
  p.ticket = p.bulk && p.splits > 1 && (p.min_blocks == 0 || p.min_blocks == 7) &&
             env_int("SPINFER_SPLIT_TICKET", 1) != 0;
  if (p.splits > 1) {
    p.counters = p.n_tiles * ((p.grid_m + p.rows - 1) / p.rows);
    p.workspace_floats = static_cast<int64_t>(p.splits) * p.counters * p.bn * kGt * p.rows;
  }
  return p;
}

int spmm_smbd_resident_blocks(const SpmmPlan& plan, bool bf16, int device) {
  return smbd::resident_blocks_cached(plan, bf16, device);
}

cudaError_t spmm_smbd_run(const SpmmArgs& args, const SpmmPlan& p, cudaStream_t stream) {
  SpmmArgs a = args;
  a.evict_first = use_l2_evict_first();
  return smbd::by_tile<smbd::LaunchF>(p.bn, &a, &p, stream);
}

}  // namespace spinfer
