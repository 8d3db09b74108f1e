// The consumer's K loop over the stage ring for one tile: per K slice, wgmma from shared
// memory into fp32 registers, keeping one slice's wgmmas in flight and handing the stage
// before it back to the producer. The MMA atom is a parameter (Consumers::Mma, bf16 wgmma
// k16 today), so an fp8 atom or a dequantizing step slots in without another loop; so are
// the operand layouts (Consumers::ALayout, BLayout: K-major or MN-major tiles, wgmma.cuh),
// which give the descriptors and their K step.
#pragma once

#include <cstdint>

#include "prime_kernels/mbarrier.cuh"
#include "prime_kernels/pipeline.cuh"
#include "prime_kernels/wgmma.cuh"

namespace prime_moe {

// kClusterCtas > 1: the CTAs of a cluster fill each other's stages (multicast), and a stage
// goes back to the producers of all of them (StageRing::consumer_release_cluster).
template <class Tile, class Consumers, bool kFenceGenericWrites, int kClusterCtas = 1>
struct WarpgroupMainloop {
  using Mma = typename Consumers::Mma;
  using ALayout = typename Consumers::ALayout;
  using BLayout = typename Consumers::BLayout;
  // [64-row half of the warpgroup's rows][weight tile][wgmma registers]
  using Accumulators = float[Consumers::kMmaM][Consumers::kNumMma][Mma::kAccRegs];

  __device__ __forceinline__ static void release(const prime_kernels::StageRing& ring, int stage) {
    if constexpr (kClusterCtas == 1)
      ring.consumer_release(stage);
    else
      ring.consumer_release_cluster<kClusterCtas>(stage);
  }

  // A tile this warpgroup has no work in (a 64-row half of padding, or a cluster's missing
  // tile) only passes its stages through, so the ring stays in step with the producer.
  __device__ __forceinline__ static void skip(const prime_kernels::StageRing& ring,
                                              prime_kernels::RingState& rs, int num_k_blocks) {
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      ring.consumer_wait(rs);
      release(ring, rs.stage);
      rs.advance(ring.stages);
    }
  }

  // acc = A[m_offset .. + 64 kMmaM) x B[n_offset .. + kNumMma * kMmaN)^T over all K slices.
  // issued() runs once every wgmma of the tile is issued, before they are waited for: a
  // ping-pong consumer passes its turn there, so the other warpgroup's first wgmmas queue
  // behind this one's last and the tensor pipe does not drain between tiles (CUTLASS's
  // ping-pong kernel does the same).
  template <class Issued>
  __device__ __forceinline__ static void run(Accumulators& acc,
                                             const prime_kernels::StageRing& ring,
                                             prime_kernels::RingState& rs, uint8_t* smem_a,
                                             uint8_t* smem_b, int m_offset, int n_offset,
                                             int num_k_blocks, Issued&& issued) {
    using namespace prime_kernels;
    // Fenced on both sides: without this one, ptxas may move the previous tile's epilogue
    // reads of the accumulators past the first wgmma and then serializes every wgmma of the
    // kernel (C7520, "WG.AR in divergent path"; dh's epilogue in the stores' layout did so:
    // 2.12 ms instead of 1.59 at Qwen3-30B-A3B T = 32768).
#pragma unroll
    for (int mh = 0; mh < Consumers::kMmaM; ++mh) {
#pragma unroll
      for (int b = 0; b < Consumers::kNumMma; ++b) wgmma_fence_operands(acc[mh][b]);
    }
    int prev_stage = 0;
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      ring.consumer_wait(rs);
      // cp.async wrote the A tile through the generic proxy; wgmma reads through the
      // async proxy.
      if constexpr (kFenceGenericWrites) fence_proxy_async_shared();
      // Row m (n) of a tile starts m * 128 bytes in, in either layout (wgmma.cuh).
      const uint64_t desc_a =
          ALayout::desc(smem_a + size_t(rs.stage) * Tile::kABytes + m_offset * 128);
      const uint64_t desc_b =
          BLayout::desc(smem_b + size_t(rs.stage) * Tile::kBBytes + n_offset * 128);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Tile::kBlockK / Mma::kK; ++kk) {
#pragma unroll
        for (int mh = 0; mh < Consumers::kMmaM; ++mh) {
#pragma unroll
          for (int b = 0; b < Consumers::kNumMma; ++b)
            Mma::mma(acc[mh][b], desc_a + (mh * 64 * 128 >> 4) + ALayout::kDescPerK16 * kk,
                     desc_b + (b * Tile::kBlockN * 128 >> 4) + BLayout::kDescPerK16 * kk,
                     (kb | kk) != 0);
        }
      }
      wgmma_commit();
      // Keep this K slice's wgmmas in flight; the previous slice's are done, so its stage
      // goes back to the producer.
      wgmma_wait<1>();
      if (kb > 0) release(ring, prev_stage);
      prev_stage = rs.stage;
      rs.advance(ring.stages);
    }
    issued();
    wgmma_wait<0>();
#pragma unroll
    for (int mh = 0; mh < Consumers::kMmaM; ++mh) {
#pragma unroll
      for (int b = 0; b < Consumers::kNumMma; ++b) wgmma_fence_operands(acc[mh][b]);
    }
    release(ring, prev_stage);
  }
};

}  // namespace prime_moe
