// The fused MoE's grouped GEMM on sm_90a: persistent, warp-specialized, one CTA per SM,
// composed of this folder's parts. Kernel = Tile x A loader x epilogue (the weight loader,
// the consumer schedule, the MMA mainloop and the tile scheduler follow from the tile):
//   warpgroup 0      producer: the weight tiles by TMA (TmaWeightTiles) and the A rows by
//                    the A loader (GatherTokenRows or TmaRows) into the stage ring;
//   warpgroups 1, 2  consumers (CooperativeConsumers): the MMA mainloop over the ring into
//                    fp32 registers, then the epilogue from registers to global memory.
// Tiles come from MoeTileScheduler, M-grouped over moe_align's expert blocks.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "epilogues.cuh"
#include "loaders.cuh"
#include "mma.cuh"
#include "moe_gemm_params.cuh"
#include "prime_kernels/mbarrier.cuh"
#include "prime_kernels/pipeline.cuh"
#include "prime_kernels/tma.cuh"
#include "schedulers.cuh"
#include "tile.cuh"

namespace prime_moe {

template <class Tile_, class ALoad_, class Epilogue_>
struct MoeGemm {
  using Tile = Tile_;
  using ALoad = ALoad_;
  using Epilogue = Epilogue_;
  using WeightLoad = TmaWeightTiles<Tile>;
  using Consumers = CooperativeConsumers<Tile>;
  using Mainloop = WarpgroupMainloop<Tile, Consumers, ALoad::kGenericProxyWrites>;
  using Scheduler = MoeTileScheduler;

  static constexpr int kThreads = 128 * (1 + Consumers::kWarpgroups);
  // A stage is full after the weight thread's expect_tx arrival, the A loader's arrivals
  // and every TMA byte; it is empty again once every consumer thread released it.
  static constexpr uint32_t kFullArrivals = 1 + ALoad::kFullArrivals;
  static constexpr uint32_t kStageTmaBytes = WeightLoad::kTmaBytes + ALoad::kTmaBytes;
  static constexpr uint32_t kEmptyArrivals = 128 * Consumers::kWarpgroups;

  static_assert(Epilogue::kNumB == Tile::kNumB, "the epilogue reads the stage's weight tiles");
  static_assert(ALoad::kThreads >= 1 && ALoad::kThreads <= 128,
                "the A loader runs in the producer warpgroup, thread 0 included");

  static constexpr size_t smem_bytes(int stages) { return Tile::smem_bytes(stages); }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    moe_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a,
                    const __grid_constant__ CUtensorMap tmap_b, const MoeGemmParams p) {
  using namespace prime_kernels;
  using Tile = typename Kernel::Tile;
  using Consumers = typename Kernel::Consumers;
  using Mainloop = typename Kernel::Mainloop;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int stages = p.stages;
  uint8_t* smem_a = smem;
  uint8_t* smem_b = smem + size_t(stages) * Tile::kABytes;
  const StageRing ring(smem_b + size_t(stages) * Tile::kBBytes, stages);

  const int warpgroup = threadIdx.x / 128;
  const int tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    ring.init(Kernel::kFullArrivals, Kernel::kEmptyArrivals);
    tma_prefetch_descriptor(&tmap_b);
    if constexpr (Kernel::ALoad::kTmaBytes > 0) tma_prefetch_descriptor(&tmap_a);
  }
  __syncthreads();

  const typename Kernel::Scheduler sched(p.num_tokens_post_padded, p.max_padded, Tile::kBlockM,
                                         p.n_dim, Tile::kBlockN);
  const int num_tiles = sched.num_tiles();
  const int num_k_blocks = p.k_dim / Tile::kBlockK;
  RingState rs;

  if (warpgroup == 0) {
    setmaxnreg_dec<Consumers::kProducerRegs>();
    if (tid >= Kernel::ALoad::kThreads) return;
    typename Kernel::ALoad a_load(tid);
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      int block, n_tile;
      sched.tile(t, block, n_tile);
      const int expert = block_expert(p, block);
      if (expert < 0) continue;
      const int b_row = expert * p.b_rows_per_expert + n_tile * Tile::kBlockN;
      a_load.start_block(p, sched.npp, block, n_tile);
      for (int kb = 0; kb < num_k_blocks; ++kb) {
        ring.producer_acquire(rs);
        uint64_t* full = ring.full_barrier(rs);
        if (tid == 0) {
          mbarrier_arrive_expect_tx(full, Kernel::kStageTmaBytes);
          Kernel::WeightLoad::load(&tmap_b, smem_b + size_t(rs.stage) * Tile::kBBytes, full, kb,
                                   b_row, p.b_second_offset);
        }
        a_load.load(p, &tmap_a, smem_a + size_t(rs.stage) * Tile::kABytes, full, kb);
        rs.advance(stages);
      }
    }
  } else {
    setmaxnreg_inc<Consumers::kConsumerRegs>();
    const int consumer = warpgroup - 1;
    const int m_offset = Consumers::m_offset(consumer);
    const int n_offset = Consumers::n_offset(consumer);
    typename Mainloop::Accumulators acc;
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      int block, n_tile;
      sched.tile(t, block, n_tile);
      if (block_expert(p, block) < 0) continue;
      // A 64-row half with no routed row (the padded tail of an expert's segment: most
      // rows at decode sizes) only passes its stages through: no wgmma, no stores. Its
      // output rows are then left unwritten, which is fine: nothing reads padding results.
      const int first_row = block * Tile::kBlockM + m_offset;
      if (!warpgroup_any(routed_pair(p, sched.npp, first_row + tid % 64) >= 0, 1 + consumer)) {
        Mainloop::skip(ring, rs, num_k_blocks);
        continue;
      }
      Mainloop::run(acc, ring, rs, smem_a, smem_b, m_offset, n_offset, num_k_blocks);
      Kernel::Epilogue::store(p, sched.npp, acc, first_row, n_tile * Tile::kBlockN + n_offset);
    }
  }
}

}  // namespace prime_moe
