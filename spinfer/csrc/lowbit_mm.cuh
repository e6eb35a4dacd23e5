// The fused weight-only low-bit kernel: y[N, M] = x[N, K] @ W[M, K]^T, W = (q - zero) * scale
// with q at 1, 2, 4 or 8 bits, dequantized in registers straight into mma.m16n8k16 A fragments.
//
// Read top to bottom:
//  * One block of 4 warps owns 64 output rows and a tile of BN tokens; warp w owns rows
//    16w .. 16w+15 and walks a range of 128-column chunks of K (all, or a split-K share).
//  * The packed format puts, inside every 128-column chunk of a row, lane t's values for the
//    8 k16 tiles of the chunk into `bits` consecutive words (spinfer/quant/lowbit.py,
//    `fragment_order`): a lane fetches its whole share of a row with one 4..32-byte load, the
//    4 lanes of a row read one contiguous 16..128-byte span, and no shuffle is needed.
//  * In a word of V = 32/bits values, value s and value s + V/2 sit 16 bits apart, so one
//    LOP3 turns them into a half2 (1024 + q for fp16, 128 + q for bf16: the "magic number"
//    conversion), one HSUB2 makes it exactly q, one HFMA2 applies (q - zero) * scale as
//    q * scale + (-zero * scale).
//  * Weights are read once, straight into registers, one iteration ahead. Activations go
//    through a 3-stage shared-memory ring (cp.async, zero-filled past N) shared by the 4 warps;
//    each lane reads its B fragment for a tile with one 8-byte load.
//  * fp32 accumulation; the shared epilogue (epilogue.cuh) adds bias and casts or reduces
//    split-K partials deterministically.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "epilogue.cuh"
#include "lowbit_mm.h"
#include "ptx.cuh"

namespace spinfer {
namespace lowbit {

constexpr int kChunk = 128;   // K columns per chunk: 8 k16 tiles
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockRows = 16 * kWarps;
constexpr int kStages = 3;

// Chunks per main-loop iteration: 16 words per lane per iteration at 8, 4 and 2 bits (2 KB
// per warp in flight), capped at 512 columns so the activation stages stay small, and at 256
// columns for groups of 32, whose scales would otherwise spill registers.
template <int BITS, int NG>
constexpr int chunks_per_iter() {
  return BITS == 8 ? 1 : BITS == 4 || NG == 4 ? 2 : 4;
}

// Shared memory: kStages activation slices [BN][stride], stride = columns + 16 halves. The
// pad makes row g's 8-byte B-fragment loads start 32 bytes after row g-1's (mod 128), so the
// 16 lanes of a half-warp (4 rows x 4 lanes) cover all 32 banks once.
template <int BITS, int BN, int NG>
struct Layout {
  static constexpr int kCols = chunks_per_iter<BITS, NG>() * kChunk;
  static constexpr int kStride = kCols + 16;
  static constexpr int kStageBytes = BN * kStride * 2;
  static constexpr int kSmemBytes = kStages * kStageBytes;
};

template <bool kBF16>
struct Num;
template <>
struct Num<false> {
  static constexpr uint32_t kMagic = 0x64006400u;  // half2(1024, 1024)
  static __device__ __forceinline__ uint32_t sub(uint32_t a, uint32_t b) {
    const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
  static __device__ __forceinline__ uint32_t add(uint32_t a, uint32_t b) {
    const __half2 r = __hadd2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
  static __device__ __forceinline__ uint32_t fma(uint32_t a, uint32_t b, uint32_t c) {
    const __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b),
                              *reinterpret_cast<const __half2*>(&c));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
  static __device__ __forceinline__ float to_float(uint16_t v) { return __half2float(__ushort_as_half(v)); }
  static __device__ __forceinline__ uint32_t splat(float v) {
    const __half h = __float2half_rn(v);
    const uint32_t u = __half_as_ushort(h);
    return u | (u << 16);
  }
};
template <>
struct Num<true> {
  static constexpr uint32_t kMagic = 0x43004300u;  // bfloat162(128, 128)
  static __device__ __forceinline__ uint32_t sub(uint32_t a, uint32_t b) {
    const __nv_bfloat162 r =
        __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
  static __device__ __forceinline__ uint32_t add(uint32_t a, uint32_t b) {
    const __nv_bfloat162 r =
        __hadd2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
  static __device__ __forceinline__ uint32_t fma(uint32_t a, uint32_t b, uint32_t c) {
    const __nv_bfloat162 r = __hfma2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                     *reinterpret_cast<const __nv_bfloat162*>(&b),
                                     *reinterpret_cast<const __nv_bfloat162*>(&c));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
  static __device__ __forceinline__ float to_float(uint16_t v) { return __bfloat162float(__ushort_as_bfloat16(v)); }
  static __device__ __forceinline__ uint32_t splat(float v) {
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    const uint32_t u = __bfloat16_as_ushort(h);
    return u | (u << 16);
  }
};

// Values s and s + V/2 of a packed word as an exact half2/bfloat162 of q.
template <bool kBF16, int BITS>
__device__ __forceinline__ uint32_t unpack_pair(uint32_t word, int s) {
  constexpr uint32_t kMask = ((1u << BITS) - 1u) * 0x00010001u;
  const uint32_t shifted = word >> (BITS * s);
  if constexpr (kBF16 && BITS == 8) {
    // bf16 holds 128 + q exactly only for q < 128: convert the low 7 bits that way and add
    // bit 7 back as 0 or 128 (0x4300); q <= 255 is exact in bf16.
    const uint32_t low = ptx::and_or(shifted, 0x007f007fu, Num<true>::kMagic);
    const uint32_t high = ((shifted >> 7) & 0x00010001u) * 0x4300u;
    return Num<true>::add(Num<true>::sub(low, Num<true>::kMagic), high);
  } else {
    return Num<kBF16>::sub(ptx::and_or(shifted, kMask, Num<kBF16>::kMagic), Num<kBF16>::kMagic);
  }
}

// One lane's share of an iteration: for each chunk, `BITS` words of row g and of row g+8,
// and the raw (scale | zero << 16) of each of the chunk's NG groups for both rows.
template <int BITS, int NG>
struct Frag {
  static constexpr int U = chunks_per_iter<BITS, NG>();
  uint32_t w[U][2][BITS];
  uint32_t sz[U][NG][2];
};

template <int BITS>
__device__ __forceinline__ void load_words(uint32_t (&dst)[BITS], const uint32_t* src) {
  if constexpr (BITS == 8) {
    const uint4 a = ptx::ldg_stream_v4(src), b = ptx::ldg_stream_v4(src + 4);
    dst[0] = a.x, dst[1] = a.y, dst[2] = a.z, dst[3] = a.w, dst[4] = b.x, dst[5] = b.y, dst[6] = b.z, dst[7] = b.w;
  } else if constexpr (BITS == 4) {
    const uint4 a = ptx::ldg_stream_v4(src);
    dst[0] = a.x, dst[1] = a.y, dst[2] = a.z, dst[3] = a.w;
  } else if constexpr (BITS == 2) {
    const uint2 a = ptx::ldg_stream_v2(src);
    dst[0] = a.x, dst[1] = a.y;
  } else {
    dst[0] = ptx::ldg_stream_u32(src);
  }
}

template <bool kBF16, int BITS, int BN, int NG>
__global__ void __launch_bounds__(kThreads, 4)
    lowbit_mm_kernel(const LowbitArgs args, const int chunks, const int iters_per_split, const int splits) {
  using L = Layout<BITS, BN, NG>;
  using F = Frag<BITS, NG>;
  constexpr int U = F::U;
  constexpr int kTilesPerWord = 8 / BITS;  // k16 tiles whose values one word holds (8-bit: 1)
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_is_last;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * BN;
  const int m_base = blockIdx.y * kBlockRows;
  const int split = blockIdx.z;
  const int total_iters = (chunks + U - 1) / U;
  const int it_begin = split * iters_per_split;
  const int iters = max(0, min(total_iters, it_begin + iters_per_split) - it_begin);
  const int words_per_row = args.kp / 32 * BITS;

  // This lane's rows; rows past M read nothing and dequantize to 0 (scale 0, zero 0).
  int row[2];
  bool row_ok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row[h] = m_base + warp * 16 + g + 8 * h;
    row_ok[h] = row[h] < args.m;
  }
  const uint16_t* scales = static_cast<const uint16_t*>(args.scales);
  const uint16_t* zeros = static_cast<const uint16_t*>(args.zeros);

  auto load_frag = [&](F& f, int it) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = (it_begin + it) * U + u;
      const bool ok_c = c < chunks;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool ok = ok_c && row_ok[h];
        if (ok) {
          load_words<BITS>(f.w[u][h], args.qweight + static_cast<int64_t>(row[h]) * words_per_row +
                                          (c * 4 + t) * BITS);
        } else {
#pragma unroll
          for (int i = 0; i < BITS; ++i) f.w[u][h][i] = 0u;
        }
#pragma unroll
        for (int j = 0; j < NG; ++j) {
          // Group of the chunk's tiles j*8/NG .. : for per-channel groups (size K) this is 0.
          const int grp = min((c * kChunk + j * (kChunk / NG)) / args.group_size, args.groups - 1);
          const int64_t at = static_cast<int64_t>(row[h]) * args.groups + grp;
          f.sz[u][j][h] = ok ? (uint32_t(__ldg(scales + at)) | (uint32_t(__ldg(zeros + at)) << 16)) : 0u;
        }
      }
    }
  };

  auto issue_x = [&](int stage, int it) {  // all threads: 16-byte cp.async, zero past N and K
    unsigned char* st = smem + stage * L::kStageBytes;
    const int k0 = (it_begin + it) * U * kChunk;
    constexpr int kPieces = L::kCols / 8;
    for (int p = tid; p < BN * kPieces; p += kThreads) {
      const int r = p / kPieces, col = (p % kPieces) * 8;
      const bool ok = n0 + r < args.n && k0 + col < args.kp;
      const char* src =
          static_cast<const char*>(args.x) + (ok ? (static_cast<int64_t>(n0 + r) * args.kp + k0 + col) * 2 : 0);
      ptx::cp_async_cg_16(st + (r * L::kStride + col) * 2, src, ok);
    }
  };

  float acc[BN / 8][4];
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

  auto compute = [&](const F& f, int stage) {
    const uint32_t xs = ptx::smem_addr(smem + stage * L::kStageBytes) + (g * L::kStride + 4 * t) * 2;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      uint32_t scale2[NG][2], nzs2[NG][2];  // half2 (s, s) and (-z*s, -z*s)
#pragma unroll
      for (int j = 0; j < NG; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float s = Num<kBF16>::to_float(static_cast<uint16_t>(f.sz[u][j][h] & 0xffffu));
          const float z = Num<kBF16>::to_float(static_cast<uint16_t>(f.sz[u][j][h] >> 16));
          scale2[j][h] = Num<kBF16>::splat(s);
          nzs2[j][h] = Num<kBF16>::splat(-z * s);
        }
#pragma unroll
      for (int tile = 0; tile < 8; ++tile) {
        const int wi = tile / kTilesPerWord, s0 = 2 * (tile % kTilesPerWord), j = tile / (8 / NG);
        uint32_t a[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          a[h] = Num<kBF16>::fma(unpack_pair<kBF16, BITS>(f.w[u][h][wi], s0), scale2[j][h], nzs2[j][h]);
          a[h + 2] = Num<kBF16>::fma(unpack_pair<kBF16, BITS>(f.w[u][h][wi], s0 + 1), scale2[j][h], nzs2[j][h]);
        }
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) {
          uint32_t b0, b1;
          asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n"
                       : "=r"(b0), "=r"(b1)
                       : "r"(xs + (nb * 8 * L::kStride + u * kChunk + 16 * tile) * 2));
          ptx::mma_m16n8k16<kBF16>(acc[nb], a, b0, b1);
        }
      }
    }
  };

  // Stage i is consumed while stage i+1 is in flight; weights come one iteration ahead.
  // A group is committed every iteration (empty near the end) so wait_group's count stays
  // uniform.
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < iters) issue_x(st, st);
    ptx::cp_async_commit_group();
  }
  F cur, nxt;
  if (iters > 0) load_frag(cur, 0);
  for (int i = 0; i < iters; ++i) {
    if (i + 1 < iters) load_frag(nxt, i + 1);
    ptx::cp_async_wait_group<kStages - 2>();
    // Stage i is visible to all threads, and all threads are done with stage i-1, whose
    // buffer the prefetch below overwrites.
    __syncthreads();
    const int pf = i + kStages - 1;
    if (pf < iters) issue_x(pf % kStages, pf);
    ptx::cp_async_commit_group();
    compute(cur, i % kStages);
    cur = nxt;
  }
  ptx::cp_async_wait_group<0>();
  const TileOut out{args.y, args.bias, args.workspace, args.counters, args.m, args.n};
  store_tile<kBF16, BN, kBlockRows, kThreads>(out, m_base, warp * 16 + g, n0, split, splits, acc, lane, tid,
                                              &s_is_last);
}

// Host side of one (dtype, bits) pair: the BN and NG variants, instantiated in
// lowbit_mm_{fp16,bf16}_{1,2,4,8}.cu so nvcc builds them in parallel.
template <bool kBF16, int BITS, int BN, int NG>
struct Launcher {
  static cudaError_t launch(const LowbitArgs& args, const LowbitPlan& plan, cudaStream_t stream) {
    auto kernel = lowbit_mm_kernel<kBF16, BITS, BN, NG>;
    constexpr int kSmem = Layout<BITS, BN, NG>::kSmemBytes;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
    constexpr int U = chunks_per_iter<BITS, NG>();
    const int total_iters = (plan.chunks + U - 1) / U;
    const int iters_per_split = (total_iters + plan.splits - 1) / plan.splits;
    const dim3 grid(plan.n_tiles, plan.row_blocks, plan.splits);
    kernel<<<grid, kThreads, kSmem, stream>>>(args, plan.chunks, iters_per_split, plan.splits);
    return cudaGetLastError();
  }
  static int blocks_per_sm() {
    auto kernel = lowbit_mm_kernel<kBF16, BITS, BN, NG>;
    constexpr int kSmem = Layout<BITS, BN, NG>::kSmemBytes;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) != cudaSuccess) return 1;
    int blocks = 1;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, kSmem) != cudaSuccess) return 1;
    return blocks > 0 ? blocks : 1;
  }
};

template <bool kBF16, int BITS, int BN>
cudaError_t launch_ng(int ng, const LowbitArgs& args, const LowbitPlan& plan, cudaStream_t stream) {
  switch (ng) {
    case 4: return Launcher<kBF16, BITS, BN, 4>::launch(args, plan, stream);
    case 2: return Launcher<kBF16, BITS, BN, 2>::launch(args, plan, stream);
    default: return Launcher<kBF16, BITS, BN, 1>::launch(args, plan, stream);
  }
}
template <bool kBF16, int BITS, int BN>
int blocks_per_sm_ng(int ng) {
  switch (ng) {
    case 4: return Launcher<kBF16, BITS, BN, 4>::blocks_per_sm();
    case 2: return Launcher<kBF16, BITS, BN, 2>::blocks_per_sm();
    default: return Launcher<kBF16, BITS, BN, 1>::blocks_per_sm();
  }
}

// The entry points of one (dtype, bits) pair, for the runtime tile width and groups/chunk.
template <bool kBF16, int BITS>
cudaError_t launch(const LowbitArgs& args, const LowbitPlan& plan, cudaStream_t stream) {
  switch (plan.bn) {
    case 8: return launch_ng<kBF16, BITS, 8>(plan.ng, args, plan, stream);
    case 16: return launch_ng<kBF16, BITS, 16>(plan.ng, args, plan, stream);
    default: return launch_ng<kBF16, BITS, 32>(plan.ng, args, plan, stream);
  }
}
template <bool kBF16, int BITS>
int blocks_per_sm(int bn, int ng) {
  switch (bn) {
    case 8: return blocks_per_sm_ng<kBF16, BITS, 8>(ng);
    case 16: return blocks_per_sm_ng<kBF16, BITS, 16>(ng);
    default: return blocks_per_sm_ng<kBF16, BITS, 32>(ng);
  }
}

#define SPINFER_LOWBIT_INSTANTIATE(BF16, BITS)                                                        \
  template cudaError_t launch<BF16, BITS>(const LowbitArgs&, const LowbitPlan&, cudaStream_t); \
  template int blocks_per_sm<BF16, BITS>(int, int);
#define SPINFER_LOWBIT_EXTERN(BF16, BITS)                                                                    \
  extern template cudaError_t launch<BF16, BITS>(const LowbitArgs&, const LowbitPlan&, cudaStream_t); \
  extern template int blocks_per_sm<BF16, BITS>(int, int);
#define SPINFER_LOWBIT_FOR_BITS(X, BF16) X(BF16, 1) X(BF16, 2) X(BF16, 4) X(BF16, 8)

}  // namespace lowbit
}  // namespace spinfer
