// Thin wrappers over the PTX instructions the kernels use, one per instruction, named for it.
// sm_80 and later (cp.async, mma.sync m16n8k16 with fp16/bf16 inputs); the bulk-copy and
// mbarrier wrappers compile to nothing below sm_90, where the kernels never select them.
#pragma once

#include <cstdint>

namespace spinfer {
namespace ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared async copy through L2 only (.cg: the weight stream is read once, so
// keeping it out of L1 leaves L1 for nothing else but costs nothing). When `valid` is false
// the source is not read and the 16 destination bytes are zero-filled (src-size 0).
__device__ __forceinline__ void cp_async_cg_16(uint32_t smem_dst, const void* gmem_src, bool valid = true) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_cg_16(void* smem_dst, const void* gmem_src, bool valid = true) {
  cp_async_cg_16(smem_addr(smem_dst), gmem_src, valid);
}

// The L2 policy of a weight stream: evict_first, or evict_normal (SPINFER_L2_EVICT_FIRST=0: A/B
// runs). A decode layer streams more bytes than L2 holds (50 MB on an H100); read with the normal
// policy they evict everything else L2 held, and every launch of a CUDA graph that holds such a
// layer then starts ~0.16 us later, from the graph's first kernel on: what the launches read comes
// from DRAM again (scripts/graph_l2_probe.py, docs/kernels.md). evict_first lines are replaced before
// normal ones, so the stream recycles its own lines. Used by the SMBD kernel's bulk copies: ptxas
// 13.0 miscompiled `cp.async.cg ... .L2::cache_hint` in the fused low-bit kernel and the SMBD
// cp.async loader (its descriptor read from a uniform register it never wrote: an illegal
// instruction), so the cp.async loaders get the policy from their launch instead (an access-policy
// window, launch.cuh: StreamWindow).
__device__ __forceinline__ uint64_t l2_stream_policy(bool evict_first) {
  uint64_t policy;
  if (evict_first)
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  else
    asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// 16-byte global->shared async copy through L1 (.ca): data that other blocks on the SM read again.
__device__ __forceinline__ void cp_async_ca_16(uint32_t smem_dst, const void* gmem_src, bool valid = true) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src), "r"(src_bytes)
               : "memory");
}

// 8-byte global->shared async copy through L1 (.ca: the only form for sizes below 16).
__device__ __forceinline__ void cp_async_ca_8(uint32_t smem_dst, const void* gmem_src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_dst), "l"(gmem_src) : "memory");
}

// 4-byte global->shared async copy through L1 (.ca: the only form for sizes below 16); zero
// fill when `valid` is false, as above.
__device__ __forceinline__ void cp_async_ca_4(uint32_t smem_dst, const void* gmem_src, bool valid = true) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_dst), "l"(gmem_src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_ca_4(void* smem_dst, const void* gmem_src, bool valid = true) {
  cp_async_ca_4(smem_addr(smem_dst), gmem_src, valid);
}

__device__ __forceinline__ void cp_async_commit_group() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// cp_async_wait_group for a count known only at run time (0..2: pipelines of 2 to 4 stages).
__device__ __forceinline__ void cp_async_wait_group_dynamic(int n) {
  if (n <= 0) cp_async_wait_group<0>();
  else if (n == 1) cp_async_wait_group<1>();
  else cp_async_wait_group<2>();
}

// Zero, computed from `v`: added to an address, it makes the access wait until `v` has arrived
// (the low-bit GEMV orders a stage's wait before the next stage's loads with it).
__device__ __forceinline__ uint32_t zero_after(uint32_t v) {
  uint32_t z;
  // popc(v) <= 32, so popc(v) >> 6 is 0; ptxas folds `and v, 0` away but does not know this.
  asm volatile("{\n.reg .b32 c;\npopc.b32 c, %1;\nshr.u32 %0, c, 6;\n}\n" : "=r"(z) : "r"(v));
  return z;
}

// `v`, as a value the compiler cannot recompute: it stays in a register. Without it, values
// derived from the thread index are recomputed where they are used, inside loops too (the low-bit
// GEMV's per-lane ring offsets). Not volatile, so that an unused one is still removed.
__device__ __forceinline__ uint32_t keep(uint32_t v) {
  uint32_t r;
  asm("mov.b32 %0, %1;" : "=r"(r) : "r"(v));
  return r;
}
template <typename T>
__device__ __forceinline__ const T* keep(const T* p) {
  uint64_t r;
  asm("mov.b64 %0, %1;" : "=l"(r) : "l"(reinterpret_cast<uint64_t>(p)));
  return reinterpret_cast<const T*>(r);
}

// Read-only global loads (ld.global.nc): `stream_*` for data read once (the low-bit GEMV's weights:
// L1::no_allocate keeps them from evicting what L1 holds for the block), `ldg_b32` for small
// values the neighbouring warps read again (scales). Volatile for the streamed ones: they are
// issued in program order, a stage ahead of the compute that waits on them.
__device__ __forceinline__ uint4 stream_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 stream_v2(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t stream_b32(const void* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ldg_b32(const void* p) {
  uint32_t v;
  asm volatile("ld.global.nc.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

// (a & b) | c in one LOP3.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Four 8x8 b16 matrices from shared memory: lane i gives the address of row i%8 of matrix i/8
// (16 bytes, 16-byte aligned) and receives, in r[j], row lane/4, columns 2*(lane%4) and +1 of
// matrix j: exactly an mma.m16n8k16 B fragment when the rows are tokens and the columns k.
// Volatile: it reads shared memory that the pipeline's waits make valid.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Integer multiply and multiply-high on the FMA pipe. As inline PTX so the compiler cannot
// turn a multiply by a power of two into a shift, which would run on the ALU pipe: the SMBD
// decode moves work off the busy ALU pipe onto the idle FMA pipe on purpose.
__device__ __forceinline__ uint32_t mul_lo(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.lo.u32 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t mul_hi(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.hi.u32 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Byte permute with the hardware's selector: each nibble's bit 3 replicates the chosen byte's
// sign (the SMBD pair selector uses that for its zero bytes). __byte_perm masks the bit off with
// an extra LOP3 per call.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// One step of an inclusive warp scan: v + (the value of lane - d), or v where lane < d. The
// shuffle's own predicate says whether the source lane exists, so a step is a shuffle and a
// predicated add, where __shfl_up_sync with `if (lane >= d)` compiled to a shuffle, a compare,
// a select and an add (CUB's scans use the same form).
template <int D>
__device__ __forceinline__ uint32_t scan_up_add(uint32_t v) {
  asm("{\n"
      "  .reg .u32 t;\n"
      "  .reg .pred p;\n"
      "  shfl.sync.up.b32 t|p, %0, %1, 0, 0xffffffff;\n"
      "  @p add.u32 %0, %0, t;\n"
      "}\n"
      : "+r"(v)
      : "n"(D));
  return v;
}

// 2-byte shared-memory load from a 32-bit shared address (zero-extended).
__device__ __forceinline__ uint32_t lds_u16(uint32_t addr) {
  unsigned short v;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(addr));
  return v;
}

// Device-scope acquire-release fence: with a relaxed atomic after it (release) or before it
// (acquire), the pattern that publishes a block's global writes to the block that reads them.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }

// Device-scope acquire load (a split-K reducer reading the count of the partials stored before it).
__device__ __forceinline__ int ld_acquire_gpu(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// ---- sm_90: bulk async copies completing on an mbarrier (the copy engine moves a whole
// contiguous run, so one thread issues what 128 threads of cp.async would) ----------------

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}

// One arrival on `bar` once every cp.async this thread issued before it has landed (.noinc: the
// arrival counts against the barrier's expected count, which must include it).
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Makes mbarrier.init visible to the async proxy (the copy engine) before first use.
__device__ __forceinline__ void fence_mbarrier_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// Orders this thread's earlier generic-proxy shared-memory accesses before later async-proxy
// ones (the bulk copy about to overwrite a buffer that was just read with ld.shared).
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// One arrival that also announces `bytes` of async copies the phase must wait for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}

// A plain arrival (release semantics: this thread's earlier shared-memory reads are ordered
// before whoever waits on the phase).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Global -> shared bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned);
// its completion counts `bytes` against the mbarrier's expected transactions.
__device__ __forceinline__ void cp_async_bulk_g2s(void* smem_dst, const void* gmem_src, uint32_t bytes,
                                                  uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_addr(smem_dst)),
      "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
#endif
}
// The same for a weight stream, under an L2 policy from l2_stream_policy.
__device__ __forceinline__ void cp_async_bulk_g2s(void* smem_dst, const void* gmem_src, uint32_t bytes,
                                                  uint64_t* bar, uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::
          "r"(smem_addr(smem_dst)),
      "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
#endif
}

// Global -> shared tensor copy of the box at coordinates (c0, c1) (innermost first) of a 2-D
// tensor map (a __grid_constant__ kernel parameter, by its generic address) to a 128-byte-aligned
// address; its bytes, zeros past the tensor's bounds included, count against the mbarrier.
__device__ __forceinline__ void cp_async_bulk_tensor_2d_g2s(void* smem_dst, const void* map, int c0, int c1,
                                                            uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];\n" ::"r"(smem_addr(smem_dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
#endif
}

// Brings a tensor map (a kernel parameter, by its generic address) into the copy engine's cache
// ahead of its first copy.
__device__ __forceinline__ void prefetch_tensormap(const void* map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
#endif
}

// The block barrier (barrier 0, every thread of the block) for warp-specialized loops that reach
// it from different code: the producer's loop and the decoding warps' loop each execute it once
// a step. __syncthreads() compiles to bar.sync, the .aligned form, which requires every thread of
// the block to execute the same instruction; barrier.sync without .aligned does not. Each warp
// reconverges first, so the barrier still counts whole warps (compute-sanitizer's synccheck
// flagged the producer warp's lanes arriving apart without it).
__device__ __forceinline__ void bar_sync_block() {
  __syncwarp();
  asm volatile("barrier.sync 0;\n" ::: "memory");
}

// Blocks until the barrier's phase with this parity has completed. The retry loop is inside the
// asm: written as a C++ loop around try_wait, it cost a convergence region (BSSY/BSYNC) and the
// barrier's shared address rebuilt on every call, ~5 instructions a stage in the SMBD loop.
__device__ __forceinline__ void mbarrier_wait_parity(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, uint32_t parity) {
  mbarrier_wait_parity(smem_addr(bar), parity);
}

// ---- sm_90: programmatic dependent launch. A kernel launched with programmatic stream
// serialization may start while the previous kernel in the stream still runs; griddep_wait()
// returns once that kernel has completed and its writes are visible, so everything before it
// may read only what no earlier kernel writes (weights), and every global write and every read
// of activations comes after it. Both are no-ops in a kernel launched without the attribute.

__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the next kernel in the stream, if launched with the attribute, start its own prologue.
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// D = A * B + D, m16n8k16, A row-major 16x16 (4 regs), B column-major 16x8 (2 regs), fp32 acc.
// Not volatile: the mma touches only registers, so the compiler may schedule shared loads and
// dequantization of the next tile across it (volatile asm statements keep their order).
template <bool kBF16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_m16n8k16<false>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<true>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}


// Warp-group MMA (sm_90a): D[64 x N] += A[64 x 16] * B[16 x N] for the four warps of a warp group,
// A from registers (each warp its 16 rows, in mma.m16n8k16's A-fragment layout), B from shared
// memory through a matrix descriptor, fp32 accumulators in mma.m16n8k16's C layout per 8 columns
// (d[j] holds columns 8 j .. 8 j + 7 of the warp's rows). Asynchronous: wgmma_fence() orders the
// registers' earlier writes before the next wgmma reads them, wgmma_commit() closes a group and
// wgmma_wait<G>() waits until at most G groups are in flight; a wgmma's A registers and
// accumulators must not be touched until its group has been waited for. Compiled only where
// the sm_90a features are (the kernels that call them trap elsewhere, and the host launches them
// on sm_90 only).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SPINFER_WGMMA 1
#endif

__device__ __forceinline__ void wgmma_fence() {
#ifdef SPINFER_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef SPINFER_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int G>
__device__ __forceinline__ void wgmma_wait() {
#ifdef SPINFER_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(G) : "memory");
#endif
}
// Keeps the compiler from moving reads or writes of an accumulator across this point (the wgmma
// writes it behind the compiler's back until its group is waited for).
__device__ __forceinline__ void wgmma_hold(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Descriptor of a K-major B operand without swizzle: 8 x 16-byte core matrices (8 columns of N,
// 8 elements of K each), `lbo` bytes to the next 8 elements of K, `sbo` bytes to the next 8 of N;
// as its low and high words. The low word holds the start address / 16 in bits 0-13, so a start
// `bytes` further on is the low word + bytes / 16 (shared addresses are below 256 KB): one 32-bit
// add where a 64-bit one took two instructions and two moves to uniform registers.
__device__ __forceinline__ uint32_t wgmma_desc_lo(uint32_t smem_address, uint32_t lbo) {
  return ((smem_address & 0x3FFFF) >> 4) | ((lbo >> 4) << 16);
}
__device__ __forceinline__ constexpr uint32_t wgmma_desc_hi(uint32_t sbo) { return sbo >> 4; }
// The high word for the 128-byte swizzle (layout type 1 in bits 62-63): rows of 128 bytes of K,
// 16-byte units XORed with the row's index mod 8, as a tensor copy with CU_TENSOR_MAP_SWIZZLE_128B
// writes them to a 1024-byte aligned address; `sbo` to the next 8 rows (1024), the leading offset
// unused (a k16 tile lies inside a row), and a k16 tile `t` of the row starts 32 t bytes on.
__device__ __forceinline__ constexpr uint32_t wgmma_desc_hi_sw128(uint32_t sbo) { return (sbo >> 4) | (1u << 30); }

// One thread's accumulators as asm operands %0 ... (4 at N = 8, 8 at 16, 16 at 32, 32 at 64, 64 at 128).
#define SPINFER_WGMMA_ACC8 "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
#define SPINFER_WGMMA_ACC16 \
  SPINFER_WGMMA_ACC8, "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
#define SPINFER_WGMMA_ACC32 \
  SPINFER_WGMMA_ACC16, \
  "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
  "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
#define SPINFER_WGMMA_ACC64 \
  SPINFER_WGMMA_ACC32, \
  "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), \
  "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
  "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
  "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define SPINFER_WGMMA_ACC128 \
  SPINFER_WGMMA_ACC64, \
  "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), \
  "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
  "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), \
  "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
  "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), \
  "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
  "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
  "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
// wgmma.mma_async.m64nNk16 on TYPE (f16 or bf16): the accumulators, then A's four registers, the
// descriptor's two words and scale-d (1: accumulate), as the operands numbered in DREGS, AREGS, LO,
// HI and ONE.
#define SPINFER_WGMMA_ASM(N, TYPE, DREGS, AREGS, LO, HI, ONE)                                           \
  "{\n.reg .pred p;\n.reg .b64 desc;\nsetp.ne.b32 p, " ONE ", 0;\nmov.b64 desc, {" LO ", " HI "};\n" \
  "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TYPE "." TYPE " {" DREGS "}, {" AREGS "}, desc, p, 1, 1, "  \
  "0;\n}\n"
#define SPINFER_WGMMA_ASM8(TYPE) SPINFER_WGMMA_ASM("8", TYPE, "%0,%1,%2,%3", "%4,%5,%6,%7", "%8", "%9", "%10")
#define SPINFER_WGMMA_ASM16(TYPE) \
  SPINFER_WGMMA_ASM("16", TYPE, "%0,%1,%2,%3,%4,%5,%6,%7", "%8,%9,%10,%11", "%12", "%13", "%14")
#define SPINFER_WGMMA_ASM32(TYPE)                                                                     \
  SPINFER_WGMMA_ASM("32", TYPE, "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15", "%16,%17,%18,%19", \
                    "%20", "%21", "%22")
#define SPINFER_WGMMA_ASM64(TYPE)                        \
  SPINFER_WGMMA_ASM("64", TYPE,                          \
                    "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"  \
                    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31",  \
                    "%32,%33,%34,%35", "%36", "%37", "%38")
#define SPINFER_WGMMA_ASM128(TYPE)                        \
  SPINFER_WGMMA_ASM("128", TYPE,                          \
                    "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"  \
                    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63",  \
                    "%64,%65,%66,%67", "%68", "%69", "%70")
#define SPINFER_WGMMA_IN "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(desc_lo), "r"(desc_hi), "r"(1)

template <bool kBF16, int N>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 8][4], const uint32_t (&a)[4], uint32_t desc_lo,
                                             uint32_t desc_hi) {
  static_assert(N == 8 || N == 16 || N == 32 || N == 64 || N == 128, "the SMBD kernel's tiles of 8 to 128 tokens");
#ifdef SPINFER_WGMMA
  if constexpr (N == 8 && !kBF16)
    asm volatile(SPINFER_WGMMA_ASM8("f16") : SPINFER_WGMMA_ACC8 : SPINFER_WGMMA_IN);
  else if constexpr (N == 8)
    asm volatile(SPINFER_WGMMA_ASM8("bf16") : SPINFER_WGMMA_ACC8 : SPINFER_WGMMA_IN);
  else if constexpr (N == 16 && !kBF16)
    asm volatile(SPINFER_WGMMA_ASM16("f16") : SPINFER_WGMMA_ACC16 : SPINFER_WGMMA_IN);
  else if constexpr (N == 16)
    asm volatile(SPINFER_WGMMA_ASM16("bf16") : SPINFER_WGMMA_ACC16 : SPINFER_WGMMA_IN);
  else if constexpr (N == 32 && !kBF16)
    asm volatile(SPINFER_WGMMA_ASM32("f16") : SPINFER_WGMMA_ACC32 : SPINFER_WGMMA_IN);
  else if constexpr (N == 32)
    asm volatile(SPINFER_WGMMA_ASM32("bf16") : SPINFER_WGMMA_ACC32 : SPINFER_WGMMA_IN);
  else if constexpr (N == 64 && !kBF16)
    asm volatile(SPINFER_WGMMA_ASM64("f16") : SPINFER_WGMMA_ACC64 : SPINFER_WGMMA_IN);
  else if constexpr (N == 64)
    asm volatile(SPINFER_WGMMA_ASM64("bf16") : SPINFER_WGMMA_ACC64 : SPINFER_WGMMA_IN);
  else if constexpr (!kBF16)
    asm volatile(SPINFER_WGMMA_ASM128("f16") : SPINFER_WGMMA_ACC128 : SPINFER_WGMMA_IN);
  else
    asm volatile(SPINFER_WGMMA_ASM128("bf16") : SPINFER_WGMMA_ACC128 : SPINFER_WGMMA_IN);
#endif
}

}  // namespace ptx
}  // namespace spinfer
