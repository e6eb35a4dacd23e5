// CUDA implementations of the spinfer ops (schemas live in spinfer/ops/library.py).
// Every check runs before a launch and raises ValueError/TypeError naming the problem.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "eager.h"
#include "lowbit_mm.h"
#include "spmm_smbd.h"
#include "to_dense.h"

namespace spinfer {
namespace {

constexpr int64_t kGt = 64;

// A dtype as Python names it (torch.float16, not Half), so the checks here read like the Python
// layer's: eager CUDA calls of spinfer.spmm and spinfer.lowbit_mm leave their x / bias checks here.
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    default: return std::string("torch.") + c10::toString(t);
  }
}

struct Prepared {
  at::Tensor x, bitmap, values;
  int64_t kp;
};

// Split-K arrival counters must be zero when a split launch starts, and every split launch
// leaves them zero (the last block of a tile re-arms its counter, epilogue.cuh). So each
// (device, stream) keeps one buffer, zeroed when it is allocated or grown: launches on a stream
// run in order. A fresh at::zeros per call cost a fill kernel before every split launch, 2-3 us
// of a 40 us layer.
//
// Under CUDA graph capture a launch must not share counters with eager launches or other graphs
// (a graph may be replayed on any stream). It takes an exclusive slice of a per-device reserve
// that was zeroed, and synchronized, by the first eager split launch on the device, and keeps
// it for the life of the process: the graph's replays leave it zero like any other launch, and
// replays of one graph never overlap (CUDA orders each launch of a graph after the previous
// one). Before, each captured launch got its own at::zeros, a fill-kernel node that every replay ran
// ahead of the kernel: ~3.7 us per split layer in a graph of back-to-back layers on H100
// (scripts/launch_anatomy.py), where unsplit layers gain ~2 us from the graph instead. Only a
// capture that comes before any eager split launch on its device, or that exhausts the reserve,
// still records the fill.
constexpr int64_t kCaptureReserve = int64_t(1) << 20;  // counters, 4 MiB per device

// Zeroed device memory for the life of the process, from cudaMalloc rather than torch's caching
// allocator. While torch.compile(mode="reduce-overhead") warms a CUDA graph up, the allocator gives
// that graph's private pool everything allocated on its stream, captured or not, and a buffer kept
// from then on stayed in the pool: the CUDA-graph trees then refused to record ("tensor(s) in the
// cudagraph pool not tracked as outputs"). Never freed: a grown-out buffer may still be read by
// launches in flight, and its few bytes are not worth a synchronization.
int32_t* lasting_zeros(int64_t n, cudaStream_t stream) {
  void* p = nullptr;
  C10_CUDA_CHECK(cudaMalloc(&p, n * sizeof(int32_t)));
  C10_CUDA_CHECK(cudaMemsetAsync(p, 0, n * sizeof(int32_t), stream));
  return static_cast<int32_t*>(p);
}

struct Counters {
  int32_t* ptr = nullptr;
  int64_t size = 0;
};

// The counters of one split launch. `owned` keeps a capture's own zeroed counters (the fallback
// above) alive for the launch.
int32_t* arrival_counters(int64_t n, const at::TensorOptions& options, at::Tensor& owned) {
  static std::mutex mu;
  // Leaked on purpose, as the memory they name.
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, Counters>();
  static auto* reserves = new std::map<int, Counters>();  // size: the slices taken
  const int device = options.device().index();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const std::lock_guard<std::mutex> lock(mu);
  Counters& reserve = (*reserves)[device];
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    const int64_t take = (n + 31) / 32 * 32;  // 128-byte aligned slices
    if (reserve.ptr != nullptr && reserve.size + take <= kCaptureReserve) {
      int32_t* slice = reserve.ptr + reserve.size;
      reserve.size += take;
      return slice;
    }
    owned = at::zeros({n}, options.dtype(at::kInt));
    return owned.data_ptr<int32_t>();
  }
  if (reserve.ptr == nullptr) {
    reserve.ptr = lasting_zeros(kCaptureReserve, stream);
    // Zeroed before any graph can use it, whatever stream that graph is replayed on. Once per
    // device and process.
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  Counters& c = (*buffers)[{device, stream}];
  if (c.size < n) {
    c.size = std::max({n, int64_t(1024), 2 * c.size});
    c.ptr = lasting_zeros(c.size, stream);
  }
  return c.ptr;
}

// Split-K scratch shared by the kernels' epilogue (epilogue.cuh): fp32 partial tiles (not
// initialised: every split writes its whole tile) and the stream's arrival counters.
struct SplitK {
  at::Tensor workspace, owned;
  int32_t* counters = nullptr;
  SplitK(int splits, int64_t floats, int64_t n_counters, const at::TensorOptions& options) {
    if (splits > 1) {
      workspace = at::empty({floats}, options.dtype(at::kFloat));
      counters = arrival_counters(n_counters, options, owned);
    }
  }
  float* workspace_ptr() const { return workspace.defined() ? workspace.data_ptr<float>() : nullptr; }
  int32_t* counters_ptr() const { return counters; }
};

// 16-byte cp.async needs 16-byte aligned bases; fresh allocations are, views may not be.
at::Tensor aligned16(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

// The TCA-BME arrays of an [m, k] weight, checked for a CUDA kernel that reads them (SMBD, the
// decode to dense): GroupTile 64x64, dtypes, 1-D arrays on `device`, and sizes that match the
// shape, so no kernel indexes past them. Returns the GroupTile grid {rows, columns}.
std::array<int64_t, 2> check_tca_bme_arrays(const char* op, const at::Tensor& bitmap, const at::Tensor& values,
                                            const at::Tensor& gtile_offset, int64_t m, int64_t k, int64_t gt_h,
                                            int64_t gt_w, const at::Device& device) {
  TORCH_CHECK_VALUE(gt_h == kGt && gt_w == kGt, op, " on CUDA supports GroupTile 64x64, got ", gt_h, "x", gt_w,
                    "; re-encode with group_tile=(64, 64)");
  TORCH_CHECK_VALUE(m >= 1 && k >= 1, op, ": weight shape must be at least 1x1, got ", m, "x", k);
  TORCH_CHECK_TYPE(values.scalar_type() == at::kHalf || values.scalar_type() == at::kBFloat16,
                   "values must be torch.float16 or torch.bfloat16, got ", dtype_name(values.scalar_type()));
  TORCH_CHECK_TYPE(bitmap.scalar_type() == at::kLong, "bitmap must be torch.int64, got ",
                   dtype_name(bitmap.scalar_type()));
  TORCH_CHECK_TYPE(gtile_offset.scalar_type() == at::kInt, "gtile_offset must be torch.int32, got ",
                   dtype_name(gtile_offset.scalar_type()));
  for (const at::Tensor* t : {&bitmap, &values, &gtile_offset}) {
    TORCH_CHECK_VALUE(t->is_cuda() && t->device() == device, "expected TCA-BME arrays on ", device,
                      ", but one is on ", t->device());
    TORCH_CHECK_VALUE(t->dim() == 1, "TCA-BME arrays must be 1-D");
  }
  const int64_t grid_m = (m + kGt - 1) / kGt, grid_k = (k + kGt - 1) / kGt;
  TORCH_CHECK_VALUE(bitmap.numel() == grid_m * grid_k * kGt, "bitmap has ", bitmap.numel(), " words, a ", m, "x", k,
                    " weight needs ", grid_m * grid_k * kGt);
  TORCH_CHECK_VALUE(gtile_offset.numel() == grid_m * grid_k + 1, "gtile_offset has ", gtile_offset.numel(),
                    " entries, expected ", grid_m * grid_k + 1);
  return {grid_m, grid_k};
}

Prepared check_and_prepare(const at::Tensor& x, const at::Tensor& bitmap, const at::Tensor& values,
                           const at::Tensor& gtile_offset, int64_t m, int64_t k, int64_t gt_h,
                           int64_t gt_w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == k, "spinfer::spmm expects x of shape [N, ", k, "], got ",
                    x.sizes());
  const int64_t grid_k = check_tca_bme_arrays("spinfer::spmm", bitmap, values, gtile_offset, m, k, gt_h, gt_w,
                                              x.device())[1];
  TORCH_CHECK_TYPE(x.scalar_type() == values.scalar_type(), "x is ", dtype_name(x.scalar_type()),
                   " but the weight is ", dtype_name(values.scalar_type()), "; cast x to ",
                   dtype_name(values.scalar_type()));
  TORCH_CHECK_VALUE(values.numel() < (int64_t(1) << 31), "too many values for int32 offsets");
  if (bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == m, "bias must have shape (", m, ",), got ",
                      bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "bias is ", dtype_name(bias->scalar_type()), " but x is ",
                     dtype_name(x.scalar_type()));
    TORCH_CHECK_VALUE(bias->device() == x.device(), "bias is on ", bias->device(), " but x is on ", x.device());
  }
  Prepared p;
  p.kp = grid_k * kGt;
  TORCH_CHECK_VALUE(x.size(0) <= INT32_MAX && m <= INT32_MAX && p.kp <= INT32_MAX, "shape too large");
  // The kernel reads whole 64-column slices of x: pad K up to the GroupTile with zeros.
  p.x = p.kp == k ? aligned16(x) : at::constant_pad_nd(x, {0, p.kp - k}, 0).contiguous();
  p.bitmap = aligned16(bitmap);
  p.values = aligned16(values);
  return p;
}

// The weight's row table (TCABME.row_offset), checked for the kernel's 8-byte copies of its
// entries, or an undefined tensor where the caller has none. Its values are not trusted: the decode
// clamps every prefix to its run, so a wrong table gives wrong results, never an out-of-range read.
at::Tensor check_row_table(const std::optional<at::Tensor>& row_offset, const at::Tensor& gtile_offset) {
  if (!row_offset) return at::Tensor();
  const at::Tensor& t = *row_offset;
  const int64_t ngt = gtile_offset.numel() - 1;
  TORCH_CHECK_TYPE(t.scalar_type() == at::kShort, "row_offset must be int16, got ", dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == ngt && t.size(1) == kGt / 16, "row_offset must have shape [", ngt,
                    ", ", kGt / 16, "], got ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == gtile_offset.device(), "row_offset is on ", t.device(), " but the weight is on ",
                    gtile_offset.device());
  return aligned16(t);
}

void run(const Prepared& p, const at::Tensor& gtile_offset, int64_t m, int64_t max_run,
         const std::optional<at::Tensor>& bias, int64_t splits, const at::Tensor& table, at::Tensor& y) {
  const int64_t n = p.x.size(0);
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(p.x.device());
  const bool bf16 = p.x.scalar_type() == at::kBFloat16;
  const int cap = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(max_run, kGt * kGt)));
  const SpmmPlan plan =
      spmm_smbd_plan(static_cast<int>(m), static_cast<int>(n), static_cast<int>(p.kp), cap, bf16, p.x.get_device(),
                     static_cast<int>(std::min<int64_t>(splits, INT32_MAX)), table.defined());
  const SplitK split(plan.splits, plan.workspace_floats, plan.counters, p.x.options());
  at::Tensor offsets = gtile_offset.contiguous();
  at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  SpmmArgs a{};
  a.x = p.x.data_ptr();
  a.bitmap = p.bitmap.data_ptr<int64_t>();
  a.values = p.values.data_ptr();
  a.gtile_offset = offsets.data_ptr<int32_t>();
  a.row_offset = table.defined() ? table.data_ptr<int16_t>() : nullptr;
  a.bias = bias ? b.data_ptr() : nullptr;
  a.y = y.data_ptr();
  a.workspace = split.workspace_ptr();
  a.counters = split.counters_ptr();
  a.m = static_cast<int>(m);
  a.n = static_cast<int>(n);
  a.kp = static_cast<int>(p.kp);
  a.value_cap = plan.value_cap;
  a.nvalues = p.values.numel();
  a.x_l1 = plan.x_l1;
  a.stagger = plan.stagger;
  a.ticket = plan.ticket;
  a.bf16 = bf16;
  C10_CUDA_CHECK(spmm_smbd_run(a, plan, at::cuda::getCurrentCUDAStream()));
}

at::Tensor spmm_cuda(const at::Tensor& x, const at::Tensor& bitmap, const at::Tensor& values,
                     const at::Tensor& gtile_offset, int64_t m, int64_t k, int64_t gt_h, int64_t gt_w,
                     int64_t max_run, const std::optional<at::Tensor>& bias, int64_t splits,
                     const std::optional<at::Tensor>& row_offset) {
  TORCH_CHECK_VALUE(x.is_cuda(), "spinfer::spmm (CUDA) got x on ", x.device());
  TORCH_CHECK_VALUE(splits >= 0, "splits must be >= 0 (0: the planner's choice), got ", splits);
  const Prepared p = check_and_prepare(x, bitmap, values, gtile_offset, m, k, gt_h, gt_w, bias);
  const at::Tensor table = check_row_table(row_offset, gtile_offset);
  at::Tensor y = at::empty({x.size(0), m}, x.options());
  run(p, gtile_offset, m, max_run, bias, splits, table, y);
  return y;
}

void spmm_out_cuda(const at::Tensor& x, const at::Tensor& bitmap, const at::Tensor& values,
                   const at::Tensor& gtile_offset, int64_t m, int64_t k, int64_t gt_h, int64_t gt_w,
                   int64_t max_run, const std::optional<at::Tensor>& bias, int64_t splits,
                   const std::optional<at::Tensor>& row_offset, at::Tensor& out) {
  TORCH_CHECK_VALUE(x.is_cuda(), "spinfer::spmm_out (CUDA) got x on ", x.device());
  TORCH_CHECK_VALUE(splits >= 0, "splits must be >= 0 (0: the planner's choice), got ", splits);
  const Prepared p = check_and_prepare(x, bitmap, values, gtile_offset, m, k, gt_h, gt_w, bias);
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == m && out.is_contiguous(),
                    "out must be a contiguous [", x.size(0), ", ", m, "] tensor, got ", out.sizes());
  TORCH_CHECK_TYPE(out.scalar_type() == x.scalar_type(), "out is ", dtype_name(out.scalar_type()), " but x is ",
                   dtype_name(x.scalar_type()));
  TORCH_CHECK_VALUE(out.device() == x.device(), "out is on ", out.device(), " but x is on ", x.device());
  run(p, gtile_offset, m, max_run, bias, splits, check_row_table(row_offset, gtile_offset), out);
}

// The packed low-bit arrays of an [m, k] weight (spinfer/quant/lowbit.py layout), checked for the
// kernels that read them (the fused matmul and the decode to dense): K padded to whole 256-column
// stages (two 128-column stages at 8 bits), and the shift that maps a column to its group.
struct LowbitGeometry {
  int64_t kp, groups;
  int group_shift;  // log2(group size); 30 for one group per row (per-channel): every column maps to 0
  bool nibble_zeros;  // the records hold 4-bit integer zeros (their width says so)
};

LowbitGeometry check_lowbit_arrays(const at::Tensor& qweight, const at::Tensor& scale_zero, int64_t bits,
                                   int64_t group_size, int64_t m, int64_t k) {
  TORCH_CHECK_VALUE(bits == 1 || bits == 2 || bits == 4 || bits == 8, "bits must be 1, 2, 4 or 8, got ", bits);
  TORCH_CHECK_VALUE(m >= 1 && k >= 1 && group_size >= 1 && k % group_size == 0,
                    "bad low-bit geometry: m=", m, " k=", k, " group_size=", group_size);
  LowbitGeometry g{(k + 255) / 256 * 256, k / group_size, 30, false};
  const int64_t stage = bits == 8 ? 128 : 256;
  TORCH_CHECK_TYPE(qweight.scalar_type() == at::kInt, "qweight must be int32");
  TORCH_CHECK_VALUE(qweight.dim() == 4 && qweight.size(0) == (m + 63) / 64 && qweight.size(1) == g.kp / stage &&
                        qweight.size(2) == 64 && qweight.size(3) == stage * bits / 32,
                    "qweight must be [", (m + 63) / 64, ", ", g.kp / stage, ", 64, ", stage * bits / 32, "], got ",
                    qweight.sizes());
  TORCH_CHECK_TYPE(scale_zero.scalar_type() == at::kHalf || scale_zero.scalar_type() == at::kBFloat16,
                   "scale_zero must be float16 or bfloat16, got ", dtype_name(scale_zero.scalar_type()));
  // Records of 2 * record_words halves (lowbit_mm.h): 4-bit integer zeros at 1, 2 and 4 bits only.
  const int64_t dtype_halves = 2 * record_words(false), nibble_halves = 2 * record_words(true);
  TORCH_CHECK_VALUE(scale_zero.dim() == 3 && scale_zero.size(0) == (m + 63) / 64 && scale_zero.size(1) == g.groups &&
                        (scale_zero.size(2) == dtype_halves || (bits <= 4 && scale_zero.size(2) == nibble_halves)),
                    "scale_zero must be [", (m + 63) / 64, ", ", g.groups, ", ", dtype_halves, "]",
                    bits <= 4 ? " or [" + std::to_string((m + 63) / 64) + ", " + std::to_string(g.groups) + ", " +
                                    std::to_string(nibble_halves) + "]"
                              : std::string(),
                    " records at ", bits, " bits, got ", scale_zero.sizes());
  g.nibble_zeros = scale_zero.size(2) == nibble_halves;
  if (g.groups > 1) {  // group sizes 32..256 are powers of two
    TORCH_CHECK_VALUE((group_size & (group_size - 1)) == 0, "group_size must be a power of two, got ", group_size);
    g.group_shift = 0;
    while ((int64_t(1) << g.group_shift) < group_size) ++g.group_shift;
  }
  return g;
}

// ---- lowbit_mm_out: the fused low-bit kernel. The Python layer (LowBitWeight and
// check_op_inputs) has already checked everything below; these checks guard direct calls.
void lowbit_mm_out_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale_zero,
                        int64_t bits, int64_t group_size, int64_t m, int64_t k,
                        const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& bias, int64_t splits,
                        bool integer_zeros, at::Tensor& out) {
  TORCH_CHECK_VALUE(x.is_cuda(), "spinfer::lowbit_mm_out (CUDA) got x on ", x.device());
  TORCH_CHECK_VALUE(splits >= -1, "splits must be >= -1 (0: the planner's choice, -1: the balanced schedule), got ",
                    splits);
  const LowbitGeometry geo = check_lowbit_arrays(qweight, scale_zero, bits, group_size, m, k);
  const int64_t kp = geo.kp, groups = geo.groups;
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == k, "x must be [N, ", k, "], got ", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
                   "x must be float16 or bfloat16, got ", dtype_name(x.scalar_type()));
  TORCH_CHECK_TYPE(scale_zero.scalar_type() == x.scalar_type(), "x is ", dtype_name(x.scalar_type()),
                   " but the weight is ", dtype_name(scale_zero.scalar_type()), "; cast x to ",
                   dtype_name(scale_zero.scalar_type()));
  for (const at::Tensor* t : {&qweight, &scale_zero, const_cast<const at::Tensor*>(&out)})
    TORCH_CHECK_VALUE(t->device() == x.device(), "x is on ", x.device(), " but an array is on ", t->device());
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == m && out.is_contiguous(),
                    "out must be a contiguous [", x.size(0), ", ", m, "] tensor, got ", out.sizes());
  TORCH_CHECK_TYPE(out.scalar_type() == x.scalar_type(), "out is ", dtype_name(out.scalar_type()), " but x is ",
                   dtype_name(x.scalar_type()));
  if (bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == m, "bias must have shape (", m, ",), got ",
                      bias->sizes());
    TORCH_CHECK_VALUE(bias->device() == x.device(), "bias is on ", bias->device(), " but x is on ", x.device());
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "bias is ", dtype_name(bias->scalar_type()), " but x is ",
                     dtype_name(x.scalar_type()));
  }
  TORCH_CHECK_VALUE(x.size(0) <= INT32_MAX && m <= INT32_MAX && kp <= INT32_MAX, "shape too large");
  // One block row per 64 output rows, at most 65535 of them (the grid's y dimension).
  TORCH_CHECK_VALUE(m <= int64_t(65535) * 64, "the low-bit kernel takes at most ", int64_t(65535) * 64,
                    " output rows, got ", m);
  const int64_t n = x.size(0);
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  // Act-order: gather x's columns once. The kernel reads whole 256-column stages of x: pad K
  // with zeros (the padded weight columns hold q = 0 but a nonzero zero-point).
  at::Tensor xg = x;
  if (perm) {
    TORCH_CHECK_VALUE(perm->dim() == 1 && perm->size(0) == k && perm->scalar_type() == at::kLong &&
                          perm->device() == x.device(),
                      "perm must be an int64 [", k, "] tensor on ", x.device());
    xg = x.index_select(1, *perm);
  }
  xg = kp == k ? aligned16(xg) : at::constant_pad_nd(xg, {0, kp - k}, 0).contiguous();
  const at::Tensor qw = aligned16(qweight), sz = aligned16(scale_zero);
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const LowbitPlan plan = lowbit_mm_plan(static_cast<int>(m), static_cast<int>(n), static_cast<int>(kp),
                                         static_cast<int>(bits), static_cast<int>(group_size), x.get_device(), bf16,
                                         static_cast<int>(std::min<int64_t>(splits, INT32_MAX)));
  const SplitK split(plan.splits, plan.workspace_floats, plan.counters, x.options());
  LowbitArgs a{};
  a.x = xg.data_ptr();
  a.qweight = reinterpret_cast<const uint32_t*>(qw.data_ptr<int32_t>());
  a.scale_zero = sz.data_ptr();
  a.bias = bias ? b.data_ptr() : nullptr;
  a.y = out.data_ptr();
  a.workspace = split.workspace_ptr();
  a.counters = split.counters_ptr();
  a.m = static_cast<int>(m);
  a.n = static_cast<int>(n);
  a.kp = static_cast<int>(kp);
  a.group_shift = geo.group_shift;
  a.groups = static_cast<int>(groups);
  a.bits = static_cast<int>(bits);
  a.bf16 = bf16;
  const char* force_xsum = std::getenv("SPINFER_LOWBIT_XSUM");
  a.force_xsum = force_xsum != nullptr && force_xsum[0] == '1';
  // At 8 bits the caller's word (LowBitWeight.integer_zeros checked it once): a zero outside the
  // fast decode's set then gives wrong values, but no access depends on it. At 1, 2 and 4 bits
  // the records' width: 4-bit zeros are integers, and the kernels decode no others unchecked.
  a.nibble_zeros = geo.nibble_zeros;
  a.integer_zeros = (bits == 8 ? integer_zeros : geo.nibble_zeros) && !a.force_xsum;
  a.rotate = lowbit_rotate();
  C10_CUDA_CHECK(lowbit_mm_run(a, plan, at::cuda::getCurrentCUDAStream()));
}

// The launch configuration the planner picks for x's N, dtype and device and an [m, k] weight
// whose longest GroupTile run is max_run (spinfer.ops.spmm.spmm_plan names the fields). A host
// query for tests and tuning; the Python wrapper checks its arguments.
std::vector<int64_t> spmm_plan_cuda(const at::Tensor& x, int64_t m, int64_t k, int64_t max_run, int64_t splits) {
  TORCH_CHECK_VALUE(x.is_cuda() && x.dim() == 2 && x.size(0) >= 1 && m >= 1 && k >= 1 && splits >= 0,
                    "spmm_plan: bad arguments");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t kp = (k + kGt - 1) / kGt * kGt;
  const int cap = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(max_run, kGt * kGt)));
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const SpmmPlan p = spmm_smbd_plan(static_cast<int>(m), static_cast<int>(x.size(0)), static_cast<int>(kp), cap, bf16,
                                    x.get_device(), static_cast<int>(std::min<int64_t>(splits, INT32_MAX)),
                                    /*row_table=*/true);  // spinfer.spmm passes every weight's table
  return {p.bn, p.n_tiles, p.grid_m, p.grid_k, p.splits, p.k_per_split, p.stages, p.value_cap, p.smem_bytes,
          spmm_smbd_resident_blocks(p, bf16, x.get_device()), p.min_blocks, p.lean, p.bulk, p.x_l1,
          p.count_rows, p.stagger, p.row_table, p.wgmma, p.rows, p.ticket};
}

// The fused low-bit kernel's launch for x's N, dtype and device and an [m, k] weight of `bits` and
// `group_size` (spinfer.ops.lowbit_mm.lowbit_plan names the fields): a host query for tests and
// tuning, reading the same environment overrides as a launch.
std::vector<int64_t> lowbit_plan_cuda(const at::Tensor& x, int64_t m, int64_t k, int64_t bits, int64_t group_size,
                                      int64_t splits) {
  TORCH_CHECK_VALUE(x.is_cuda() && x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= INT32_MAX && m >= 1 &&
                        m <= int64_t(65535) * 64 && k >= 1 && k <= INT32_MAX - 255 && splits >= -1 &&
                        (bits == 1 || bits == 2 || bits == 4 || bits == 8) && group_size >= 1,
                    "lowbit_plan: bad arguments");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t kp = (k + 255) / 256 * 256;
  const LowbitPlan p = lowbit_mm_plan(static_cast<int>(m), static_cast<int>(x.size(0)), static_cast<int>(kp),
                                      static_cast<int>(bits), static_cast<int>(group_size), x.get_device(),
                                      x.scalar_type() == at::kBFloat16, static_cast<int>(std::min<int64_t>(splits, INT32_MAX)));
  return {p.bn,         p.n_tiles,     p.row_blocks, p.grid_blocks, p.splits,     p.iters_per_split,
          p.blocks_per_sm, p.variant == kLowbitBalanced, p.tail_first, p.tail_splits, p.tail_iters,
          lowbit_tile_rows(p.variant), p.bulk_weights, p.variant == kLowbitGemv, p.gemv_ring,
          p.gemv_warps};
}

// ---- tca_bme_to_dense / lowbit_to_dense: the weight as a dense [m, k] matrix (to_dense.cu). The
// Python callers (TCABME.to_dense, LowBitWeight.dequantize, lowbit_mm) hold validated weights;
// these checks guard direct calls, so the kernels never index past the arrays.
at::Tensor tca_bme_to_dense_cuda(const at::Tensor& bitmap, const at::Tensor& values, const at::Tensor& gtile_offset,
                                 int64_t m, int64_t k, int64_t gt_h, int64_t gt_w) {
  TORCH_CHECK_VALUE(bitmap.is_cuda(), "spinfer::tca_bme_to_dense (CUDA) got bitmap on ", bitmap.device());
  const auto [grid_m, grid_k] = check_tca_bme_arrays("spinfer::tca_bme_to_dense", bitmap, values, gtile_offset, m, k,
                                                     gt_h, gt_w, bitmap.device());
  TORCH_CHECK_VALUE(m <= INT32_MAX && k <= INT32_MAX, "weight shape ", m, "x", k, " too large");
  const c10::cuda::CUDAGuard guard(bitmap.device());
  const at::Tensor bm = bitmap.contiguous(), vals = values.contiguous(), off = gtile_offset.contiguous();
  at::Tensor out = at::empty({m, k}, values.options());
  TcaBmeToDenseArgs a{};
  a.bitmap = reinterpret_cast<const uint64_t*>(bm.data_ptr<int64_t>());
  a.values = reinterpret_cast<const uint16_t*>(vals.data_ptr());
  a.gtile_offset = off.data_ptr<int32_t>();
  a.nvalues = vals.numel();
  a.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  a.m = static_cast<int>(m), a.k = static_cast<int>(k);
  a.grid_m = static_cast<int>(grid_m), a.grid_k = static_cast<int>(grid_k);
  C10_CUDA_CHECK(tca_bme_to_dense(a, at::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor lowbit_to_dense_cuda(const at::Tensor& qweight, const at::Tensor& scale_zero, int64_t bits,
                                int64_t group_size, int64_t m, int64_t k) {
  const LowbitGeometry geo = check_lowbit_arrays(qweight, scale_zero, bits, group_size, m, k);
  TORCH_CHECK_VALUE(m <= INT32_MAX && geo.kp <= INT32_MAX, "shape too large");
  TORCH_CHECK_VALUE(qweight.is_cuda() && scale_zero.device() == qweight.device(),
                    "qweight and scale_zero must be on one CUDA device");
  const c10::cuda::CUDAGuard guard(qweight.device());
  const at::Tensor qw = aligned16(qweight), sz = aligned16(scale_zero);  // 4-byte words of records
  at::Tensor out = at::empty({m, k}, scale_zero.options());
  LowbitToDenseArgs a{};
  a.qweight = reinterpret_cast<const uint32_t*>(qw.data_ptr<int32_t>());
  a.scale_zero = sz.data_ptr();
  a.out = out.data_ptr();
  a.m = static_cast<int>(m), a.k = static_cast<int>(k), a.kp = static_cast<int>(geo.kp);
  a.bits = static_cast<int>(bits);
  a.group_shift = geo.group_shift;
  a.groups = static_cast<int>(geo.groups);
  a.bf16 = scale_zero.scalar_type() == at::kBFloat16;
  a.nibble_zeros = geo.nibble_zeros;
  C10_CUDA_CHECK(lowbit_to_dense(a, at::cuda::getCurrentCUDAStream()));
  return out;
}

// The Autograd kernel of the _out ops: they record no gradient, so as torch's own out= ops they
// refuse an argument that requires one, then run below autograd and bump the buffer's version as
// an in-place write. Before, nothing refused them, and out came back detached from the graph: x
// got no gradient through it and nothing said so. A boxed kernel on the stack as it is: it measured
// no slower per call (fifty-eighth session). (spinfer/ops/library.py registers the same check for
// the CPU.)
void out_op_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const auto args = torch::jit::last(*stack, n);
  at::Tensor out;
  for (size_t i = 0; i < n; ++i) {
    if (!args[i].isTensor()) continue;  // ints, and an optional tensor left None
    const at::Tensor& t = args[i].toTensor();
    const std::string& name = schema.arguments()[i].name();
    TORCH_CHECK(!(at::GradMode::is_enabled() && t.requires_grad()), schema.name(),
                ": functions with out=... arguments don't support automatic differentiation, but '", name,
                "' requires grad; call the differentiable op (spinfer.spmm / spinfer.lowbit_mm) or run under "
                "torch.no_grad()");
    if (name == "out") out = t;
  }
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  if (out.defined()) out.unsafeGetTensorImpl()->bump_version();
}

// x [..., k] as the [N, k] the kernels take, and the [..., m] shape of the result.
std::pair<at::Tensor, std::vector<int64_t>> flatten_leading(const at::Tensor& x, int64_t m, int64_t k) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == k, "x must have shape [..., ", k, "] to match the weight ", m, "x", k,
                    ", got ", x.sizes());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = m;
  return {x.dim() == 2 ? x : x.reshape({-1, k}), std::move(shape)};
}

}  // namespace

// eager.h. The profiler still sees each call under the op's name.
at::Tensor spmm_eager(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& bitmap,
                      const at::Tensor& values, const at::Tensor& gtile_offset, int64_t m, int64_t k, int64_t max_run,
                      int64_t splits, const std::optional<at::Tensor>& row_offset) {
  RECORD_FUNCTION("spinfer::spmm", std::vector<c10::IValue>());
  auto [x2, shape] = flatten_leading(x, m, k);
  return spmm_cuda(x2, bitmap, values, gtile_offset, m, k, kGt, kGt, max_run, bias, splits, row_offset).view(shape);
}

at::Tensor lowbit_mm_eager(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& qweight,
                           const at::Tensor& scale_zero, int64_t bits, int64_t group_size, int64_t m, int64_t k,
                           const std::optional<at::Tensor>& perm, int64_t splits, bool integer_zeros) {
  RECORD_FUNCTION("spinfer::lowbit_mm", std::vector<c10::IValue>());
  auto [x2, shape] = flatten_leading(x, m, k);
  at::Tensor y = at::empty({x2.size(0), m}, x2.options());
  lowbit_mm_out_cuda(x2, qweight, scale_zero, bits, group_size, m, k, perm, bias, splits, integer_zeros, y);
  return y.view(shape);
}

}  // namespace spinfer

TORCH_LIBRARY_IMPL(spinfer, Autograd, m) {
  m.impl("spmm_out", torch::CppFunction::makeFromBoxedFunction<&spinfer::out_op_autograd>());
  m.impl("lowbit_mm_out", torch::CppFunction::makeFromBoxedFunction<&spinfer::out_op_autograd>());
}

TORCH_LIBRARY_IMPL(spinfer, CUDA, m) {
  m.impl("tca_bme_to_dense", &spinfer::tca_bme_to_dense_cuda);
  m.impl("lowbit_to_dense", &spinfer::lowbit_to_dense_cuda);
  m.impl("spmm_plan", &spinfer::spmm_plan_cuda);
  m.impl("lowbit_plan", &spinfer::lowbit_plan_cuda);
  m.impl("spmm", &spinfer::spmm_cuda);
  m.impl("spmm_out", &spinfer::spmm_out_cuda);
  m.impl("lowbit_mm_out", &spinfer::lowbit_mm_out_cuda);
}
