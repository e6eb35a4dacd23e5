// The low-bit GEMV kernel: y[1, M] = x[1, K] @ W[M, K]^T for one token (decode at batch 1), on
// the packed format of the fused kernel (lowbit_mm.cuh), at 1, 2, 4 and 8 bits (gemv_supported says
// which group sizes).
//
// Read top to bottom:
//  * A block of 8 warps owns 16 output rows (a quarter of one of the format's 64-row tiles) and
//    all of K. Warp w takes stages w, w + 8, w + 16, ... of those rows; at the end the block sums
//    the 8 warps' accumulators through shared memory in warp order (deterministic), adds bias and
//    casts. There is no split-K and no workspace: a layer has ceil(M / 16) blocks, 4x the fused
//    kernel's, and the block scheduler hands them out as SMs free up.
//  * No shared-memory ring and no barrier in the loop. Each lane loads its own A-fragment words
//    of rows g and g + 8 (lowbit_mm.cuh's fragment order: 32 bytes a row per stage at 4 and 8
//    bits, 16 at 2, 8 at 1) straight into registers with 16-, 8- or 4-byte
//    `ld.global.nc.L1::no_allocate`, one stage ahead of the one it computes, and dequantizes them
//    as the fused kernel does (unpack_pair).
//  * x (K halves) is copied to shared memory once per block, after the first stage's weight loads
//    are issued, and the B fragments are read from there (at N = 1 the 8 columns of an n8 mma
//    are the same token, a broadcast). Read through L1 instead, they waited behind the weight
//    loads issued before them (the probe, docs/quant.md).
//  * Zero points as in the fused kernel: the A fragments hold q - zi exactly, and a segment's
//    fractional rest z - zi (HQQ) is applied on the accumulator through the segment's sum of x,
//    which the block computes once from shared memory when the launch needs it.
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
constexpr int kGemvThreads = 32 * kGemvWarps;
constexpr int kGemvRows = 16;
// 80 registers: the stage in flight and the one computed. With 4 resident blocks (64 registers)
// the prefetch spilled at 4 bits; without it, 4 blocks measured slower than this (the probe).
constexpr int kGemvMinBlocks = 3;
// The (width, scale groups per 128-column chunk) pairs the GEMV is built for: those whose stage,
// the lane's words of rows g and g + 8 and their (scale, zero) pairs, takes at most 20 registers,
// as 4-bit g128 does (16 words + 4 pairs; with 2 groups a chunk its stage in flight spilled 16
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
// A flag fixed at compile time that converts to bool in device code (std::bool_constant's
// conversion is host-only without --expt-relaxed-constexpr).
template <bool V>
struct Fixed {
  __host__ __device__ constexpr operator bool() const { return V; }
};
// The longest padded K it takes: x (64 KB at 32768) stays in shared memory with 3 blocks an SM.
constexpr int kGemvMaxKp = 32768;

// Shared memory of a launch: x (kp halves) and one float per segment for the zero points' sums.
__host__ __device__ constexpr int gemv_smem_bytes(int kp, int ng) { return kp * 2 + kp / kChunk * ng * 4; }

template <bool kBF16, int BITS, int NG>
__global__ void __launch_bounds__(kGemvThreads, kGemvMinBlocks) lowbit_gemv_kernel(const LowbitArgs args) {
  static_assert(gemv_supported(BITS, NG), "a stage in at most 20 registers");
  constexpr int U = chunks_per_stage<BITS>();
  constexpr int kCols = U * kChunk;                 // columns of a stage
  constexpr int kRowBytes = U * kChunk * BITS / 8;  // a row's bytes of a stage: 128 (8, 4 bits), 64, 32
  constexpr int kChunkBytes = kRowBytes / U;        // a row's bytes of one chunk
  constexpr int kTilesPerWord = 8 / BITS;
  constexpr int kSegTiles = 8 / NG;                 // k16 tiles of a segment (one scale group)
  using Nm = Num<kBF16>;
  extern __shared__ __align__(128) unsigned char smem[];  // (as the fused kernel declares it)
  __shared__ float red[kGemvWarps][kGemvRows];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int stages = args.kp / kCols;
  const int row0 = blockIdx.x * kGemvRows;  // the block's first output row
  // Rows g and g + 8 of the block are rows 16 (bx % 4) + g (+ 8) of 64-row tile bx / 4.
  const unsigned char* wrow = reinterpret_cast<const unsigned char*>(args.qweight) +
                              ((static_cast<int64_t>(blockIdx.x / 4) * stages * 64) + (blockIdx.x % 4) * 16 + g) *
                                  kRowBytes;
  const uint32_t* szrow[2];  // rows past M read row M - 1's scales: finite, never stored
#pragma unroll
  for (int h = 0; h < 2; ++h)
    szrow[h] = static_cast<const uint32_t*>(args.scale_zero) +
               static_cast<int64_t>(min(row0 + g + 8 * h, args.m - 1)) * args.groups;

  struct Stage {
    uint32_t w[2][U * BITS];  // rows g, g + 8: the lane's words of the stage, chunk-major
    uint32_t sz[2][U * NG];  // their (scale, zero) pairs, chunk-major
  };
  auto load = [&](Stage& s, const int st) {
    const unsigned char* p = wrow + static_cast<int64_t>(st) * (64 * kRowBytes);
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
#pragma unroll
      for (int j = 0; j < U * NG; ++j) {
        // Group sizes are powers of two; per-channel groups come with a shift that gives 0, and
        // padding columns clamp to the last group.
        const int col = st * kCols + j * (kChunk / NG);
        s.sz[h][j] = ptx::ldg_b32(szrow[h] + min(col >> args.group_shift, args.groups - 1));
      }
    }
  };

  // The first stage's weights go out before the wait for the previous kernel (programmatic
  // dependent launch, launch.cuh); x after it.
  Stage cur, nxt;
  if (warp < stages) load(cur, warp);
  ptx::griddep_wait();
  {
    const int pieces = args.kp / 8;  // 16-byte pieces of x
    const char* x = static_cast<const char*>(args.x);
    for (int i = threadIdx.x; i < pieces; i += kGemvThreads) ptx::cp_async_cg_16(smem + 16 * i, x + 16 * i);
    ptx::cp_async_commit_group();
    ptx::cp_async_wait_group<0>();
  }
  // Fractional zero points (or force_xsum) need each segment's sum of x: one warp per segment.
  const bool sums = args.force_xsum || !args.integer_zeros;
  float* xsum = reinterpret_cast<float*>(smem + args.kp * 2);
  if (sums) {
    __syncthreads();
    constexpr int kSegCols = kChunk / NG;
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(smem);
    for (int seg = warp; seg < args.kp / kSegCols; seg += kGemvWarps) {
      float v = 0.f;
      for (int c = lane; c < kSegCols; c += 32) v += Nm::to_float(xs[seg * kSegCols + c]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) xsum[seg] = v;
    }
  }
  __syncthreads();

  // This lane's B fragments: columns 16 T + 4 t .. + 3 of each k16 tile (the format's order).
  const unsigned char* xlane = smem + 8 * t;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  // `sums`: the launch applies zero points through the segments' sums of x. Without it every zero
  // is an integer the A fragments subtract exactly (args.integer_zeros, checked on the host), and
  // the segment needs neither the clamp nor the sum term. Where kGemvSplitSums the main loop is
  // built twice, one copy a launch, and `sums` is a Fixed flag; elsewhere it is the launch's
  // bool and each segment branches on it.
  auto compute = [&](const Stage& s, const int st, const auto sums) {
    constexpr bool kFixed = !std::is_same_v<decltype(sums), const bool>;  // a Fixed<> flag
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int j = 0; j < NG; ++j) {
        const int seg = u * NG + j;
        // zc = magic + zi for rows g and g + 8, zi the zero's integer part (integer_zero): the
        // sum in the dtype rounds z to an integer, as rintf would, once z is clamped to the range
        // where magic + zi is exact. bf16 8-bit keeps zi = 0 (lowbit_mm.cuh, unpack_pair).
        const uint32_t zz = ptx::prmt(s.sz[0][seg], s.sz[1][seg], 0x7632);  // {z row g, z row g + 8}
        uint32_t zc2 = Nm::kMagic;
        if constexpr (!(kBF16 && BITS == 8))
          zc2 = Nm::add(!kFixed || sums ? Nm::clamp(zz, Nm::splat(Nm::kZeroLo), Nm::splat(Nm::kZeroHi)) : zz,
                        Nm::kMagic);
        uint32_t zc[2], zo[2] = {0u, 0u};
        float sc[2], zf[2] = {0.f, 0.f};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          zc[h] = ptx::prmt(zc2, zc2, h ? 0x3232 : 0x1010);
          if constexpr (kInPlace<kBF16, BITS>) zo[h] = Nm::sub(Nm::splat(kOddBias<kBF16, BITS>), zc[h]);
          sc[h] = Nm::to_float(static_cast<uint16_t>(s.sz[h][seg] & 0xffffu));
          if (sums)  // z - zi, with zi = zc - magic exact
            zf[h] = Nm::to_float(static_cast<uint16_t>(s.sz[h][seg] >> 16)) -
                    (Nm::to_float(static_cast<uint16_t>(zc[h] & 0xffffu)) - Nm::kMagicValue);
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
          const uint2 b = *reinterpret_cast<const uint2*>(xlane + (st * kCols + u * kChunk + 16 * T) * 2);
          ptx::mma_m16n8k16<kBF16>(part, a, b.x, b.y);
        }
        // acc += s * (sum (q - zi) x - (z - zi) sum x), per row (e / 2)
        if (kFixed && !sums) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[e] = fmaf(sc[e / 2], part[e], acc[e]);
        } else {
          const float xs = sums ? xsum[st * U * NG + seg] : 0.f;
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[e] = fmaf(sc[e / 2], fmaf(-zf[e / 2], xs, part[e]), acc[e]);
        }
      }
    }
  };

  // Two stage buffers in registers, named (not indexed) so they stay in registers.
  auto run = [&](const auto sums_arg) {
    for (int st = warp; st < stages;) {
      int nx = st + kGemvWarps;
      if (nx < stages) load(nxt, nx);
      compute(cur, st, sums_arg);
      st = nx;
      if (st >= stages) break;
      nx = st + kGemvWarps;
      if (nx < stages) load(cur, nx);
      compute(nxt, st, sums_arg);
      st = nx;
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
  if (threadIdx.x < kGemvRows) {
    const int row = row0 + threadIdx.x;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kGemvWarps; ++w) v += red[w][threadIdx.x];
    if (row < args.m) {
      if (args.bias != nullptr) v += load_float<kBF16>(args.bias, row);
      store_float<kBF16>(args.y, row, v);
    }
  }
}

// Host side of one (dtype, bits) pair, instantiated with the fused kernel's variants.
template <bool kBF16, int BITS, int NG>
struct GemvLauncher {
  static constexpr auto kernel = lowbit_gemv_kernel<kBF16, BITS, NG>;
  // The dynamic shared-memory opt-in, once per device: to the most any launch of this kernel asks
  // (kGemvMaxKp), so the attribute does not depend on the layer.
  static cudaError_t allow_smem(int smem) {
    static std::atomic<uint64_t> done{0};
    return allow_smem_once(kernel, smem, done);
  }
  static cudaError_t launch(const LowbitArgs& args, const LowbitPlan& plan, cudaStream_t stream) {
    if (cudaError_t err = allow_smem(gemv_smem_bytes(kGemvMaxKp, NG)); err != cudaSuccess) return err;
    return launch_kernel(kernel, dim3(plan.grid_blocks), kGemvThreads, gemv_smem_bytes(args.kp, NG), stream, plan.pdl,
                         args);
  }
  static int blocks_per_sm(int kp) {
    if (allow_smem(gemv_smem_bytes(kGemvMaxKp, NG)) != cudaSuccess) return 1;
    int blocks = 1;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kGemvThreads, gemv_smem_bytes(kp, NG)) !=
        cudaSuccess)
      return 1;
    return blocks > 0 ? blocks : 1;
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
int gemv_blocks_per_sm(int kp, int ng) {
  return with_groups<kBF16, BITS>(ng, [&](auto g) { return decltype(g)::blocks_per_sm(kp); });
}

#define SPINFER_GEMV_INSTANTIATE(BF16, BITS)                                                           \
  template cudaError_t launch_gemv<BF16, BITS>(const LowbitArgs&, const LowbitPlan&, cudaStream_t); \
  template int gemv_blocks_per_sm<BF16, BITS>(int, int);
#define SPINFER_GEMV_EXTERN(BF16, BITS)                                                                       \
  extern template cudaError_t launch_gemv<BF16, BITS>(const LowbitArgs&, const LowbitPlan&, cudaStream_t); \
  extern template int gemv_blocks_per_sm<BF16, BITS>(int, int);

}  // namespace lowbit
}  // namespace spinfer
