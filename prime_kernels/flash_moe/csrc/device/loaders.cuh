// Producer parts of the fused MoE GEMMs: what fills a pipeline stage. A stage's weight
// tiles always come by TMA; its A rows come either gathered token by token from x
// (cp.async, the first GEMM: Hopper's TMA has no row gather) or by TMA from a dense
// workspace (the second GEMM reads h). An A loader says how many threads it needs, how many
// arrivals and TMA bytes the stage's full barrier expects from it, and whether it writes
// shared memory through the generic proxy (then consumers fence before wgmma).
// (A multicast weight loader for 2-CTA clusters, an fp8 loader with its scales, and a gather
// along K for weight gradients are further parts of this file's kind.)
#pragma once

#include <cuda.h>

#include <cstdint>

#include "moe_gemm_params.cuh"
#include "prime_kernels/mbarrier.cuh"
#include "prime_kernels/tma.cuh"

namespace prime_moe {

// kNumB weight tiles of kBlockN x 64 from the (E * b_rows_per_expert, K) view of the
// weights: expert e's tile b starts at row e * b_rows_per_expert + n0 + b * b_second_offset.
template <class Tile>
struct TmaWeightTiles {
  static constexpr uint32_t kTmaBytes = Tile::kBBytes;

  __device__ __forceinline__ static void load(const CUtensorMap* map, uint8_t* smem_b,
                                              uint64_t* full, int kb, int b_row,
                                              int second_offset) {
    using namespace prime_kernels;
    const uint32_t dst = smem_addr(smem_b);
#pragma unroll
    for (int b = 0; b < Tile::kNumB; ++b)
      tma_load_2d(dst + b * Tile::kBlockN * 128, map, smem_addr(full), kb * Tile::kBlockK,
                  b_row + b * second_offset);
  }
};

// The block's rows gathered from x: 8 threads per 128-byte row (one 16-byte chunk each),
// 16 rows per pass, padding rows zero-filled. The first n tile of each block also records
// pair -> row for the combine (pair_to_row, when the split path builds it).
template <class Tile>
struct GatherTokenRows {
  static constexpr int kThreads = 128;
  static constexpr uint32_t kFullArrivals = kThreads;  // one cp.async arrival per thread
  static constexpr uint32_t kTmaBytes = 0;
  static constexpr bool kGenericProxyWrites = true;
  static constexpr int kRowsPerThread = Tile::kBlockM / 16;

  const int chunk, pass_row;
  // Hand-applied 128B swizzle: 16-byte chunk c of row r lands at chunk c ^ (r % 8).
  // pass_row + 16 i has the same r % 8 for every i, so the offset is per thread.
  const uint32_t thread_offset;
  // The thread's gathered rows, as 16-byte-chunk offsets into x (uint32: T*D/8 < 2^32).
  uint32_t src_chunk[kRowsPerThread];
  uint32_t valid_mask = 0;

  __device__ __forceinline__ explicit GatherTokenRows(int tid)
      : chunk(tid & 7),
        pass_row(tid >> 3),
        thread_offset(pass_row * 128 + ((chunk ^ (pass_row & 7)) << 4)) {}

  __device__ __forceinline__ void start_block(const MoeGemmParams& p, int npp, int block,
                                              int n_tile) {
    valid_mask = 0;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int row = block * Tile::kBlockM + pass_row + 16 * i;
      const int pair = routed_pair(p, npp, row);
      const uint32_t token = pair >= 0 ? uint32_t(pair / p.top_k) : 0u;
      src_chunk[i] = token * uint32_t(p.k_dim / 8) + chunk;
      valid_mask |= uint32_t(pair >= 0) << i;
      if (p.pair_to_row != nullptr && n_tile == 0 && chunk == 0 && pair >= 0)
        p.pair_to_row[pair] = row;
    }
  }

  __device__ __forceinline__ void load(const MoeGemmParams& p, const CUtensorMap* /*map*/,
                                       uint8_t* smem_a, uint64_t* full, int kb) const {
    using namespace prime_kernels;
    const uint32_t dst = smem_addr(smem_a) + thread_offset;
    const uint4* src = reinterpret_cast<const uint4*>(p.x) + kb * (Tile::kBlockK / 8);
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i)
      cp_async_16_zfill(dst + i * 16 * 128, src + src_chunk[i], (valid_mask >> i) & 1);
    cp_async_mbarrier_arrive_noinc(full);
  }
};

// The block's rows of a dense (max_padded, K) workspace by TMA, issued by the one thread
// that also loads the weights.
template <class Tile>
struct TmaRows {
  static constexpr int kThreads = 1;
  static constexpr uint32_t kFullArrivals = 0;  // completes as TMA bytes
  static constexpr uint32_t kTmaBytes = Tile::kABytes;
  static constexpr bool kGenericProxyWrites = false;

  int block = 0;

  __device__ __forceinline__ explicit TmaRows(int /*tid*/) {}

  __device__ __forceinline__ void start_block(const MoeGemmParams& /*p*/, int /*npp*/, int block_,
                                              int /*n_tile*/) {
    block = block_;
  }

  __device__ __forceinline__ void load(const MoeGemmParams& /*p*/, const CUtensorMap* map,
                                       uint8_t* smem_a, uint64_t* full, int kb) const {
    using namespace prime_kernels;
    tma_load_2d(smem_addr(smem_a), map, smem_addr(full), kb * Tile::kBlockK, block * Tile::kBlockM);
  }
};

}  // namespace prime_moe
