// Deterministic per-token and per-pair reductions, each in a fixed order.
// moe_combine_kernel: the split path's out[t] = bf16(sum_{j=0..k-1} w[t*k+j] * y[row of pair
// t*k+j]) in fp32, in order j = 0..k-1 (w = 1 when topk_weights is null: the backward's
// dx[t] from its per-pair dxe rows); a pair with no row (dropped, or in a skipped block) adds
// nothing, so a token with every pair dropped gets 0. Memory-bound: 16-byte loads and
// stores, one CTA per token.
// moe_routing_weight_grad_kernel: the backward's ds[p] = sum_n ds_part[p][n] in order
// n = 0.., 0 for a dropped pair.
// moe_scatter_rows_kernel, the combine's inverse: dst[r] = src[token of the pair in padded
// row r] (a slice of its columns), zeros in every other row (padding, and any row whose
// routing tables disagree), so that a K-grouped GEMM reads both operands by TMA (the
// backward's dW: gathering x along K inside the GEMM ran at 190 TFLOP/s, TMA rows at 600).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "prime_kernels/grid_dependency.cuh"

namespace prime_moe {

struct CombineParams {
  const __nv_bfloat16* y;      // (max_padded, D)
  const int32_t* pair_to_row;  // (T * k,) a pair's row; -1 or anything when it has none
  const float* topk_weights;   // (T * k,), or null for weights of 1
  __nv_bfloat16* out;          // (T, D)
  int dim, top_k;
  int rows;  // rows of y (max_padded): a row outside [0, rows) counts as no row
  // Null when pair_to_row was filled with -1 before the GEMMs scattered the routed pairs' rows.
  // Otherwise the routing the GEMMs that wrote y ran on, and a pair's row counts only where it
  // is one of that pair's rows there (sorted_token_ids names the pair back, below the padded
  // total, in a block with a valid expert: the rows the GEMMs compute, MoeTileScheduler); a
  // stale row from an earlier call passes only where it is the pair's row now too. With 64-row
  // tiles of 128-row blocks the GEMMs skip an upper half whose first row has no pair, which in
  // moe_align's layout (routed rows first) has none: with another layout such a half's rows
  // pass here and read y rows this call did not write (in bounds, not the pair's sum).
  const int32_t* sorted_token_ids;        // (rows,)
  const int32_t* expert_ids;              // (rows / block_m,)
  const int32_t* num_tokens_post_padded;  // (1,)
  int block_m, num_experts;
};

constexpr int kCombineThreads = 128;
constexpr int kCombineColumnsPerPass = kCombineThreads * 8;

// A CTA per token, and with fewer tokens than SMs the columns split over CTAs too: one CTA a
// token left SMs idle at decode sizes while each CTA walked its columns a pass at a time, one
// round trip to y each, after the down GEMM (T = 64, D = 2048: two passes on 64 of 132 SMs).
inline dim3 combine_grid(int64_t num_tokens, int dim, int num_sms) {
  const int slices =
      num_tokens < num_sms ? (dim + kCombineColumnsPerPass - 1) / kCombineColumnsPerPass : 1;
  return dim3(unsigned(num_tokens), unsigned(slices));
}

// Pairs are taken 8 at a time so that their 16-byte loads are all in flight together
// (a load per pair behind a data-dependent branch would serialize on DRAM latency); the
// sum still runs in order j = 0..k-1.
constexpr int kCombinePairsInFlight = 8;

// Rows below this one may be a pair's: y's, and with the routing given, the padded total's.
__device__ __forceinline__ int combine_rows_in_use(const CombineParams& p) {
  if (p.sorted_token_ids == nullptr) return p.rows;
  const int npp = *p.num_tokens_post_padded;
  return npp < 0 ? 0 : (npp < p.rows ? npp : p.rows);
}

// A pair's row, or -1 (no row this call).
__device__ __forceinline__ int combine_row(const CombineParams& p, int rows_in_use, int pair0,
                                           int64_t j) {
  if (j >= p.top_k) return -1;
  const int pair = pair0 + int(j);
  const int row = p.pair_to_row[pair];
  if (row < 0 || row >= rows_in_use) return -1;
  if (p.sorted_token_ids == nullptr) return row;
  const int expert = p.expert_ids[row / p.block_m];
  const bool computed = expert >= 0 && expert < p.num_experts;
  return computed && p.sorted_token_ids[row] == pair ? row : -1;
}

static __global__ void __launch_bounds__(kCombineThreads)
    moe_combine_kernel(const CombineParams p) {
  const int token = blockIdx.x;
  const int pair0 = token * p.top_k;
  // The first pairs' rows are read before the wait: pair_to_row comes from a kernel the one
  // this launch depends on waited for (the gate/up GEMM, before the down GEMM), the routing
  // from one before that, so only y's loads wait for the down GEMM, and at decode sizes the
  // round trips of the rows' checks do not follow it.
  const int rows_in_use = combine_rows_in_use(p);
  int first_row[kCombinePairsInFlight];
#pragma unroll
  for (int u = 0; u < kCombinePairsInFlight; ++u)
    first_row[u] = combine_row(p, rows_in_use, pair0, u);
  prime_kernels::grid_dependency_wait();  // y comes from the down GEMM (a dependent launch)
  for (int c = (blockIdx.y * kCombineThreads + threadIdx.x) * 8; c < p.dim;
       c += gridDim.y * kCombineColumnsPerPass) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t j0 = 0; j0 < p.top_k; j0 += kCombinePairsInFlight) {  // top_k near INT_MAX
      int row[kCombinePairsInFlight];
      uint4 v[kCombinePairsInFlight];
#pragma unroll
      for (int u = 0; u < kCombinePairsInFlight; ++u) {
        row[u] = j0 == 0 ? first_row[u] : combine_row(p, rows_in_use, pair0, j0 + u);
        v[u] = row[u] >= 0 ? *reinterpret_cast<const uint4*>(p.y + size_t(row[u]) * p.dim + c)
                           : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kCombinePairsInFlight; ++u) {
        if (row[u] < 0) continue;  // dropped: adds nothing
        const float w = p.topk_weights != nullptr ? p.topk_weights[pair0 + j0 + u] : 1.f;
        const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = __bfloat1622float2(v2[e]);
          acc[2 * e] += w * f.x;
          acc[2 * e + 1] += w * f.y;
        }
      }
    }
    uint4 o;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int e = 0; e < 4; ++e) o2[e] = __floats2bfloat162_rn(acc[2 * e], acc[2 * e + 1]);
    *reinterpret_cast<uint4*>(p.out + size_t(token) * p.dim + c) = o;
  }
}

constexpr int kRoutingGradThreads = 256;

static __global__ void __launch_bounds__(kRoutingGradThreads)
    moe_routing_weight_grad_kernel(const float* ds_part, int ld_ds, const int32_t* pair_to_row,
                                   int num_pairs, int rows, float* ds) {
  const int pair = blockIdx.x * kRoutingGradThreads + threadIdx.x;
  if (pair >= num_pairs) return;
  float sum = 0.f;
  const int row = pair_to_row[pair];
  if (row >= 0 && row < rows)
    for (int n = 0; n < ld_ds; ++n) sum += ds_part[size_t(pair) * ld_ds + n];
  ds[pair] = sum;
}

struct ScatterRowsParams {
  const __nv_bfloat16* src;               // (T, D)
  const int32_t* sorted_token_ids;        // (max_padded,) flat pair index or -1
  const int32_t* pair_to_row;             // (T * k,) padded row or -1
  const int32_t* num_tokens_post_padded;  // rows at and past it are not written
  __nv_bfloat16* dst;                     // (max_padded, cols)
  int dim;                                // D: elements between src's token rows
  int col0, cols;                         // the columns of src copied (multiples of 8)
  int num_tokens, top_k;
  int rows;  // max_padded
};

// Each token's row is read once and written to its k padded rows. Walking the padded rows
// instead read every token row k times from DRAM (an expert's rows are a pass over all the
// tokens, and the k passes that share a token run far apart): 2k row sizes moved per token
// instead of k + 1.
constexpr int kScatterRowsThreads = 256;
constexpr int kScatterRowsWarps = kScatterRowsThreads / 32;
constexpr int kScatterRowsChunks = 8;  // 16-byte loads a lane has in flight: 4 KB of a row a warp

// The grid's first token_ctas CTAs copy token rows, a warp per token; the rest zero the
// padding rows, a warp per 32 rows. Row r < num_tokens_post_padded is written by exactly one
// warp, whatever the routing tables hold: by its pair's token when sorted_token_ids[r] = p and
// pair_to_row[p] = r agree, else zeroed (padding, and rows of blocks the forward skipped).
static __global__ void __launch_bounds__(kScatterRowsThreads)
    moe_scatter_rows_kernel(const ScatterRowsParams p, int token_ctas) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int valid_rows = min(p.rows, *p.num_tokens_post_padded);
  const int num_pairs = p.num_tokens * p.top_k;
  const int chunks = p.cols / 8;
  if (int(blockIdx.x) < token_ctas) {
    const int token = blockIdx.x * kScatterRowsWarps + warp;
    if (token >= p.num_tokens) return;
    const uint4* src = reinterpret_cast<const uint4*>(p.src + size_t(token) * p.dim + p.col0);
    // j0 is 64-bit: top_k may come within 32 of INT_MAX (T = 1).
    for (int64_t j0 = 0; j0 < p.top_k; j0 += 32) {
      // Lane j holds the row of the token's pair j0 + j, or -1: every row id is loaded before
      // the copy, not one dependent round trip per store.
      int my_row = -1;
      if (j0 + lane < p.top_k) {
        const int pair = int(int64_t(token) * p.top_k + j0 + lane);
        const int row = p.pair_to_row[pair];
        if (row >= 0 && row < valid_rows && p.sorted_token_ids[row] == pair) my_row = row;
      }
      const int pairs_here = int(min(int64_t(32), p.top_k - j0));
      for (int c0 = 0; c0 < chunks; c0 += 32 * kScatterRowsChunks) {
        uint4 v[kScatterRowsChunks];
#pragma unroll
        for (int u = 0; u < kScatterRowsChunks; ++u) {
          const int c = c0 + 32 * u + lane;
          if (c < chunks) v[u] = src[c];
        }
        for (int j = 0; j < pairs_here; ++j) {
          const int row = __shfl_sync(0xFFFFFFFFu, my_row, j);
          if (row < 0) continue;
          uint4* dst = reinterpret_cast<uint4*>(p.dst + size_t(row) * p.cols);
#pragma unroll
          for (int u = 0; u < kScatterRowsChunks; ++u) {
            const int c = c0 + 32 * u + lane;
            if (c < chunks) dst[c] = v[u];
          }
        }
      }
    }
  } else {
    const int row0 = ((int(blockIdx.x) - token_ctas) * kScatterRowsWarps + warp) * 32;
    if (row0 >= valid_rows) return;
    const int r = row0 + lane;
    bool zero = false;
    if (r < valid_rows) {
      const int pair = p.sorted_token_ids[r];
      zero = !(pair >= 0 && pair < num_pairs && p.pair_to_row[pair] == r);
    }
    for (unsigned mask = __ballot_sync(0xFFFFFFFFu, zero); mask != 0; mask &= mask - 1) {
      uint4* dst = reinterpret_cast<uint4*>(p.dst + size_t(row0 + __ffs(mask) - 1) * p.cols);
      for (int c = lane; c < chunks; c += 32) dst[c] = make_uint4(0, 0, 0, 0);
    }
  }
}

}  // namespace prime_moe
