// Launcher of the MXFP8 quantizers: one thread per 32-element block (mxfp8_quantize.cuh).
#include "mxfp8_quantize.h"

#include "device/mxfp8_quantize.cuh"

namespace prime_moe {

cudaError_t launch_mxfp8_quantize(const __nv_bfloat16* x, uint8_t* values, uint8_t* scales,
                                  int64_t rows, int64_t k, int64_t n_rows, bool rceil, bool blocked,
                                  cudaStream_t stream) {
  const int64_t blocks = rows * (k / 32);
  if (blocks == 0) return cudaSuccess;
  const Mxfp8QuantizeParams p{x, values, scales, rows, int(k / 32), int(n_rows)};
  const int64_t grid = (blocks + kMxfp8QuantizeThreads - 1) / kMxfp8QuantizeThreads;
  if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const dim3 g{unsigned(grid)};
  if (rceil && blocked) {
    mxfp8_quantize_kernel<true, true><<<g, kMxfp8QuantizeThreads, 0, stream>>>(p);
  } else if (rceil) {
    mxfp8_quantize_kernel<true, false><<<g, kMxfp8QuantizeThreads, 0, stream>>>(p);
  } else if (blocked) {
    mxfp8_quantize_kernel<false, true><<<g, kMxfp8QuantizeThreads, 0, stream>>>(p);
  } else {
    mxfp8_quantize_kernel<false, false><<<g, kMxfp8QuantizeThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace prime_moe
