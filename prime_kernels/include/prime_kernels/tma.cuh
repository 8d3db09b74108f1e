// TMA (cp.async.bulk.tensor) helpers for sm_90: host-side 2D tensor-map encoding through
// the runtime's driver entry point (so nothing links -lcuda), and the device-side load.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only; no driver symbols are linked
#include <cuda_runtime.h>

#include <cstdint>

namespace prime_kernels {

namespace detail {
using TmaEncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// Resolved once (thread-safe static init); 12000 is the ABI of cuTensorMapEncodeTiled as
// introduced in CUDA 12.0.
inline TmaEncodeFn tma_encode_fn() {
  static const TmaEncodeFn encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                             cudaEnableDefault, &status);
    const bool ok = err == cudaSuccess && status == cudaDriverEntryPointSuccess;
    return ok ? reinterpret_cast<TmaEncodeFn>(fn) : nullptr;
  }();
  return encode;
}

// A row-major 2D matrix (rows x cols elements of elem_bytes, row stride = cols) as a tensor
// map with boxes of box_rows x box_cols; out-of-bounds box rows are filled with zeros.
inline cudaError_t make_tma_2d(CUtensorMap* map, CUtensorMapDataType dtype, uint32_t elem_bytes,
                               const void* base, uint64_t rows, uint64_t cols, uint32_t box_cols,
                               uint32_t box_rows, CUtensorMapSwizzle swizzle) {
  const TmaEncodeFn encode = tma_encode_fn();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * elem_bytes};  // bytes between rows
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult res =
      encode(map, dtype, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
             CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}
}  // namespace detail

// Encodes a row-major 2D bf16 matrix (rows x cols, row stride = cols elements) as a tensor
// map with boxes of box_rows x 64 elements (64 bf16 = 128 bytes, the widest box the
// 128-byte swizzle allows) and the 128-byte swizzle that the wgmma descriptors expect.
// Out-of-bounds box rows are filled with zeros.
inline cudaError_t make_tma_2d_bf16_sw128(CUtensorMap* map, const void* base, uint64_t rows,
                                          uint64_t cols, uint32_t box_rows) {
  return detail::make_tma_2d(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, rows, cols, 64,
                             box_rows, CU_TENSOR_MAP_SWIZZLE_128B);
}

// A row-major 2D byte matrix (fp8 values: rows x cols bytes) with boxes of box_rows x 64
// bytes, unswizzled: box row r lands at 64 r bytes, for threads that read it back by hand.
inline cudaError_t make_tma_2d_u8(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols,
                                  uint32_t box_rows) {
  return detail::make_tma_2d(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, base, rows, cols, 64, box_rows,
                             CU_TENSOR_MAP_SWIZZLE_NONE);
}

// The same byte matrix with the 64-byte swizzle: box row r lands at 64 r bytes with its 16-byte
// chunk c at chunk c ^ ((r / 2) % 4) (the XOR of address bits 4-5 with bits 7-8; dst 512-byte
// aligned). Threads that read 2-byte pieces of 8 consecutive rows at one column (the wgmma
// register-A fragments of MXFP8 weights) then hit 8 distinct 16-byte bank groups, where the
// unswizzled rows put every second row in the same banks.
inline cudaError_t make_tma_2d_u8_sw64(CUtensorMap* map, const void* base, uint64_t rows,
                                       uint64_t cols, uint32_t box_rows) {
  return detail::make_tma_2d(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, base, rows, cols, 64, box_rows,
                             CU_TENSOR_MAP_SWIZZLE_64B);
}

// The same byte matrix with boxes of box_rows x 128 bytes and the 128-byte swizzle: e4m3 operand
// tiles that fp8 wgmma reads by descriptor (a 128-byte row holds 128 values of K).
inline cudaError_t make_tma_2d_u8_sw128(CUtensorMap* map, const void* base, uint64_t rows,
                                        uint64_t cols, uint32_t box_rows) {
  return detail::make_tma_2d(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, base, rows, cols, 128, box_rows,
                             CU_TENSOR_MAP_SWIZZLE_128B);
}

// Loads the box at (col, row) of `map` into shared memory at dst (1024-byte aligned for
// the 128-byte swizzle); completion is signalled on `bar` as transaction bytes.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int col, int row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(col), "r"(row)
      : "memory");
}

// tma_load_2d into every CTA of the cluster named in cta_mask (bit i: rank i), at the same
// shared-memory offsets, each signalling its own barrier at bar's offset.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map,
                                                      uint32_t bar, int col, int row,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(col), "r"(row), "h"(cta_mask)
      : "memory");
}

__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory to
// shared memory at dst; completion is signalled on `bar` as transaction bytes.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes,
                                              uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

}  // namespace prime_kernels
