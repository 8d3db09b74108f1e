// Tile schedulers of the fused MoE GEMMs. MoeTileScheduler, M-grouped: a static
// round-robin over (expert block, n tile) tiles whose count is only known on the device (it
// depends on num_tokens_post_padded), so CUDA graphs can capture the launch. (A K-grouped
// scheduler, one weight-gradient tile per (expert, m, n) reducing over the expert's rows,
// is the other kind that belongs here.)
#pragma once

#include <cstdint>

namespace prime_moe {

struct MoeTileScheduler {
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

  __device__ MoeTileScheduler(const int32_t* num_tokens_post_padded, int max_padded, int block_m,
                              int n_dim, int block_n) {
    const int raw = *num_tokens_post_padded;
    npp = raw < 0 ? 0 : (raw > max_padded ? max_padded : raw);
    num_blocks = (npp + block_m - 1) / block_m;
    num_n_tiles = (n_dim + block_n - 1) / block_n;
  }

  __device__ int num_tiles() const { return num_blocks * num_n_tiles; }

  __device__ void tile(int t, int& block, int& n_tile) const {
    const int group_tiles = num_blocks * kGroup;
    const int group = t / group_tiles;
    const int first_n = group * kGroup;
    const int width = min(kGroup, num_n_tiles - first_n);  // the last group may be narrower
    const int within = t - group * group_tiles;
    block = within / width;
    n_tile = first_n + within % width;
  }
};

}  // namespace prime_moe
