// Launcher of the MXFP8 fused MoE forward on sm_90a (host side of fused_moe_mxfp8.h): x is
// dequantized to a bf16 workspace (mxfp8_dequantize.cuh), then forward_kernels.h's launch
// sequence runs with MXFP8 weights (Mxfp8Weights). The hints' meaning is the bf16 forward's.
//
// Design (docs/flash_moe_mxfp8_design.md): both GEMMs compute out^T = w x^T with the weights as
// wgmma's register A operand. The producer copies raw e4m3 weight tiles (TMA, 64-byte swizzle)
// and their scale blocks into the stage, beside the token rows (gathered x for gate/up, h by TMA
// for down); each consumer thread reads its fragment's bytes (LDS.U16), widens them exactly to
// bf16 in registers (a bit move and one bf16x2 multiply, mxfp8_fragment.cuh) and issues wgmma
// RS. fp8 is read once from shared memory and never written back as bf16, where the previous
// path (widened to bf16 in shared memory, 0.56-0.67x of bf16; mxfp8_loaders.cuh) saturated
// shared memory; a stage holds half of bf16's weight bytes, so the ring is deeper (6 stages of
// 33 KB at 128 x (128 + 128)). The epilogues take the transposed accumulators (SwiGluToMxfp8,
// StoreRows, WeightedAtomicAdd::store_transposed). Every instantiated tile runs this path. On
// the H200 at Qwen3-30B-A3B T = 32768 it runs at 0.55-0.63x of the bf16 forward in two runs
// (the previous path: ~0.50x). A tile's wgmmas multiply only the first 16, 32, 64 or 128 token
// rows of its block, the fewest that cover its routed rows (tile_tokens, moe_gemm.cuh): at decode
// sizes a block is a few tokens and then padding, and all 128 rows had cost more tensor time than
// the fp8 stream takes at T = 64 (by arithmetic).
#include "fused_moe_mxfp8.h"

#include <string>

#include "device/mxfp8_dequantize.cuh"
#include "flash_moe_constants.h"
#include "forward_kernels.h"
#include "moe_launch.h"

namespace prime_moe {
namespace {

using forward::Mxfp8Weights;

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

size_t x_rows_bytes(const FusedMoeMxfp8Problem& pr) {
  return size_t(pr.num_tokens) * size_t(pr.dim) * sizeof(__nv_bfloat16);
}

}  // namespace

FusedMoeMxfp8Config resolve_fused_moe_mxfp8_config(const FusedMoeMxfp8Problem& problem,
                                                   const FusedMoeMxfp8Config& requested) {
  return forward::resolve_config<Mxfp8Weights>(shape_of(problem), requested);
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
  std::string error = forward::check_config<Mxfp8Weights>(shape, c, 4);
  if (!error.empty()) return error;
  if (pr.num_tokens > 0 &&
      (!aligned16(pr.x) || !aligned16(pr.w) || !aligned16(pr.w2) || !aligned16(pr.out) ||
       !aligned16(pr.w_scales) || !aligned16(pr.w2_scales)))
    return "x, w, w2, out, w_scales and w2_scales must be 16-byte aligned (TMA and 16-byte "
           "copies)";
  return forward::check_ring<Mxfp8Weights>(shape, c);
}

size_t fused_moe_mxfp8_workspace_bytes(const FusedMoeMxfp8Problem& problem,
                                       const FusedMoeMxfp8Config& config) {
  return forward::carve_workspace(shape_of(problem), config.split, x_rows_bytes(problem), nullptr)
      .bytes;
}

cudaError_t launch_fused_moe_mxfp8(const FusedMoeMxfp8Problem& pr, const FusedMoeMxfp8Config& c,
                                   void* workspace, cudaStream_t stream) {
  if (pr.num_tokens == 0) return cudaSuccess;  // out is empty
  const FusedMoeBf16Problem shape = shape_of(pr);
  if (!forward::launchable<Mxfp8Weights>(shape, c)) return cudaErrorInvalidValue;
  const forward::Workspace ws =
      forward::carve_workspace(shape, c.split, x_rows_bytes(pr), workspace);
  const Mxfp8DequantizeParams dq{pr.x, pr.x_scales, ws.x_rows, pr.num_tokens * pr.dim / 16};
  const int64_t grid = (dq.chunks + kMxfp8DequantizeThreads - 1) / kMxfp8DequantizeThreads;
  mxfp8_dequantize_rows_kernel<<<unsigned(grid), kMxfp8DequantizeThreads, 0, stream>>>(dq);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return forward::launch_forward<Mxfp8Weights>(
      shape, ws.x_rows, {pr.w, pr.w2, pr.w_scales, pr.w2_scales}, c, ws, stream);
}

std::string describe_fused_moe_mxfp8_config(const FusedMoeMxfp8Problem& pr,
                                            const FusedMoeMxfp8Config& requested,
                                            const FusedMoeMxfp8Config& c) {
  return forward::describe_config<Mxfp8Weights>(
      shape_of(pr), requested, c,
      "x=dequantized pre-pass + gather, weights=fp8 TMA + scales widened to bf16 in registers "
      "(wgmma RS, out^T), h=MXFP8 re-quantized");
}

}  // namespace prime_moe
