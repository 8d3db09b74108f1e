// Host interface of the MXFP8 fused MoE forward on sm_90a. Torch-free: the binding
// (binding.cpp) checks tensors and calls these; the launcher (fused_moe_mxfp8.cu) dequantizes x
// and runs forward_kernels.h's launch sequence with MXFP8 weights.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "fused_moe_bf16.h"

namespace prime_moe {

// Names as in CONTRACT.md and FusedMoeBf16Problem. Values are e4m3 bytes, scales e8m0 bytes
// (2^(s - 127), 0xFF NaN), one per 32 consecutive elements along each GEMM's reduction dim.
struct FusedMoeMxfp8Problem {
  const uint8_t* x;                       // (T, D)
  const uint8_t* x_scales;                // (T, D/32), row-major
  const uint8_t* w;                       // (E, 2H, D): rows [0, H) gate, [H, 2H) up
  const uint8_t* w_scales;                // E x blocked (2H, D/32): E * 2H * D/32 bytes
  const uint8_t* w2;                      // (E, D, H)
  const uint8_t* w2_scales;               // E x blocked (D, H/32): E * D * H/32 bytes
  const int32_t* sorted_token_ids;        // (max_padded,)
  const int32_t* expert_ids;              // (max_padded / block_m,)
  const int32_t* num_tokens_post_padded;  // (1,), device memory: never read on the host
  const float* topk_weights;              // (T * k,)
  __nv_bfloat16* out;                     // (T, D)
  int64_t num_tokens, dim, hidden_dim, num_experts, top_k, max_padded, block_m;
  int device;  // CUDA device of every tensor: the tuned config is read from its properties
};

// The same hints as the bf16 forward (cpc is not an argument of the MXFP8 op: 0).
using FusedMoeMxfp8Config = FusedMoeBf16Config;

// Empty when the problem and the requested tuning values can run; otherwise one sentence
// naming the argument, its value and what sm_90 accepts. Called before any launch.
std::string check_fused_moe_mxfp8(const FusedMoeMxfp8Problem& problem,
                                  const FusedMoeMxfp8Config& requested);

// What the kernels run for this problem, given checked hints (as the bf16 forward resolves).
FusedMoeMxfp8Config resolve_fused_moe_mxfp8_config(const FusedMoeMxfp8Problem& problem,
                                                   const FusedMoeMxfp8Config& requested);

// Bytes of scratch device memory the launch needs (256-byte aligned, the caller's allocator):
// x dequantized to bf16, then the bf16 forward's workspace.
size_t fused_moe_mxfp8_workspace_bytes(const FusedMoeMxfp8Problem& problem,
                                       const FusedMoeMxfp8Config& config);

// Enqueues the forward on `stream` with a resolved config. No host synchronization.
// split=true writes every element of out (bitwise deterministic); split=false adds into out,
// which the caller zeroed.
cudaError_t launch_fused_moe_mxfp8(const FusedMoeMxfp8Problem& problem,
                                   const FusedMoeMxfp8Config& config, void* workspace,
                                   cudaStream_t stream);

// Whether the forward widens the weights to bf16 once, by a pre-pass (prefill sizes: more than
// forward_kernels.h's kMxfp8WidenRowsPerExpert rows per routed expert), or in registers.
bool fused_moe_mxfp8_widens_weights(const FusedMoeMxfp8Problem& problem);

// The widened path on operands already widened to bf16: problem.x, w, w2 hold each MXFP8 value
// times its scale (launch_mxfp8_round_trip makes them from bf16 tensors: the MXFP8 training
// forward). Only where fused_moe_mxfp8_widens_weights holds for the same shapes; config as
// resolve_fused_moe_mxfp8_config resolves it for them. Same outputs as launch_fused_moe_mxfp8 on
// the quantized operands, without its pre-passes.
size_t fused_moe_mxfp8_widened_workspace_bytes(const FusedMoeBf16Problem& problem,
                                               const FusedMoeMxfp8Config& config);
cudaError_t launch_fused_moe_mxfp8_widened(const FusedMoeBf16Problem& problem,
                                           const FusedMoeMxfp8Config& config, void* workspace,
                                           cudaStream_t stream);

// One line: the resolved config, and what each hint became (PRIME_MOE_PRINT_CONFIG=1).
std::string describe_fused_moe_mxfp8_config(const FusedMoeMxfp8Problem& problem,
                                            const FusedMoeMxfp8Config& requested,
                                            const FusedMoeMxfp8Config& config);

}  // namespace prime_moe
