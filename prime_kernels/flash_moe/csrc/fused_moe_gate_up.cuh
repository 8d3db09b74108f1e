// Gate/up GEMM of the bf16 fused MoE: per (expert block, n tile), the block's token rows
// gathered from x times the gate rows [n0, n0 + block_n) and the up rows H + [n0, ...) of
// w[e], two fp32 accumulators, and the SwiGLU epilogue h = bf16(silu(g) * u).
#pragma once

#include "fused_moe_mainloop.cuh"

namespace prime_moe {

struct GateUpSwiglu {
  static constexpr int kNumB = 2;          // gate tile, up tile
  static constexpr bool kGatherA = true;   // A rows are tokens of x, gathered

  // h rows are the padded-sorted rows (workspace, max_padded x H); padding rows hold zeros
  // (or nothing, in a skipped half), which only padding rows of the down GEMM see.
  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store(const MoeGemmParams& p, int /*npp*/,
                                               const float (&acc)[kMmas][kRegs], int row0,
                                               int col0, uint8_t* scratch) {
    constexpr int kHalf = kMmas * kRegs / 2;  // flat offset of the up columns
    auto swiglu = [&](int i, int j) {
      const float g0 = acc_at(acc, 4 * j + 2 * i), g1 = acc_at(acc, 4 * j + 2 * i + 1);
      const float u0 = acc_at(acc, kHalf + 4 * j + 2 * i);
      const float u1 = acc_at(acc, kHalf + 4 * j + 2 * i + 1);
      return __floats2bfloat162_rn(g0 / (1.0f + __expf(-g0)) * u0,
                                   g1 / (1.0f + __expf(-g1)) * u1);
    };
    store_warp_rows_bf16<kHalf / 4>(p.out, p.ld_out, row0 + acc_warp_row(), col0,
                                    p.n_dim, scratch, swiglu);
  }
};

}  // namespace prime_moe
