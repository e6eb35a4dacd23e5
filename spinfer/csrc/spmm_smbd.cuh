// The SMBD SpMM kernels: y[N, M] = x[N, K] @ W[M, K]^T with W in TCA-BME (GroupTile 64x64).
//
// Read top to bottom:
//  * One thread block owns ROWS GroupTile rows of W (64 output features each) and a tile of BN
//    tokens, and walks a range of GroupTiles along K (all of them, or a split-K share). The
//    planner uses ROWS=1; ROWS=2 (two rows sharing each x slice) measured slower at every N on
//    H100 (fewer resident blocks) and stays selectable for A/B runs (SPINFER_ROWS=2).
//  * A 4-stage ring brings each GroupTile to shared memory *compressed*: its 64 bitmap words
//    (512 B), its value run (16-byte aligned, 2 B per nonzero) and the matching 64-column slice
//    of x. On sm_90 one thread issues bulk copies (cp.async.bulk) that complete on the stage's
//    mbarrier; on sm_80 all threads issue 16-byte cp.async. Nothing dense of W ever exists
//    outside registers.
//  * Four warps per GroupTile row decode it: warp w takes TCTile row w (16 bitmap words) and
//    expands it straight into mma.m16n8k16 A fragments (Shared-Memory Bitmap Decoding): a
//    lane's value offset is the PopCount of everything before its bits plus a masked PopCount
//    inside its word. fp32 accumulators.
//  * The epilogue adds bias and casts, or (split-K) stores fp32 partials and the last block to
//    arrive for a tile reduces them in a fixed order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "epilogue.cuh"
#include "ptx.cuh"
#include "spmm_smbd.h"

namespace spinfer {
namespace smbd {

constexpr int kGt = 64;                 // GroupTile is kGt x kGt
constexpr int kConsumers = 4;           // decoding warps: one per TCTile row of the GroupTile
constexpr int kWordsPerGt = kGt * kGt / 64;
constexpr int kBitmapBytes = kWordsPerGt * 8;
constexpr int kMaxValues = kGt * kGt;   // a fully dense GroupTile
constexpr int kXStride = kGt + 8;       // halves per x row in smem: +16 B makes the B-fragment
                                        // loads of lanes g=0..7 hit 8 distinct bank groups
constexpr unsigned kFull = 0xffffffffu;

// A decoding lane reads values[off] and values[off + 1] unconditionally, off < run for valid
// data. Arrays that bypassed validation can push off past the run. The per-word decode clamps
// every offset to the run; the lean decode clamps each half-word's prefix once per GroupTile,
// after which a lane adds at most 31 (its masked PopCount) plus 1, so its reads stay inside
// this slack.
constexpr int kValueSlack = 40;

// Shared memory of one block: kStages stages, each holding for every one of the block's ROWS
// GroupTile rows a bitmap (512 B) and a value-run buffer, plus one x slice [BN][kXStride] that
// all rows share; then the GroupTile offsets of the block's rows. The value buffer holds
// value_cap elements, the weight's longest run (TCABME.max_run) rather than a dense GroupTile:
// ~2.2k values instead of 4096 at 50% sparsity, so almost twice as many blocks stay resident.
template <int BN, int ROWS>
struct Layout {
  static constexpr int kStages = 4;
  static constexpr int kWarps = kConsumers * ROWS;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kXBytes = BN * kXStride * 2;
  static constexpr int kValueOffset = ROWS * kBitmapBytes;
  static_assert(kXBytes % 16 == 0 && kValueOffset % 16 == 0, "16-byte alignment of every buffer");
  int value_bytes, x_offset, stage_bytes;
  __host__ __device__ explicit Layout(int value_cap)
      : value_bytes(((value_cap + kValueSlack) * 2 + 15) / 16 * 16),
        x_offset(ROWS * (kBitmapBytes + value_bytes)),
        stage_bytes(x_offset + kXBytes) {}
  __host__ __device__ int smem_bytes(int k_per_split) const {
    return kStages * stage_bytes + (ROWS * (k_per_split + 1) * 4 + 15) / 16 * 16;
  }
};

// What one block works on, derived from blockIdx: GroupTile rows row0 .. row0+rows-1 (rows
// < ROWS only at the bottom edge), tokens n0 .. n0+valid_rows-1, GroupTile columns g_begin ..
// g_begin+nk-1.
struct BlockWork {
  int row0, rows, split, g_begin, nk, n0, valid_rows;
};

template <int BN, int ROWS>
__device__ __forceinline__ BlockWork block_work(const SpmmArgs& args, int grid_m, int grid_k, int k_per_split) {
  BlockWork b;
  b.row0 = blockIdx.y * ROWS;
  b.rows = min(ROWS, grid_m - b.row0);
  b.split = blockIdx.z;
  b.g_begin = b.split * k_per_split;
  b.nk = max(0, min(grid_k, b.g_begin + k_per_split) - b.g_begin);
  b.n0 = blockIdx.x * BN;
  b.valid_rows = min(BN, args.n - b.n0);
  return b;
}

__device__ __forceinline__ int64_t first_gtile(const BlockWork& b, int r, int grid_k) {
  return static_cast<int64_t>(b.row0 + r) * grid_k + b.g_begin;
}

// The GroupTile offsets of the block's rows, loaded once so issuing a copy never waits on a
// dependent global load. Clamped and rounded down to 16 bytes: arrays that bypassed validation
// can give wrong results but can never send a copy outside `values`.
__device__ __forceinline__ void load_offsets(const SpmmArgs& args, const BlockWork& b, int grid_k, int* s_off,
                                             int tid, int threads) {
  const int per_row = b.nk + 1;
  for (int idx = tid; idx < b.rows * per_row; idx += threads) {
    int64_t o = args.gtile_offset[first_gtile(b, idx / per_row, grid_k) + idx % per_row];
    o = min(max(o, int64_t(0)), args.nvalues);
    s_off[idx] = static_cast<int>(o & ~int64_t(7));
  }
}

// A GroupTile's run, clamped to the value buffer (value_cap, a multiple of 8, <= kMaxValues):
// only a max_run below the truth or corrupt offsets ever clamp.
__device__ __forceinline__ int run_length(const int* s_off_row, int i, int value_cap) {
  return min(max(s_off_row[i + 1] - s_off_row[i], 0), value_cap);
}

// Decodes this warp's TCTile row of one GroupTile and multiplies it into acc.
//   bm32: the GroupTile's bitmap as 128 half-words; vals: its value run (with kValueSlack
//   readable elements past `run`); xs: the x slice [BN][kXStride]; pack: 32 uint2 of scratch.
template <bool kBF16, int BN, bool kLean>
__device__ __forceinline__ void decode_and_multiply(const uint32_t* bm32, const uint16_t* vals, int run,
                                                    const uint16_t* xs, uint2* pack, int warp, int lane,
                                                    float (&acc)[BN / 8][4]) {
  // Lane geometry of the m16n8k16 fragments: group g = lane/4 owns row g (and g+8) of A and
  // column g of B; tq = lane%4 picks the column pair. In a BitmapTile word that row/pair is
  // bits 2*lane and 2*lane+1: lanes 0-15 read the low 32-bit half, lanes 16-31 the high one.
  const int g = lane / 4, tq = lane % 4;
  const int hi = lane >> 4;
  const int lp = 2 * (lane & 15);
  const uint32_t below = (1u << lp) - 1u;
  const uint32_t bit_lo = 1u << lp, bit_hi = 2u << lp;

  // Exclusive PopCount prefix of every 32-bit half-word of this warp's 16 words, relative to
  // the run: one POPC per lane here instead of one per word in the decode below.
  const uint32_t my_half = bm32[32 * warp + lane];
  int before = 0;  // set bits in the TCTile rows of the warps above
#pragma unroll
  for (int r = 0; r < kConsumers - 1; ++r)
    if (r < warp) before += __popc(bm32[32 * r + lane]);
  before = __reduce_add_sync(kFull, before);
  const int cnt = __popc(my_half);
  int incl = cnt;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int t = __shfl_up_sync(kFull, incl, d);
    if (lane >= d) incl += t;
  }
  // Publish {bits, prefix} side by side: the decode fetches both with one 8-byte broadcast
  // load per word instead of two shuffles.
  __syncwarp();  // every lane is done reading the previous GroupTile's pairs
  const int last = max(run - 1, 0);  // clamp target for offsets of corrupt arrays
  if constexpr (kLean)  // the prefix as the shared address of its first value, clamped once
    pack[lane] = make_uint2(my_half, ptx::smem_addr(vals) + 2u * static_cast<uint32_t>(min(before + incl - cnt, last)));
  else
    pack[lane] = make_uint2(my_half, static_cast<uint32_t>(before + incl - cnt));
  __syncwarp();

#pragma unroll
  for (int t = 0; t < 4; ++t) {  // TCTile (warp, t): k columns 16t .. 16t+15
    uint32_t a[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // BitmapTile j = register Ra_j (TL, BL, TR, BR)
      const uint2 he = pack[2 * (4 * t + j) + hi];  // this lane's half of word 4t+j
      // Both candidates are loaded unconditionally and selected: cheaper than two predicated
      // loads plus two zeroings.
      uint32_t v0, v1;
      if constexpr (kLean) {
        const uint32_t addr = he.y + 2u * __popc(he.x & below);
        v0 = ptx::lds_u16(addr);
        v1 = ptx::lds_u16(addr + 2);
      } else {
        const int off = min(static_cast<int>(he.y) + __popc(he.x & below), last);
        v0 = vals[off];
        v1 = vals[off + 1];
      }
      const bool b0 = he.x & bit_lo, b1 = he.x & bit_hi;
      const uint32_t lo = b0 ? v0 : 0u;
      const uint32_t up = b1 ? (b0 ? v1 : v0) : 0u;  // the pair's second value follows the first
      a[j] = __byte_perm(lo, up, 0x5410);
    }
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb) {
      const uint16_t* xr = xs + (nb * 8 + g) * kXStride + 16 * t + 2 * tq;
      const uint32_t b_lo = *reinterpret_cast<const uint32_t*>(xr);
      const uint32_t b_hi = *reinterpret_cast<const uint32_t*>(xr + 8);
      ptx::mma_m16n8k16<kBF16>(acc[nb], a, b_lo, b_hi);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The kernel. kBulk (sm_90): lane 0 of warp 0 posts the stage's byte count on its mbarrier and
// issues cp.async.bulk copies of each row's bitmap and value run; warp 0's lanes copy the x
// rows. Otherwise (sm_80): every thread issues 16-byte cp.async and groups are counted.
template <bool kBF16, int BN, int ROWS, bool kBulk, bool kLean>
__global__ void __launch_bounds__(Layout<BN, ROWS>::kThreads)
    spmm_smbd_kernel(const SpmmArgs args, const int grid_m, const int grid_k, const int k_per_split,
                     const int splits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (kBulk) {
    __trap();  // never launched below sm_90 (the host checks); keeps sm_80 builds valid
  } else
#endif
  {
    using L = Layout<BN, ROWS>;
    constexpr int S = L::kStages;
    const L lay(args.value_cap);
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ __align__(8) uint64_t s_full[S];  // bulk: the stage's bytes have landed
    __shared__ uint2 s_pack[L::kWarps][32];
    __shared__ int s_is_last;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int rw = warp / kConsumers, w = warp % kConsumers;  // GroupTile row, TCTile row
    const BlockWork b = block_work<BN, ROWS>(args, grid_m, grid_k, k_per_split);
    int* s_off = reinterpret_cast<int*>(smem + S * lay.stage_bytes);
    const int per_row = b.nk + 1;
    load_offsets(args, b, grid_k, s_off, tid, L::kThreads);

    if constexpr (kBulk) {
      // x rows past N are never copied: zero them once in every stage.
      const int zero_words = (BN - b.valid_rows) * kXStride / 2;
      for (int idx = tid; idx < S * zero_words; idx += L::kThreads)
        reinterpret_cast<uint32_t*>(smem + (idx / zero_words) * lay.stage_bytes + lay.x_offset +
                                    b.valid_rows * kXStride * 2)[idx % zero_words] = 0u;
      if (tid == 0) {
        for (int st = 0; st < S; ++st) ptx::mbarrier_init(&s_full[st], 1);
        ptx::fence_mbarrier_init();
      }
    }
    __syncthreads();

    auto issue_bulk = [&](int stage, int i) {  // warp 0 only
      unsigned char* st = smem + stage * lay.stage_bytes;
      if (lane == 0) {
        uint32_t bytes = b.valid_rows * kGt * 2;
        for (int r = 0; r < b.rows; ++r) bytes += kBitmapBytes + run_length(s_off + r * per_row, i, args.value_cap) * 2;
        ptx::fence_proxy_async_shared();  // the generic reads of this buffer come before the copy
        ptx::mbarrier_arrive_expect_tx(&s_full[stage], bytes);
        for (int r = 0; r < b.rows; ++r) {
          const int* off = s_off + r * per_row;
          const int run = run_length(off, i, args.value_cap);
          ptx::cp_async_bulk_g2s(st + r * kBitmapBytes, args.bitmap + (first_gtile(b, r, grid_k) + i) * kWordsPerGt,
                                 kBitmapBytes, &s_full[stage]);
          if (run > 0)
            ptx::cp_async_bulk_g2s(st + L::kValueOffset + r * lay.value_bytes,
                                   static_cast<const char*>(args.values) + int64_t(off[i]) * 2, run * 2,
                                   &s_full[stage]);
        }
      }
      __syncwarp();  // the byte count is posted before any row copy can complete
      const int k0 = (b.g_begin + i) * kGt;
      for (int r = lane; r < b.valid_rows; r += 32)
        ptx::cp_async_bulk_g2s(st + lay.x_offset + r * kXStride * 2,
                               static_cast<const char*>(args.x) + (int64_t(b.n0 + r) * args.kp + k0) * 2, kGt * 2,
                               &s_full[stage]);
    };

    auto issue_cp_async = [&](int stage, int i) {  // all threads
      unsigned char* st = smem + stage * lay.stage_bytes;
      for (int r = 0; r < b.rows; ++r) {
        const int* off = s_off + r * per_row;
        const char* g_bitmap =
            reinterpret_cast<const char*>(args.bitmap + (first_gtile(b, r, grid_k) + i) * kWordsPerGt);
        if (tid < kBitmapBytes / 16) ptx::cp_async_cg_16(st + r * kBitmapBytes + tid * 16, g_bitmap + tid * 16);
        const char* g_vals = static_cast<const char*>(args.values) + int64_t(off[i]) * 2;
        for (int c = tid; c < run_length(off, i, args.value_cap) / 8; c += L::kThreads)
          ptx::cp_async_cg_16(st + L::kValueOffset + r * lay.value_bytes + c * 16, g_vals + c * 16);
      }
      const int k0 = (b.g_begin + i) * kGt;
      for (int c = tid; c < BN * 8; c += L::kThreads) {  // rows past N are zero-filled
        const int r = c / 8, cc = c % 8;
        const bool ok = r < b.valid_rows;
        const char* src =
            static_cast<const char*>(args.x) + (ok ? (int64_t(b.n0 + r) * args.kp + k0 + cc * 8) * 2 : 0);
        ptx::cp_async_cg_16(st + lay.x_offset + (r * kXStride + cc * 8) * 2, src, ok);
      }
    };

    float acc[BN / 8][4];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

    auto compute = [&](int stage, int i) {
      if (rw >= b.rows) return;  // this warp's GroupTile row is past the bottom edge
      const unsigned char* st = smem + stage * lay.stage_bytes;
      decode_and_multiply<kBF16, BN, kLean>(reinterpret_cast<const uint32_t*>(st + rw * kBitmapBytes),
                                     reinterpret_cast<const uint16_t*>(st + L::kValueOffset + rw * lay.value_bytes),
                                     run_length(s_off + rw * per_row, i, args.value_cap),
                                     reinterpret_cast<const uint16_t*>(st + lay.x_offset), s_pack[warp], w, lane,
                                     acc);
    };

    // Stage i is consumed while stages i+1 .. i+S-1 are in flight.
    if constexpr (kBulk) {
      if (warp == 0)
        for (int st = 0; st < S - 1 && st < b.nk; ++st) issue_bulk(st, st);
      for (int i = 0; i < b.nk; ++i) {
        __syncthreads();  // all warps are done with stage i-1, which the prefetch overwrites
        const int pf = i + S - 1;
        if (warp == 0 && pf < b.nk) issue_bulk(pf % S, pf);
        ptx::mbarrier_wait_parity(&s_full[i % S], (i / S) & 1);
        compute(i % S, i);
      }
    } else {
      // A group is committed every iteration (empty near the end) so wait_group's count
      // stays uniform.
#pragma unroll
      for (int st = 0; st < S - 1; ++st) {
        if (st < b.nk) issue_cp_async(st, st);
        ptx::cp_async_commit_group();
      }
      for (int i = 0; i < b.nk; ++i) {
        ptx::cp_async_wait_group<S - 2>();
        // Stage i is visible to all threads, and all threads are done with stage i-1, whose
        // buffer the prefetch below overwrites.
        __syncthreads();
        const int pf = i + S - 1;
        if (pf < b.nk) issue_cp_async(pf % S, pf);
        ptx::cp_async_commit_group();
        compute(i % S, i);
      }
      ptx::cp_async_wait_group<0>();
    }
    const TileOut out{args.y, args.bias, args.workspace, args.counters, args.m, args.n};
    store_tile<kBF16, BN, kGt * ROWS, L::kThreads>(out, b.row0 * kGt, rw * kGt + w * 16 + lane / 4, b.n0, b.split,
                                                   splits, acc, lane, tid, &s_is_last);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side of one (dtype, BN, ROWS) instantiation; instantiated in spmm_smbd_{fp16,bf16}.cu so
// the two dtypes compile in parallel.
template <bool kBF16, int BN, int ROWS>
int smem_bytes(int k_per_split, int value_cap) {
  return Layout<BN, ROWS>(value_cap).smem_bytes(k_per_split);
}

template <bool kBF16, int BN, int ROWS>
cudaError_t launch(const SpmmArgs& args, const SpmmPlan& plan, cudaStream_t stream) {
  auto kernel = plan.bulk ? (plan.lean ? spmm_smbd_kernel<kBF16, BN, ROWS, true, true>
                                       : spmm_smbd_kernel<kBF16, BN, ROWS, true, false>)
                          : (plan.lean ? spmm_smbd_kernel<kBF16, BN, ROWS, false, true>
                                       : spmm_smbd_kernel<kBF16, BN, ROWS, false, false>);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, plan.smem_bytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(plan.n_tiles, (plan.grid_m + ROWS - 1) / ROWS, plan.splits);
  kernel<<<grid, Layout<BN, ROWS>::kThreads, plan.smem_bytes, stream>>>(args, plan.grid_m, plan.grid_k,
                                                                          plan.k_per_split, plan.splits);
  return cudaGetLastError();
}

#define SPINFER_SMBD_FOR_TILES(X, BF16) \
  X(BF16, 8, 1) X(BF16, 16, 1) X(BF16, 32, 1) X(BF16, 64, 1) X(BF16, 8, 2) X(BF16, 16, 2) X(BF16, 32, 2) X(BF16, 64, 2)
#define SPINFER_SMBD_INSTANTIATE_ONE(BF16, BN, ROWS)                                              \
  template cudaError_t launch<BF16, BN, ROWS>(const SpmmArgs&, const SpmmPlan&, cudaStream_t); \
  template int smem_bytes<BF16, BN, ROWS>(int, int);
#define SPINFER_SMBD_EXTERN_ONE(BF16, BN, ROWS)                                                          \
  extern template cudaError_t launch<BF16, BN, ROWS>(const SpmmArgs&, const SpmmPlan&, cudaStream_t); \
  extern template int smem_bytes<BF16, BN, ROWS>(int, int);

}  // namespace smbd
}  // namespace spinfer
