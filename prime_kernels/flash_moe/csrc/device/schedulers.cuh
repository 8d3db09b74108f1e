// Tile schedulers of the fused MoE GEMMs. Both are static round-robins over a tile count
// known only on the device (it depends on num_tokens_post_padded or the routing), so CUDA
// graphs can capture the launch, and both hand the kernel a MoeWorkTile:
//   MoeTileScheduler     M-grouped: (expert block, n tile); K is the GEMM's fixed k_dim.
//                        The forward's GEMMs and the backward's activation gradients.
//   ExpertKScheduler     K-grouped: (expert, m tile, n tile) of a weight gradient, K the
//                        expert's padded rows. One CTA owns an output tile for the whole
//                        reduction: no split, no atomics, so the sum's order is fixed.
// For 2-CTA clusters (cluster_m = 2) both count tiles in pairs, tile 2i + r for the cluster's
// CTA r: the two tiles of a pair are consecutive M (blocks, or m tiles) at the same n, so
// they read the same B tile when their expert is the same (moe_gemm.cuh). work() is false
// for a pair's missing tile (past the last block or m tile) but still gives its K steps.
#pragma once

#include <cstdint>

#include "moe_gemm_params.cuh"

namespace prime_moe {

struct MoeWorkTile {
  int expert;
  int row0;          // M-grouped: the block's first padded row; K-grouped: first output row
  int n0;            // first output column
  int k_row0;        // K-grouped: the expert's first padded row (K runs along rows)
  int num_k_blocks;  // K steps of the tile's block_k
};

__device__ __forceinline__ int clamp_npp(const MoeGemmParams& p) {
  const int raw = *p.num_tokens_post_padded;
  return raw < 0 ? 0 : (raw > p.max_padded ? p.max_padded : raw);
}

struct MoeTileScheduler {
  // A 64-row half of a block with no routed row is passed over by its consumer.
  static constexpr bool kMGrouped = true;
  // n tiles per raster group. Tiles are ordered group-major, then block, then n within the
  // group, so the ~132 tiles in flight at once cover about 132 / kGroup consecutive
  // blocks (mostly one expert) times kGroup n tiles: each weight tile is shared by those
  // blocks and each gathered A block by kGroup tiles through L2. With one group spanning
  // all n tiles (Mixtral gate/up: 112 n tiles), every block would stream its expert's
  // whole 235 MB weight from DRAM.
  static constexpr int kGroup = 8;

  int npp;          // num_tokens_post_padded clamped to [0, max_padded]
  int num_blocks;   // blocks of block_m rows holding rows below npp
  int num_n_tiles;  // ceil(n_dim / block_n)
  int block_m, block_n, block_k;
  int cluster_m;        // tiles per pair: 1, or 2 for 2-CTA clusters
  int num_block_pairs;  // ceil(num_blocks / cluster_m); of whole expert blocks (tile_shift)
  int tile_shift;       // log2 of the tiles per expert block: 0, or 1 for 64-row tiles of 128
  int lower_tiles;      // tile_shift 1: the tiles of every block's lower 64 rows, first

  // The most tiles any routing can give (sizes the persistent grid on the host).
  static int64_t max_tiles(const MoeGemmParams& p, int block_m, int block_n, int cluster_m) {
    const int64_t pairs = (p.max_padded / block_m + cluster_m - 1) / cluster_m;
    return pairs * cluster_m * ((p.n_dim + block_n - 1) / block_n);
  }

  __device__ MoeTileScheduler(const MoeGemmParams& p, int block_m_, int block_n_, int block_k_,
                              int cluster_m_)
      : npp(clamp_npp(p)),
        block_m(block_m_),
        block_n(block_n_),
        block_k(block_k_),
        cluster_m(cluster_m_) {
    num_blocks = (npp + block_m - 1) / block_m;
    num_n_tiles = (p.n_dim + block_n - 1) / block_n;
    tile_shift = p.expert_block_rows > block_m ? 1 : 0;
    num_block_pairs = (((num_blocks + tile_shift) >> tile_shift) + cluster_m - 1) / cluster_m;
    lower_tiles = num_block_pairs * cluster_m * num_n_tiles;
  }

  __device__ int num_tiles() const { return lower_tiles << tile_shift; }

  // False for a block whose expert id is outside [0, E) and for a pair's block past the
  // last: no work (single CTAs skip it; in a cluster its stages pass through empty). With
  // 64-row tiles of 128-row blocks, also for a block's upper tile whose first row is not
  // routed: moe_align puts a block's routed rows first, so the tile has none (at decode sizes
  // most upper tiles), and neither its producer nor its consumers touch it. Every lower tile
  // comes before any upper one: the CTAs stream weights first and pass over the empty upper
  // tiles last, rather than every other run of tiles.
  __device__ bool work(int t, const MoeGemmParams& p, MoeWorkTile& w) const {
    const int upper = t >= lower_tiles ? 1 : 0;  // always 0 at tile_shift 0 (num_tiles)
    t -= upper * lower_tiles;
    const int pair = t / cluster_m;
    const int group_tiles = num_block_pairs * kGroup;
    const int group = pair / group_tiles;
    const int first_n = group * kGroup;
    const int width = min(kGroup, num_n_tiles - first_n);  // the last group may be narrower
    const int within = pair - group * group_tiles;
    const int block = ((within / width * cluster_m + t % cluster_m) << tile_shift) + upper;
    w.expert = block < num_blocks ? block_expert(p, block >> tile_shift) : -1;
    w.row0 = block * block_m;
    if (upper != 0 && w.expert >= 0 && routed_pair(p, npp, w.row0) < 0) w.expert = -1;
    w.n0 = (first_n + within % width) * block_n;
    w.k_row0 = 0;
    w.num_k_blocks = p.k_dim / block_k;
    return w.expert >= 0;
  }
};

struct ExpertKScheduler {
  static constexpr bool kMGrouped = false;

  int npp;
  int num_m_tiles, num_n_tiles, num_experts;
  int block_m, block_n, block_k;
  int cluster_m;    // tiles per pair: 1, or 2 for 2-CTA clusters
  int num_m_pairs;  // ceil(num_m_tiles / cluster_m)

  static int64_t max_tiles(const MoeGemmParams& p, int block_m, int block_n, int cluster_m) {
    const int64_t m_pairs = ((p.m_dim + block_m - 1) / block_m + cluster_m - 1) / cluster_m;
    return int64_t(p.num_experts) * m_pairs * cluster_m * ((p.n_dim + block_n - 1) / block_n);
  }

  __device__ ExpertKScheduler(const MoeGemmParams& p, int block_m_, int block_n_, int block_k_,
                              int cluster_m_)
      : npp(clamp_npp(p)),
        num_experts(p.num_experts),
        block_m(block_m_),
        block_n(block_n_),
        block_k(block_k_),
        cluster_m(cluster_m_) {
    num_m_tiles = (p.m_dim + block_m - 1) / block_m;
    num_n_tiles = (p.n_dim + block_n - 1) / block_n;
    num_m_pairs = (num_m_tiles + cluster_m - 1) / cluster_m;
  }

  __device__ int num_tiles() const { return num_experts * num_m_pairs * cluster_m * num_n_tiles; }

  // Expert-major, then m, then n: the CTAs working at once share an expert, so its gathered
  // token rows and its workspace rows are read from L2 by every tile that needs them. An
  // expert with no rows still owns its tiles: they store zeros. False only for a pair's m
  // tile past the last.
  __device__ bool work(int t, const MoeGemmParams& p, MoeWorkTile& w) const {
    const int pair = t / cluster_m;
    const int per_expert = num_m_pairs * num_n_tiles;
    w.expert = pair / per_expert;
    const int within = pair - w.expert * per_expert;
    const int m_tile = within / num_n_tiles * cluster_m + t % cluster_m;
    w.row0 = m_tile * block_m;
    w.n0 = (within % num_n_tiles) * block_n;
    const int begin = p.segments[w.expert];
    const int end = min(p.segments[num_experts + w.expert], npp);
    w.k_row0 = begin;
    w.num_k_blocks = end > begin ? (end - begin) / block_k : 0;
    return m_tile < num_m_tiles;
  }
};

// ExpertKScheduler's input from moe_align's layout: expert e's padded rows [start, end) as
// segments[e] (starts) and segments[E + e] (ends): the least and the greatest row of the
// blocks below the padded total whose expert_ids entry is e. In moe_align's layout each
// expert's blocks are consecutive; with any other expert_ids the range still holds (min and
// max do not depend on the order of the atomics), it just spans other experts' rows too.
// segments starts as starts = 0x7F7F7F7F, ends = 0. One thread per block.
constexpr int kSegmentThreads = 256;

static __global__ void __launch_bounds__(kSegmentThreads)
    moe_expert_segments_kernel(const int32_t* expert_ids, const int32_t* num_tokens_post_padded,
                               int max_padded, int block_m, int num_experts, int32_t* segments) {
  const int block = blockIdx.x * kSegmentThreads + threadIdx.x;
  const int raw = *num_tokens_post_padded;
  const int npp = raw < 0 ? 0 : (raw > max_padded ? max_padded : raw);
  const int num_blocks = (npp + block_m - 1) / block_m;
  if (block >= num_blocks) return;
  const int e = expert_ids[block];
  if (e < 0 || e >= num_experts) return;
  atomicMin(&segments[e], block * block_m);
  atomicMax(&segments[num_experts + e], min((block + 1) * block_m, npp));
}

}  // namespace prime_moe
