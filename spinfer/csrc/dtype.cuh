// fp16 and bf16 as every kernel sees them, selected by kBF16: an element is its 16 bits
// (uint16_t), a pair is two elements in one 32-bit register (an mma.m16n8k16 fragment
// register). Conversions round to nearest; the pair arithmetic is the dtype's own packed
// instructions (HADD2, HFMA2, HMNMX2, ...), so the kernels' exactness arguments hold for it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace spinfer {

template <bool kBF16>
struct Dtype;
template <>
struct Dtype<false> {
  using Pair = __half2;
  static __device__ __forceinline__ float to_float(uint16_t v) { return __half2float(__ushort_as_half(v)); }
  static __device__ __forceinline__ uint16_t from_float(float v) { return __half_as_ushort(__float2half_rn(v)); }
};
template <>
struct Dtype<true> {
  using Pair = __nv_bfloat162;
  static __device__ __forceinline__ float to_float(uint16_t v) { return __bfloat162float(__ushort_as_bfloat16(v)); }
  static __device__ __forceinline__ uint16_t from_float(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};

// Arithmetic on pairs held in 32-bit registers; cuda_fp16.h and cuda_bf16.h overload every
// intrinsic used here for both pair types.
template <bool kBF16>
struct Packed : Dtype<kBF16> {
  using P = typename Dtype<kBF16>::Pair;
  static __device__ __forceinline__ P pair(uint32_t r) { return *reinterpret_cast<const P*>(&r); }
  static __device__ __forceinline__ uint32_t bits(P p) { return *reinterpret_cast<const uint32_t*>(&p); }
  static __device__ __forceinline__ uint32_t sub(uint32_t a, uint32_t b) { return bits(__hsub2(pair(a), pair(b))); }
  static __device__ __forceinline__ uint32_t add(uint32_t a, uint32_t b) { return bits(__hadd2(pair(a), pair(b))); }
  static __device__ __forceinline__ uint32_t fma(uint32_t a, uint32_t b, uint32_t c) {
    return bits(__hfma2(pair(a), pair(b), pair(c)));
  }
  static __device__ __forceinline__ uint32_t clamp(uint32_t v, uint32_t lo, uint32_t hi) {
    return bits(__hmin2(__hmax2(pair(v), pair(lo)), pair(hi)));
  }
  static __device__ __forceinline__ bool equal(uint32_t a, uint32_t b) {  // both halves; NaN never equal
    return __hbeq2(pair(a), pair(b));
  }
  // 0xffff in each half where a >= b, else 0
  static __device__ __forceinline__ uint32_t ge_mask(uint32_t a, uint32_t b) { return __hge2_mask(pair(a), pair(b)); }
  // Both halves set to half h of r. Written as the intrinsics (not a prmt) so that ptxas can fold
  // it into a consuming HADD2 / HFMA2 as an operand selector (R.H0_H0, R.H1_H1).
  static __device__ __forceinline__ uint32_t broadcast(uint32_t r, int h) {
    if constexpr (kBF16)
      return bits(h ? __high2bfloat162(pair(r)) : __low2bfloat162(pair(r)));
    else
      return bits(h ? __high2half2(pair(r)) : __low2half2(pair(r)));
  }
  // Both halves set to v (rounded once); with a constant v the compiler folds it.
  static __device__ __forceinline__ uint32_t splat(float v) {
    const uint32_t u = Dtype<kBF16>::from_float(v);
    return u | (u << 16);
  }
};

// Element i of a [..] array of the dtype, as float, and its store from float.
template <bool kBF16>
__device__ __forceinline__ float load_float(const void* p, int64_t i) {
  return Dtype<kBF16>::to_float(static_cast<const uint16_t*>(p)[i]);
}
template <bool kBF16>
__device__ __forceinline__ void store_float(void* p, int64_t i, float v) {
  static_cast<uint16_t*>(p)[i] = Dtype<kBF16>::from_float(v);
}

}  // namespace spinfer
