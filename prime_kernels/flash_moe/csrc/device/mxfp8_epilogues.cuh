// The MXFP8 forward's gate/up epilogue: SwiGLU, then h re-quantized to MXFP8 along H from its
// fp32 values, stored dequantized (exactly) as bf16 so the down GEMM reads h by TMA as in bf16;
// or (kE4m3Out: the register-A forward's 64 x 64 decode tiles, whose down GEMM multiplies e4m3 by
// e4m3, MoeGemmTileE4m3) stored as MXFP8 itself: the e4m3 bytes, and each block's scale as the fp32
// 2^(s - 127) (NaN for a NaN or +-Inf block) in out_scales (moe_gemm_params.cuh's layout).
//
//   SwiGluToMxfp8  h = silu(g) * u in fp32; per 32 consecutive columns of a row (one block of
//                  mxfp8.py, rounding "floor"): s = biased exponent of the block's amax - 8,
//                  clamped to [0, 254]; value = e4m3 (round to nearest even, saturating) of
//                  clamp(h * 2^(127 - s), +-448); h stored as bf16(value * 2^(s - 127)), which
//                  is exact above about 2^-130 (mxfp8_loaders.cuh). A block holding NaN or +-Inf is
//                  stored as NaN, as mxfp8.py's quantize then dequantize gives it.
//
// It takes either accumulator layout: the bf16 GEMM's (store: weights widened to bf16 by a
// pre-pass, tokens along wgmma's M) and the register-A GEMM's transposed one (store_transposed).
// The consumer's columns start on a multiple of 32 (block_n and its halves are), and so does H,
// so a block is never split. Padding rows hold zeros, as in SwiGluToH; in the transposed form rows
// past the tile's first n_tokens are not written (the down GEMM's tile of the same block does
// not multiply them).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "epilogues.cuh"
#include "moe_gemm_params.cuh"
#include "mxfp8_loaders.cuh"
#include "mxfp8_quantize.cuh"
#include "prime_kernels/mbarrier.cuh"
#include "schedulers.cuh"

namespace prime_moe {

template <bool kE4m3Out = false>
struct SwiGluToMxfp8 {
  static constexpr int kNumB = 2;  // gate tile, up tile
  static constexpr bool kWritesPaddingRows = false;

  // An h value's block scale and its stored (re-quantized, dequantized) bf16 pair, from the
  // block's largest biased exponent (0xFF: the block holds NaN or +-Inf).
  struct BlockScale {
    bool bad;
    float inv_scale, scale;
    __device__ __forceinline__ explicit BlockScale(uint32_t exp)
        : bad(exp == 0xFF),
          inv_scale(mxfp8_pow2(127 - max(int(exp) - 8, 0))),  // exp <= 254: s <= 246
          scale(mxfp8_pow2(max(int(exp) - 8, 0) - 127)) {}
    // The two e4m3 bytes (h0's the low one): what a bad block holds does not matter, its scale
    // is NaN.
    __device__ __forceinline__ uint32_t e4m3_pair(float h0, float h1) const {
      const float v0 = fminf(fmaxf(__fmul_rn(h0, inv_scale), -448.f), 448.f);
      const float v1 = fminf(fmaxf(__fmul_rn(h1, inv_scale), -448.f), 448.f);
      return __nv_cvt_float2_to_fp8x2(make_float2(v0, v1), __NV_SATFINITE, __NV_E4M3);
    }
    __device__ __forceinline__ float scale_value() const {
      return bad ? __int_as_float(0x7FC00000) : scale;
    }
    __device__ __forceinline__ uint32_t pair(float h0, float h1) const {
      return bad ? 0x7FC07FC0u : mxfp8_pair_to_bf16x2(e4m3_pair(h0, h1), scale);
    }
  };

  // silu(g) * u with the approximate divide, as SwiGluToH (within 2 ulp for g > -87): the IEEE
  // divide is a subroutine of ~20 instructions a value, run while the tensor cores wait. A few ulp
  // of fp32 h move its e4m3 rounding only when h lies that close to a rounding boundary (about one
  // value in 2^18 at e4m3's 3 mantissa bits).
  __device__ __forceinline__ static float swiglu(float g, float u) {
    return __fdividef(g, 1.0f + __expf(-g)) * u;
  }
  __device__ __forceinline__ static uint32_t biased_exponent(float v) {
    return (__float_as_uint(v) >> 23) & 0xFF;
  }

  // The bf16 GEMM's accumulators (tokens along M; the flat tile's first half the gate columns,
  // the second the up columns, as SwiGluToH). A row's 32-column group a is 8 values in each of
  // the quad's 4 lanes (2 adjacent columns per 8-column step): its amax exponent is the lane's
  // over two shuffles of the quad; then the rows' 16-byte stores (store_row_groups).
  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store(const MoeGemmParams& p, int /*npp*/,
                                               const float (&acc)[kMmas][kRegs], bool /*acc_valid*/,
                                               const MoeWorkTile& /*w*/, int row0, int col0) {
    using namespace prime_kernels;
    static_assert(!kE4m3Out, "an e4m3 h is the register-A forward's (store_transposed)");
    constexpr int kHalf = kMmas * kRegs / 2;  // flat offset of the up columns
    static_assert(kHalf * 2 % 32 == 0, "whole 32-column groups per warpgroup");
    // 32-column groups (MXFP8 blocks) of the gate half
    store_row_groups<kHalf * 2 / 32>(p, row0, col0, [&](int i, int a, uint32_t(&v)[4]) {
      float h[8];
      uint32_t exp = 0;
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const int f = 4 * (4 * a + t) + 2 * i;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          h[2 * t + c] = swiglu(wgmma_acc_at(acc, f + c), wgmma_acc_at(acc, kHalf + f + c));
          exp = max(exp, biased_exponent(h[2 * t + c]));
        }
      }
      exp = max(exp, __shfl_xor_sync(0xFFFFFFFFu, exp, 1));
      exp = max(exp, __shfl_xor_sync(0xFFFFFFFFu, exp, 2));
      const BlockScale block(exp);
#pragma unroll
      for (int t = 0; t < 4; ++t) v[t] = block.pair(h[2 * t], h[2 * t + 1]);
      quad_transpose(v);
    });
  }

  // Register-A accumulators (RegisterAConsumers, tokens along wgmma's N). Two row layouts: split
  // rows (kMmas = 2: acc[0] the gate rows h = 16 w + g + 8 i, acc[1] the up rows of the same h,
  // in the same registers) and interleaved (kMmas = 1: row half i = 0 the gate and i = 1 the up
  // row of h = 8 w + g). After transposed_pair a lane holds,
  // per j, one token's h at 2 adjacent columns per row half; the 32 columns of that token's
  // MXFP8 block are those of lanes l ^ 8, l ^ 16 (the warp's other column pairs) and of the same
  // lane in warp w ^ 1 (split: 16 columns a warp) or in all 4 warps (interleaved: 8 a warp).
  // The block's amax is taken on biased exponents (the largest |h| has the largest exponent
  // field; 0xFF is NaN/Inf, as `bad`), 4 tokens a word: __vmaxu4 over two shuffles, then through
  // 128 bytes of shared memory per warp (scratch) and a named barrier of the warpgroup
  // (barrier_id). Tokens are independent, so this runs per 4 token steps (32 tokens), with h
  // in registers for those only: with all of a 64-token tile's h live across the barrier, the
  // two-CTA tile's 104 consumer registers spilled (ptxas).
  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store_transposed(const MoeGemmParams& p, int /*npp*/,
                                                          const float (&acc)[kMmas][kRegs],
                                                          uint32_t nan_rows,
                                                          const MoeWorkTile& /*w*/, int row0,
                                                          int col0, uint8_t* scratch,
                                                          int barrier_id, int n_tokens) {
    using namespace prime_kernels;
    static_assert(kMmas == 1 || kMmas == 2, "interleaved gate/up rows, or a gate and an up block");
    constexpr bool kInterleaved = kMmas == 1;
    // An e4m3 h from block_n = 64 tiles only: a warpgroup's 32 columns are then one MX block.
    static_assert(!kE4m3Out || kInterleaved, "an e4m3 h comes from the interleaved tile");
    constexpr int kHalves = kInterleaved ? 1 : 2;    // row halves of h a thread holds
    constexpr int kSteps = kRegs / 4;                // token steps j (8 tokens each)
    constexpr int kGroup = kSteps < 4 ? kSteps : 4;  // steps per exchange: a word of exponents
    static_assert(kSteps % kGroup == 0, "whole groups of token steps");
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    // h is NaN where its gate or up weight row held an e4m3 NaN byte (nan_rows: interleaved,
    // gate in row r0 and up in r1; else gate in block 0 and up in block 1, row i). Worked out
    // once per tile: testing nan_rows per value kept it live and spilled the 128-wide tile.
    bool nan_h[kHalves];
#pragma unroll
    for (int i = 0; i < kHalves; ++i) nan_h[i] = (nan_rows & (kInterleaved ? 3u : 5u << i)) != 0;
    uint32_t* words = reinterpret_cast<uint32_t*>(scratch);
#pragma unroll
    for (int j0 = 0; j0 < kSteps; j0 += kGroup) {
      // Tokens the mainloop did not multiply (n_tokens is the warpgroup's: the shuffles and
      // barriers below stay whole-warpgroup): no SwiGLU, no store. At decode sizes that is 7 of
      // 8 steps of a 128-row block (n_tokens = 16).
      if (8 * j0 >= n_tokens) break;
      float2 h[kGroup][kHalves];
      uint32_t e = 0;
#pragma unroll
      for (int s = 0; s < kGroup; ++s) {
        const int j = j0 + s;
        if (8 * j >= n_tokens) break;  // its exponent byte stays 0
        uint32_t ej = 0;
#pragma unroll
        for (int i = 0; i < kHalves; ++i) {
          // SwiGLU in the accumulators' layout, then one exchange for h (not one for g and u).
          float hc[2];
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float g = kInterleaved ? acc[0][4 * j + c] : acc[0][4 * j + 2 * i + c];
            const float u =
                kInterleaved ? acc[0][4 * j + 2 + c] : acc[kMmas - 1][4 * j + 2 * i + c];
            hc[c] = nan_h[i] ? __int_as_float(0x7FC00000) : swiglu(g, u);
          }
          h[s][i] = transposed_pair(hc[0], hc[1]);
          ej = max(ej, max(biased_exponent(h[s][i].x), biased_exponent(h[s][i].y)));
        }
        e |= ej << (8 * s);
      }
      e = __vmaxu4(e, __shfl_xor_sync(0xFFFFFFFFu, e, 8));
      e = __vmaxu4(e, __shfl_xor_sync(0xFFFFFFFFu, e, 16));
      if ((lane & 24) == 0) words[warp * 8 + lane] = e;
      named_barrier_sync(barrier_id, 128);
#pragma unroll
      for (int other = 0; other < 4; ++other) {
        if (!kInterleaved && other >> 1 != warp >> 1) continue;  // split: the warp pair only
        e = __vmaxu4(e, words[other * 8 + (lane & 7)]);
      }
      named_barrier_sync(barrier_id, 128);  // read: the next group or tile may write the scratch
#pragma unroll
      for (int s = 0; s < kGroup; ++s) {
        const int j = j0 + s;
        if (8 * j >= n_tokens) break;  // tokens the mainloop did not multiply: not stored
        const BlockScale block((e >> (8 * s)) & 0xFF);
        const int row = row0 + transposed_token(j);
        if constexpr (kE4m3Out) {
          // Lanes 0-7 of warp 0 hold the step's 8 tokens at the block's first columns.
          const int col = col0 + 8 * warp + ((lane / 4) & ~1);
          if (col >= p.n_dim) continue;
          uint8_t* dst = reinterpret_cast<uint8_t*>(p.out) + size_t(row) * p.ld_out;
          *reinterpret_cast<uint16_t*>(dst + col) = uint16_t(block.e4m3_pair(h[s][0].x, h[s][0].y));
          if (warp == 0 && lane < 8)
            p.out_scales[h_scale_index(row, col0 / 32, p.n_dim)] = block.scale_value();
        } else {
          __nv_bfloat16* dst = p.out + size_t(row) * p.ld_out;
#pragma unroll
          for (int i = 0; i < kHalves; ++i) {
            const int col =
                col0 + (kInterleaved ? 8 * warp + ((lane / 4) & ~1) : transposed_column(i));
            if (col >= p.n_dim) continue;  // partial last n tile (H % block_n != 0)
            *reinterpret_cast<uint32_t*>(dst + col) = block.pair(h[s][i].x, h[s][i].y);
          }
        }
      }
    }
  }
};

}  // namespace prime_moe
