// The MXFP8 forward's gate/up epilogue: SwiGLU, then h re-quantized to MXFP8 along H from its
// fp32 values, stored dequantized (exactly) as bf16 so the down GEMM reads h by TMA as in bf16.
//
//   SwiGluToMxfp8  h = silu(g) * u in fp32; per 32 consecutive columns of a row (one block of
//                  mxfp8.py, rounding "floor"): s = biased exponent of the block's amax - 8,
//                  clamped to [0, 254]; value = e4m3 (round to nearest even, saturating) of
//                  clamp(h * 2^(127 - s), +-448); h stored as bf16(value * 2^(s - 127)), which
//                  is exact down to 2^-133 (mxfp8_loaders.cuh). A block holding NaN or +-Inf is
//                  stored as NaN, as mxfp8.py's quantize then dequantize gives it.
//
// In the wgmma accumulator layout a row's 32 columns of one block (registers 4 j + 2 i + c for j
// in [4 a, 4 a + 4)) are spread over the 4 lanes of a quad, 8 per lane: the block's amax and its
// NaN flag are the lane's own, then two butterfly shuffles. The consumer's columns start on a
// multiple of 32 (block_n and its halves are), and so does H, so a block is never split.
// Padding rows hold zeros, as in SwiGluToH.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "moe_gemm_params.cuh"
#include "mxfp8_loaders.cuh"
#include "mxfp8_quantize.cuh"
#include "prime_kernels/wgmma.cuh"
#include "schedulers.cuh"

namespace prime_moe {

struct SwiGluToMxfp8 {
  static constexpr int kNumB = 2;  // gate tile, up tile
  static constexpr bool kWritesPaddingRows = false;

  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store(const MoeGemmParams& p, int /*npp*/,
                                               const float (&acc)[kMmas][kRegs], bool /*acc_valid*/,
                                               const MoeWorkTile& /*w*/, int row0, int col0) {
    using namespace prime_kernels;
    constexpr int kHalf = kMmas * kRegs / 2;  // flat offset of the up columns
    constexpr int kBlocks = kHalf / 16;       // 32-column blocks: 16 registers each (2 rows)
    static_assert(kHalf % 16 == 0, "whole 32-column blocks");
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const size_t row = size_t(row0 + wgmma_acc_row(i));
      __nv_bfloat16* dst = p.out + row * p.ld_out;
#pragma unroll
      for (int a = 0; a < kBlocks; ++a) {
        float h[8];
        float amax = 0.f;
        bool finite = true;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int j = 4 * a + t;
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float g = wgmma_acc_at(acc, 4 * j + 2 * i + c);
            const float u = wgmma_acc_at(acc, kHalf + 4 * j + 2 * i + c);
            const float v = g / (1.0f + __expf(-g)) * u;
            h[2 * t + c] = v;
            finite &= isfinite(v);
            amax = fmaxf(amax, fabsf(v));
          }
        }
        // The quad's lanes hold the block's 32 columns; every lane runs the shuffles.
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
        uint32_t bad = finite ? 0u : 1u;
        bad |= __shfl_xor_sync(0xFFFFFFFFu, bad, 1);
        bad |= __shfl_xor_sync(0xFFFFFFFFu, bad, 2);
        const int s = min(max(int((__float_as_uint(amax) >> 23) & 0xFF) - 8, 0), 254);
        const float inv_scale = mxfp8_pow2(127 - s);
        const float scale = mxfp8_pow2(s - 127);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int col = col0 + wgmma_acc_col(4 * a + t);
          if (col >= p.n_dim) continue;  // partial last n tile (H % block_n != 0)
          const float v0 = fminf(fmaxf(__fmul_rn(h[2 * t], inv_scale), -448.f), 448.f);
          const float v1 = fminf(fmaxf(__fmul_rn(h[2 * t + 1], inv_scale), -448.f), 448.f);
          const __nv_fp8x2_storage_t two =
              __nv_cvt_float2_to_fp8x2(make_float2(v0, v1), __NV_SATFINITE, __NV_E4M3);
          const uint32_t word = bad ? 0x7FC07FC0u : mxfp8_pair_to_bf16x2(two, scale);
          *reinterpret_cast<uint32_t*>(dst + col) = word;
        }
      }
    }
  }
};

}  // namespace prime_moe
