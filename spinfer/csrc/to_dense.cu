// Weight-to-dense kernels (to_dense.h): TCA-BME -> dense and packed low-bit -> dense. Both are
// pure streams (read the compressed weight once, write 2 bytes per element once); with them,
// "decode, then cuBLAS" costs one pass over memory instead of the seconds-per-gigabyte of the
// torch-op decoders, and it is what the layers run at large token counts (docs/kernels.md).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "dtype.cuh"
#include "lowbit_mm.h"  // the scale and zero records
#include "to_dense.h"

namespace spinfer {
namespace to_dense {

constexpr int kThreads = 128;
constexpr int kMaxGridY = 65535;

// ---- TCA-BME (GroupTile 64x64; spinfer/format/tca_bme.py has the layout) --------------------
constexpr int kGt = 64;
constexpr int kWords = kGt * kGt / 64;   // BitmapTile words per GroupTile
constexpr int kRunCap = kGt * kGt + 8;   // a dense GroupTile's run and its 16-byte padding

// One block per GroupTile: the run goes to shared memory with 16-byte copies, threads 0-63 scan
// the words' PopCounts, then each thread writes whole 8-element BitmapTile rows (16 bytes). The
// items run row-major over the GroupTile, so 8 consecutive threads write one 128-byte row span.
__global__ void __launch_bounds__(kThreads) tca_bme_kernel(const TcaBmeToDenseArgs a) {
  __shared__ uint64_t s_bits[kWords];
  __shared__ int s_prefix[kWords];
  __shared__ int s_first_half;  // set bits in words 0-31 (the first warp's total)
  __shared__ __align__(16) uint16_t s_vals[kRunCap];
  const int tid = threadIdx.x, gc = blockIdx.x;
  for (int gr = blockIdx.y; gr < a.grid_m; gr += gridDim.y) {
    const int64_t g = static_cast<int64_t>(gr) * a.grid_k + gc;
    // The run, clamped to the values array and to a dense GroupTile: corrupt offsets read wrong
    // values but stay in bounds.
    const int64_t start = min(max(static_cast<int64_t>(a.gtile_offset[g]), int64_t(0)), a.nvalues);
    const int64_t end = min(max(static_cast<int64_t>(a.gtile_offset[g + 1]), start), a.nvalues);
    const int len = static_cast<int>(min(end - start, static_cast<int64_t>(kRunCap)));
    const uint16_t* src = a.values + start;
    int done = 0;
    if ((reinterpret_cast<uintptr_t>(src) & 15) == 0) {  // runs of valid arrays start 16-byte aligned
      done = len / 8 * 8;
      for (int i = tid; i < len / 8; i += kThreads)
        reinterpret_cast<uint4*>(s_vals)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
    for (int i = done + tid; i < len; i += kThreads) s_vals[i] = src[i];
    if (tid < kWords) {
      const uint64_t w = a.bitmap[g * kWords + tid];
      const int c = __popcll(w);
      int incl = c;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int v = __shfl_up_sync(0xffffffffu, incl, d);
        if ((tid & 31) >= d) incl += v;
      }
      s_bits[tid] = w;
      s_prefix[tid] = incl - c;  // exclusive, within this word's warp
      if (tid == 31) s_first_half = incl;
    }
    __syncthreads();
    for (int item = tid; item < kGt * 8; item += kThreads) {
      const int row = item >> 3, seg = item & 7;  // GroupTile row, 8-column segment
      // TCTile (row / 16, seg / 2), BitmapTile (seg % 2, (row / 8) % 2) in column-major order
      const int word = ((row >> 4) * 4 + (seg >> 1)) * 4 + (seg & 1) * 2 + ((row >> 3) & 1);
      const uint64_t bits = s_bits[word];
      const int r = row & 7;
      const int first = s_prefix[word] + (word >= 32 ? s_first_half : 0) + __popcll(bits & ((uint64_t(1) << (8 * r)) - 1));
      const uint32_t byte = static_cast<uint32_t>(bits >> (8 * r)) & 0xffu;
      uint32_t packed[4] = {0, 0, 0, 0};
#pragma unroll
      for (int c = 0; c < 8; ++c) {  // element c is value first + (set bits before c), if set
        const int idx = first + __popc(byte & ((1u << c) - 1u));
        if (((byte >> c) & 1u) && idx < len) packed[c / 2] |= static_cast<uint32_t>(s_vals[idx]) << (16 * (c & 1));
      }
      const int orow = gr * kGt + row, ocol = gc * kGt + seg * 8;
      if (orow < a.m && ocol < a.k) {
        uint16_t* dst = a.out + static_cast<int64_t>(orow) * a.k + ocol;
        if ((a.k & 7) == 0) {  // 16-byte aligned rows (the output is a fresh allocation)
          *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        } else {
#pragma unroll
          for (int c = 0; c < 8; ++c)
            if (ocol + c < a.k) dst[c] = static_cast<uint16_t>(packed[c / 2] >> (16 * (c & 1)));
        }
      }
    }
    __syncthreads();  // the next GroupTile row reuses the shared arrays
  }
}

// ---- packed low-bit (spinfer/quant/lowbit.py has the layout) --------------------------------
// One thread per 8 output columns of one row: in the fragment order those are 4 values from
// each of two words (lanes 2h and 2h+1 of k16 tile T, where the columns are 16T + 8h .. +7), so
// a thread loads two words, a scale and a zero, and stores 16 bytes. A block covers 1024
// consecutive columns of a row; rows run along the grid's y dimension.
template <bool kBF16, int BITS>
__global__ void __launch_bounds__(kThreads) lowbit_kernel(const LowbitToDenseArgs a) {
  constexpr int V = 32 / BITS;                     // values per word
  constexpr int Q = V / 4;                         // k16 tiles per word and lane
  constexpr int H = V / 2;                         // a pair's two values are H positions apart
  constexpr int S = BITS == 8 ? 128 : 256;         // columns per qweight tile
  constexpr int kRowWords = S * BITS / 32;         // words of one row of a tile
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  using D = Dtype<kBF16>;
  const int c0 = (blockIdx.x * kThreads + threadIdx.x) * 8;
  if (c0 >= a.k) return;
  const int t16 = (c0 & 127) >> 4, h = (c0 >> 3) & 1;
  const int stages = a.kp / S;
  const int in_row = ((c0 % S) >> 7) * 4 * BITS + (t16 / Q) + 2 * h * BITS;
  const int sbase = 2 * (t16 % Q);
  for (int row = blockIdx.y; row < a.m; row += gridDim.y) {
    const int64_t base = ((static_cast<int64_t>(row >> 6) * stages + c0 / S) * 64 + (row & 63)) * kRowWords + in_row;
    const uint32_t words[2] = {a.qweight[base], a.qweight[base + BITS]};
    const int r = row % kRecordTileRows;  // the row in its tile's record (lowbit_mm.h)
    const uint32_t* rec = static_cast<const uint32_t*>(a.scale_zero) +
                          record_word(row / kRecordTileRows, c0 >> a.group_shift, a.groups, record_words(a.nibble_zeros));
    const int half = zero_shift_of(r, false);  // the row's half of its scale word (and of a dtype zero's)
    const uint32_t zw = rec[zero_word_of(r, a.nibble_zeros)];
    const float scale = D::to_float(static_cast<uint16_t>(rec[scale_word_of(r)] >> half));
    const float zero = a.nibble_zeros ? static_cast<float>((zw >> zero_shift_of(r, true)) & 15u)
                                      : D::to_float(static_cast<uint16_t>(zw >> half));
    uint32_t packed[4] = {0, 0, 0, 0};
#pragma unroll
    for (int l = 0; l < 2; ++l)
#pragma unroll
      for (int slot = 0; slot < 4; ++slot) {
        const int p = sbase + slot / 2 + (slot & 1) * H;  // pair s = sbase + slot / 2, half e = slot % 2
        const uint32_t q = (words[l] >> (BITS * p)) & kMask;
        const uint16_t w = D::from_float(__fmul_rn(__fsub_rn(static_cast<float>(q), zero), scale));
        packed[2 * l + slot / 2] |= static_cast<uint32_t>(w) << (16 * (slot & 1));
      }
    uint16_t* dst = static_cast<uint16_t*>(a.out) + static_cast<int64_t>(row) * a.k + c0;
    if ((a.k & 7) == 0) {  // 16-byte aligned rows (the output is a fresh allocation)
      *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    } else {
#pragma unroll
      for (int c = 0; c < 8; ++c)
        if (c0 + c < a.k) dst[c] = static_cast<uint16_t>(packed[c / 2] >> (16 * (c & 1)));
    }
  }
}

template <bool kBF16>
cudaError_t launch_lowbit(const LowbitToDenseArgs& a, cudaStream_t stream) {
  const dim3 grid((a.k + 8 * kThreads - 1) / (8 * kThreads), std::min(a.m, kMaxGridY));
  switch (a.bits) {
    case 1: lowbit_kernel<kBF16, 1><<<grid, kThreads, 0, stream>>>(a); break;
    case 2: lowbit_kernel<kBF16, 2><<<grid, kThreads, 0, stream>>>(a); break;
    case 4: lowbit_kernel<kBF16, 4><<<grid, kThreads, 0, stream>>>(a); break;
    case 8: lowbit_kernel<kBF16, 8><<<grid, kThreads, 0, stream>>>(a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace to_dense

cudaError_t tca_bme_to_dense(const TcaBmeToDenseArgs& a, cudaStream_t stream) {
  if (a.m < 1 || a.k < 1) return cudaSuccess;
  const dim3 grid(a.grid_k, std::min(a.grid_m, to_dense::kMaxGridY));
  to_dense::tca_bme_kernel<<<grid, to_dense::kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t lowbit_to_dense(const LowbitToDenseArgs& a, cudaStream_t stream) {
  if (a.m < 1 || a.k < 1) return cudaSuccess;
  return a.bf16 ? to_dense::launch_lowbit<true>(a, stream) : to_dense::launch_lowbit<false>(a, stream);
}

}  // namespace spinfer
