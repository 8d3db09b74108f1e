// The warp-specialized, persistent mainloop shared by the gate/up and down GEMMs of the
// bf16 fused MoE on sm_90a. One CTA per SM, 384 threads:
//   warpgroup 0      producer: TMA for the weight tiles (and for A when A is a dense
//                    workspace), or a cp.async gather of the block's token rows with the
//                    128-byte swizzle applied by hand (Hopper's TMA has no row gather);
//   warpgroups 1, 2  consumers: wgmma m64nNk16 from shared memory into fp32 registers,
//                    then the variant's epilogue straight from registers to global.
// They talk through a ring of `stages` shared-memory stages guarded by full/empty
// mbarriers. A stage holds one 64-wide K slice: A (block_m x 64) and kNumB weight tiles
// (block_n x 64 each: gate and up for the first GEMM, one w2 tile for the second).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "prime_kernels/mbarrier.cuh"
#include "prime_kernels/tma.cuh"
#include "prime_kernels/wgmma.cuh"
#include "tile_scheduler.cuh"

namespace prime_moe {

struct MoeGemmParams {
  const int32_t* sorted_token_ids;        // (max_padded,) pair index or -1
  const int32_t* expert_ids;              // (max_padded / block_m,)
  const int32_t* num_tokens_post_padded;  // (1,) device
  const __nv_bfloat16* x;                 // gather source (gate/up): (T, k_dim)
  const float* topk_weights;              // (T * k,) atomic epilogue
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
// Accumulator element (i, j, c) of WgmmaBf16's layout: row and column inside the
// warpgroup's 64 x N tile, for the calling thread.
__device__ __forceinline__ int acc_row(int i) {
  return ((threadIdx.x / 32) % 4) * 16 + (threadIdx.x % 32) / 4 + 8 * i;
}
__device__ __forceinline__ int acc_col(int j) {
  return 8 * j + 2 * (threadIdx.x % 4);
}

// Element f of the accumulators read as one flat array (f is a compile-time constant
// after unrolling, so this stays in registers).
template <int kMmas, int kRegs>
__device__ __forceinline__ float acc_at(const float (&acc)[kMmas][kRegs], int f) {
  return acc[f / kRegs][f % kRegs];
}

// True in every thread of the calling warpgroup when pred holds in any of its 128 threads
// (named barrier `id`, not 0, which __syncthreads uses).
__device__ __forceinline__ bool warpgroup_any(bool pred, int id) {
  uint32_t any;
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\n"
      "barrier.cta.red.or.pred q, %2, 128, p;\nselp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(uint32_t(pred)), "r"(id)
      : "memory");
  return any != 0;
}

template <int kBlockM_, int kBlockN_, class Variant>
struct MoeGemmConfig {
  static constexpr int kBlockM = kBlockM_;  // rows per expert block (moe_align's block_m)
  static constexpr int kBlockN = kBlockN_;  // rows of each weight tile (output columns)
  static constexpr int kNumB = Variant::kNumB;
  static constexpr bool kGatherA = Variant::kGatherA;
  static constexpr int kBlockK = 64;  // one 128-byte swizzle row of bf16
  static constexpr int kThreads = 384;
  // 64 rows per wgmma: with block_m = 128 each consumer takes 64 rows and all columns;
  // with block_m = 64 both take the 64 rows and half the columns each.
  static constexpr int kWgM = kBlockM / 64;
  static constexpr int kWgN = 2 / kWgM;
  static constexpr int kWgCols = kBlockN / kWgN;
  // With block_m = 128 a warpgroup's gate and up tiles sit back to back in shared memory,
  // so one m64n(2 * block_n) wgmma covers both (A is read once per K step, half the
  // instructions); with block_m = 64 the warpgroup's column halves are apart: one each.
  static constexpr bool kFuseB = kWgN == 1;
  static constexpr int kNumMma = kFuseB ? 1 : kNumB;
  static constexpr int kMmaN = kFuseB ? kNumB * kBlockN : kWgCols;
  static constexpr int kABytes = kBlockM * kBlockK * 2;
  static constexpr int kBBytes = kNumB * kBlockN * kBlockK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kTmaBytes = kBBytes + (kGatherA ? 0 : kABytes);
  // Gather: 8 threads per 128-byte row (one 16-byte chunk each), 16 rows per pass.
  static constexpr int kGatherRowsPerThread = kBlockM / 16;
  // Register split (sm_90a setmaxnreg): 128 * (40 + 2 * 232) = 64512 <= 65536. The
  // consumers hold up to 128 fp32 accumulators each (two 64x128 or one 64x256 tile).
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;

  static_assert(kBlockM == 64 || kBlockM == 128, "block_m is 64 or 128");
  static_assert(kMmaN == 32 || kMmaN == 64 || kMmaN == 128 || kMmaN == 256,
                "wgmma N must be one of the instantiated shapes");
  static_assert(kNumB * kBlockN <= 512 && kBlockN <= 256, "TMA box rows are at most 256");
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0,
                "stage buffers keep the 1024-byte alignment of the 128B swizzle atom");
  static_assert(kNumMma * prime_kernels::WgmmaBf16<kMmaN>::kAccRegs <= 128,
                "accumulators must fit the consumer register budget");

  static constexpr size_t smem_bytes(int stages) {
    return 1024 /* alignment slack */ + size_t(stages) * kStageBytes + 2 * stages * 8;
  }
};

template <class Cfg, class Variant>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    moe_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a,
                    const __grid_constant__ CUtensorMap tmap_b, const MoeGemmParams p) {
  using namespace prime_kernels;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int stages = p.stages;
  uint8_t* smem_a = smem;
  uint8_t* smem_b = smem + size_t(stages) * Cfg::kABytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_b + size_t(stages) * Cfg::kBBytes);
  uint64_t* empty = full + stages;

  const int warpgroup = threadIdx.x / 128;
  const int tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      // Gather: 128 cp.async arrivals + the TMA thread's expect_tx; else the TMA thread.
      mbarrier_init(&full[s], Cfg::kGatherA ? 129 : 1);
      mbarrier_init(&empty[s], 256);  // every consumer thread releases the stage
    }
    mbarrier_init_fence();
    tma_prefetch_descriptor(&tmap_b);
    if (!Cfg::kGatherA) tma_prefetch_descriptor(&tmap_a);
  }
  __syncthreads();

  const MoeTileScheduler sched(p.num_tokens_post_padded, p.max_padded, Cfg::kBlockM, p.n_dim,
                               Cfg::kBlockN);
  const int num_tiles = sched.num_tiles();
  const int num_k_blocks = p.k_dim / Cfg::kBlockK;

  if (warpgroup == 0) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (!Cfg::kGatherA && tid != 0) return;  // one thread issues all TMA copies
    const int chunk = tid & 7;
    const int pass_row = tid >> 3;
    // Hand-applied 128B swizzle: 16-byte chunk c of row r lands at chunk c ^ (r % 8).
    // pass_row + 16 i has the same r % 8 for every i, so the offset is per-thread.
    const uint32_t a_thread_offset = pass_row * 128 + ((chunk ^ (pass_row & 7)) << 4);
    int stage = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      int block, n_tile;
      sched.tile(t, block, n_tile);
      const int expert = p.expert_ids[block];
      if (expert < 0 || expert >= p.num_experts) continue;
      const int b_row = expert * p.b_rows_per_expert + n_tile * Cfg::kBlockN;

      // The thread's gathered rows, as 16-byte-chunk offsets into x (uint32: T*D < 2^35).
      uint32_t src_chunk[Cfg::kGatherRowsPerThread];
      uint32_t valid_mask = 0;
      if constexpr (Cfg::kGatherA) {
#pragma unroll
        for (int i = 0; i < Cfg::kGatherRowsPerThread; ++i) {
          const int row = block * Cfg::kBlockM + pass_row + 16 * i;
          const int pair = routed_pair(p, sched.npp, row);
          const uint32_t token = pair >= 0 ? uint32_t(pair / p.top_k) : 0u;
          src_chunk[i] = token * uint32_t(p.k_dim / 8) + chunk;
          valid_mask |= uint32_t(pair >= 0) << i;
          if (p.pair_to_row != nullptr && n_tile == 0 && chunk == 0 && pair >= 0)
            p.pair_to_row[pair] = row;
        }
      }
      for (int kb = 0; kb < num_k_blocks; ++kb) {
        mbarrier_wait(&empty[stage], phase ^ 1);
        const uint32_t full_bar = smem_addr(&full[stage]);
        if (tid == 0) {
          mbarrier_arrive_expect_tx(&full[stage], Cfg::kTmaBytes);
          const uint32_t b_dst = smem_addr(smem_b + size_t(stage) * Cfg::kBBytes);
#pragma unroll
          for (int b = 0; b < Cfg::kNumB; ++b)
            tma_load_2d(b_dst + b * Cfg::kBlockN * 128, &tmap_b, full_bar, kb * Cfg::kBlockK,
                        b_row + b * p.b_second_offset);
          if constexpr (!Cfg::kGatherA)
            tma_load_2d(smem_addr(smem_a + size_t(stage) * Cfg::kABytes), &tmap_a, full_bar,
                        kb * Cfg::kBlockK, block * Cfg::kBlockM);
        }
        if constexpr (Cfg::kGatherA) {
          const uint32_t a_dst = smem_addr(smem_a + size_t(stage) * Cfg::kABytes) + a_thread_offset;
          const uint4* src = reinterpret_cast<const uint4*>(p.x) + kb * (Cfg::kBlockK / 8);
#pragma unroll
          for (int i = 0; i < Cfg::kGatherRowsPerThread; ++i)
            cp_async_16_zfill(a_dst + i * 16 * 128, src + src_chunk[i], (valid_mask >> i) & 1);
          cp_async_mbarrier_arrive_noinc(&full[stage]);
        }
        if (++stage == stages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
  } else {
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    using Mma = WgmmaBf16<Cfg::kMmaN>;
    const int consumer = warpgroup - 1;
    const int m_offset = (consumer % Cfg::kWgM) * 64;
    const int n_offset = (consumer / Cfg::kWgM) * Cfg::kWgCols;
    // Flattened (see acc_at), the kNumMma accumulators are one 64 x (kNumB * kWgCols)
    // tile in WgmmaBf16's layout: column group j < J / 2 gate, the rest up.
    float acc[Cfg::kNumMma][Mma::kAccRegs];
    int stage = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      int block, n_tile;
      sched.tile(t, block, n_tile);
      const int expert = p.expert_ids[block];
      if (expert < 0 || expert >= p.num_experts) continue;
      // A 64-row half with no routed row (the padded tail of an expert's segment: most
      // rows at decode sizes) only passes its stages through: no wgmma, no stores. Its
      // h / y rows are then left unwritten, which is fine: nothing reads padding results.
      const int first_row = block * Cfg::kBlockM + m_offset;
      if (!warpgroup_any(routed_pair(p, sched.npp, first_row + tid % 64) >= 0, 1 + consumer)) {
        for (int kb = 0; kb < num_k_blocks; ++kb) {
          mbarrier_wait(&full[stage], phase);
          mbarrier_arrive(&empty[stage]);
          if (++stage == stages) {
            stage = 0;
            phase ^= 1;
          }
        }
        continue;
      }
      int prev_stage = 0;
      for (int kb = 0; kb < num_k_blocks; ++kb) {
        mbarrier_wait(&full[stage], phase);
        // cp.async wrote the A tile through the generic proxy; wgmma reads through the
        // async proxy.
        if constexpr (Cfg::kGatherA) fence_proxy_async_shared();
        const uint64_t desc_a =
            make_smem_desc_sw128(smem_a + size_t(stage) * Cfg::kABytes + m_offset * 128);
        const uint64_t desc_b =
            make_smem_desc_sw128(smem_b + size_t(stage) * Cfg::kBBytes + n_offset * 128);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < Cfg::kBlockK / 16; ++kk) {
#pragma unroll
          for (int b = 0; b < Cfg::kNumMma; ++b)
            Mma::mma(acc[b], desc_a + 2 * kk, desc_b + (b * Cfg::kBlockN * 128 >> 4) + 2 * kk,
                     (kb | kk) != 0);
        }
        wgmma_commit();
        // Keep this K slice's wgmmas in flight; the previous slice's are done, so its
        // stage goes back to the producer.
        wgmma_wait<1>();
        if (kb > 0) mbarrier_arrive(&empty[prev_stage]);
        prev_stage = stage;
        if (++stage == stages) {
          stage = 0;
          phase ^= 1;
        }
      }
      wgmma_wait<0>();
#pragma unroll
      for (int b = 0; b < Cfg::kNumMma; ++b) wgmma_fence_operands(acc[b]);
      mbarrier_arrive(&empty[prev_stage]);
      Variant::store(p, sched.npp, acc, first_row, n_tile * Cfg::kBlockN + n_offset);
    }
  }
}

}  // namespace prime_moe
