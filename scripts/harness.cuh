// What the standalone timing harnesses under scripts/ share: a CUDA error check, and one launch
// timed between two events after L2 is evicted by a read (the benchmarks' method).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <type_traits>

#define CHECK(x)                                                                               \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

__global__ void read_flush(const int4* buf, size_t n, int* sink) {  // evicts L2 by reading
  int4 acc = {0, 0, 0, 0};
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const int4 v = buf[i];
    acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x7fffffff) *sink = 1;  // never true for the buffer's bytes
}

// flushed(launch): L2 evicted by reading 512 MiB, then `launch()` (a cudaError_t is checked) between
// two events; its event time in microseconds.
class FlushedTimer {
 public:
  FlushedTimer() {
    int dev;
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaDeviceGetAttribute(&flush_blocks_, cudaDevAttrMultiProcessorCount, dev));
    flush_blocks_ *= 2;
    CHECK(cudaMalloc(&flush_, kFlushBytes));
    CHECK(cudaMemset(flush_, 1, kFlushBytes));
    CHECK(cudaMalloc(&sink_, 4));
    CHECK(cudaEventCreate(&e0_));
    CHECK(cudaEventCreate(&e1_));
  }
  template <typename F>
  float operator()(F&& launch) {
    read_flush<<<flush_blocks_, 512>>>(flush_, kFlushBytes / 16, sink_);
    CHECK(cudaEventRecord(e0_));
    if constexpr (std::is_same_v<decltype(launch()), cudaError_t>)
      CHECK(launch());
    else
      launch();
    CHECK(cudaEventRecord(e1_));
    CHECK(cudaEventSynchronize(e1_));
    CHECK(cudaGetLastError());
    float ms;
    CHECK(cudaEventElapsedTime(&ms, e0_, e1_));
    return ms * 1000.f;
  }

 private:
  static constexpr size_t kFlushBytes = size_t(512) << 20;
  int4* flush_ = nullptr;
  int* sink_ = nullptr;
  int flush_blocks_ = 0;
  cudaEvent_t e0_, e1_;
};
