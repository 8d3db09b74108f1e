// Host interface of the MXFP8 quantizers (device/mxfp8_quantize.cuh). Torch-free: the binding
// checks tensors and calls this.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace prime_moe {

// x: (rows, K) bf16, K % 32 == 0; values: (rows, K) e4m3 bytes; scales: (rows, K/32) bytes,
// row-major, or with `blocked` the layout of pack_scales_blocked per group of n_rows rows
// (n_rows % 128 == 0, (K/32) % 4 == 0, rows % n_rows == 0). rceil: the consumer's scale
// rounding; otherwise floor (the kernel's own re-quantization). No host synchronization.
cudaError_t launch_mxfp8_quantize(const __nv_bfloat16* x, uint8_t* values, uint8_t* scales,
                                  int64_t rows, int64_t k, int64_t n_rows, bool rceil, bool blocked,
                                  cudaStream_t stream);

// x: (rows, K) bf16, K % 32 == 0, 16-byte aligned, quantized as launch_mxfp8_quantize with rceil
// and widened straight back: out (rows, K) bf16 holds each e4m3 value times its scale (what
// fused_moe_mxfp8 widens the quantized tensor to). No host synchronization.
cudaError_t launch_mxfp8_round_trip(const __nv_bfloat16* x, __nv_bfloat16* out, int64_t rows,
                                    int64_t k, cudaStream_t stream);

// scales: (rows, kb) bytes, rows % 128 == 0, kb % 4 == 0, row-major <-> the layout of
// pack_scales_blocked (each 128-row tile row's blocked bytes after the previous one's); unpack:
// src is the blocked one. src and dst are 4-byte aligned and do not overlap. No host
// synchronization.
cudaError_t launch_mxfp8_scales_blocked(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t kb,
                                        bool unpack, cudaStream_t stream);

}  // namespace prime_moe
