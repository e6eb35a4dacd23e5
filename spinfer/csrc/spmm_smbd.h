// Host interface of the SMBD SpMM kernel: y[N, M] = x[N, K] @ W[M, K]^T (+ bias), with W in
// TCA-BME (GroupTile 64x64). Plain CUDA types only, so this compiles without torch.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace spinfer {

struct SpmmArgs {
  const void* x;                // [n, kp] fp16/bf16 row-major, 16-byte aligned, zero past K
  const int64_t* bitmap;        // [grid_m * grid_k * 64] BitmapTile words (uint64 patterns)
  const void* values;           // [nvalues] GroupTile runs, 16-byte aligned
  const int32_t* gtile_offset;  // [grid_m * grid_k + 1]
  const int16_t* row_offset;    // [grid_m * grid_k, 4]: set bits of each GroupTile's TCTile rows above
                                // each row (TCABME.row_offset), or nullptr (SpmmPlan::row_table)
  const void* bias;             // [m] or nullptr
  void* y;                      // [n, m]
  float* workspace;             // split-K partial tiles (plan.workspace_floats), or nullptr
  int32_t* counters;            // split-K arrival counters (plan.counters), zero on entry
  int m, n, kp;
  int value_cap;                // value buffer per GroupTile (plan.value_cap)
  int64_t nvalues;
  bool bf16;
  bool x_l1;                    // the activation copies go through L1 (SpmmPlan::x_l1)
  bool evict_first;             // bitmaps and values under L2's evict_first policy (set by the launch)
  bool stagger;                 // the second stage waits for the first to land (SpmmPlan::stagger)
  bool ticket;                  // split-K reducer by ticket (SpmmPlan::ticket)
};

struct SpmmPlan {
  int bn;           // tokens per block tile: 8, 16, 32 or 64 (128: past 64 tokens on sm_90's wgmma form)
  int n_tiles;      // ceil(n / bn)
  int grid_m;       // GroupTile rows: ceil(m / 64)
  int grid_k;       // GroupTile columns: kp / 64
  int splits;       // split-K factor (1: no reduction)
  int k_per_split;  // GroupTiles per split (even: the pipeline moves GroupTiles in pairs)
  int stages;       // pipeline stages of two GroupTiles each: 2..4
  int64_t workspace_floats;
  int counters;
  int value_cap;    // longest value run rounded up to 8, in [8, 4096]
  int smem_bytes;
  int min_blocks;   // register budget of the lean sm_90 variants at BN <= 16, as the resident
                    // blocks it allows: 7 (56 registers, the default), 8 (48) or 9 (40);
                    // SPINFER_MIN_BLOCKS overrides. 0 elsewhere
  bool bulk;        // sm_90 bulk-copy loader; false: cp.async (sm_80, or SPINFER_LOADER=cp_async)
  bool pdl;         // programmatic dependent launch (sm_90; SPINFER_PDL=0 turns it off)
  bool lean;        // decode variant: prefix as a shared address clamped once (the default) or
                    // offsets clamped per word (SPINFER_DECODE=safe)
  bool count_rows;  // the sm_90 producer warp counts the set bits of each stage's TCTile rows above
                    // each decoding warp's row (kCount), which the warps otherwise count
                    // themselves: at BN = 16, and at BN = 8 where the longest run is at least 60%
                    // of a GroupTile (spmm_smbd.cu); SPINFER_COUNT_ROWS=0|1 overrides for the
                    // lean sm_90 kernel at BN <= 16 (never elsewhere)
  bool x_l1;        // the sm_90 loader copies the activation slices through L1 (cp.async.ca), where
                    // a slice is at most half a stage's compressed weight bytes (spmm_smbd.cu);
                    // SPINFER_SPMM_XL1=0|1 overrides
  bool row_table;   // the decoding warps read the rows above their own from the weight's row table
                    // (SpmmArgs::row_offset, copied with each stage) instead of counting them: the
                    // lean sm_90 kernel where the producer does not count rows (spmm_smbd.cu);
                    // SPINFER_ROW_TABLE=0 turns it off
  bool stagger;     // the sm_90 producer requests a block's second stage once its first has landed:
                    // at BN = 8 where it does not count rows (spmm_smbd.cu); SPINFER_STAGGER=0|1
                    // overrides there
  int wgmma;        // the warp-group MMA variant (spmm_smbd.cuh, decode_gt_wg), as the TCTiles of one
                    // wgmma group (1, 2 or 4; 3: 1 with one group in flight, kWgRing; 0: mma.sync):
                    // on sm_90 with the lean decode, at BN = 8 and 16 groups of 4 at the default
                    // register budget only (spmm_smbd.cu); SPINFER_WGMMA=0|1|2|3|4 and
                    // SPINFER_WGMMA_SMALL=0 (mma.sync at BN <= 16) override
  bool ticket;      // split-K: the sm_90 producer takes its block's reducer ticket as the last stage
                    // starts (epilogue.cuh, take_reducer_ticket), where the grid is split, at the
                    // default register budgets; SPINFER_SPLIT_TICKET=0 keeps the last arrival
  int rows;         // GroupTile rows a block: 1, or 2 (wgmma groups of 4 at BN >= 32), whose two warp
                    // groups share the stage's x slice (spmm_smbd.cu); the launch grid has
                    // ceil(grid_m / rows) block rows, and a split-K tile is rows x 64 outputs
};

// Tile size, split-K, pipeline depth, loader and workspace for a problem on `device` (bf16:
// the dtype, whose kernels' occupancy the split rule asks for).
// splits > 0: that split-K factor (capped at the GroupTile columns), as tuned by
// spinfer.tuning; 0: the planner's rule. For A/B runs and tests SPINFER_SPLITS overrides the
// rule (not an explicit splits), SPINFER_STAGES (2..4) the pipeline depth and
// SPINFER_LOADER=cp_async the loader.
// max_run is the weight's longest GroupTile run (TCABME.max_run); SPINFER_VALUE_CAP overrides
// the value buffer size (for A/B runs; a value below max_run truncates runs).
// row_table: the launch has the weight's row table (SpmmArgs::row_offset).
SpmmPlan spmm_smbd_plan(int m, int n, int kp, int max_run, bool bf16, int device, int splits, bool row_table);

// Blocks of the plan's kernel that fit on one SM of `device` at its shared memory (CUDA's
// occupancy calculator, cached), 0 where the query fails. For reports (spinfer::spmm_plan); a
// launch does not need it.
int spmm_smbd_resident_blocks(const SpmmPlan& plan, bool bf16, int device);

cudaError_t spmm_smbd_run(const SpmmArgs& args, const SpmmPlan& plan, cudaStream_t stream);

}  // namespace spinfer
