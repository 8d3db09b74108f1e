// The MXFP8 forward's pre-pass over x: e4m3 (rows, K) values and their row-major e8m0 scales
// (rows, K/32) to a bf16 (rows, K) workspace, each element value * 2^(s - 127), exact down to
// 2^-133 (mxfp8_loaders.cuh); a scale byte 0xFF makes its block NaN. The gate/up GEMM then
// gathers token rows from the workspace as the bf16 forward gathers them from x: the gather is
// per row and needs no per-K-step scale, and x (T x D) is small next to the weights it meets.
//
// One thread per 16 elements: a 16-byte load, its scale byte (flat element e has scale e / 32,
// since K % 32 == 0), two 16-byte stores. Memory-bound.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mxfp8_loaders.cuh"

namespace prime_moe {

constexpr int kMxfp8DequantizeThreads = 256;

struct Mxfp8DequantizeParams {
  const uint8_t* values;  // (rows, K) e4m3, 16-byte aligned
  const uint8_t* scales;  // (rows, K/32) e8m0, row-major
  __nv_bfloat16* out;     // (rows, K), 16-byte aligned
  int64_t chunks;         // rows * K / 16
};

static __global__ void __launch_bounds__(kMxfp8DequantizeThreads)
    mxfp8_dequantize_rows_kernel(const Mxfp8DequantizeParams p) {
  const int64_t c = int64_t(blockIdx.x) * kMxfp8DequantizeThreads + threadIdx.x;
  if (c >= p.chunks) return;
  const uint4 v = reinterpret_cast<const uint4*>(p.values)[c];
  const float scale = mxfp8_scale_value(p.scales[c / 2]);
  uint4* dst = reinterpret_cast<uint4*>(p.out) + 2 * c;
  dst[0] = mxfp8_widen8(make_uint2(v.x, v.y), scale);
  dst[1] = mxfp8_widen8(make_uint2(v.z, v.w), scale);
}

}  // namespace prime_moe
