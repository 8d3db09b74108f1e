// flash_moe's torch binding: checks every input, names the argument that is wrong, then
// calls the torch-free launchers. Bound with the LibTorch stable ABI (built with
// TORCH_TARGET_VERSION = 2.10) and the Python limited API, so one build imports under every
// torch >= 2.10 and every CPython >= 3.10.
#include <Python.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "flash_moe_constants.h"
#include "fused_moe_bf16.h"
#include "fused_moe_mxfp8.h"
#include "moe_align.h"
#include "moe_backward.h"
#include "mxfp8_quantize.h"
#include "prime_kernels/binding.h"

namespace prime_moe {
namespace {

using namespace prime_kernels::binding;
using torch::headeronly::ScalarType;
using torch::stable::Tensor;

void check_block_m_bpc(const char* op, int64_t block_m, int64_t bpc) {
  if (block_m <= 0 || block_m % 16 != 0 || block_m > 1024) {
    fail(op, "block_m=", block_m, " must be a positive multiple of 16 up to 1024");
  }
  // Divided, not multiplied: bpc is any int64 the caller passed.
  if (bpc <= 0 || bpc > (1 << 16) / block_m) {
    fail(op, "bpc=", bpc, " must be positive with block_m * bpc <= 65536");
  }
}

std::tuple<Tensor, Tensor, Tensor> moe_align(Tensor topk_ids, int64_t num_experts, int64_t block_m,
                                             int64_t bpc) {
  constexpr const char* op = "moe_align";
  const std::vector<TensorArg> tensors = {{"topk_ids", topk_ids, ScalarType::Int, 2}};
  check_tensors(op, tensors);
  if (num_experts < 1 || num_experts > kMaxExperts) {
    fail(op, "num_experts=", num_experts, " must be in [1, ", kMaxExperts, "]");
  }
  check_block_m_bpc(op, block_m, bpc);
  const int64_t num_pairs = topk_ids.numel();
  if (num_pairs > kMaxRows) {
    fail(op, "argument 'topk_ids' of shape ", shape_of(topk_ids), " holds ", num_pairs,
         " pairs; at most 2^31 - 1 are supported");
  }
  const int64_t pad = block_m * bpc;
  const int64_t max_padded = moe_align_max_padded(num_pairs, num_experts, pad);
  // Rows and segment offsets are int32 on the device: the worst-case padded length (every
  // expert wasting pad - 1 rows) must stay below 2^31, not only T * k.
  if (max_padded > kMaxRows) {
    fail(op, "argument 'topk_ids' of shape ", shape_of(topk_ids), " with num_experts=", num_experts,
         " and block_m * bpc = ", pad, " gives up to ", max_padded,
         " padded rows; at most 2^31 - 1 are supported (fewer experts or a smaller block_m * "
         "bpc)");
  }
  const int32_t device = check_devices(op, tensors);

  torch::stable::accelerator::DeviceGuard guard(device);
  Tensor sorted_token_ids = torch::stable::new_empty(topk_ids, {max_padded});
  Tensor expert_ids = torch::stable::new_empty(topk_ids, {max_padded / block_m});
  Tensor num_tokens_post_padded = torch::stable::new_empty(topk_ids, {1});
  // Allocated only where the three passes run: at decode sizes each allocation is host time.
  const int64_t workspace_elems =
      int64_t(moe_align_workspace_bytes(num_pairs, num_experts, max_padded) / sizeof(int32_t));
  std::optional<Tensor> workspace;
  if (workspace_elems > 0) workspace = torch::stable::new_empty(topk_ids, {workspace_elems});
  check_cuda(op,
             launch_moe_align(topk_ids.const_data_ptr<int32_t>(), num_pairs,
                              static_cast<int>(num_experts), static_cast<int>(block_m),
                              static_cast<int>(bpc), sorted_token_ids.mutable_data_ptr<int32_t>(),
                              expert_ids.mutable_data_ptr<int32_t>(),
                              num_tokens_post_padded.mutable_data_ptr<int32_t>(), max_padded,
                              workspace ? workspace->mutable_data_ptr<int32_t>() : nullptr,
                              current_stream(device)));
  return {sorted_token_ids, expert_ids, num_tokens_post_padded};
}

// What both forward ops check alike once each tensor is what it should be: top_k, and w's,
// w2's, out's, topk_weights' and num_tokens_post_padded's shapes against x's (T, D). out may
// be null (moe_forward allocates its own).
void check_forward_shapes(const char* op, const Tensor& x, const Tensor& w, const Tensor& w2,
                          const Tensor& num_tokens_post_padded, const Tensor& topk_weights,
                          const Tensor* out, const char* out_name, int64_t top_k) {
  const int64_t T = x.size(0), D = x.size(1);
  const int64_t E = w.size(0), H = w.size(1) / 2;
  if (top_k < 1) fail(op, "top_k=", top_k, " must be at least 1");
  if (w.size(1) % 2 != 0 || w.size(2) != D) {
    fail(op, "argument 'w' must have shape (E, 2 * hidden_dim, dim) = (E, 2H, ", D,
         ") with gate rows [0, H) and up rows [H, 2H), got ", shape_of(w));
  }
  check_shape(op, "w2", w2, {E, D, H}, "(E, dim, hidden_dim)");
  if (out != nullptr) check_shape(op, out_name, *out, {T, D}, "(T, dim), like x");
  check_shape(op, "topk_weights", topk_weights, {T, top_k}, "(T, top_k), read at t * top_k + j");
  check_shape(op, "num_tokens_post_padded", num_tokens_post_padded, {1},
              "(moe_align's padded total)");
}

// moe_align's layout as the forward ops take it: block_m and bpc as moe_align was given
// them, sorted_token_ids and expert_ids of the lengths it returns. Returns max_padded.
int64_t check_routing_layout(const char* op, const Tensor& sorted_token_ids,
                             const Tensor& expert_ids, int64_t block_m, int64_t bpc) {
  check_block_m_bpc(op, block_m, bpc);
  const int64_t max_padded = sorted_token_ids.size(0);
  if (max_padded % (block_m * bpc) != 0) {
    fail(op, "argument 'sorted_token_ids' has length ", max_padded,
         ", which is not a multiple of block_m * bpc = ", block_m * bpc,
         "; pass moe_align's output for the same block_m and bpc");
  }
  if (expert_ids.size(0) != max_padded / block_m) {
    fail(op, "argument 'expert_ids' must have length len(sorted_token_ids) / block_m = ",
         max_padded / block_m, ", got ", expert_ids.size(0),
         "; pass moe_align's output for the same block_m");
  }
  return max_padded;
}

// Tuning values are small ints on the device side: refuse what would not survive the cast.
void check_tuning_ranges(const char* op,
                         std::initializer_list<std::pair<const char*, int64_t>> values) {
  for (const auto& [name, value] : values) {
    if (value < 0 || value > 1024) fail(op, name, "=", value, " must be in [0, 1024]");
  }
}

// The MXFP8 kernels' own rules on D and H (beyond bf16's): the blocked scale layout's tiles.
void check_mxfp8_dims(const char* op, int64_t D, int64_t H) {
  if (D % kMxfp8DimMultiple != 0) {
    fail(op, "dim=", D, " (x.size(1)) must be a multiple of ", kMxfp8DimMultiple,
         " (the blocked scale layout: w2's rows in tiles of 128, w's D/32 scale columns in tiles "
         "of 4)");
  }
  if (H % kMxfp8HiddenMultiple != 0) {
    fail(op, "hidden_dim=", H, " (w.size(1) / 2) must be a multiple of ", kMxfp8HiddenMultiple,
         " (the blocked scale layout: w's up rows start a 128-row tile, w2's H/32 scale "
         "columns come in tiles of 4)");
  }
}

// The forward's tensors (and `kept`, the backward's extra ones), checked in the order the
// messages promise: what each tensor is, then the shapes (check_kept_shapes for `kept`, given
// the problem), then where. Returns the launcher's problem.
FusedMoeBf16Problem forward_problem(
    const char* op, const Tensor& x, const Tensor& w, const Tensor& w2,
    const Tensor& sorted_token_ids, const Tensor& expert_ids, const Tensor& num_tokens_post_padded,
    const Tensor& topk_weights, const Tensor* out, const char* out_name, int64_t top_k,
    int64_t block_m, int64_t bpc, const std::vector<TensorArg>& kept = {},
    const std::function<void(const FusedMoeBf16Problem&)>& check_kept_shapes = nullptr) {
  const Tensor& out_or_x = out != nullptr ? *out : x;
  std::vector<TensorArg> tensors = {
      {"x", x, ScalarType::BFloat16, 2},
      {"w", w, ScalarType::BFloat16, 3},
      {"w2", w2, ScalarType::BFloat16, 3},
      {"sorted_token_ids", sorted_token_ids, ScalarType::Int, 1},
      {"expert_ids", expert_ids, ScalarType::Int, 1},
      {"num_tokens_post_padded", num_tokens_post_padded, ScalarType::Int, 1},
      {"topk_weights", topk_weights, ScalarType::Float, 2},
      {out != nullptr ? out_name : "x", out_or_x, ScalarType::BFloat16, 2}};
  for (const TensorArg& arg : kept) tensors.push_back(arg);
  check_tensors(op, tensors);

  const int64_t T = x.size(0), D = x.size(1);
  const int64_t E = w.size(0), H = w.size(1) / 2;
  check_forward_shapes(op, x, w, w2, num_tokens_post_padded, topk_weights, out, out_name, top_k);
  if (D % kDimMultiple != 0) {
    fail(op, "dim=", D, " (x.size(1)) must be a multiple of ", kDimMultiple,
         " (one 64-element K step of the gate/up GEMM)");
  }
  if (H % kHiddenMultiple != 0) {
    fail(op, "hidden_dim=", H, " (w.size(1) / 2) must be a multiple of ", kHiddenMultiple,
         " (one 64-element K step of the down GEMM)");
  }
  const int64_t max_padded = check_routing_layout(op, sorted_token_ids, expert_ids, block_m, bpc);
  FusedMoeBf16Problem problem{};
  problem.x = static_cast<const __nv_bfloat16*>(x.const_data_ptr());
  problem.w = static_cast<const __nv_bfloat16*>(w.const_data_ptr());
  problem.w2 = static_cast<const __nv_bfloat16*>(w2.const_data_ptr());
  problem.sorted_token_ids = sorted_token_ids.const_data_ptr<int32_t>();
  problem.expert_ids = expert_ids.const_data_ptr<int32_t>();
  problem.num_tokens_post_padded = num_tokens_post_padded.const_data_ptr<int32_t>();
  problem.topk_weights = topk_weights.const_data_ptr<float>();
  problem.out = out != nullptr ? static_cast<__nv_bfloat16*>(out->mutable_data_ptr()) : nullptr;
  problem.num_tokens = T;
  problem.dim = D;
  problem.hidden_dim = H;
  problem.num_experts = E;
  problem.top_k = top_k;
  problem.max_padded = max_padded;
  problem.block_m = block_m;
  if (check_kept_shapes) check_kept_shapes(problem);
  problem.device = check_devices(op, tensors);
  return problem;
}

// Checks the problem against the kernels' rules, resolves the tiles (x's device decides)
// and enqueues the forward. The caller holds a guard for problem.device.
void run_forward(const char* op, const Tensor& x, const FusedMoeBf16Problem& problem,
                 const FusedMoeBf16Config& requested) {
  const std::string problem_error = check_fused_moe_bf16(problem, requested);
  if (!problem_error.empty()) fail(op, problem_error);
  const FusedMoeBf16Config config = resolve_fused_moe_bf16_config(problem, requested);
  if (const char* print = std::getenv("PRIME_MOE_PRINT_CONFIG"); print && print[0] == '1') {
    std::fprintf(stderr, "%s: %s\n", op,
                 describe_fused_moe_bf16_config(problem, requested, config).c_str());
  }
  if (problem.num_tokens == 0) return;  // nothing to write, nothing launched

  const int64_t workspace_bytes =
      static_cast<int64_t>(fused_moe_bf16_workspace_bytes(problem, config));
  Tensor workspace =
      torch::stable::new_empty(x, {workspace_bytes > 0 ? workspace_bytes : 1}, ScalarType::Byte);
  check_cuda(op, launch_fused_moe_bf16(problem, config, workspace.mutable_data_ptr(),
                                       current_stream(problem.device)));
}

void fused_moe_bf16(Tensor x, Tensor w, Tensor w2, Tensor sorted_token_ids, Tensor expert_ids,
                    Tensor num_tokens_post_padded, Tensor topk_weights, Tensor out, int64_t top_k,
                    int64_t block_m, int64_t block_n, int64_t warp_n, int64_t stages, int64_t bpc,
                    int64_t cpc, bool split) {
  constexpr const char* op = "fused_moe_bf16";
  check_tuning_ranges(op,
                      {{"block_n", block_n}, {"warp_n", warp_n}, {"stages", stages}, {"cpc", cpc}});
  const FusedMoeBf16Problem problem =
      forward_problem(op, x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                      topk_weights, &out, "out", top_k, block_m, bpc);
  FusedMoeBf16Config requested;
  requested.block_n = static_cast<int>(block_n);
  requested.warp_n = static_cast<int>(warp_n);
  requested.stages = static_cast<int>(stages);
  requested.bpc = static_cast<int>(bpc);
  requested.cpc = static_cast<int>(cpc);
  requested.split = split;
  torch::stable::accelerator::DeviceGuard guard(problem.device);
  run_forward(op, x, problem, requested);
}

// What an e8m0 scale tensor is: the bits as torch.uint8 (flash_moe.fused_moe_mxfp8 views the
// caller's float8_e8m0fnu: the stable ABI cannot name that dtype), contiguous, `numel` bytes;
// `rows_shape` (non-empty) also pins its shape.
void check_mxfp8_scales(const char* op, const char* name, const Tensor& t, int64_t numel,
                        const char* meaning, const std::vector<int64_t>& rows_shape = {}) {
  ScalarType dtype;
  try {
    dtype = t.scalar_type();
  } catch (const std::exception&) {
    fail(op, "argument '", name,
         "' must be a torch.uint8 tensor (the bits of e8m0 scales), got a dtype the stable ABI "
         "does not name, such as torch.float8_e8m0fnu: pass it through "
         "flash_moe.fused_moe_mxfp8, or scales.view(torch.uint8)");
  }
  if (dtype != ScalarType::Byte) {
    fail(op, "argument '", name, "' must be float8_e8m0fnu scales (their torch.uint8 bits), got ",
         dtype_name(dtype));
  }
  if (!t.is_contiguous()) {
    fail(op, "argument '", name, "' must be contiguous, got shape ", shape_of(t),
         " with non-contiguous strides");
  }
  if (!rows_shape.empty()) {
    check_shape(op, name, t, rows_shape, meaning);
  } else if (t.numel() != numel) {
    fail(op, "argument '", name, "' must hold ", numel, " scales ", meaning, ", got shape ",
         shape_of(t));
  }
}

// The MXFP8 forward: e4m3 x, w, w2 (CONTRACT.md's shapes) with their e8m0 scales, bf16 out.
// Every tensor is checked (what it is, its shape, then where) before anything is launched.
void fused_moe_mxfp8(Tensor x, Tensor x_scales, Tensor w, Tensor w_scales, Tensor w2,
                     Tensor w2_scales, Tensor sorted_token_ids, Tensor expert_ids,
                     Tensor num_tokens_post_padded, Tensor topk_weights, Tensor out, int64_t top_k,
                     int64_t block_m, int64_t block_n, int64_t warp_n, int64_t stages, int64_t bpc,
                     bool split) {
  constexpr const char* op = "fused_moe_mxfp8";
  check_tuning_ranges(op, {{"block_n", block_n}, {"warp_n", warp_n}, {"stages", stages}});
  const std::vector<TensorArg> tensors = {
      {"x", x, ScalarType::Float8_e4m3fn, 2},
      {"w", w, ScalarType::Float8_e4m3fn, 3},
      {"w2", w2, ScalarType::Float8_e4m3fn, 3},
      {"sorted_token_ids", sorted_token_ids, ScalarType::Int, 1},
      {"expert_ids", expert_ids, ScalarType::Int, 1},
      {"num_tokens_post_padded", num_tokens_post_padded, ScalarType::Int, 1},
      {"topk_weights", topk_weights, ScalarType::Float, 2},
      {"out", out, ScalarType::BFloat16, 2}};
  check_tensors(op, tensors);
  const int64_t T = x.size(0), D = x.size(1);
  const int64_t E = w.size(0), H = w.size(1) / 2;
  check_forward_shapes(op, x, w, w2, num_tokens_post_padded, topk_weights, &out, "out", top_k);
  check_mxfp8_dims(op, D, H);
  check_mxfp8_scales(op, "x_scales", x_scales, T * (D / kMxfp8ScaleBlock),
                     "(T, dim / 32), row-major", {T, D / kMxfp8ScaleBlock});
  check_mxfp8_scales(op, "w_scales", w_scales, E * 2 * H * (D / kMxfp8ScaleBlock),
                     "(E * 2H * dim/32: each expert's (2H, dim/32) in pack_scales_blocked's "
                     "layout)");
  check_mxfp8_scales(op, "w2_scales", w2_scales, E * D * (H / kMxfp8ScaleBlock),
                     "(E * dim * H/32: each expert's (dim, H/32) in pack_scales_blocked's "
                     "layout)");
  const int64_t max_padded = check_routing_layout(op, sorted_token_ids, expert_ids, block_m, bpc);
  std::vector<TensorArg> all = tensors;
  all.push_back({"x_scales", x_scales, ScalarType::Byte, 2});
  all.push_back({"w_scales", w_scales, ScalarType::Byte, w_scales.dim()});
  all.push_back({"w2_scales", w2_scales, ScalarType::Byte, w2_scales.dim()});
  FusedMoeMxfp8Problem problem{};
  problem.x = static_cast<const uint8_t*>(x.const_data_ptr());
  problem.x_scales = static_cast<const uint8_t*>(x_scales.const_data_ptr());
  problem.w = static_cast<const uint8_t*>(w.const_data_ptr());
  problem.w_scales = static_cast<const uint8_t*>(w_scales.const_data_ptr());
  problem.w2 = static_cast<const uint8_t*>(w2.const_data_ptr());
  problem.w2_scales = static_cast<const uint8_t*>(w2_scales.const_data_ptr());
  problem.sorted_token_ids = sorted_token_ids.const_data_ptr<int32_t>();
  problem.expert_ids = expert_ids.const_data_ptr<int32_t>();
  problem.num_tokens_post_padded = num_tokens_post_padded.const_data_ptr<int32_t>();
  problem.topk_weights = topk_weights.const_data_ptr<float>();
  problem.out = static_cast<__nv_bfloat16*>(out.mutable_data_ptr());
  problem.num_tokens = T;
  problem.dim = D;
  problem.hidden_dim = H;
  problem.num_experts = E;
  problem.top_k = top_k;
  problem.max_padded = max_padded;
  problem.block_m = block_m;
  problem.device = check_devices(op, all);

  FusedMoeMxfp8Config requested;
  requested.block_n = static_cast<int>(block_n);
  requested.warp_n = static_cast<int>(warp_n);
  requested.stages = static_cast<int>(stages);
  requested.bpc = static_cast<int>(bpc);
  requested.cpc = 0;
  requested.split = split;
  torch::stable::accelerator::DeviceGuard guard(problem.device);
  const std::string problem_error = check_fused_moe_mxfp8(problem, requested);
  if (!problem_error.empty()) fail(op, problem_error);
  const FusedMoeMxfp8Config config = resolve_fused_moe_mxfp8_config(problem, requested);
  if (const char* print = std::getenv("PRIME_MOE_PRINT_CONFIG"); print && print[0] == '1') {
    std::fprintf(stderr, "%s: %s\n", op,
                 describe_fused_moe_mxfp8_config(problem, requested, config).c_str());
  }
  if (T == 0) return;  // nothing to write, nothing launched
  const int64_t workspace_bytes =
      static_cast<int64_t>(fused_moe_mxfp8_workspace_bytes(problem, config));
  Tensor workspace =
      torch::stable::new_empty(out, {workspace_bytes > 0 ? workspace_bytes : 1}, ScalarType::Byte);
  check_cuda(op, launch_fused_moe_mxfp8(problem, config, workspace.mutable_data_ptr(),
                                        current_stream(problem.device)));
}

// The training forward: fused_moe_bf16's split path (deterministic) into a new out, keeping
// for moe_backward the gate/up pre-activations z (max_padded, 2H) and each pair's padded row.
std::tuple<Tensor, Tensor, Tensor> moe_forward(Tensor x, Tensor w, Tensor w2,
                                               Tensor sorted_token_ids, Tensor expert_ids,
                                               Tensor num_tokens_post_padded, Tensor topk_weights,
                                               int64_t top_k) {
  constexpr const char* op = "moe_forward";
  // The backward's tiles take moe_align's default layout (block_m = BLOCK_M, bpc = 1).
  FusedMoeBf16Problem problem =
      forward_problem(op, x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                      topk_weights, nullptr, nullptr, top_k, kBlockM, 1);
  torch::stable::accelerator::DeviceGuard guard(problem.device);
  const int64_t T = problem.num_tokens, D = problem.dim, H = problem.hidden_dim;
  Tensor out = torch::stable::new_empty(x, {T, D});
  Tensor z = torch::stable::new_empty(x, {problem.max_padded, 2 * H});
  Tensor pair_to_row = torch::stable::new_empty(sorted_token_ids, {T * top_k});
  problem.out = static_cast<__nv_bfloat16*>(out.mutable_data_ptr());
  problem.keep_z = static_cast<__nv_bfloat16*>(z.mutable_data_ptr());
  problem.keep_pair_to_row = pair_to_row.mutable_data_ptr<int32_t>();
  run_forward(op, x, problem, FusedMoeBf16Config{});
  return {out, z, pair_to_row};
}

// The gradients of moe_forward for dO = grad_out; each one not asked for comes back as an
// empty (0,) tensor and costs nothing. z, pair_to_row and the alignment must be what
// moe_forward returned for this routing: their shapes are checked, their values trusted.
// overwrite_z: dz is computed into z's memory (z is then gone), for a backward whose graph
// is not kept.
std::tuple<Tensor, Tensor, Tensor, Tensor> moe_backward(
    Tensor grad_out, Tensor x, Tensor w, Tensor w2, Tensor sorted_token_ids, Tensor expert_ids,
    Tensor num_tokens_post_padded, Tensor topk_weights, Tensor z, Tensor pair_to_row, int64_t top_k,
    bool need_dx, bool need_dw, bool need_dw2, bool need_dtopk_weights, bool overwrite_z) {
  constexpr const char* op = "moe_backward";
  const FusedMoeBf16Problem fwd = forward_problem(
      op, x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, &grad_out,
      "grad_out", top_k, kBlockM, 1,
      {{"z", z, ScalarType::BFloat16, 2}, {"pair_to_row", pair_to_row, ScalarType::Int, 1}},
      [&](const FusedMoeBf16Problem& pr) {
        check_shape(op, "z", z, {pr.max_padded, 2 * pr.hidden_dim},
                    "(len(sorted_token_ids), 2 * hidden_dim), as moe_forward returned it");
        check_shape(op, "pair_to_row", pair_to_row, {pr.num_tokens * top_k},
                    "(T * top_k,), as moe_forward returned it");
      });
  const int64_t T = fwd.num_tokens, D = fwd.dim, H = fwd.hidden_dim, E = fwd.num_experts;

  torch::stable::accelerator::DeviceGuard guard(fwd.device);
  auto grad = [](bool need, std::vector<int64_t> shape, const Tensor& like) {
    return torch::stable::new_empty(like, need ? shape : std::vector<int64_t>{0});
  };
  Tensor dx = grad(need_dx, {T, D}, x);
  Tensor dw2 = grad(need_dw2, {E, D, H}, w2);
  Tensor dtopk_weights = grad(need_dtopk_weights, {T, top_k}, topk_weights);

  MoeBackwardProblem problem{};
  problem.grad_out = static_cast<const __nv_bfloat16*>(grad_out.const_data_ptr());
  problem.x = fwd.x;
  problem.w = fwd.w;
  problem.w2 = fwd.w2;
  problem.sorted_token_ids = fwd.sorted_token_ids;
  problem.expert_ids = fwd.expert_ids;
  problem.num_tokens_post_padded = fwd.num_tokens_post_padded;
  problem.topk_weights = fwd.topk_weights;
  problem.z = static_cast<__nv_bfloat16*>(z.mutable_data_ptr());
  problem.overwrite_z = overwrite_z;
  problem.pair_to_row = pair_to_row.const_data_ptr<int32_t>();
  problem.dx = need_dx ? static_cast<__nv_bfloat16*>(dx.mutable_data_ptr()) : nullptr;
  problem.dw = nullptr;  // allocated once the first launch's scratch is released
  problem.need_dw = need_dw;
  problem.dw2 = need_dw2 ? static_cast<__nv_bfloat16*>(dw2.mutable_data_ptr()) : nullptr;
  problem.dtopk_weights = need_dtopk_weights ? dtopk_weights.mutable_data_ptr<float>() : nullptr;
  problem.num_tokens = T;
  problem.dim = D;
  problem.hidden_dim = H;
  problem.num_experts = E;
  problem.top_k = top_k;
  problem.max_padded = fwd.max_padded;
  problem.block_m = kBlockM;
  problem.device = fwd.device;
  // The forward's rules (sizes, alignment of x, w, w2 and grad_out), then the backward's own.
  if (const std::string error = check_fused_moe_bf16(fwd, FusedMoeBf16Config{}); !error.empty())
    fail(op, error);
  const std::string problem_error = check_moe_backward(problem);
  if (!problem_error.empty()) fail(op, problem_error);
  if (!(need_dx || need_dw || need_dw2 || need_dtopk_weights))
    return {dx, grad(false, {}, w), dw2, dtopk_weights};

  auto bytes = [&](size_t n) {
    return torch::stable::new_empty(x, {n > 0 ? int64_t(n) : 1}, ScalarType::Byte);
  };
  const cudaStream_t stream = current_stream(fwd.device);
  Tensor workspace = bytes(moe_backward_workspace_bytes(problem));
  {
    Tensor scratch = bytes(moe_backward_scratch_bytes(problem));
    check_cuda(op, launch_moe_backward(problem, workspace.mutable_data_ptr(),
                                       scratch.mutable_data_ptr(), stream));
  }  // the scratch goes back to the caching allocator (stream-ordered) before dw takes its own
  Tensor dw = grad(need_dw, {E, 2 * H, D}, w);
  problem.dw = need_dw ? static_cast<__nv_bfloat16*>(dw.mutable_data_ptr()) : nullptr;
  Tensor dw_scratch = bytes(moe_backward_dw_scratch_bytes(problem));
  check_cuda(op, launch_moe_backward_dw(problem, workspace.mutable_data_ptr(),
                                        dw_scratch.mutable_data_ptr(), stream));
  return {dx, dw, dw2, dtopk_weights};
}

// MXFP8 quantization of a bf16 tensor along its last dim, bit for bit mxfp8.quantize_mxfp8:
// (values e4m3 like x, the bits of the e8m0 scales as uint8). Activations (T, K): scales row-major
// (T, K/32). Weights (E, N, K) with blocked: each expert's (N, K/32) scales in
// pack_scales_blocked's layout, shape (E, N * K/32), as flash_moe.pack_scales_blocked returns them.
std::tuple<Tensor, Tensor> quantize_mxfp8(Tensor x, bool rceil, bool blocked) {
  constexpr const char* op = "quantize_mxfp8";
  if (x.scalar_type() != ScalarType::BFloat16) {
    fail(op, "argument 'x' must be a torch.bfloat16 tensor, got ", dtype_name(x.scalar_type()));
  }
  if (x.dim() != 2 && x.dim() != 3) {
    fail(op, "argument 'x' must be 2-D (T, K) or 3-D (E, N, K), got shape ", shape_of(x));
  }
  if (!x.is_contiguous()) {
    fail(op, "argument 'x' must be contiguous, got shape ", shape_of(x),
         " with non-contiguous strides");
  }
  const int64_t k = x.size(-1), n_rows = x.size(-2);
  const int64_t rows = x.dim() == 3 ? x.size(0) * n_rows : n_rows;
  if (k % kMxfp8ScaleBlock != 0) {
    fail(op, "argument 'x' has shape ", shape_of(x), ": its last dim must be a multiple of ",
         kMxfp8ScaleBlock, " (one scale per ", kMxfp8ScaleBlock, " elements)");
  }
  const int64_t k_blocks = k / kMxfp8ScaleBlock;
  if (blocked && (n_rows % 128 != 0 || k_blocks % 4 != 0)) {
    fail(op, "argument 'x' has shape ", shape_of(x),
         ": the blocked scale layout needs rows (shape[-2]) % 128 == 0 and (K/32) % 4 == 0; "
         "pad first");
  }
  if (!x.is_cuda()) fail(op, "argument 'x' must be on a CUDA device, got a CPU tensor");
  if (reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 != 0) {
    fail(op,
         "argument 'x' must start on a 16-byte boundary (the kernel reads 16-byte vectors), "
         "got a view whose data does not; pass x.clone()");
  }
  const int32_t device = x.get_device_index();
  torch::stable::accelerator::DeviceGuard guard(device);
  std::vector<int64_t> value_shape, scale_shape;
  for (int64_t d = 0; d < x.dim(); ++d) value_shape.push_back(x.size(d));
  if (blocked) {
    if (x.dim() == 3) scale_shape.push_back(x.size(0));
    scale_shape.push_back(n_rows * k_blocks);
  } else {
    scale_shape = value_shape;
    scale_shape.back() = k_blocks;
  }
  Tensor values = torch::stable::new_empty(x, value_shape, ScalarType::Float8_e4m3fn);
  // The scales' bytes: the stable ABI has no e8m0 dtype, flash_moe.quantize_mxfp8 views them.
  Tensor scales = torch::stable::new_empty(x, scale_shape, ScalarType::Byte);
  check_cuda(op, launch_mxfp8_quantize(static_cast<const __nv_bfloat16*>(x.const_data_ptr()),
                                       static_cast<uint8_t*>(values.mutable_data_ptr()),
                                       static_cast<uint8_t*>(scales.mutable_data_ptr()), rows, k,
                                       n_rows, rceil, blocked, current_stream(device)));
  return {values, scales};
}

// The MXFP8 training forward (flash_moe.moe(mxfp8=True)): x, w and w2 quantized as the
// consumer quantizes them (per 32 along each GEMM's K, RCEIL scales, the weights' scales
// blocked), then fused_moe_mxfp8's deterministic split path into a new out (at prefill sizes
// on the round-tripped bf16 values, which is what that path computes with). Nothing is kept:
// the backward (registered in Python) runs moe_forward in bf16 again for what moe_backward
// reads, and so differentiates the bf16 layer at the unquantized weights, as the consumer's
// MXFP8 backward does.
Tensor moe_forward_mxfp8(Tensor x, Tensor w, Tensor w2, Tensor sorted_token_ids, Tensor expert_ids,
                         Tensor num_tokens_post_padded, Tensor topk_weights, int64_t top_k) {
  constexpr const char* op = "moe_forward_mxfp8";
  const FusedMoeBf16Problem problem =
      forward_problem(op, x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                      topk_weights, nullptr, nullptr, top_k, kBlockM, 1);
  check_mxfp8_dims(op, problem.dim, problem.hidden_dim);
  torch::stable::accelerator::DeviceGuard guard(problem.device);
  Tensor out = torch::stable::new_empty(x, {problem.num_tokens, problem.dim});
  if (problem.num_tokens == 0) return out;  // nothing to quantize or write
  // The op's shapes and x, w, w2 (bf16 here: the launchers read 16-byte vectors of both), for
  // fused_moe_mxfp8's checks and path.
  FusedMoeMxfp8Problem shape{};
  shape.x = static_cast<const uint8_t*>(x.const_data_ptr());
  shape.w = static_cast<const uint8_t*>(w.const_data_ptr());
  shape.w2 = static_cast<const uint8_t*>(w2.const_data_ptr());
  shape.out = static_cast<__nv_bfloat16*>(out.mutable_data_ptr());
  shape.num_tokens = problem.num_tokens;
  shape.dim = problem.dim;
  shape.hidden_dim = problem.hidden_dim;
  shape.num_experts = problem.num_experts;
  shape.top_k = problem.top_k;
  shape.max_padded = problem.max_padded;
  shape.block_m = problem.block_m;
  shape.device = problem.device;
  const FusedMoeMxfp8Config requested{};  // the tuned choice of every hint, split
  const std::string error = check_fused_moe_mxfp8(shape, requested);
  if (!error.empty()) fail(op, error);
  if (fused_moe_mxfp8_widens_weights(shape)) {
    // Prefill sizes: fused_moe_mxfp8 would widen its quantized operands to bf16 first; quantize and
    // widen back in one pass each (4 bytes an element moved instead of 6), then its kernels.
    const FusedMoeMxfp8Config config = resolve_fused_moe_mxfp8_config(shape, requested);
    if (const char* print = std::getenv("PRIME_MOE_PRINT_CONFIG"); print && print[0] == '1') {
      std::fprintf(stderr, "%s: %s\n", op,
                   describe_fused_moe_mxfp8_config(shape, requested, config).c_str());
    }
    const cudaStream_t stream = current_stream(problem.device);
    FusedMoeBf16Problem wide = problem;
    const auto round_trip = [&](const Tensor& t, int64_t rows, int64_t k) {
      Tensor r = torch::stable::new_empty(t, {t.numel()});
      check_cuda(op, launch_mxfp8_round_trip(static_cast<const __nv_bfloat16*>(t.const_data_ptr()),
                                             static_cast<__nv_bfloat16*>(r.mutable_data_ptr()),
                                             rows, k, stream));
      return r;
    };
    const int64_t T = problem.num_tokens, D = problem.dim, H = problem.hidden_dim;
    const int64_t E = problem.num_experts;
    const Tensor x_wide = round_trip(x, T, D), w_wide = round_trip(w, E * 2 * H, D),
                 w2_wide = round_trip(w2, E * D, H);
    wide.x = static_cast<const __nv_bfloat16*>(x_wide.const_data_ptr());
    wide.w = static_cast<const __nv_bfloat16*>(w_wide.const_data_ptr());
    wide.w2 = static_cast<const __nv_bfloat16*>(w2_wide.const_data_ptr());
    wide.out = static_cast<__nv_bfloat16*>(out.mutable_data_ptr());
    const int64_t workspace_bytes =
        static_cast<int64_t>(fused_moe_mxfp8_widened_workspace_bytes(wide, config));
    Tensor workspace = torch::stable::new_empty(out, {workspace_bytes > 0 ? workspace_bytes : 1},
                                                ScalarType::Byte);
    check_cuda(op,
               launch_fused_moe_mxfp8_widened(wide, config, workspace.mutable_data_ptr(), stream));
    return out;
  }
  auto [x_values, x_scales] = quantize_mxfp8(x, true, false);
  auto [w_values, w_scales] = quantize_mxfp8(w, true, true);
  auto [w2_values, w2_scales] = quantize_mxfp8(w2, true, true);
  fused_moe_mxfp8(x_values, x_scales, w_values, w_scales, w2_values, w2_scales, sorted_token_ids,
                  expert_ids, num_tokens_post_padded, topk_weights, out, top_k, kBlockM, 0, 0, 0, 1,
                  true);
  return out;
}

// What both directions of the blocked scale layout check: `t` holds the bytes of e8m0 scales,
// contiguous, and its (..., MN, K/32) scales are whole tiles of 128 rows x 4 scale columns (mn
// and kb as the caller reads them from t's shape, which mn_is and kb_is spell out).
void check_scale_bytes(const char* op, const char* name, const Tensor& t, int64_t min_rank,
                       const char* expected_shape) {
  ScalarType dtype;
  try {
    dtype = t.scalar_type();
  } catch (const std::exception&) {
    // The stable ABI of torch 2.10 cannot name float8_e8m0fnu, the likeliest wrong dtype here.
    fail(op, "argument '", name,
         "' must be a torch.uint8 tensor (the bits of e8m0 scales), got a dtype the stable ABI "
         "does not name, such as torch.float8_e8m0fnu: pass scales.view(torch.uint8)");
  }
  if (dtype != ScalarType::Byte) {
    fail(op, "argument '", name, "' must be a torch.uint8 tensor (the bits of e8m0 scales), got ",
         dtype_name(dtype));
  }
  if (t.dim() < min_rank) {
    fail(op, "argument '", name, "' must be ", expected_shape, ", got shape ", shape_of(t));
  }
  if (!t.is_contiguous()) {
    fail(op, "argument '", name, "' must be contiguous, got shape ", shape_of(t),
         " with non-contiguous strides");
  }
}

void check_scale_tiles(const char* op, const char* name, const Tensor& t, const char* mn_is,
                       int64_t mn, const char* kb_is, int64_t kb) {
  if (mn % 128 != 0) {
    fail(op, "argument '", name, "' has shape ", shape_of(t), ": ", mn_is, mn,
         " must be a multiple of 128 (one scale tile is 128 rows); pad first");
  }
  if (kb % 4 != 0) {
    fail(op, "argument '", name, "' has shape ", shape_of(t), ": ", kb_is, kb,
         " must be a multiple of 4 (one scale tile is 4 scale columns); pad first");
  }
}

// Permutes the (rows, kb) scale bytes of `src` into a new tensor of shape `shape`.
Tensor permute_scales(const char* op, const char* name, Tensor src, std::vector<int64_t> shape,
                      int64_t kb, bool unpack) {
  if (!src.is_cuda()) {
    fail(op, "argument '", name, "' must be on a CUDA device, got a CPU tensor");
  }
  const int32_t device = src.get_device_index();
  torch::stable::accelerator::DeviceGuard guard(device);
  // The kernel moves 4-byte words: a view starting inside one (a byte slice) is copied to an
  // aligned buffer first.
  if (reinterpret_cast<uintptr_t>(src.const_data_ptr()) % 4 != 0) src = torch::stable::clone(src);
  Tensor dst = torch::stable::new_empty(src, shape);
  const int64_t rows = kb == 0 ? 0 : src.numel() / kb;
  check_cuda(op, launch_mxfp8_scales_blocked(static_cast<const uint8_t*>(src.const_data_ptr()),
                                             static_cast<uint8_t*>(dst.mutable_data_ptr()), rows,
                                             kb, unpack, current_stream(device)));
  return dst;
}

// mxfp8.pack_scales_blocked bit for bit: row-major scale bytes (..., MN, K/32) to the blocked
// layout, shape (..., MN * K/32) as flash_moe.pack_scales_blocked returns it (the stable ABI has no
// e8m0 dtype: flash_moe views the bytes).
Tensor pack_scales_blocked(Tensor scales) {
  constexpr const char* op = "pack_scales_blocked";
  check_scale_bytes(op, "scales", scales, 2, "(..., MN, K/32)");
  const int64_t mn = scales.size(-2), kb = scales.size(-1);
  check_scale_tiles(op, "scales", scales, "MN = shape[-2] = ", mn, "K/32 = shape[-1] = ", kb);
  std::vector<int64_t> shape;
  for (int64_t d = 0; d < scales.dim() - 2; ++d) shape.push_back(scales.size(d));
  shape.push_back(mn * kb);
  return permute_scales(op, "scales", scales, shape, kb, false);
}

// The inverse: blocked scale bytes (..., mn * K/32) of mn rows to row-major (..., mn, K/32).
Tensor unpack_scales_blocked(Tensor packed, int64_t mn) {
  constexpr const char* op = "unpack_scales_blocked";
  check_scale_bytes(op, "packed", packed, 1, "(..., MN * K/32)");
  const int64_t n = packed.size(-1);
  if (mn <= 0 || n % mn != 0) {
    fail(op, "argument 'packed' has shape ", shape_of(packed),
         ": its last dim must be mn * K/32 with mn=", mn);
  }
  check_scale_tiles(op, "packed", packed, "mn = ", mn, "K/32 = shape[-1] / mn = ", n / mn);
  std::vector<int64_t> shape;
  for (int64_t d = 0; d < packed.dim() - 1; ++d) shape.push_back(packed.size(d));
  shape.push_back(mn);
  shape.push_back(n / mn);
  return permute_scales(op, "packed", packed, shape, n / mn, true);
}

}  // namespace
}  // namespace prime_moe

STABLE_TORCH_LIBRARY(prime_moe, m) {
  m.def(
      "moe_align(Tensor topk_ids, int num_experts, int block_m=128, int bpc=1) -> "
      "(Tensor sorted_token_ids, Tensor expert_ids, Tensor num_tokens_post_padded)");
  m.def(
      "fused_moe_bf16(Tensor x, Tensor w, Tensor w2, Tensor sorted_token_ids, "
      "Tensor expert_ids, Tensor num_tokens_post_padded, Tensor topk_weights, "
      "Tensor(a!) out, int top_k, int block_m=128, int block_n=0, int warp_n=0, "
      "int stages=0, int bpc=1, int cpc=0, bool split=True) -> ()");
  m.def(
      "moe_forward_mxfp8(Tensor x, Tensor w, Tensor w2, Tensor sorted_token_ids, "
      "Tensor expert_ids, Tensor num_tokens_post_padded, Tensor topk_weights, int top_k) -> "
      "Tensor");
  m.def(
      "fused_moe_mxfp8(Tensor x, Tensor x_scales, Tensor w, Tensor w_scales, Tensor w2, "
      "Tensor w2_scales, Tensor sorted_token_ids, Tensor expert_ids, "
      "Tensor num_tokens_post_padded, Tensor topk_weights, Tensor(a!) out, int top_k, "
      "int block_m=128, int block_n=0, int warp_n=0, int stages=0, int bpc=1, "
      "bool split=True) -> ()");
  m.def(
      "quantize_mxfp8(Tensor x, bool rceil=True, bool blocked=False) -> "
      "(Tensor values, Tensor scales)");
  m.def("pack_scales_blocked(Tensor scales) -> Tensor");
  m.def("unpack_scales_blocked(Tensor packed, int mn) -> Tensor");
  m.def(
      "moe_forward(Tensor x, Tensor w, Tensor w2, Tensor sorted_token_ids, Tensor expert_ids, "
      "Tensor num_tokens_post_padded, Tensor topk_weights, int top_k) -> "
      "(Tensor out, Tensor z, Tensor pair_to_row)");
  m.def(
      "moe_backward(Tensor grad_out, Tensor x, Tensor w, Tensor w2, Tensor sorted_token_ids, "
      "Tensor expert_ids, Tensor num_tokens_post_padded, Tensor topk_weights, Tensor(a!) z, "
      "Tensor pair_to_row, int top_k, bool need_dx, bool need_dw, bool need_dw2, "
      "bool need_dtopk_weights, bool overwrite_z=False) -> (Tensor dx, Tensor dw, Tensor dw2, "
      "Tensor dtopk_weights)");
}

STABLE_TORCH_LIBRARY_IMPL(prime_moe, CUDA, m) {
  m.impl("moe_align", TORCH_BOX(&prime_moe::moe_align));
  m.impl("fused_moe_bf16", TORCH_BOX(&prime_moe::fused_moe_bf16));
  m.impl("fused_moe_mxfp8", TORCH_BOX(&prime_moe::fused_moe_mxfp8));
  m.impl("moe_forward", TORCH_BOX(&prime_moe::moe_forward));
  m.impl("moe_forward_mxfp8", TORCH_BOX(&prime_moe::moe_forward_mxfp8));
  m.impl("moe_backward", TORCH_BOX(&prime_moe::moe_backward));
  m.impl("quantize_mxfp8", TORCH_BOX(&prime_moe::quantize_mxfp8));
  m.impl("pack_scales_blocked", TORCH_BOX(&prime_moe::pack_scales_blocked));
  m.impl("unpack_scales_blocked", TORCH_BOX(&prime_moe::unpack_scales_blocked));
}

// CPU tensors reach the same checks, so they get the message naming the argument and the
// device it must be on instead of the dispatcher's "no kernel for CPU".
STABLE_TORCH_LIBRARY_IMPL(prime_moe, CPU, m) {
  m.impl("moe_align", TORCH_BOX(&prime_moe::moe_align));
  m.impl("fused_moe_bf16", TORCH_BOX(&prime_moe::fused_moe_bf16));
  m.impl("fused_moe_mxfp8", TORCH_BOX(&prime_moe::fused_moe_mxfp8));
  m.impl("moe_forward", TORCH_BOX(&prime_moe::moe_forward));
  m.impl("moe_forward_mxfp8", TORCH_BOX(&prime_moe::moe_forward_mxfp8));
  m.impl("moe_backward", TORCH_BOX(&prime_moe::moe_backward));
  m.impl("quantize_mxfp8", TORCH_BOX(&prime_moe::quantize_mxfp8));
  m.impl("pack_scales_blocked", TORCH_BOX(&prime_moe::pack_scales_blocked));
  m.impl("unpack_scales_blocked", TORCH_BOX(&prime_moe::unpack_scales_blocked));
}

// The extension module carries the constants and the SM setting; the ops live in
// torch.ops.
namespace {

PyObject* set_num_sms(PyObject*, PyObject* args) {
  int num_sms = 0;
  if (!PyArg_ParseTuple(args, "i", &num_sms)) return nullptr;
  if (num_sms < 0) {
    PyErr_SetString(PyExc_ValueError, "set_num_sms: num_sms must be >= 0 (0: every SM)");
    return nullptr;
  }
  prime_moe::set_num_sms(num_sms);
  Py_RETURN_NONE;
}

PyObject* get_num_sms(PyObject*, PyObject*) {
  return PyLong_FromLong(prime_moe::num_sms_setting());
}

PyMethodDef methods[] = {
    {"set_num_sms", set_num_sms, METH_VARARGS,
     "Caps the SMs flash_moe's persistent kernels use (0: all of the device's)."},
    {"get_num_sms", get_num_sms, METH_NOARGS, "The cap set by set_num_sms (0: none)."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C",
                                   "flash_moe's compiled ops (torch.ops.prime_moe) and constants",
                                   -1, methods};
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  const std::pair<const char*, long> constants[] = {
      {"BLOCK_M", prime_moe::kBlockM},
      {"MXFP8_SCALE_BLOCK", prime_moe::kMxfp8ScaleBlock},
      {"DIM_MULTIPLE", prime_moe::kDimMultiple},
      {"HIDDEN_MULTIPLE", prime_moe::kHiddenMultiple},
      {"MAX_EXPERTS", prime_moe::kMaxExperts},
      {"MAX_ROWS", prime_moe::kMaxRows},
      {"MXFP8_DIM_MULTIPLE", prime_moe::kMxfp8DimMultiple},
      {"MXFP8_HIDDEN_MULTIPLE", prime_moe::kMxfp8HiddenMultiple},
  };
  for (const auto& [name, value] : constants) {
    if (PyModule_AddIntConstant(module, name, value) != 0) {
      Py_DECREF(module);
      return nullptr;
    }
  }
  return module;
}
