// How fast can any kernel read a low-bit layer's bytes? Event time of kernels that only read and
// fold them into a word, against the GEMV (lowbit_gemv.cuh) that has to read the same bytes. The
// floor tables (docs/benchmarks.md) assume the copy bandwidth from the first byte plus an empty
// kernel's event time; this measures what a plain read actually reaches at each layer's size.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a scripts/read_floor.cu -o /tmp/read_floor
//   /tmp/read_floor [bits[:group]] [MxK,MxK,...] [reps] [occupancy]   (defaults: 4:128, the four issue shapes, 200)
//
// With `occupancy` (4 bits), the GEMV's pattern is timed with the resident blocks an SM capped by
// unused dynamic shared memory (each row says how many the occupancy API gives it, 2 and up): how
// much of the bandwidth do the bytes in flight of that many 8-warp blocks reach?
//
// Kernels, each timed after an L2 flush by a read (the benchmarks' method), median of `reps`:
//   empty      an empty launch: the event floor.
//   stream U   grid-stride over the bytes as one array, U 16-byte loads in flight a thread, a grid
//              of every SM's resident blocks: the best plain read of that many bytes.
//   gemv D     the GEMV's weight reads: a block of 8 warps per 16 rows of the packed format
//              ([M/64, K/S, 64 rows, S*bits/8 bytes], S = 256 columns), warp w reads stages w,
//              w + 8, ... with `ld.global.nc.L1::no_allocate`, D stages ahead in registers, and
//              the block ends with a barrier and a 32-byte store as the GEMV's does. At 4 bits
//              also with 16 warps a block (stages w, w + 16, ...).
//   rows16 D   the same reads from a layout whose 16-row blocks are contiguous along K
//              ([M/16, K/S, 16 rows, ...]): does the GEMV's 2 KB-in-8 KB stride cost DRAM time?
//   gemv D, sz [M,G] / sz tiled   the GEMV's pattern with its (scale, zero) words as well (4-bit
//              g128 and 2-bit g64): rows g and g + 8 of each lane's quad, a stage's words of each,
//              from the format-2 layout [M, G] (16 rows a stage, one 32-byte sector each) or from
//              a [M/16, G, 16] layout, whose 16 rows of a stage are 64 contiguous bytes, as in the
//              64-row tiles the format stored from the forty-seventh session to the sixty-seventh
//              (format 3; the records of format 4 hold a 16-row block's scales in 32 bytes and
//              its zeros in 8 or 32: lowbit_mm.h, record_word).
// The other GEMV variants read the weights only; `stream` is given the weights and also the weights
// plus the (scale, zero) words (4 bytes a group), the bytes the GEMV moves.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "harness.cuh"

__device__ __forceinline__ int4 load_nc(const int4* p) {  // the GEMV's weight load
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ unsigned fold(int4 v) { return unsigned(v.x ^ v.y ^ v.z ^ v.w); }

__global__ void empty_kernel() {}

template <int U>
__global__ void __launch_bounds__(256) stream_read(const int4* w, size_t n, unsigned* sink) {
  unsigned acc = 0;
  const size_t step = size_t(gridDim.x) * blockDim.x * U;
  for (size_t base = blockIdx.x * size_t(blockDim.x) * U + threadIdx.x; base < n; base += step) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)  // all U loads issued before any is used
      v[u] = base + u * blockDim.x < n ? load_nc(w + base + u * blockDim.x) : int4{0, 0, 0, 0};
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= fold(v[u]);
  }
  if (acc == 0x7fffffffu) *sink = acc;
}

// C: 16-byte loads a lane per stage (a 16-row stage is C * 512 bytes: 4 at 4 bits).
// SZ: 0 weights only; 1 also the (scale, zero) words as the GEMV reads them from [M, G] (rows g
// and g + 8 of the lane's quad, NG words a stage each: 16 rows x NG x 4 bytes, row-strided); 2 the
// same words from a [M/16, G, 16] layout (a stage's words of 16 rows contiguous).
template <int C, int D, bool kRows16, int W = 8, int SZ = 0, int NG = 2>
__global__ void __launch_bounds__(W * 32) gemv_read(const int4* w, int stages, unsigned* out,
                                                    const unsigned* sz = nullptr) {
  const unsigned rb = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = stages * NG, g = lane / 4;
  auto sz_at = [&](int s, int h, int j) {
    const int grp = s * NG + j, r = g + 8 * h;
    return SZ == 1 ? sz + size_t(rb * 16 + r) * groups + grp : sz + (size_t(rb) * groups + grp) * 16 + r;
  };
  unsigned zbuf[D][2][NG];
  auto at = [&](int s) {
    const size_t chunk = kRows16 ? size_t(rb) * stages + s : (size_t(rb / 4) * stages + s) * 4 + rb % 4;
    return w + chunk * (C * 32) + lane;
  };
  int4 buf[D][C];
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (warp + W * d < stages) {
#pragma unroll
      for (int c = 0; c < C; ++c) buf[d][c] = load_nc(at(warp + W * d) + 32 * c);
      if constexpr (SZ != 0)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int j = 0; j < NG; ++j) zbuf[d][h][j] = __ldg(sz_at(warp + W * d, h, j));
    }
  unsigned acc = 0;
  for (int base = warp; base < stages; base += W * D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int s = base + W * d;
      if (s >= stages) break;
#pragma unroll
      for (int c = 0; c < C; ++c) acc ^= fold(buf[d][c]);
      if constexpr (SZ != 0)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int j = 0; j < NG; ++j) acc += zbuf[d][h][j];
      if (s + W * D < stages) {
#pragma unroll
        for (int c = 0; c < C; ++c) buf[d][c] = load_nc(at(s + W * D) + 32 * c);
        if constexpr (SZ != 0)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < NG; ++j) zbuf[d][h][j] = __ldg(sz_at(s + W * D, h, j));
      }
    }
  }
  __shared__ unsigned part[W][32];  // the GEMV's cross-warp sum and 32-byte store
  part[warp][lane] = acc;
  __syncthreads();
  if (warp == 0 && lane < 8) {
    unsigned sum = 0;
    for (int i = 0; i < W; ++i) sum ^= part[i][lane];
    out[size_t(rb) * 8 + lane] = sum;
  }
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const int bits = argc > 1 ? std::atoi(argv[1]) : 4;
  const char* colon = argc > 1 ? std::strchr(argv[1], ':') : nullptr;
  const int group = colon ? std::atoi(colon + 1) : 128;
  const std::string shapes = argc > 2 ? argv[2] : "28672x8192,8192x28672,14336x4096,4096x14336";
  const int reps = argc > 3 ? std::atoi(argv[3]) : 200;
  const bool occupancy = argc > 4 && std::string(argv[4]) == "occupancy";
  if (bits != 1 && bits != 2 && bits != 4) {
    std::fprintf(stderr, "bits must be 1, 2 or 4 (a 16-row stage of 256 columns is 512 * bits bytes)\n");
    return 2;
  }
  if (group < 32 || group & (group - 1)) {
    std::fprintf(stderr, "group must be a power of two of at least 32\n");
    return 2;
  }
  int dev, sms;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));

  unsigned* sink;  // where the stream kernels would store a fold that is never 0x7fffffff
  CHECK(cudaMalloc(&sink, 4));
  FlushedTimer flushed;
  auto timed = [&](auto launch) {  // median of `reps` after 5 warm-up launches
    std::vector<float> t;
    for (int r = 0; r < reps + 5; ++r) {
      const float us = flushed(launch);
      if (r >= 5) t.push_back(us);
    }
    return median(t);
  };

  std::printf("%s, %d SMs; %d-bit g%d layers, L2 flushed by a read, median of %d launches (us; TB/s of the bytes read)\n",
              prop.name, sms, bits, group, reps);
  std::printf("empty kernel: %.2f us\n", timed([] { empty_kernel<<<1, 32>>>(); }));

  size_t start = 0;
  while (start < shapes.size()) {
    size_t end = shapes.find(',', start);
    if (end == std::string::npos) end = shapes.size();
    const std::string s = shapes.substr(start, end - start);
    start = end + 1;
    const int m = std::atoi(s.c_str()), k = std::atoi(s.c_str() + s.find('x') + 1);
    if (m <= 0 || k <= 0 || m % 64 || k % 256 || k % group) {
      std::fprintf(stderr, "%s: M must be a multiple of 64, K of 256 and of the group\n", s.c_str());
      return 2;
    }
    const size_t wbytes = size_t(m) * k * bits / 8, sbytes = size_t(m) * (k / group) * 4;
    int4* w;
    unsigned* out;
    CHECK(cudaMalloc(&w, wbytes + sbytes));
    CHECK(cudaMemset(w, 3, wbytes + sbytes));
    CHECK(cudaMalloc(&out, size_t(m / 16) * 32));
    const int stages = k / 256, row_blocks = m / 16;
    auto row = [&](const char* name, size_t bytes, float us) {
      std::printf("  %-22s %8.2f us  %5.2f TB/s\n", name, us, bytes / us * 1e-6);
    };
    std::printf("%dx%d: weights %.1f MB, with (scale, zero) words %.1f MB\n", m, k, wbytes * 1e-6,
                (wbytes + sbytes) * 1e-6);
    auto stream = [&](const char* name, size_t bytes, auto kernel) {
      int per_sm;
      CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, 0));
      row(name, bytes, timed([&] { kernel<<<sms * per_sm, 256>>>(w, bytes / 16, sink); }));
    };
    stream("stream U=4, weights", wbytes, stream_read<4>);
    stream("stream U=8, weights", wbytes, stream_read<8>);
    stream("stream U=4, +scales", wbytes + sbytes, stream_read<4>);
    stream("stream U=8, +scales", wbytes + sbytes, stream_read<8>);
    auto gemv = [&](const char* name, auto kernel, int warps = 8) {
      row(name, wbytes, timed([&] { kernel<<<row_blocks, warps * 32>>>(w, stages, out, nullptr); }));
    };
    // the (scale, zero) words lie after the weights, in either layout
    const unsigned* szp = reinterpret_cast<const unsigned*>(reinterpret_cast<const char*>(w) + wbytes);
    auto gemv_sz = [&](const char* name, auto kernel) {
      row(name, wbytes + sbytes, timed([&] { kernel<<<row_blocks, 256>>>(w, stages, out, szp); }));
    };
    if (bits == 4 && group == 128) {
      gemv_sz("gemv D=2, sz [M,G]", gemv_read<4, 2, false, 8, 1, 2>);
      gemv_sz("gemv D=2, sz tiled", gemv_read<4, 2, false, 8, 2, 2>);
      gemv_sz("gemv D=1, sz [M,G]", gemv_read<4, 1, false, 8, 1, 2>);
      gemv_sz("gemv D=1, sz tiled", gemv_read<4, 1, false, 8, 2, 2>);
    } else if (bits == 2 && group == 64) {
      gemv_sz("gemv D=2, sz [M,G]", gemv_read<2, 2, false, 8, 1, 4>);
      gemv_sz("gemv D=2, sz tiled", gemv_read<2, 2, false, 8, 2, 4>);
    }
    if (bits == 4 && occupancy) {
      int smem_sm;
      CHECK(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
      auto capped = [&](const char* name, auto kernel, int per_sm) {
        // the least dynamic shared memory that leaves room for per_sm blocks and not one more
        const int dyn = smem_sm / (per_sm + 1) + 1024;
        CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn));
        int got;
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&got, kernel, 256, dyn));
        char label[64];
        std::snprintf(label, sizeof label, "%s, %d blocks/SM", name, got);
        row(label, wbytes, timed([&] { kernel<<<row_blocks, 256, dyn>>>(w, stages, out, nullptr); }));
      };
      for (int per_sm : {2, 3, 4, 5, 6, 7}) {
        capped("gemv D=1", gemv_read<4, 1, false>, per_sm);
        capped("gemv D=2", gemv_read<4, 2, false>, per_sm);
      }
    } else if (bits == 4) {
      gemv("gemv D=1", gemv_read<4, 1, false>);
      gemv("gemv D=2", gemv_read<4, 2, false>);
      gemv("gemv D=4", gemv_read<4, 4, false>);
      gemv("gemv D=2, 16 warps", gemv_read<4, 2, false, 16>, 16);
      gemv("rows16 D=2", gemv_read<4, 2, true>);
      gemv("rows16 D=4", gemv_read<4, 4, true>);
    } else if (bits == 2) {
      gemv("gemv D=2", gemv_read<2, 2, false>);
      gemv("gemv D=4", gemv_read<2, 4, false>);
      gemv("rows16 D=2", gemv_read<2, 2, true>);
    } else {
      gemv("gemv D=2", gemv_read<1, 2, false>);
      gemv("gemv D=4", gemv_read<1, 4, false>);
      gemv("rows16 D=4", gemv_read<1, 4, true>);
    }
    CHECK(cudaFree(w));
    CHECK(cudaFree(out));
  }
  return 0;
}
