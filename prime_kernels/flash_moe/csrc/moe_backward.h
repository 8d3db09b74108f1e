// Host interface of the flash_moe backward on sm_90a: the gradients of the training forward
// (fused_moe_bf16 with keep_z) for x, w, w2 and the routing weights. Torch-free: the binding
// (binding.cpp) checks tensors and calls these; moe_backward.cu composes the device layer's
// parts into its kernels and launches them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace prime_moe {

// Names as in fused_moe_bf16.h. The routing (sorted_token_ids, expert_ids,
// num_tokens_post_padded) is moe_align's for block_m = kBlockM, and z / pair_to_row are what
// the training forward kept for it. A null gradient pointer is a gradient not asked for:
// none of its kernels run.
struct MoeBackwardProblem {
  const __nv_bfloat16* grad_out;          // (T, D): dO
  const __nv_bfloat16* x;                 // (T, D)
  const __nv_bfloat16* w;                 // (E, 2H, D)
  const __nv_bfloat16* w2;                // (E, D, H)
  const int32_t* sorted_token_ids;        // (max_padded,)
  const int32_t* expert_ids;              // (max_padded / block_m,)
  const int32_t* num_tokens_post_padded;  // (1,) device
  const float* topk_weights;              // (T * k,)
  __nv_bfloat16* z;                       // (max_padded, 2H): [g | u] per padded row
  const int32_t* pair_to_row;             // (T * k,): padded row, -1 for a dropped pair
  __nv_bfloat16* dx;                      // (T, D) or null
  __nv_bfloat16* dw;                      // (E, 2H, D) or null; set for launch_moe_backward_dw
  __nv_bfloat16* dw2;                     // (E, D, H) or null
  float* dtopk_weights;                   // (T * k,) or null
  bool need_dw = false;                   // dw is asked (launch_moe_backward_dw writes it)
  // dz into z's memory: dh reads a row's g, u and writes its dz at the same addresses (one
  // quad of one warp, a __syncwarp between the row's loads and its stores), which saves the
  // (max_padded, 2H) workspace. Only when z is
  // not read again (autograd does not keep the graph).
  bool overwrite_z = false;
  int64_t num_tokens, dim, hidden_dim, num_experts, top_k, max_padded, block_m;
  int device;
};

// Empty when the backward runs this problem; otherwise one sentence naming what is wrong.
// The rules the forward shares (dims, sizes, alignment of x, w, w2 and grad_out) are
// check_fused_moe_bf16's, which the caller runs first on the same problem; these are the
// backward's own: moe_align's default block_m, the alignment of z and the gradients, and
// shared memory for its rings.
std::string check_moe_backward(const MoeBackwardProblem& problem);

// The backward is two launches, so that the first launch's buffers are free again before
// dW's output (E, 2H, D) is allocated. Three scratch allocations, each 256-byte aligned, for
// the gradients asked for: the workspace both launches read (dz, the experts' segments);
// the first launch's scratch (dO and then dx per pair in padded-row order, y1s = bf16(s h)
// for dW2, the routing weights' partial sums), released (stream-ordered) once it has run;
// and dW's (x in padded-row order, a column slice at a time), allocated next to dW. The
// caller runs launch_moe_backward, releases its scratch, allocates dw and dW's scratch and
// runs launch_moe_backward_dw on the same stream with the same workspace.
size_t moe_backward_workspace_bytes(const MoeBackwardProblem& problem);
size_t moe_backward_scratch_bytes(const MoeBackwardProblem& problem);
size_t moe_backward_dw_scratch_bytes(const MoeBackwardProblem& problem);

// Enqueues every gradient but dW on `stream`; no host synchronization. Every element of
// each gradient asked for is written. Bitwise repeatable: no atomics, every sum in a fixed
// order.
cudaError_t launch_moe_backward(const MoeBackwardProblem& problem, void* workspace, void* scratch,
                                cudaStream_t stream);
// Enqueues dW (when need_dw; problem.dw set), after launch_moe_backward on the same stream.
cudaError_t launch_moe_backward_dw(const MoeBackwardProblem& problem, void* workspace,
                                   void* dw_scratch, cudaStream_t stream);

}  // namespace prime_moe
