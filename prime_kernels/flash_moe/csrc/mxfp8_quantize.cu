// Launchers of the MXFP8 quantizers, one thread per 32-element block (mxfp8_quantize.cuh), of the
// training forward's quantize-and-widen pass (mxfp8_round_trip.cuh) and of the blocked scale
// layout's permutation (mxfp8_scales.cuh).
#include "mxfp8_quantize.h"

#include <algorithm>
#include <climits>

#include "device/mxfp8_quantize.cuh"
#include "device/mxfp8_round_trip.cuh"
#include "device/mxfp8_scales.cuh"

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

cudaError_t launch_mxfp8_round_trip(const __nv_bfloat16* x, __nv_bfloat16* out, int64_t rows,
                                    int64_t k, cudaStream_t stream) {
  const Mxfp8RoundTripParams p{x, out, rows * (k / 32)};
  if (p.blocks == 0) return cudaSuccess;
  const int64_t grid = (p.blocks + kMxfp8RoundTripThreads - 1) / kMxfp8RoundTripThreads;
  mxfp8_round_trip_kernel<<<unsigned(std::min<int64_t>(grid, 1 << 20)), kMxfp8RoundTripThreads, 0,
                            stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_mxfp8_scales_blocked(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t kb,
                                        bool unpack, cudaStream_t stream) {
  if (rows == 0 || kb == 0) return cudaSuccess;
  const int64_t words = kb / 4;
  if ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 4 != 0 ||
      words > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  Mxfp8ScalesParams p{};
  p.src = reinterpret_cast<const uint32_t*>(src);
  p.dst = reinterpret_cast<uint32_t*>(dst);
  p.tile_rows = rows / 128;
  p.words = int(words);
  if (words <= kMxfp8ScalesChunkTiles) {
    p.chunk_words = int(words);
    p.chunk_tile_rows = kMxfp8ScalesChunkTiles / int(words);
    p.row_chunks = 1;
  } else {
    p.chunk_words = kMxfp8ScalesChunkTiles;
    p.chunk_tile_rows = 1;
    p.row_chunks = int((words + kMxfp8ScalesChunkTiles - 1) / kMxfp8ScalesChunkTiles);
  }
  const int64_t grid =
      (p.tile_rows + p.chunk_tile_rows - 1) / p.chunk_tile_rows * int64_t(p.row_chunks);
  if (grid > INT_MAX) return cudaErrorInvalidValue;
  const size_t smem = size_t(p.chunk_tile_rows) * 128 * (p.chunk_words | 1) * sizeof(uint32_t);
  // 16-byte vectors need aligned pointers and, when a chunk holds row segments, rows of whole
  // vectors (whole rows are contiguous, so a vector may straddle two of them).
  const bool vec16 =
      (reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16 == 0 &&
      (p.row_chunks == 1 || words % 4 == 0);
  const dim3 g{unsigned(grid)};
  if (unpack && vec16) {
    mxfp8_scales_kernel<true, 4><<<g, kMxfp8ScalesThreads, smem, stream>>>(p);
  } else if (unpack) {
    mxfp8_scales_kernel<true, 1><<<g, kMxfp8ScalesThreads, smem, stream>>>(p);
  } else if (vec16) {
    mxfp8_scales_kernel<false, 4><<<g, kMxfp8ScalesThreads, smem, stream>>>(p);
  } else {
    mxfp8_scales_kernel<false, 1><<<g, kMxfp8ScalesThreads, smem, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace prime_moe
