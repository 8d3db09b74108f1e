// The MXFP8 weight loader of the fused MoE GEMMs (Mxfp8WeightTiles) and the exact e4m3 x e8m0
// -> bf16 conversions that the consumers' register widening (mxfp8_fragment.cuh), the epilogues
// and the x pre-pass (mxfp8_dequantize.cuh) share.
//
// Why bf16 and not fp8 wgmma: Hopper has no block-scaled MMA, and applying a scale per 32 K
// elements to fp8 wgmma results means promoting the accumulators after every wgmma (an e4m3
// wgmma's K is 32), whose FP32 work at prefill tiles rivals the tensor time; and the tensor
// core's sum of a wgmma's 32 fp8 products is not fp32-exact: a decode gate/up kernel built that
// way measured 3.0-3.2e-3 against the exact-MX emulation, over the contract's 3e-3
// (docs/flash_moe_mxfp8_design.md section 5). Every e4m3 value times a power-of-two scale
// is exact in bf16 (3 mantissa bits in 7; bf16 has fp32's exponent range), except products
// below about 2^-130, where bf16's subnormals (steps of 2^-133) hold fewer than e4m3's 4
// significant bits (an e4m3 subnormal at scale 2^-127 and the like): those round to nearest
// even, as the reference rounds them. So the weights travel as fp8 (half of bf16's bytes) and are
// widened to bf16 in the consumers' registers, as wgmma's register A operand (out^T = w x^T).
//
// Scales: expert e's (MN, K/32) scales in the blocked layout (mxfp8.pack_scales_blocked): scale
// (r, c) at byte ((r / 128) * (K/32 / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 +
// c % 4 of its MN * K/32 bytes. A 128-wide K step kb uses the four columns of column tile kb: one
// 512-byte block per 128 weight rows per step. A tile row past MN (the last n tile of the down
// GEMM when D % kBlockN != 0) reads the expert's last block instead: those weight rows only make
// output columns the epilogue drops.
//
// History (H200, benchmarks/flash_moe.py): the previous loader widened the fp8 to bf16 tiles in
// shared memory for the bf16 mainloop. It was exact but ran at 0.56-0.67x of bf16's speed
// (Qwen3-30B-A3B, DeepSeek-V3-32, Mixtral-8x7B, T = 64 to 32768), its fp8 bytes moved at 28-31%
// of the copy rate at T = 64, and the widening's shared memory reads and writes saturated the
// SM's shared memory; the register-A path reads the fp8 once and never writes it back.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstddef>
#include <cstdint>

#include "loaders.cuh"
#include "moe_gemm_params.cuh"
#include "mxfp8_quantize.cuh"
#include "prime_kernels/mbarrier.cuh"
#include "prime_kernels/tma.cuh"
#include "prime_kernels/wgmma.cuh"
#include "schedulers.cuh"

namespace prime_moe {

// 2^(s - 127) for an e8m0 byte s; NaN for s = 0xFF (the whole block is NaN, as mxfp8.py).
__device__ __forceinline__ float mxfp8_scale_value(uint32_t s) {
  return s == kE8m0Nan ? __int_as_float(0x7FC00000) : mxfp8_pow2(int(s) - 127);
}

// Two e4m3 values (the low byte first) times `scale`, as a bf16x2 word (the low half first):
// e4m3 -> fp16 -> fp32 are exact, the product is exact in fp32 (a power-of-two scale; no flush
// to zero in this build), the bf16 rounding is exact above about 2^-130 (steps of 2^-133 below).
__device__ __forceinline__ uint32_t mxfp8_pair_to_bf16x2(uint32_t two, float scale) {
  const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two), __NV_E4M3);
  const float2 f = __half22float2(__half2(raw));
  const __nv_bfloat162 b = __floats2bfloat162_rn(__fmul_rn(f.x, scale), __fmul_rn(f.y, scale));
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Eight e4m3 bytes (uint2, element 0 in the low byte) times `scale` as eight bf16 (uint4).
__device__ __forceinline__ uint4 mxfp8_widen8(uint2 v, float scale) {
  return make_uint4(
      mxfp8_pair_to_bf16x2(v.x & 0xFFFF, scale), mxfp8_pair_to_bf16x2(v.x >> 16, scale),
      mxfp8_pair_to_bf16x2(v.y & 0xFFFF, scale), mxfp8_pair_to_bf16x2(v.y >> 16, scale));
}

// Sixteen e4m3 bytes (uint4, element 0 in the low byte) times `scale` as sixteen bf16 in dst[0..1].
__device__ __forceinline__ void mxfp8_widen16(uint4 v, float scale, uint4* dst) {
  dst[0] = mxfp8_widen8(make_uint2(v.x, v.y), scale);
  dst[1] = mxfp8_widen8(make_uint2(v.z, v.w), scale);
}

// The weight loader of the MXFP8 GEMMs' tiles: thread 0 copies the step's raw e4m3 weight tiles
// by TMA and the step's scale blocks (bulk copies) straight into the stage. For the register-A
// tiles (MoeGemmTileRS, RegisterAConsumers) the tiles are 64 bytes wide with the 64-byte swizzle
// (the consumers' 2-byte fragment reads of 8 rows hit 8 distinct bank groups,
// mxfp8_fragment.cuh; a 128-wide K step is two such tiles each) and the consumers widen them in
// registers; for the e4m3 tile (MoeGemmTileE4m3) one 128-byte row a weight row with the 128-byte
// swizzle, which fp8 wgmma reads by descriptor. No producer threads
// besides thread 0: the ring itself is the fp8 in flight (65 KB stages of 128 K at 128 tokens x
// 256 weight rows, 3 of them). Tile b of expert e starts at row e * b_rows_per_expert +
// n0 + b * b_second_offset of the (E * b_rows_per_expert, K) e4m3 view; a tile row past the
// expert's rows reads the last scale block (its output columns are dropped).
template <class Tile>
struct Mxfp8WeightTiles : TmaLoader {
  using Layout = prime_kernels::SmemKMajor;  // not read: the consumers address the bytes
  static constexpr uint32_t kTmaBytes = Tile::kWeightBytes + Tile::kScaleBytes;

  const uint8_t* scales = nullptr;  // the expert's blocked scales
  int value_row = 0;                // tile 0's first row in the (E * rows, K) view
  int n0 = 0;

  using TmaLoader::TmaLoader;

  __device__ __forceinline__ void start_tile(const MoeGemmParams& p, int /*npp*/,
                                             const MoeWorkTile& w) {
    value_row = w.expert * p.b_rows_per_expert + w.n0;
    n0 = w.n0;
    scales = p.b_scales + size_t(w.expert) * size_t(p.b_rows_per_expert) * size_t(p.k_dim / 32);
  }

  __device__ __forceinline__ void load(const MoeGemmParams& p, const CUtensorMap* map,
                                       uint8_t* smem_b, uint64_t* full, int kb) const {
    using namespace prime_kernels;
    const uint32_t dst = smem_addr(smem_b);
    const uint32_t bar = smem_addr(full);
    const int row_tiles = p.b_rows_per_expert / 128;
    const int col_tiles = p.k_dim / 128;  // (K/32) / 4 scale column tiles
    static_assert(Tile::kBlockK == 128, "a stage's scales are one 512-byte block's columns");
#pragma unroll
    for (int b = 0; b < Tile::kNumB; ++b) {
#pragma unroll
      for (int atom = 0; atom < Tile::kWeightAtoms; ++atom)
        tma_load_2d(dst + atom * Tile::kWeightAtomBytes + b * Tile::kBlockN * Tile::kWeightAtomK,
                    map, bar, kb * Tile::kBlockK + Tile::kWeightAtomK * atom,
                    value_row + b * p.b_second_offset);
      const int row_tile = (n0 + b * p.b_second_offset) / 128;
#pragma unroll
      for (int j = 0; j < Tile::kScaleBlocks; ++j) {
        const int t = min(row_tile + j, row_tiles - 1);
        bulk_copy_g2s(dst + Tile::kWeightBytes + (b * Tile::kScaleBlocks + j) * 512,
                      scales + (size_t(t) * col_tiles + kb) * 512, 512, bar);
      }
    }
  }
};

}  // namespace prime_moe
