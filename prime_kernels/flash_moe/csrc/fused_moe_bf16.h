// Host interface of the bf16 fused MoE forward on sm_90a. Torch-free: the binding
// (binding.cpp) checks tensors and calls these; the launcher (fused_moe_bf16.cu) turns a
// config into grids, shared memory and launches.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace prime_moe {

// Names as in CONTRACT.md: T tokens, D model dim, H expert hidden dim, E experts,
// k = top_k. Row r of the padded, expert-sorted order holds pair sorted_token_ids[r]
// (token = pair / k) or -1 on padding; block b = r / block_m belongs to expert_ids[b].
struct FusedMoeBf16Problem {
  const __nv_bfloat16* x;                 // (T, D)
  const __nv_bfloat16* w;                 // (E, 2H, D): rows [0, H) gate, [H, 2H) up
  const __nv_bfloat16* w2;                // (E, D, H)
  const int32_t* sorted_token_ids;        // (max_padded,)
  const int32_t* expert_ids;              // (max_padded / block_m,)
  const int32_t* num_tokens_post_padded;  // (1,), device memory: never read on the host
  const float* topk_weights;              // (T * k,)
  __nv_bfloat16* out;                     // (T, D)
  // Training (split=true only; both or neither): what the backward keeps, written by the
  // forward. keep_z (max_padded, 2H): the gate/up pre-activations [g | u] of each padded
  // row; keep_pair_to_row (T * k,): each pair's padded row, -1 for a dropped pair.
  __nv_bfloat16* keep_z = nullptr;
  int32_t* keep_pair_to_row = nullptr;
  int64_t num_tokens, dim, hidden_dim, num_experts, top_k, max_padded, block_m;
  int device;  // CUDA device of every tensor: the tuned config is read from its properties
};

// The tuning arguments of the op, as the caller gave them. block_m and bpc describe
// moe_align's layout and are taken as they are; block_n, warp_n, stages and cpc are hints
// (resolve_fused_moe_bf16_config says what each becomes on sm_90). 0 means "the kernel's
// own choice for this shape".
struct FusedMoeBf16Config {
  int block_n = 0;
  int warp_n = 0;
  int stages = 0;
  int bpc = 1;
  int cpc = 0;
  bool split = true;
};

// Empty when the problem and the requested tuning values can run; otherwise one sentence
// naming the argument, its value and what sm_90 accepts. Called before any launch.
std::string check_fused_moe_bf16(const FusedMoeBf16Problem& problem,
                                 const FusedMoeBf16Config& requested);

// The one place tiles are chosen: what the kernels run for this problem, given checked
// hints. Every field of the result is one of the instantiated kernels' values.
FusedMoeBf16Config resolve_fused_moe_bf16_config(const FusedMoeBf16Problem& problem,
                                                 const FusedMoeBf16Config& requested);

// Bytes of scratch device memory the launch needs (the caller allocates it with the
// framework's allocator and passes it in; 256-byte aligned).
size_t fused_moe_bf16_workspace_bytes(const FusedMoeBf16Problem& problem,
                                      const FusedMoeBf16Config& config);

// Enqueues the forward on `stream` with a resolved config. No host synchronization.
// split=true writes every element of out; split=false adds into out, which the caller
// zeroed.
cudaError_t launch_fused_moe_bf16(const FusedMoeBf16Problem& problem,
                                  const FusedMoeBf16Config& config, void* workspace,
                                  cudaStream_t stream);

// One line: the resolved config, and what each hint became (PRIME_MOE_PRINT_CONFIG=1).
std::string describe_fused_moe_bf16_config(const FusedMoeBf16Problem& problem,
                                           const FusedMoeBf16Config& requested,
                                           const FusedMoeBf16Config& config);

// The most SMs the persistent kernels use (0: all of the device's), so that kernels
// running alongside (communication, say) keep the rest. Process-wide.
void set_num_sms(int num_sms);
int num_sms_setting();

}  // namespace prime_moe
