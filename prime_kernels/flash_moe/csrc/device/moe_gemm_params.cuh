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
  const __nv_bfloat16* x;                 // gather source: x (gate/up, dW1) or dO (dh, dW2)
  int ld_x;                               // elements between its token rows (D)
  const float* topk_weights;              // (T * k,) weighted epilogues
  int32_t* pair_to_row;  // gate/up: pair -> row, scattered on n tile 0 (null: not built)
  __nv_bfloat16* out;    // h (gate/up), y (down, split), out (down, atomic), dh's dz,
                         // dxe, or a weight gradient (E, m_dim, n_dim)
  int ld_out;            // elements between rows of out
  int max_padded, num_pairs, top_k, num_experts;
  int k_dim;              // M-grouped reduction dim: D for gate/up and dh, H for down, 2H for dx
  int n_dim;              // output columns: per expert (M-grouped), or of a weight gradient
  int m_dim;              // K-grouped: output rows of a weight gradient (D or 2H)
  int b_rows_per_expert;  // rows of one expert in the 2D weight view: 2H or D
  int b_second_offset;    // row offset of the second weight tile (the up rows: H)
  int stages;             // ring depth, sized by the launcher to the shared memory
  // Rows per expert_ids entry (moe_align's block_m) where the tiles are shorter (64-row tiles
  // of 128-row blocks: MoeTileScheduler); 0: the tile's block_m.
  int expert_block_rows;
  // MXFP8 weights (Mxfp8WeightTiles): each expert's e8m0 scales of its (b_rows_per_expert,
  // k_dim / 32) in the blocked layout of pack_scales_blocked.
  const uint8_t* b_scales;
  // h as MXFP8 between the register-A forward's GEMMs on its decode tiles (SwiGluToMxfp8<true>,
  // E4m3TokenRows): the gate/up GEMM's out holds h's e4m3 bytes and out_scales its block scales
  // 2^(s - 127) as fp32 (NaN for a block of NaN or +-Inf), which the down GEMM reads back through
  // a_scales; for each 128-row block and 128-wide K step a [4 blocks][128 rows] group, so that a
  // stage's scales are four contiguous runs (h_scale_index).
  float* out_scales;
  const float* a_scales;
  // The same decode tiles' rows-ready counters (moe_gemm.cuh, RowsReady), one per 64-row tile of
  // the padded order: the gate/up GEMM adds 1 as each consumer warpgroup has stored its columns
  // of a tile's h, and the down GEMM copies a tile's h rows once the count is rows_ready_count
  // (every gate/up warpgroup tile of those rows). x's pre-pass zeroes them.
  uint32_t* rows_ready;
  int rows_ready_count;

  // Training. z: the gate/up pre-activations [g | u] per padded row (max_padded, 2H),
  // written by the training forward and read by dh's epilogue, which also writes
  // y1s = bf16(s h) (max_padded, H) and partial sums of <dh', h> per pair into ds_part
  // (T * k, ld_ds) fp32, one column per consumer column slice of H (an n tile of dh: its
  // warpgroup holds all of the tile's columns).
  __nv_bfloat16* z;
  __nv_bfloat16* y1s;
  float* ds_part;
  int ld_ds;
  // K-grouped: expert e's padded rows are [segments[e], segments[E + e]) (empty: start >=
  // end).
  const int32_t* segments;
};

// Where h's block scale (row, block) lives in out_scales / a_scales (k_dim: H).
__device__ __forceinline__ size_t h_scale_index(int row, int block, int k_dim) {
  return (size_t(row / 128) * size_t(k_dim / 128) + size_t(block / 4)) * 512 + (block % 4) * 128 +
         row % 128;
}

// Rows a rows-ready counter covers (MoeGemmParams::rows_ready): the decode tiles' block_m.
constexpr int kRowsReadyTileRows = 64;

// Rows routed to a pair: row < npp and 0 <= id < T*k; anything else (padding, garbage)
// loads zeros and is neither scattered nor added.
__device__ __forceinline__ int routed_pair(const MoeGemmParams& p, int npp, int row) {
  const int pair = row < npp ? p.sorted_token_ids[row] : -1;
  return (pair >= 0 && pair < p.num_pairs) ? pair : -1;
}

// A block whose expert id is outside [0, E) (past the padded total, or garbage) has no work:
// producer and consumers skip it (in a cluster, pass its stages through empty).
__device__ __forceinline__ int block_expert(const MoeGemmParams& p, int block) {
  const int expert = p.expert_ids[block];
  return (expert >= 0 && expert < p.num_experts) ? expert : -1;
}

}  // namespace prime_moe
