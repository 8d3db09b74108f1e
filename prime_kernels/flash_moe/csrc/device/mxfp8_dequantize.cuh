// The MXFP8 forward's widening pre-passes: e4m3 (rows, K) values and their e8m0 scales (one per
// 32 consecutive elements of a row) to a bf16 (rows, K) workspace, each element
// value * 2^(s - 127), exact above about 2^-130 (mxfp8_loaders.cuh); a scale byte 0xFF makes its
// block NaN, an e4m3 NaN byte its element.
//   x (except for the decode tiles' f16 gate/up loop: mxfp8_x_to_f16_kernel, below): row-major
//     scales. The gate/up GEMM then gathers token rows from the workspace as the bf16 forward
//     gathers them from x: the gather is per row and needs no per-K-step scale, and x (T x D) is
//     small next to the weights it meets.
//   w, w2 (prefill sizes, fused_moe_mxfp8.cu): scales in the blocked layout per group of n_rows
//     rows (an expert's 2H or D). Each weight element is widened once, however many token blocks
//     meet it; the bf16 GEMMs then read the widened weights by TMA.
//
// mxfp8_dequantize_kernel: a thread per 16 elements (a grid-stride loop past the launcher's grid):
// a 16-byte load, its scale byte (flat element e has scale e / 32, since K % 32 == 0), two 16-byte
// stores. Memory-bound.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mxfp8_fragment.cuh"
#include "mxfp8_loaders.cuh"
#include "mxfp8_quantize.cuh"
#include "prime_kernels/grid_dependency.cuh"

namespace prime_moe {

constexpr int kMxfp8DequantizeThreads = 256;

struct Mxfp8DequantizeParams {
  const uint8_t* values;  // (rows, K) e4m3, 16-byte aligned
  const uint8_t* scales;  // (rows, K/32) e8m0: row-major, or blocked per group of n_rows rows
  __nv_bfloat16* out;     // (rows, K), 16-byte aligned
  int64_t chunks;         // rows * K / 16
  int k_blocks;           // K / 32
  int n_rows;             // blocked: rows per group (n_rows % 128 == 0, k_blocks % 4 == 0)
};

template <bool kBlocked>
__global__ void __launch_bounds__(kMxfp8DequantizeThreads)
    mxfp8_dequantize_kernel(const Mxfp8DequantizeParams p) {
  for (int64_t c = int64_t(blockIdx.x) * kMxfp8DequantizeThreads + threadIdx.x; c < p.chunks;
       c += int64_t(gridDim.x) * kMxfp8DequantizeThreads) {
    const uint4 v = reinterpret_cast<const uint4*>(p.values)[c];
    const int64_t block = c / 2;  // the chunk's scale block, in row-major order
    int64_t scale_offset = block;
    if constexpr (kBlocked) {
      const int64_t row = block / p.k_blocks;
      const int64_t group = row / p.n_rows;
      scale_offset = group * p.n_rows * p.k_blocks +
                     mxfp8_blocked_offset(int(row % p.n_rows), int(block % p.k_blocks), p.k_blocks);
    }
    mxfp8_widen16(v, mxfp8_scale_value(p.scales[scale_offset]),
                  reinterpret_cast<uint4*>(p.out) + 2 * c);
  }
}

// x for the register-A forward's decode gate/up tile (ForwardKernels::kF16GateUp) instead: its
// e4m3 values as f16 into out, each 32-wide block's elements in the order the gate/up loop reads
// its weight bytes (mxfp8_f16_position), and per block an fp32 factor into out_scales, which the
// gate/up GEMM applies to the block's sum (WarpgroupMainloopF16).
//
// Each token is rebased where that is exact: its base b is the largest scale among its blocks
// that hold a nonzero value or a NaN scale, each such block's values are written times
// 2^(s - b) and every factor of the token is -2^(b - 127) (negative: the mark the gate/up loop
// tests). An e4m3 value is a multiple of 2^-9 below 2^9 with at most 4 significant bits, so
// times 2^d it is an f16 exactly while d >= -15 (f16's subnormals step by 2^-24): rebased where
// every such block's scale lies within 15 of b. The token's sums then need no factor per block,
// only 2^(b - 127) once at the end, which saves the gate/up loop a multiply and a scale read per
// accumulator and block. Other tokens (scales further apart) keep their values unscaled and the
// factors 2^(s - 127) (NaN for 0xFF) per block, as before. Zero blocks are written as zeros
// either way. The base and the spread of a token's scales are warp reductions.
struct Mxfp8XToF16Params {
  const uint8_t* values;  // (T, D) e4m3, 16-byte aligned
  const uint8_t* scales;  // (T, D/32) e8m0, row-major
  uint16_t* out;          // (T, D) f16, 16-byte aligned
  float* out_scales;      // (T, D/32)
  int64_t tokens;         // T
  int k_blocks;           // D / 32
  uint32_t* rows_ready;   // the forward's rows-ready counters (moe_gemm.cuh), zeroed here
  int64_t rows_ready_tiles;
};

// Most a rebased block's scale may lie below its token's base (the comment above).
constexpr uint32_t kMxfp8F16RebaseSpan = 15;

__device__ __forceinline__ bool mxfp8_block_counts(const uint4& v0, const uint4& v1,
                                                   uint32_t scale) {
  const uint32_t bits = v0.x | v0.y | v0.z | v0.w | v1.x | v1.y | v1.z | v1.w;
  return (bits & 0x7F7F7F7Fu) != 0 || scale == 0xFFu;  // a nonzero value, or a NaN block
}

// A warp per token; 4 warps a CTA, so that a decode call's few tokens spread over as many SMs as
// the thread-per-block pass before it took (T = 64: 16). A lane holds kMxfp8XToF16Held blocks
// at a time, loaded together, so that finding the base costs one trip to memory, not one per
// block (H100, ncu, Qwen3-30B-A3B T = 64: 5.9 us with a block at a time, against 4.6 for the
// thread-per-block pass); the writing pass reads them again, from L1.
constexpr int kMxfp8XToF16Threads = 128;
constexpr int kMxfp8XToF16Held = 4;

__global__ void __launch_bounds__(kMxfp8XToF16Threads)
    mxfp8_x_to_f16_kernel(const Mxfp8XToF16Params p) {
  // Launched as a programmatic dependent at decode sizes (fused_moe_mxfp8.cu): x may come from
  // the kernel before it, whose writes are visible only past this wait. The gate/up GEMM, its own
  // dependent, may launch from here on: its CTAs set up under this kernel and wait for its end
  // before they read x.
  prime_kernels::grid_dependency_wait();
  // Zeroed before this kernel ends: the gate/up GEMM counts into them only past its wait for it,
  // and the down GEMM, launched after that wait, reads them.
  for (int64_t i = int64_t(blockIdx.x) * kMxfp8XToF16Threads + threadIdx.x; i < p.rows_ready_tiles;
       i += int64_t(gridDim.x) * kMxfp8XToF16Threads)
    p.rows_ready[i] = 0;
  prime_kernels::launch_dependent_grids();
  constexpr int kWarps = kMxfp8XToF16Threads / 32;
  const int lane = threadIdx.x % 32;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; t < p.tokens;
       t += int64_t(gridDim.x) * kWarps) {
    const uint4* values = reinterpret_cast<const uint4*>(p.values) + t * p.k_blocks * 2;
    const uint8_t* scales = p.scales + t * p.k_blocks;
    uint32_t base = 0, lowest = 0xFFu;
    for (int kb0 = lane; kb0 < p.k_blocks; kb0 += 32 * kMxfp8XToF16Held) {
      uint4 v[kMxfp8XToF16Held][2];
      uint32_t s[kMxfp8XToF16Held];
#pragma unroll
      for (int i = 0; i < kMxfp8XToF16Held; ++i) {
        const int kb = kb0 + 32 * i;
        const bool in = kb < p.k_blocks;
        v[i][0] = in ? values[2 * kb] : make_uint4(0, 0, 0, 0);
        v[i][1] = in ? values[2 * kb + 1] : make_uint4(0, 0, 0, 0);
        s[i] = in ? scales[kb] : 0u;
      }
#pragma unroll
      for (int i = 0; i < kMxfp8XToF16Held; ++i) {
        if (mxfp8_block_counts(v[i][0], v[i][1], s[i])) {
          base = max(base, s[i]);
          lowest = min(lowest, s[i]);
        }
      }
    }
    base = __reduce_max_sync(0xFFFFFFFFu, base);
    lowest = __reduce_min_sync(0xFFFFFFFFu, lowest);
    const bool rebased = lowest == 0xFFu || base - lowest <= kMxfp8F16RebaseSpan;
    const float token_factor = -mxfp8_scale_value(base);
    for (int kb = lane; kb < p.k_blocks; kb += 32) {
      const uint4 v0 = values[2 * kb], v1 = values[2 * kb + 1];
      const uint32_t s = scales[kb];
      const uint32_t words[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
      // 2^(s - base) as f16x2 (exponent field s - base + 15 >= 0; 2^-15 is f16's subnormal
      // 0x0200), for the blocks that count; 1 for the others (zeros).
      const bool scaled = rebased && mxfp8_block_counts(v0, v1, s);
      const uint32_t shift = scaled ? s + kMxfp8F16RebaseSpan - base : 15u;
      const uint32_t half = shift > 0 ? shift << 10 : 0x0200u;
      const uint32_t factor = half * 0x00010001u;
      // Element pairs (j, j + 1), j even, land on position pairs (p, p + 1), p even: an f16x2.
      uint32_t h[16];
#pragma unroll
      for (int w = 0; w < 8; ++w) {
        h[mxfp8_f16_position(4 * w) / 2] = f16x2_mul_rn(e4m3x2_to_f16x2(words[w]), factor);
        h[mxfp8_f16_position(4 * w + 2) / 2] = f16x2_mul_rn(e4m3x2_hi_to_f16x2(words[w]), factor);
      }
      uint4* dst = reinterpret_cast<uint4*>(p.out) + (t * p.k_blocks + kb) * 4;
#pragma unroll
      for (int c = 0; c < 4; ++c)
        dst[c] = make_uint4(h[4 * c], h[4 * c + 1], h[4 * c + 2], h[4 * c + 3]);
      p.out_scales[t * p.k_blocks + kb] = rebased ? token_factor : mxfp8_scale_value(s);
    }
  }
}

}  // namespace prime_moe
