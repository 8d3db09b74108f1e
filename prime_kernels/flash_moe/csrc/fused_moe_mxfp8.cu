// Launcher of the MXFP8 fused MoE forward on sm_90a (host side of fused_moe_mxfp8.h): x is
// dequantized to a bf16 workspace (mxfp8_dequantize.cuh) or, for the decode tiles' gate/up loop,
// written as f16 with fp32 block factors (forward::f16_gate_up), then forward_kernels.h's
// launch sequence runs on the MXFP8 weights in one of two ways, by the mean rows per routed expert
// (forward::mxfp8_widens_weights). The hints' meaning is the bf16 forward's.
//
// Decode sizes (at most kMxfp8WidenRowsPerExpert rows an expert): Mxfp8Weights (design:
// docs/flash_moe_mxfp8_design.md). Both GEMMs compute out^T = w x^T with the weights as wgmma's
// register A operand. The producer copies raw e4m3 weight tiles (TMA, 64-byte swizzle) and their
// scale blocks into the stage, beside the token rows (gathered x for gate/up, h by TMA for down);
// each consumer thread reads its fragment's bytes (LDS.U16), widens them exactly to bf16 in
// registers (a bit move and one bf16x2 multiply, mxfp8_fragment.cuh) and issues wgmma RS; on the
// 64 x 64 decode tiles the gate/up GEMM converts them to f16 instead and promotes each 32-block's
// sum by both scales (WarpgroupMainloopF16), and the down GEMM runs on fp8 wgmma. The
// weights stream as fp8 (half of bf16's bytes), which is what a weight-bound call pays for. The
// epilogues take the transposed accumulators (SwiGluToMxfp8, StoreRows,
// WeightedAtomicAdd::store_transposed). A tile's wgmmas multiply only the first 16, 32, 64 or 128
// token rows of its block, the fewest that cover its routed rows (tile_tokens, moe_gemm.cuh): at
// decode sizes a block is a few tokens and then padding, and all 128 rows had cost more tensor
// time than the fp8 stream takes at T = 64 (by arithmetic).
//
// Prefill sizes: Mxfp8WidenedWeights. The register widening is paid once per weight tile and
// token block, and its instructions compete with the wgmmas' issue: 0.60-0.68x of the bf16
// forward at T = 32768 (H200, Qwen3-30B-A3B, DeepSeek-V3-32, Mixtral-8x7B). Here a pre-pass
// widens w and w2 once into bf16 workspaces (3 bytes a weight moved), and the bf16 forward's
// kernels run on them, with SwiGluToMxfp8 re-quantizing h in the bf16 accumulators' layout. The
// numbers are the same either way: exact bf16 products summed in fp32. The cost is workspace
// memory: the weights' bf16 size, E * 3 * D * H * 2 bytes.
#include "fused_moe_mxfp8.h"

#include <algorithm>
#include <string>

#include "device/mxfp8_dequantize.cuh"
#include "flash_moe_constants.h"
#include "forward_kernels.h"
#include "moe_launch.h"

namespace prime_moe {
namespace {

using forward::Mxfp8Weights;
using forward::Mxfp8WidenedWeights;

// The problem's shapes and routing in the form the shared launch sequence reads (its x, w and
// w2 are bf16-typed: the MXFP8 operands travel beside it).
FusedMoeBf16Problem shape_of(const FusedMoeMxfp8Problem& pr) {
  FusedMoeBf16Problem s{};
  s.sorted_token_ids = pr.sorted_token_ids;
  s.expert_ids = pr.expert_ids;
  s.num_tokens_post_padded = pr.num_tokens_post_padded;
  s.topk_weights = pr.topk_weights;
  s.out = pr.out;
  s.num_tokens = pr.num_tokens;
  s.dim = pr.dim;
  s.hidden_dim = pr.hidden_dim;
  s.num_experts = pr.num_experts;
  s.top_k = pr.top_k;
  s.max_padded = pr.max_padded;
  s.block_m = pr.block_m;
  s.device = pr.device;
  return s;
}

// Calls f(Mxfp8WidenedWeights{}) or f(Mxfp8Weights{}): the weights policy this problem runs.
template <class F>
auto with_weights(const FusedMoeBf16Problem& shape, F&& f) {
  return forward::mxfp8_widens_weights(shape) ? f(Mxfp8WidenedWeights{}) : f(Mxfp8Weights{});
}

// Whether the gate/up GEMM reads x as f16 with fp32 block factors (the decode tile), not as bf16.
bool x_as_f16(const FusedMoeMxfp8Problem& pr, int block_n) {
  const FusedMoeBf16Problem shape = shape_of(pr);
  return !forward::mxfp8_widens_weights(shape) &&
         forward::f16_gate_up<Mxfp8Weights>(shape, block_n);
}

// x's pre-pass output: (T, D) 16-bit rows (bf16 dequantized, or f16 unscaled for the decode
// gate/up tile), then, for the latter only, its fp32 scales (T, D / 32) and the decode tiles'
// rows-ready counters, which that pre-pass zeroes.
size_t x_token_bytes(const FusedMoeMxfp8Problem& pr) {
  return size_t(pr.num_tokens) * size_t(pr.dim) * sizeof(__nv_bfloat16);
}
size_t x_scale_bytes(const FusedMoeMxfp8Problem& pr) {
  return size_t(pr.num_tokens) * size_t(pr.dim / kMxfp8ScaleBlock) * 4;
}
size_t x_rows_bytes(const FusedMoeMxfp8Problem& pr, int block_n) {
  if (!x_as_f16(pr, block_n)) return x_token_bytes(pr);
  return x_token_bytes(pr) + x_scale_bytes(pr) +
         forward::rows_ready_tiles(pr.max_padded) * sizeof(uint32_t);
}

// The widened weights, after the forward's workspace (prefill sizes only).
struct WidenedWeights {
  __nv_bfloat16* w;   // (E, 2H, D)
  __nv_bfloat16* w2;  // (E, D, H)
};

size_t widened_w_bytes(const FusedMoeMxfp8Problem& pr) {
  return align256(size_t(pr.num_experts * 2 * pr.hidden_dim) * size_t(pr.dim) * 2);
}
size_t widened_bytes(const FusedMoeMxfp8Problem& pr) {
  return widened_w_bytes(pr) +
         align256(size_t(pr.num_experts * pr.dim) * size_t(pr.hidden_dim) * 2);
}

WidenedWeights carve_widened(const FusedMoeMxfp8Problem& pr, uint8_t* base) {
  return {reinterpret_cast<__nv_bfloat16*>(base),
          reinterpret_cast<__nv_bfloat16*>(base + widened_w_bytes(pr))};
}

// Enqueues mxfp8_dequantize_kernel over (rows, K) values: a grid-stride loop past 2^20 blocks.
template <bool kBlocked>
cudaError_t widen(const uint8_t* values, const uint8_t* scales, __nv_bfloat16* out, int64_t rows,
                  int64_t k, int64_t n_rows, cudaStream_t stream) {
  const Mxfp8DequantizeParams p{values,     scales, out, rows * k / 16, int(k / kMxfp8ScaleBlock),
                                int(n_rows)};
  const int64_t blocks = (p.chunks + kMxfp8DequantizeThreads - 1) / kMxfp8DequantizeThreads;
  mxfp8_dequantize_kernel<kBlocked>
      <<<unsigned(std::min<int64_t>(blocks, 1 << 20)), kMxfp8DequantizeThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// Enqueues mxfp8_x_to_f16_kernel over x (T, D): f16 values, rebased per token where exact, and
// fp32 block factors. At decode sizes as a programmatic dependent of the kernel before it
// (moe_align, as a model calls the op), as the forward's GEMMs are: its blocks then start as
// moe_align's exit, without a launch's latency between them (H100 timeline, Qwen3-30B-A3B
// T = 64: a plain launch started 2.1 us after moe_align's end, this one as it ends; the whole
// call 1.003-1.006x), and its wait, first thing, keeps the order (grid_dependency.cuh).
cudaError_t x_to_f16(const FusedMoeMxfp8Problem& pr, uint16_t* out, float* out_scales,
                     uint32_t* rows_ready, cudaStream_t stream) {
  const Mxfp8XToF16Params p{pr.x,          pr.x_scales,
                            out,           out_scales,
                            pr.num_tokens, int(pr.dim / kMxfp8ScaleBlock),
                            rows_ready,    int64_t(forward::rows_ready_tiles(pr.max_padded))};
  constexpr int kWarps = kMxfp8XToF16Threads / 32;  // a warp per token
  const int64_t blocks = (p.tokens + kWarps - 1) / kWarps;
  const bool dependent = pr.num_tokens * pr.top_k <= forward::kDependentLaunchMaxPairs;
  return prime_kernels::launch_kernel(mxfp8_x_to_f16_kernel,
                                      dim3(unsigned(std::min<int64_t>(blocks, 1 << 20))),
                                      dim3(kMxfp8XToF16Threads), 0, stream, dependent, p);
}

}  // namespace

FusedMoeMxfp8Config resolve_fused_moe_mxfp8_config(const FusedMoeMxfp8Problem& problem,
                                                   const FusedMoeMxfp8Config& requested) {
  const FusedMoeBf16Problem shape = shape_of(problem);
  return with_weights(shape, [&](auto weights) {
    return forward::resolve_config<decltype(weights)>(shape, requested);
  });
}

std::string check_fused_moe_mxfp8(const FusedMoeMxfp8Problem& pr, const FusedMoeMxfp8Config& c) {
  const std::string sm90 = " is not supported by fused_moe_mxfp8 on sm_90";
  if (pr.dim <= 0 || pr.dim % kMxfp8DimMultiple != 0)
    return "dim=" + std::to_string(pr.dim) + sm90 + "; it must be a positive multiple of " +
           std::to_string(kMxfp8DimMultiple) +
           " (the blocked scale layout's 128-row tiles of w2 and 4-column tiles of w's D/32)";
  if (pr.hidden_dim <= 0 || pr.hidden_dim % kMxfp8HiddenMultiple != 0)
    return "hidden_dim=" + std::to_string(pr.hidden_dim) + sm90 +
           "; it must be a positive multiple of " + std::to_string(kMxfp8HiddenMultiple) +
           " (the blocked scale layout's 128-row tiles of w and 4-column tiles of w2's H/32)";
  const FusedMoeBf16Problem shape = shape_of(pr);
  std::string error = with_weights(shape, [&](auto weights) {
    return forward::check_config<decltype(weights)>(shape, c, forward::kOriginalMxfp8MaxStages);
  });
  if (!error.empty()) return error;
  if (pr.num_tokens > 0 &&
      (!aligned16(pr.x) || !aligned16(pr.w) || !aligned16(pr.w2) || !aligned16(pr.out) ||
       !aligned16(pr.w_scales) || !aligned16(pr.w2_scales)))
    return "x, w, w2, out, w_scales and w2_scales must be 16-byte aligned (TMA and 16-byte "
           "copies)";
  return with_weights(
      shape, [&](auto weights) { return forward::check_ring<decltype(weights)>(shape, c); });
}

size_t fused_moe_mxfp8_workspace_bytes(const FusedMoeMxfp8Problem& problem,
                                       const FusedMoeMxfp8Config& config) {
  const FusedMoeBf16Problem shape = shape_of(problem);
  const size_t bytes =
      forward::carve_workspace(shape, config.split, x_rows_bytes(problem, config.block_n), nullptr)
          .bytes;
  return bytes + (forward::mxfp8_widens_weights(shape) ? widened_bytes(problem) : 0);
}

cudaError_t launch_fused_moe_mxfp8(const FusedMoeMxfp8Problem& pr, const FusedMoeMxfp8Config& c,
                                   void* workspace, cudaStream_t stream) {
  if (pr.num_tokens == 0) return cudaSuccess;  // out is empty
  const FusedMoeBf16Problem shape = shape_of(pr);
  forward::Workspace ws =
      forward::carve_workspace(shape, c.split, x_rows_bytes(pr, c.block_n), workspace);
  cudaError_t err;
  if (x_as_f16(pr, c.block_n)) {
    uint8_t* x_rows = reinterpret_cast<uint8_t*>(ws.x_rows);
    float* x_scales = reinterpret_cast<float*>(x_rows + x_token_bytes(pr));
    ws.x_scales = x_scales;
    ws.rows_ready = reinterpret_cast<uint32_t*>(x_rows + x_token_bytes(pr) + x_scale_bytes(pr));
    err = x_to_f16(pr, reinterpret_cast<uint16_t*>(ws.x_rows), x_scales, ws.rows_ready, stream);
  } else {
    err = widen<false>(pr.x, pr.x_scales, ws.x_rows, pr.num_tokens, pr.dim, 0, stream);
  }
  if (err != cudaSuccess) return err;
  if (!forward::mxfp8_widens_weights(shape)) {
    if (!forward::launchable<Mxfp8Weights>(shape, c)) return cudaErrorInvalidValue;
    return forward::launch_forward<Mxfp8Weights>(
        shape, ws.x_rows, {pr.w, pr.w2, pr.w_scales, pr.w2_scales}, c, ws, stream);
  }
  if (!forward::launchable<Mxfp8WidenedWeights>(shape, c)) return cudaErrorInvalidValue;
  const int64_t E = pr.num_experts, D = pr.dim, H = pr.hidden_dim;
  const WidenedWeights wide = carve_widened(pr, static_cast<uint8_t*>(workspace) + ws.bytes);
  err = widen<true>(pr.w, pr.w_scales, wide.w, E * 2 * H, D, 2 * H, stream);
  if (err != cudaSuccess) return err;
  err = widen<true>(pr.w2, pr.w2_scales, wide.w2, E * D, H, D, stream);
  if (err != cudaSuccess) return err;
  return forward::launch_forward<Mxfp8WidenedWeights>(
      shape, ws.x_rows, {wide.w, wide.w2, nullptr, nullptr}, c, ws, stream);
}

bool fused_moe_mxfp8_widens_weights(const FusedMoeMxfp8Problem& problem) {
  return forward::mxfp8_widens_weights(shape_of(problem));
}

size_t fused_moe_mxfp8_widened_workspace_bytes(const FusedMoeBf16Problem& problem,
                                               const FusedMoeMxfp8Config& config) {
  return forward::carve_workspace(problem, config.split, 0, nullptr).bytes;
}

cudaError_t launch_fused_moe_mxfp8_widened(const FusedMoeBf16Problem& pr,
                                           const FusedMoeMxfp8Config& c, void* workspace,
                                           cudaStream_t stream) {
  if (pr.num_tokens == 0) return cudaSuccess;  // out is empty
  if (!forward::mxfp8_widens_weights(pr) || !forward::launchable<Mxfp8WidenedWeights>(pr, c))
    return cudaErrorInvalidValue;
  const forward::Workspace ws = forward::carve_workspace(pr, c.split, 0, workspace);
  return forward::launch_forward<Mxfp8WidenedWeights>(pr, pr.x, {pr.w, pr.w2, nullptr, nullptr}, c,
                                                      ws, stream);
}

std::string describe_fused_moe_mxfp8_config(const FusedMoeMxfp8Problem& pr,
                                            const FusedMoeMxfp8Config& requested,
                                            const FusedMoeMxfp8Config& c) {
  const FusedMoeBf16Problem shape = shape_of(pr);
  if (forward::mxfp8_widens_weights(shape))
    return forward::describe_config<Mxfp8WidenedWeights>(
        shape, requested, c,
        "x=dequantized pre-pass + gather, weights=widened to bf16 once by a pre-pass + TMA "
        "(wgmma SS), h=MXFP8 re-quantized");
  if (forward::f16_gate_up<Mxfp8Weights>(shape, c.block_n))
    return forward::describe_config<Mxfp8Weights>(
        shape, requested, c,
        "x=f16 pre-pass (rebased per token where exact) + gather with fp32 block factors, "
        "weights=fp8 TMA, gate/up converted to f16 in registers (wgmma RS, out^T) with each "
        "32-block's sum promoted by the weight scale (and the token's where not rebased), "
        "h=MXFP8 re-quantized");
  return forward::describe_config<Mxfp8Weights>(
      shape, requested, c,
      "x=dequantized pre-pass + gather, weights=fp8 TMA + scales widened to bf16 in registers "
      "(wgmma RS, out^T), h=MXFP8 re-quantized");
}

}  // namespace prime_moe
