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
// e4m3 values unscaled as f16 (exact, an e4m3 NaN stays NaN) into out, each 32-wide block's
// elements in the order the gate/up loop reads its weight bytes (mxfp8_f16_position), and its
// row-major scales as fp32 2^(s - 127) (NaN for 0xFF) into out_scales, which the gate/up GEMM
// applies to each block's sum (WarpgroupMainloopF16). A thread per block: two 16-byte loads, four
// 16-byte stores, its scale.
struct Mxfp8XToF16Params {
  const uint8_t* values;  // (T, D) e4m3, 16-byte aligned
  const uint8_t* scales;  // (T, D/32) e8m0, row-major
  uint16_t* out;          // (T, D) f16, 16-byte aligned
  float* out_scales;      // (T, D/32)
  int64_t blocks;         // T * D / 32
};

__global__ void __launch_bounds__(kMxfp8DequantizeThreads)
    mxfp8_x_to_f16_kernel(const Mxfp8XToF16Params p) {
  // Launched as a programmatic dependent at decode sizes (fused_moe_mxfp8.cu): x may come from
  // the kernel before it, whose writes are visible only past this wait. The gate/up GEMM, its own
  // dependent, may launch from here on: its CTAs set up under this kernel and wait for its end
  // before they read x.
  prime_kernels::grid_dependency_wait();
  prime_kernels::launch_dependent_grids();
  for (int64_t blk = int64_t(blockIdx.x) * kMxfp8DequantizeThreads + threadIdx.x; blk < p.blocks;
       blk += int64_t(gridDim.x) * kMxfp8DequantizeThreads) {
    const uint4 v0 = reinterpret_cast<const uint4*>(p.values)[2 * blk];
    const uint4 v1 = reinterpret_cast<const uint4*>(p.values)[2 * blk + 1];
    const uint32_t words[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    // Element pairs (j, j + 1), j even, land on position pairs (p, p + 1), p even: an f16x2 word.
    uint32_t h[16];
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      h[mxfp8_f16_position(4 * w) / 2] = e4m3x2_to_f16x2(words[w]);
      h[mxfp8_f16_position(4 * w + 2) / 2] = e4m3x2_hi_to_f16x2(words[w]);
    }
    uint4* dst = reinterpret_cast<uint4*>(p.out) + 4 * blk;
#pragma unroll
    for (int c = 0; c < 4; ++c)
      dst[c] = make_uint4(h[4 * c], h[4 * c + 1], h[4 * c + 2], h[4 * c + 3]);
    p.out_scales[blk] = mxfp8_scale_value(p.scales[blk]);
  }
}

}  // namespace prime_moe
