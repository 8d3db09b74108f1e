// Gate/up GEMM of the bf16 fused MoE: per (expert block, n tile), the block's token rows
// gathered from x times the gate rows [n0, n0 + block_n) and the up rows H + [n0, ...) of
// w[e], two fp32 accumulators, and the SwiGLU epilogue h = bf16(silu(g) * u).
#pragma once

#include "fused_moe_mainloop.cuh"

namespace prime_moe {

struct GateUpSwiglu {
  static constexpr int kNumB = 2;         // gate tile, up tile
  static constexpr bool kGatherA = true;  // A rows are tokens of x, gathered

  // h rows are the padded-sorted rows (workspace, max_padded x H); padding rows hold zeros
  // (or nothing, in a skipped half), which only padding rows of the down GEMM see.
  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store(const MoeGemmParams& p, int /*npp*/,
                                               const float (&acc)[kMmas][kRegs], int row0,
                                               int col0) {
    constexpr int kHalf = kMmas * kRegs / 2;  // flat offset of the up columns
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      __nv_bfloat16* dst = p.out + size_t(row0 + acc_row(i)) * p.ld_out;
#pragma unroll
      for (int j = 0; j < kHalf / 4; ++j) {
        const int col = col0 + acc_col(j);
        if (col >= p.n_dim) continue;  // partial last n tile (H % block_n != 0)
        const float g0 = acc_at(acc, 4 * j + 2 * i), g1 = acc_at(acc, 4 * j + 2 * i + 1);
        const float u0 = acc_at(acc, kHalf + 4 * j + 2 * i);
        const float u1 = acc_at(acc, kHalf + 4 * j + 2 * i + 1);
        const float h0 = g0 / (1.0f + __expf(-g0)) * u0;
        const float h1 = g1 / (1.0f + __expf(-g1)) * u1;
        *reinterpret_cast<__nv_bfloat162*>(dst + col) = __floats2bfloat162_rn(h0, h1);
      }
    }
  }
};

}  // namespace prime_moe
