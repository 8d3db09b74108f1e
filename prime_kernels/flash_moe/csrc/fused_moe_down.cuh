// Down GEMM of the bf16 fused MoE: per (expert block, n tile), h rows (TMA from the
// workspace) times the w2[e] rows [n0, n0 + block_n). Two epilogues:
//   DownStore  (split=true):  y = bf16(acc) into the (max_padded, D) workspace, combined
//                             later in a fixed order (deterministic);
//   DownAtomic (split=false): out[token] += topk_weight * acc with bf16x2 atomics (the
//                             caller zeroed out; the k contributions land in any order).
#pragma once

#include "fused_moe_mainloop.cuh"

namespace prime_moe {

struct DownStore {
  static constexpr int kNumB = 1;
  static constexpr bool kGatherA = false;

  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store(const MoeGemmParams& p, int /*npp*/,
                                               const float (&acc)[kMmas][kRegs], int row0,
                                               int col0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      __nv_bfloat16* dst = p.out + size_t(row0 + acc_row(i)) * p.ld_out;
#pragma unroll
      for (int j = 0; j < kMmas * kRegs / 4; ++j) {
        const int col = col0 + acc_col(j);
        if (col >= p.n_dim) continue;  // partial last n tile (D % block_n != 0)
        *reinterpret_cast<__nv_bfloat162*>(dst + col) =
            __floats2bfloat162_rn(acc_at(acc, 4 * j + 2 * i), acc_at(acc, 4 * j + 2 * i + 1));
      }
    }
  }
};

struct DownAtomic {
  static constexpr int kNumB = 1;
  static constexpr bool kGatherA = false;

  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store(const MoeGemmParams& p, int npp,
                                               const float (&acc)[kMmas][kRegs], int row0,
                                               int col0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int pair = routed_pair(p, npp, row0 + acc_row(i));
      if (pair < 0) continue;
      const float weight = p.topk_weights[pair];
      __nv_bfloat16* dst = p.out + size_t(pair / p.top_k) * p.ld_out;
#pragma unroll
      for (int j = 0; j < kMmas * kRegs / 4; ++j) {
        const int col = col0 + acc_col(j);
        if (col >= p.n_dim) continue;
        atomicAdd(reinterpret_cast<__nv_bfloat162*>(dst + col),
                  __floats2bfloat162_rn(weight * acc_at(acc, 4 * j + 2 * i),
                                        weight * acc_at(acc, 4 * j + 2 * i + 1)));
      }
    }
  }
};

}  // namespace prime_moe
