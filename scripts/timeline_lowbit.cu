// Where a fused low-bit launch spends the time that does not scale with K: per-block timestamps
// (%globaltimer) at block entry, first stage ready, main loop done and output stored, for one
// 4-bit g128 layer at N = 1, or N = TIMELINE_N tokens (up to 16: one token tile of 8 or 16), L2
// flushed before every launch. The kernel is the library's per-tile one (lowbit_mm.cuh) compiled
// with SPINFER_TIMELINE, launched unsplit without PDL.
//
//   nvcc -std=c++17 -O3 -DSPINFER_TIMELINE -Ispinfer/csrc -gencode=arch=compute_90a,code=sm_90a \
//        scripts/timeline_lowbit.cu -o /tmp/timeline_lowbit && /tmp/timeline_lowbit [M] [K,K,...] [reps] [balanced]
//
// `balanced` launches the balanced schedule (SMs x 2 blocks, ranges across row blocks) instead
// of one block per row block; `tail:S` one block per row block but the rows past the last whole
// wave of SMs split S ways (schedule.cuh, tail_split). SPINFER_LOWBIT_ROTATE sets the stage-order
// rotation as for the library (0: every block starts at stage 0).
//
// Printed per K (medians over the launches, µs): the launch's event time; when blocks start after
// the first one (median / last); how long a block waits for its first stage; its main loop; its
// epilogue; when blocks end (10th / 50th / 90th percentile / last), all from the first block's
// start; and the event time not covered by first start .. last end. Then, for the last launch,
// when the blocks end by how many blocks their SM held (the block scheduler gives each SM the
// blocks it gives, and the layer ends with its busiest SM). With TIMELINE_CSV set, the last
// launch's blocks are also written there, one line per block: M, K, block (row block, split),
// SM, and its entry, first stage, loop end and end from the first block's start (us).
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <cstdlib>
#include <string>
#include <vector>

#include "harness.cuh"
#include "lowbit_mm.cuh"

static double pct(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

int main(int argc, char** argv) {
  using namespace spinfer;
  const int m = argc > 1 ? std::atoi(argv[1]) : 14336;
  std::vector<int> ks;
  for (std::string list = argc > 2 ? argv[2] : "1024,4096,16384"; !list.empty();) {
    const size_t c = list.find(',');
    ks.push_back(std::atoi(list.substr(0, c).c_str()));
    list = c == std::string::npos ? "" : list.substr(c + 1);
  }
  const int reps = argc > 3 ? std::atoi(argv[3]) : 20;
  const std::string schedule = argc > 4 ? argv[4] : "";
  const bool balanced = schedule == "balanced";
  const int tail_splits = schedule.rfind("tail:", 0) == 0 ? std::atoi(schedule.c_str() + 5) : 0;
  const int n = std::getenv("TIMELINE_N") ? std::atoi(std::getenv("TIMELINE_N")) : 1;
  if (n < 1 || n > 16) return std::fprintf(stderr, "TIMELINE_N must be 1..16\n"), 2;
  const int bn = n <= 8 ? 8 : 16;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (m % 64 || m / 64 > (1 << 16)) return std::fprintf(stderr, "M must be a multiple of 64, at most 2^22\n"), 2;

  FlushedTimer flushed;
  std::printf("M=%d, 4-bit g128, N=%d (BN=%d), %s, no PDL, L2 flushed; medians of %d launches (us)\n", m, n, bn,
              balanced ? "balanced schedule" : tail_splits ? "tail rows split" : "unsplit", reps);
  std::printf("%6s %7s | %14s | %6s %7s %6s | %27s | %8s\n", "K", "event", "starts p50/max", "first", "loop",
              "epil.", "ends p10/p50/p90/max", "uncovered");
  for (const int k : ks) {
    if (k % 256) return std::fprintf(stderr, "K must be a multiple of 256\n"), 2;
    const int groups = k / 128;
    void *qw, *sz, *x, *y;
    CHECK(cudaMalloc(&qw, size_t(m) * k / 2));
    CHECK(cudaMemset(qw, 0x37, size_t(m) * k / 2));
    CHECK(cudaMalloc(&sz, size_t(m) * groups * 4));
    // format 4 records with the zeros in the dtype (lowbit_mm.h): per 64-row tile and group 32 words of
    // scales (0.01) then 32 of zeros (8), m * groups * 4 bytes in all
    std::vector<uint32_t> records(size_t(m) * groups);
    for (size_t i = 0; i < records.size(); ++i) records[i] = i % 64 < 32 ? 0x211f211fu : 0x48004800u;
    CHECK(cudaMemcpy(sz, records.data(), records.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&x, size_t(n) * k * 2));
    std::vector<uint16_t> ones(size_t(n) * k, 0x3c00);
    CHECK(cudaMemcpy(x, ones.data(), size_t(n) * k * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&y, size_t(m) * n * 2));

    LowbitArgs a{};
    a.x = x, a.qweight = static_cast<const uint32_t*>(qw), a.scale_zero = sz, a.y = y;
    a.m = m, a.n = n, a.kp = k, a.group_shift = 7, a.groups = groups, a.bits = 4;
    a.rotate = lowbit_rotate();  // as the library: SPINFER_LOWBIT_ROTATE=0 turns it off
    LowbitPlan p{};
    p.bn = bn, p.n_tiles = 1, p.row_blocks = m / 64, p.chunks = k / 128, p.ng = 1, p.pdl = false;
    const BalancedGrid g =
        balanced_grid(sms, lowbit::kBalancedPerSM, 1, p.row_blocks, int64_t(p.row_blocks) * (k / 256));
    p.grid_blocks = balanced ? g.blocks : p.row_blocks;
    p.splits = balanced ? g.shares : 1;
    p.iters_per_split = k / 256;  // one split: the whole row
    // The variant's resident blocks, from the occupancy API as the planner asks them.
    const int resident = bn == 16 ? lowbit::Launcher<false, 4, 16, 1, kLowbitPerTile>::blocks_per_sm(false)
                                  : lowbit::Launcher<false, 4, 8, 1, kLowbitPerTile>::blocks_per_sm(false);
    if (const TailSplit t = tail_split(p.row_blocks, sms, resident, k / 256, tail_splits); tail_splits > 1 && t.splits > 1) {
      p.tail_first = t.first, p.tail_splits = t.splits, p.tail_iters = t.iters;  // as the planner
      p.grid_blocks = t.first + (p.row_blocks - t.first) * t.splits;
      p.splits = t.splits;
    }
    const int blocks = p.grid_blocks;
    float* workspace = nullptr;
    int* counters = nullptr;
    if (p.splits > 1) {
      CHECK(cudaMalloc(&workspace, size_t(p.splits) * p.row_blocks * bn * 64 * 4));
      CHECK(cudaMalloc(&counters, size_t(p.row_blocks) * 4));
      CHECK(cudaMemset(counters, 0, size_t(p.row_blocks) * 4));
    }
    a.workspace = workspace, a.counters = counters;
    auto launch = [&] {
      if (bn == 16)
        return balanced ? lowbit::Launcher<false, 4, 16, 1, kLowbitBalanced>::launch(a, p, 0)
                        : lowbit::Launcher<false, 4, 16, 1, kLowbitPerTile>::launch(a, p, 0);
      return balanced ? lowbit::Launcher<false, 4, 8, 1, kLowbitBalanced>::launch(a, p, 0)
                      : lowbit::Launcher<false, 4, 8, 1, kLowbitPerTile>::launch(a, p, 0);
    };

    std::vector<double> ev, s50, smax, first, loop, epil, e10, e50, e90, emax, unc;
    std::map<int, std::vector<double>> by_load;  // blocks on the SM -> their end times (last launch)
    std::vector<unsigned long long> last;        // the last launch's stamps
    for (int r = -3; r < reps; ++r) {
      const float us = flushed(launch);
      if (r < 0) continue;  // warm-up
      std::vector<unsigned long long> t(size_t(blocks) * 5);
      CHECK(cudaMemcpyFromSymbol(t.data(), spinfer_timeline, t.size() * 8));
      unsigned long long t0 = ~0ull, tend = 0;
      for (int b = 0; b < blocks; ++b) t0 = std::min(t0, t[b * 5]), tend = std::max(tend, t[b * 5 + 3]);
      std::vector<double> st, fi, lo, ep, en;
      for (int b = 0; b < blocks; ++b) {
        const unsigned long long* q = &t[b * 5];
        st.push_back((q[0] - t0) * 1e-3), fi.push_back((q[1] - q[0]) * 1e-3);
        lo.push_back((q[2] - q[1]) * 1e-3), ep.push_back((q[3] - q[2]) * 1e-3), en.push_back((q[3] - t0) * 1e-3);
      }
      ev.push_back(us), s50.push_back(pct(st, 0.5)), smax.push_back(pct(st, 1.0));
      first.push_back(pct(fi, 0.5)), loop.push_back(pct(lo, 0.5)), epil.push_back(pct(ep, 0.5));
      e10.push_back(pct(en, 0.1)), e50.push_back(pct(en, 0.5)), e90.push_back(pct(en, 0.9)), emax.push_back(pct(en, 1.0));
      unc.push_back(us - (tend - t0) * 1e-3);
      std::map<unsigned long long, int> per_sm;
      for (int b = 0; b < blocks; ++b) ++per_sm[t[b * 5 + 4]];
      by_load.clear();
      for (int b = 0; b < blocks; ++b) by_load[per_sm[t[b * 5 + 4]]].push_back(en[b]);
      last = t;
    }
    std::printf("%6d %7.1f | %6.2f / %5.2f | %6.2f %7.2f %6.2f | %5.1f / %5.1f / %5.1f / %5.1f | %8.2f\n", k,
                pct(ev, 0.5), pct(s50, 0.5), pct(smax, 0.5), pct(first, 0.5), pct(loop, 0.5), pct(epil, 0.5),
                pct(e10, 0.5), pct(e50, 0.5), pct(e90, 0.5), pct(emax, 0.5), pct(unc, 0.5));
    if (const char* path = std::getenv("TIMELINE_CSV")) {
      FILE* f = std::fopen(path, "a");
      unsigned long long t0 = ~0ull;
      for (int b = 0; b < blocks; ++b) t0 = std::min(t0, last[b * 5]);
      for (int b = 0; b < blocks && f; ++b) {
        const unsigned long long* q = &last[b * 5];
        std::fprintf(f, "%d,%d,%d,%llu,%.3f,%.3f,%.3f,%.3f\n", m, k, b, q[4], (q[0] - t0) * 1e-3, (q[1] - t0) * 1e-3,
                     (q[2] - t0) * 1e-3, (q[3] - t0) * 1e-3);
      }
      if (f) std::fclose(f);
    }
    for (const auto& [load, ends] : by_load)
      std::printf("        blocks on SMs holding %d: %4zu, end p50 %5.1f, max %5.1f\n", load, ends.size(), pct(ends, 0.5),
                  pct(ends, 1.0));
    CHECK(cudaFree(qw));
    CHECK(cudaFree(sz));
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
    if (workspace) {
      CHECK(cudaFree(workspace));
      CHECK(cudaFree(counters));
    }
  }
  return 0;
}
