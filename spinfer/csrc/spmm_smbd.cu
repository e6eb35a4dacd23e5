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

// Calls F<kBF16, BN, ROWS>::run(args...) for the runtime (bn, rows).
template <template <bool, int, int> class F, bool kBF16, typename... A>
auto by_tile(int bn, int rows, A... a) {
  if (rows == 2) {
    switch (bn) {
      case 8: return F<kBF16, 8, 2>::run(a...);
      case 16: return F<kBF16, 16, 2>::run(a...);
      case 32: return F<kBF16, 32, 2>::run(a...);
      default: return F<kBF16, 64, 2>::run(a...);
    }
  }
  switch (bn) {
    case 8: return F<kBF16, 8, 1>::run(a...);
    case 16: return F<kBF16, 16, 1>::run(a...);
    case 32: return F<kBF16, 32, 1>::run(a...);
    default: return F<kBF16, 64, 1>::run(a...);
  }
}
template <bool B, int BN, int R>
struct SmemF {
  static int run(int kps, int cap) { return smem_bytes<B, BN, R>(kps, cap); }
};
template <bool B, int BN, int R>
struct LaunchF {
  static cudaError_t run(const SpmmArgs* a, const SpmmPlan* p, cudaStream_t s) { return launch<B, BN, R>(*a, *p, s); }
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

}  // namespace
}  // namespace smbd

SpmmPlan spmm_smbd_plan(int m, int n, int kp, int max_run, int device, bool bf16) {
  using namespace smbd;
  SpmmPlan p{};
  p.bn = n <= 8 ? 8 : n <= 16 ? 16 : n <= 32 ? 32 : 64;
  p.n_tiles = (n + p.bn - 1) / p.bn;
  p.grid_m = (m + kGt - 1) / kGt;
  p.grid_k = kp / kGt;
  // One GroupTile row per block: two rows sharing each x slice measured slower at every N
  // (fewer resident blocks); kept selectable for A/B runs.
  p.rows = 1;
  if (const char* env = std::getenv("SPINFER_ROWS")) p.rows = std::atoi(env) == 2 ? 2 : 1;
  int sms = 1, major = 8;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  const char* loader = std::getenv("SPINFER_LOADER");
  p.bulk = major >= 9 && !(loader && std::strcmp(loader, "cp_async") == 0);
  // Decode variant, by same-process A/B on H100: the lean decode (prefix published as a shared
  // address, clamped once per GroupTile) is 4-11% faster at BN <= 16 and 3-10% slower at BN = 32
  // than the per-word clamped one. SPINFER_DECODE=lean|safe overrides.
  p.lean = p.bn <= 16;
  if (const char* decode = std::getenv("SPINFER_DECODE")) p.lean = std::strcmp(decode, "safe") != 0;
  const int row_blocks = (p.grid_m + p.rows - 1) / p.rows;
  int splits = choose_splits(row_blocks * p.n_tiles, sms, p.grid_k);
  if (const char* env = std::getenv("SPINFER_SPLITS")) {
    const int forced = std::atoi(env);
    if (forced > 0) splits = forced < p.grid_k ? forced : p.grid_k;
  }
  p.k_per_split = (p.grid_k + splits - 1) / splits;
  p.splits = (p.grid_k + p.k_per_split - 1) / p.k_per_split;  // no empty splits
  int cap = max_run;
  if (const char* env = std::getenv("SPINFER_VALUE_CAP")) cap = std::atoi(env);
  p.value_cap = std::max(8, std::min(kMaxValues, (cap + 7) / 8 * 8));
  p.smem_bytes = bf16 ? by_tile<SmemF, true>(p.bn, p.rows, p.k_per_split, p.value_cap)
                      : by_tile<SmemF, false>(p.bn, p.rows, p.k_per_split, p.value_cap);
  if (p.splits > 1) {
    p.counters = p.n_tiles * row_blocks;
    p.workspace_floats = static_cast<int64_t>(p.splits) * p.counters * p.bn * kGt * p.rows;
  }
  return p;
}

cudaError_t spmm_smbd_run(const SpmmArgs& a, const SpmmPlan& p, cudaStream_t stream) {
  using namespace smbd;
  return a.bf16 ? by_tile<LaunchF, true>(p.bn, p.rows, &a, &p, stream)
                : by_tile<LaunchF, false>(p.bn, p.rows, &a, &p, stream);
}

}  // namespace spinfer
