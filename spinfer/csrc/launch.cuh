// Kernel launches shared by the tensor-core kernels: with programmatic dependent launch on
// sm_90, so a launch's prologue (block setup, the first stages' weight copies) overlaps the end
// of the kernel before it in the stream, in eager streams and in captured CUDA graphs alike.
// The kernels call ptx::griddep_wait() before their first read of x and their first global
// write (ptx.cuh).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include <cstdlib>
#include <cstring>

namespace spinfer {

// Whether launches on a device of this compute capability use programmatic dependent launch;
// SPINFER_PDL=0 turns it off (A/B runs, tests).
inline bool use_pdl(int major) {
  const char* env = std::getenv("SPINFER_PDL");
  return major >= 9 && !(env && env[0] == '0');
}

// Whether the kernels stream their weights under L2's evict_first policy (ptx::l2_stream_policy);
// SPINFER_L2_EVICT_FIRST=0 reads them with the normal policy (A/B runs).
inline bool use_l2_evict_first() {
  const char* env = std::getenv("SPINFER_L2_EVICT_FIRST");
  return !(env && env[0] == '0');
}

// Whether a device of this compute capability may copy with the sm_90 bulk loader (the SMBD
// kernel's bitmaps and value runs, the low-bit kernel's weight tiles at 4 and 8 bits);
// SPINFER_LOADER=cp_async keeps the cp.async loaders sm_80 runs (A/B runs, tests).
inline bool use_bulk_loader(int major) {
  const char* env = std::getenv("SPINFER_LOADER");
  return major >= 9 && !(env && std::strcmp(env, "cp_async") == 0);
}

// A kernel's dynamic shared-memory opt-in, once per device (a driver call costs microseconds):
// `done` holds one bit per device for this kernel and size.
template <typename Kernel>
cudaError_t allow_smem_once(Kernel kernel, int smem, std::atomic<uint64_t>& done) {
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (done.load(std::memory_order_acquire) & bit) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err == cudaSuccess) done.fetch_or(bit, std::memory_order_release);
  return err;
}

// A kernel's dynamic shared-memory opt-in for a size that varies by launch (the SMBD kernel's value
// buffers follow the weight's longest run): the attribute is a ceiling, so it is raised only when a
// launch needs more than this device was given so far, and never lowered. Setting it on every launch
// cost ~4 us of host time a call on the H100 machine's host (torch.profiler, an eager decode step).
template <typename Kernel>
cudaError_t allow_smem_at_least(Kernel kernel, int smem) {
  int device = 0;
  cudaGetDevice(&device);
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> allowed;  // (kernel, device) -> bytes opted in
  const std::lock_guard<std::mutex> lock(mutex);
  int& have = allowed[{reinterpret_cast<const void*>(kernel), device}];
  if (smem <= have) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err == cudaSuccess) have = smem;
  return err;
}

// A host query's answer (an occupancy calculation costs microseconds), asked once per key: each
// call site (its own Query type) keeps its own table.
template <typename Key, typename Query>
int asked_once(const Key& key, Query query) {
  static std::mutex mutex;
  static std::map<Key, int> table;
  const std::lock_guard<std::mutex> lock(mutex);
  if (auto it = table.find(key); it != table.end()) return it->second;
  return table[key] = query();
}

// A launch's weight stream as an L2 access-policy window whose lines are marked streaming (replaced
// before the others), so that a layer larger than L2 leaves what the launches around it read there
// (docs/kernels.md, v13): for the kernels that copy with cp.async, whose in-kernel hint
// (ptx::l2_stream_policy with .L2::cache_hint) ptxas 13.0 mistranslated. The window is the
// launch's own memory descriptor, so no device code changes. Empty where SPINFER_L2_EVICT_FIRST=0;
// clipped to the device's largest window (the rest of a longer stream keeps the normal policy).
struct StreamWindow {
  const void* base = nullptr;
  size_t bytes = 0;
};
inline StreamWindow stream_window(const void* base, size_t bytes) {
  if (!use_l2_evict_first() || base == nullptr || bytes == 0) return {};
  int device = 0;
  cudaGetDevice(&device);
  const int max_bytes = asked_once(device, [&] {
    int v = 0;
    return cudaDeviceGetAttribute(&v, cudaDevAttrMaxAccessPolicyWindowSize, device) == cudaSuccess ? v : 0;
  });
  return {base, std::min(bytes, static_cast<size_t>(max_bytes))};
}

// A launch with programmatic dependent launch (`pdl`) and an L2 window over its weight stream
// (`window.bytes` > 0), each where asked.
template <typename... KArgs, typename... Args>
cudaError_t launch_kernel_window(void (*kernel)(KArgs...), dim3 grid, int threads, int smem, cudaStream_t stream,
                                 bool pdl, StreamWindow window, Args... args) {
  if (!pdl && window.bytes == 0) {
    kernel<<<grid, threads, smem, stream>>>(args...);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  unsigned n = 0;
  if (pdl) {
    attribute[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (window.bytes > 0) {
    attribute[n].id = cudaLaunchAttributeAccessPolicyWindow;
    cudaAccessPolicyWindow& w = attribute[n++].val.accessPolicyWindow;
    w.base_ptr = const_cast<void*>(window.base);
    w.num_bytes = window.bytes;
    w.hitRatio = 1.0f;
    w.hitProp = cudaAccessPropertyStreaming;
    w.missProp = cudaAccessPropertyNormal;
  }
  config.attrs = attribute;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, args...);
}
template <typename... KArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KArgs...), dim3 grid, int threads, int smem, cudaStream_t stream, bool pdl,
                          Args... args) {
  return launch_kernel_window(kernel, grid, threads, smem, stream, pdl, StreamWindow{}, args...);
}

}  // namespace spinfer
