// The training forward's operands at prefill sizes (moe_forward_mxfp8): bf16 (rows, K) quantized
// as the consumer quantizes (mxfp8_quantize_block, RCEIL) and widened straight back, into the bf16
// values fused_moe_mxfp8's pre-passes (mxfp8_dequantize.cuh) widen the quantized tensors to. One
// pass moves 4 bytes an element, where quantizing then widening moves 6. One thread per 32-element
// block.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mxfp8_loaders.cuh"
#include "mxfp8_quantize.cuh"

namespace prime_moe {

constexpr int kMxfp8RoundTripThreads = 256;

struct Mxfp8RoundTripParams {
  const __nv_bfloat16* x;  // (rows, K), 16-byte aligned
  __nv_bfloat16* out;      // (rows, K), 16-byte aligned
  int64_t blocks;          // rows * K / 32
};

__global__ void __launch_bounds__(kMxfp8RoundTripThreads)
    mxfp8_round_trip_kernel(const Mxfp8RoundTripParams p) {
  for (int64_t b = int64_t(blockIdx.x) * kMxfp8RoundTripThreads + threadIdx.x; b < p.blocks;
       b += int64_t(gridDim.x) * kMxfp8RoundTripThreads) {
    uint4 values[2];
    const float scale = mxfp8_scale_value(
        uint32_t(mxfp8_quantize_block<true>(reinterpret_cast<const uint4*>(p.x) + 4 * b, values)));
    uint4* dst = reinterpret_cast<uint4*>(p.out) + 4 * b;
    mxfp8_widen16(values[0], scale, dst);
    mxfp8_widen16(values[1], scale, dst + 2);
  }
}

}  // namespace prime_moe
