// Epilogues of the fused MoE GEMMs: from a consumer warpgroup's fp32 accumulators (the
// wgmma layout, several arrays read as one flat 64 x (kNumB * cols) tile) straight to
// global memory. Each says how many weight tiles per stage it consumes (kNumB), which the
// kernel checks against its tile.
//   SwiGluToH          gate/up: h = bf16(silu(g) * u) into the (max_padded, H) workspace;
//   StoreRows          down, split=true: y = bf16(acc) into the (max_padded, D) workspace,
//                      combined later in a fixed order (deterministic, combine.cuh);
//   WeightedAtomicAdd  down, split=false: out[token] += topk_weight * acc with bf16x2
//                      atomics (the caller zeroed out; the k contributions land in any order).
// (A shared-memory-staged TMA-store epilogue, the MXFP8 re-quantizing one and the SwiGLU
// backward are further parts of this file's kind.)
#pragma once

#include <cuda_bf16.h>

#include "moe_gemm_params.cuh"
#include "prime_kernels/wgmma.cuh"

namespace prime_moe {

struct SwiGluToH {
  static constexpr int kNumB = 2;  // gate tile, up tile

  // h rows are the padded-sorted rows; padding rows hold zeros (or nothing, in a skipped
  // half), which only padding rows of the down GEMM see.
  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store(const MoeGemmParams& p, int /*npp*/,
                                               const float (&acc)[kMmas][kRegs], int row0,
                                               int col0) {
    using namespace prime_kernels;
    constexpr int kHalf = kMmas * kRegs / 2;  // flat offset of the up columns
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      __nv_bfloat16* dst = p.out + size_t(row0 + wgmma_acc_row(i)) * p.ld_out;
#pragma unroll
      for (int j = 0; j < kHalf / 4; ++j) {
        const int col = col0 + wgmma_acc_col(j);
        if (col >= p.n_dim) continue;  // partial last n tile (H % block_n != 0)
        const float g0 = wgmma_acc_at(acc, 4 * j + 2 * i);
        const float g1 = wgmma_acc_at(acc, 4 * j + 2 * i + 1);
        const float u0 = wgmma_acc_at(acc, kHalf + 4 * j + 2 * i);
        const float u1 = wgmma_acc_at(acc, kHalf + 4 * j + 2 * i + 1);
        const float h0 = g0 / (1.0f + __expf(-g0)) * u0;
        const float h1 = g1 / (1.0f + __expf(-g1)) * u1;
        *reinterpret_cast<__nv_bfloat162*>(dst + col) = __floats2bfloat162_rn(h0, h1);
      }
    }
  }
};

struct StoreRows {
  static constexpr int kNumB = 1;

  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store(const MoeGemmParams& p, int /*npp*/,
                                               const float (&acc)[kMmas][kRegs], int row0,
                                               int col0) {
    using namespace prime_kernels;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      __nv_bfloat16* dst = p.out + size_t(row0 + wgmma_acc_row(i)) * p.ld_out;
#pragma unroll
      for (int j = 0; j < kMmas * kRegs / 4; ++j) {
        const int col = col0 + wgmma_acc_col(j);
        if (col >= p.n_dim) continue;  // partial last n tile (D % block_n != 0)
        *reinterpret_cast<__nv_bfloat162*>(dst + col) = __floats2bfloat162_rn(
            wgmma_acc_at(acc, 4 * j + 2 * i), wgmma_acc_at(acc, 4 * j + 2 * i + 1));
      }
    }
  }
};

struct WeightedAtomicAdd {
  static constexpr int kNumB = 1;

  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store(const MoeGemmParams& p, int npp,
                                               const float (&acc)[kMmas][kRegs], int row0,
                                               int col0) {
    using namespace prime_kernels;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int pair = routed_pair(p, npp, row0 + wgmma_acc_row(i));
      if (pair < 0) continue;
      const float weight = p.topk_weights[pair];
      __nv_bfloat16* dst = p.out + size_t(pair / p.top_k) * p.ld_out;
#pragma unroll
      for (int j = 0; j < kMmas * kRegs / 4; ++j) {
        const int col = col0 + wgmma_acc_col(j);
        if (col >= p.n_dim) continue;
        atomicAdd(reinterpret_cast<__nv_bfloat162*>(dst + col),
                  __floats2bfloat162_rn(weight * wgmma_acc_at(acc, 4 * j + 2 * i),
                                        weight * wgmma_acc_at(acc, 4 * j + 2 * i + 1)));
      }
    }
  }
};

}  // namespace prime_moe
