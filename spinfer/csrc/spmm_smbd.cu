// Planning and dispatch of the SMBD SpMM kernel: tile width by N, split-K by SM count.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "spmm_smbd.cuh"

namespace spinfer {
namespace smbd {
SPINFER_SMBD_FOR_TILES(SPINFER_SMBD_EXTERN_ONE, false)
SPINFER_SMBD_FOR_TILES(SPINFER_SMBD_EXTERN_ONE, true)

namespace {

// Calls F<BN>::run(args...) for the runtime tile width.
template <template <int> class F, typename... A>
auto by_tile(int bn, A... a) {
  switch (bn) {
    case 8: return F<8>::run(a...);
    case 16: return F<16>::run(a...);
    case 32: return F<32>::run(a...);
    default: return F<64>::run(a...);
  }
}
template <int BN>
struct SmemF {
  static int run(int kps, int cap, int stages, int n) { return smem_bytes<BN>(kps, cap, stages, n); }
};
template <int BN>
struct LaunchF {
  static cudaError_t run(const SpmmArgs* a, const SpmmPlan* p, cudaStream_t s) {
    return a->bf16 ? launch<true, BN>(*a, *p, s) : launch<false, BN>(*a, *p, s);
  }
};

// Split-K factor, fitted to H100 measurements (docs/kernels.md). Enough blocks per SM lets the
// block scheduler balance a latency-bound kernel: 28672x8192 at N<=16 ran 20-35% faster with 4
// splits (~13 blocks per SM) than with 1 or 2. But each split pays a pipeline prologue and a
// partial-tile reduction: 4096x14336 ran 15-35% slower with 25 splits of 9 GroupTiles than
// with 8 splits of 28. So: ~12 blocks per SM, and at least min(28, grid_k/8) GroupTiles per
// split.
int choose_splits(int base_blocks, int sms, int grid_k) {
  constexpr int kBlocksPerSm = 12;
  const int min_per_split = std::max(1, std::min(28, grid_k / 8));
  const int max_splits = std::max(1, grid_k / min_per_split);
  const int want = (kBlocksPerSm * sms + base_blocks - 1) / base_blocks;
  return std::max(1, std::min(want, max_splits));
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

}  // namespace
}  // namespace smbd

SpmmPlan spmm_smbd_plan(int m, int n, int kp, int max_run, int device, int splits_wanted) {
  using namespace smbd;
  SpmmPlan p{};
  p.bn = n <= 8 ? 8 : n <= 16 ? 16 : n <= 32 ? 32 : 64;
  p.n_tiles = (n + p.bn - 1) / p.bn;
  p.grid_m = (m + kGt - 1) / kGt;
  p.grid_k = kp / kGt;
  int sms = 1, major = 8;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  const char* loader = std::getenv("SPINFER_LOADER");
  p.bulk = major >= 9 && !(loader && std::strcmp(loader, "cp_async") == 0);
  p.pdl = use_pdl(major);
  // Decode variant, by same-process A/B on H100: the lean decode (prefix published as a shared
  // address, clamped once per GroupTile) is 4-11% faster at BN <= 16 and 3-10% slower at BN = 32
  // than the per-word clamped one. SPINFER_DECODE=lean|safe overrides.
  p.lean = p.bn <= 16;
  if (const char* decode = std::getenv("SPINFER_DECODE")) p.lean = std::strcmp(decode, "safe") != 0;
  p.stages = std::min(kMaxStages, std::max(2, env_int("SPINFER_STAGES", 2)));
  int splits = choose_splits(p.grid_m * p.n_tiles, sms, p.grid_k);
  if (const int forced = env_int("SPINFER_SPLITS", 0); forced > 0) splits = std::min(forced, p.grid_k);
  if (splits_wanted > 0) splits = std::min(splits_wanted, p.grid_k);
  // Splits hold whole pairs of GroupTiles, so only the last stage of the last split can be odd.
  p.k_per_split = (p.grid_k + splits - 1) / splits;
  if (p.k_per_split < p.grid_k) p.k_per_split = (p.k_per_split + 1) / 2 * 2;
  p.splits = (p.grid_k + p.k_per_split - 1) / p.k_per_split;  // no empty splits
  const int cap = env_int("SPINFER_VALUE_CAP", max_run);
  p.value_cap = std::max(8, std::min(kMaxValues, (cap + 7) / 8 * 8));
  p.smem_bytes = by_tile<SmemF>(p.bn, p.k_per_split, p.value_cap, p.stages, n);
  if (p.splits > 1) {
    p.counters = p.n_tiles * p.grid_m;
    p.workspace_floats = static_cast<int64_t>(p.splits) * p.counters * p.bn * kGt;
  }
  return p;
}

cudaError_t spmm_smbd_run(const SpmmArgs& a, const SpmmPlan& p, cudaStream_t stream) {
  return smbd::by_tile<smbd::LaunchF>(p.bn, &a, &p, stream);
}

}  // namespace spinfer
