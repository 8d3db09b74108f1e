// Host interface of moe_align: sorts the T*k (token, slot) pairs by expert into segments
// padded to a multiple of pad = block_m * bpc. Torch-free; binding.cpp calls it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace prime_moe {

// Pairs each warp of the scatter pass places in index order; the chunk is also the unit of
// the per-chunk expert histogram, so the order inside an expert segment is stable.
inline constexpr int kMoeAlignChunk = 1024;

inline int64_t moe_align_num_chunks(int64_t num_pairs) {
  return (num_pairs + kMoeAlignChunk - 1) / kMoeAlignChunk;
}

// Length of sorted_token_ids: the worst case of every expert wasting pad - 1 rows.
inline int64_t moe_align_max_padded(int64_t num_pairs, int64_t num_experts, int64_t pad) {
  return (num_pairs + num_experts * (pad - 1) + pad - 1) / pad * pad;
}

// Scratch of the three-pass align: one int32 per (chunk, expert); none where one block aligns
// (decode and small prefill sizes), whose caller then need not allocate it.
size_t moe_align_workspace_bytes(int64_t num_pairs, int64_t num_experts, int64_t max_padded);

// topk_ids: (num_pairs,) int32 on the device. Ids outside [0, num_experts) are dropped.
// Writes sorted_token_ids (max_padded), expert_ids (max_padded / block_m; -1 past the
// padded total) and num_tokens_post_padded (1). No host synchronization.
cudaError_t launch_moe_align(const int32_t* topk_ids, int64_t num_pairs, int num_experts,
                             int block_m, int bpc, int32_t* sorted_token_ids, int32_t* expert_ids,
                             int32_t* num_tokens_post_padded, int64_t max_padded,
                             int32_t* workspace, cudaStream_t stream);

}  // namespace prime_moe
