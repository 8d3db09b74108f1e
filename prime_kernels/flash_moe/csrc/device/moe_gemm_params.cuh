// What every part of the fused MoE GEMMs reads: the problem's pointers and sizes, and the
// routing facts derived from moe_align's layout. Row r of the padded, expert-sorted order
// holds pair sorted_token_ids[r] (token = pair / top_k) or -1; block r / block_m belongs to
// expert_ids[block].
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace prime_moe {

struct MoeGemmParams {
  const int32_t* sorted_token_ids;        // (max_padded,) pair index or -1
  const int32_t* expert_ids;              // (max_padded / block_m,)
  const int32_t* num_tokens_post_padded;  // (1,) device
  const __nv_bfloat16* x;                 // gather source (gate/up): (T, k_dim)
  const float* topk_weights;              // (T * k,) weighted epilogues
  int32_t* pair_to_row;  // gate/up: pair -> row, scattered on n tile 0 (null: not built)
  __nv_bfloat16* out;    // h (gate/up), y (down, split) or out (down, atomic)
  int ld_out;            // elements between rows of out
  int max_padded, num_pairs, top_k, num_experts;
  int k_dim;              // reduction dim: D for gate/up, H for down
  int n_dim;              // output columns per expert: H for gate/up, D for down
  int b_rows_per_expert;  // rows of one expert in the 2D weight view: 2H or D
  int b_second_offset;    // row offset of the second weight tile (the up rows: H)
  int stages;             // ring depth, sized by the launcher to the shared memory
};

// Rows routed to a pair: row < npp and 0 <= id < T*k; anything else (padding, garbage)
// loads zeros and is neither scattered nor added.
__device__ __forceinline__ int routed_pair(const MoeGemmParams& p, int npp, int row) {
  const int pair = row < npp ? p.sorted_token_ids[row] : -1;
  return (pair >= 0 && pair < p.num_pairs) ? pair : -1;
}

// A block whose expert id is outside [0, E) (past the padded total, or garbage) is skipped
// by producer and consumers alike.
__device__ __forceinline__ int block_expert(const MoeGemmParams& p, int block) {
  const int expert = p.expert_ids[block];
  return (expert >= 0 && expert < p.num_experts) ? expert : -1;
}

}  // namespace prime_moe
