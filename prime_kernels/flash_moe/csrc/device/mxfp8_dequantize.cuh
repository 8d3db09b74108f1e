// The MXFP8 forward's widening pre-passes: e4m3 (rows, K) values and their e8m0 scales (one per
// 32 consecutive elements of a row) to a bf16 (rows, K) workspace, each element
// value * 2^(s - 127), exact above about 2^-130 (mxfp8_loaders.cuh); a scale byte 0xFF makes its
// block NaN, an e4m3 NaN byte its element.
//   x (always): row-major scales. The gate/up GEMM then gathers token rows from the workspace as
//     the bf16 forward gathers them from x: the gather is per row and needs no per-K-step scale,
//     and x (T x D) is small next to the weights it meets.
//   w, w2 (prefill sizes, fused_moe_mxfp8.cu): scales in the blocked layout per group of n_rows
//     rows (an expert's 2H or D). Each weight element is widened once, however many token blocks
//     meet it; the bf16 GEMMs then read the widened weights by TMA.
//
// A thread per 16 elements (a grid-stride loop past the launcher's grid): a 16-byte load, its scale
// byte (flat element e has scale e / 32, since K % 32 == 0), two 16-byte stores. Memory-bound.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mxfp8_fragment.cuh"
#include "mxfp8_loaders.cuh"
#include "mxfp8_quantize.cuh"

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
// e4m3 values unscaled as f16 (exact, an e4m3 NaN stays NaN) into out, and its row-major scales
// as fp32 2^(s - 127) (NaN for 0xFF) into out_scales, which the gate/up GEMM applies to each
// block's sum (WarpgroupMainloopF16). The same thread per 16 elements; the even one of a block's
// two threads writes its scale.
struct Mxfp8XToF16Params {
  const uint8_t* values;  // (T, D) e4m3, 16-byte aligned
  const uint8_t* scales;  // (T, D/32) e8m0, row-major
  uint16_t* out;          // (T, D) f16, 16-byte aligned
  float* out_scales;      // (T, D/32)
  int64_t chunks;         // T * D / 16
};

__global__ void __launch_bounds__(kMxfp8DequantizeThreads)
    mxfp8_x_to_f16_kernel(const Mxfp8XToF16Params p) {
  for (int64_t c = int64_t(blockIdx.x) * kMxfp8DequantizeThreads + threadIdx.x; c < p.chunks;
       c += int64_t(gridDim.x) * kMxfp8DequantizeThreads) {
    const uint4 v = reinterpret_cast<const uint4*>(p.values)[c];
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    uint32_t h[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      h[2 * i] = e4m3x2_to_f16x2(words[i] & 0xFFFFu);
      h[2 * i + 1] = e4m3x2_to_f16x2(words[i] >> 16);
    }
    uint4* dst = reinterpret_cast<uint4*>(p.out) + 2 * c;
    dst[0] = make_uint4(h[0], h[1], h[2], h[3]);
    dst[1] = make_uint4(h[4], h[5], h[6], h[7]);
    if (c % 2 == 0) p.out_scales[c / 2] = mxfp8_scale_value(p.scales[c / 2]);
  }
}

}  // namespace prime_moe
