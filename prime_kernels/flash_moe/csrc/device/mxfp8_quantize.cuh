// MXFP8 quantization of bf16 tensors (activations, weights), bit for bit what
// prime_kernels/flash_moe/mxfp8.py specifies (its docstring is the rule book): per block of 32
// consecutive elements along the last dim, an e8m0 scale s from the block's absolute maximum
// (RCEIL: 2^ceil(log2(amax / 448)) from the bits of the IEEE quotient; floor: the biased
// exponent of amax minus 8), clamped to [0, 254]; values x * 2^(127 - s) in fp32, clamped to
// +-448 and rounded to e4m3 (RNE, subnormals kept: the build does not flush denormals); a
// block holding NaN or +-Inf gets scale 0xFF and 32 value bytes 0x7F.
//
// One thread per block: 64 bytes read (four 16-byte loads), 32 value bytes written (two
// 16-byte stores) and one scale byte, row-major (..., K/32) or in the blocked layout of
// pack_scales_blocked for weights (rows of a group of n_rows, n_rows % 128 == 0, K/32 % 4
// == 0). Memory-bound.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace prime_moe {

struct Mxfp8QuantizeParams {
  const __nv_bfloat16* x;  // (rows, K) row-major
  uint8_t* values;         // (rows, K) e4m3 bytes
  uint8_t* scales;         // (rows, K/32) row-major, or blocked per group of n_rows rows
  int64_t rows;
  int k_blocks;  // K / 32
  int n_rows;    // blocked: rows per group (an expert's N)
};

constexpr int kMxfp8QuantizeThreads = 256;
constexpr uint32_t kE8m0Nan = 0xFF;
constexpr uint32_t kE4m3NanPair = 0x7F7F7F7Fu;  // four e4m3 NaN bytes

// fp32 bits of 2^n, n in [-127, 127] (2^-127 is the fp32 denormal 0x00400000).
__device__ __forceinline__ float mxfp8_pow2(int n) {
  return __int_as_float(n >= -126 ? (n + 127) << 23 : 0x00400000);
}

// Byte offset of scale (r, c) of a group's (n_rows, k_blocks) scales in the blocked layout.
__device__ __forceinline__ int64_t mxfp8_blocked_offset(int r, int c, int k_blocks) {
  return int64_t((r / 128) * (k_blocks / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 +
         c % 4;
}

// One block of 32 bf16 values (four 16-byte chunks at src) quantized as mxfp8.py does: the 32
// e4m3 bytes into out (element 0 in the low byte of out[0].x), and the e8m0 scale returned.
template <bool kRceil>
__device__ __forceinline__ int mxfp8_quantize_block(const uint4* src, uint4 (&out)[2]) {
  float v[32];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint4 chunk = src[q];
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&chunk);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(h[e]);
      v[8 * q + 2 * e] = f.x;
      v[8 * q + 2 * e + 1] = f.y;
    }
  }
  bool finite = true;
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    finite &= isfinite(v[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  if (!finite) {
    out[0] = out[1] = make_uint4(kE4m3NanPair, kE4m3NanPair, kE4m3NanPair, kE4m3NanPair);
    return kE8m0Nan;
  }
  int s;
  if constexpr (kRceil) {
    const uint32_t q = __float_as_uint(__fdiv_rn(amax, 448.f));
    const uint32_t exp = (q >> 23) & 0xFF, mant = q & 0x7FFFFF;
    s = exp == 0 ? int(mant > 0x400000u) : int(exp + (mant != 0));
  } else {
    s = int((__float_as_uint(amax) >> 23) & 0xFF) - 8;
  }
  s = min(max(s, 0), 254);
  const float inv_scale = mxfp8_pow2(127 - s);
  uint32_t* words = reinterpret_cast<uint32_t*>(out);
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
      const int i = 4 * w + 2 * pair;
      const float a = fminf(fmaxf(__fmul_rn(v[i], inv_scale), -448.f), 448.f);
      const float b = fminf(fmaxf(__fmul_rn(v[i + 1], inv_scale), -448.f), 448.f);
      const __nv_fp8x2_storage_t two =
          __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
      word |= uint32_t(two) << (16 * pair);
    }
    words[w] = word;
  }
  return s;
}

template <bool kRceil, bool kBlocked>
__global__ void __launch_bounds__(kMxfp8QuantizeThreads)
    mxfp8_quantize_kernel(const Mxfp8QuantizeParams p) {
  const int64_t block = int64_t(blockIdx.x) * kMxfp8QuantizeThreads + threadIdx.x;
  if (block >= p.rows * p.k_blocks) return;
  uint4 out[2];
  const int s = mxfp8_quantize_block<kRceil>(reinterpret_cast<const uint4*>(p.x) + block * 4, out);
  uint4* dst = reinterpret_cast<uint4*>(p.values) + block * 2;
  dst[0] = out[0];
  dst[1] = out[1];
  if constexpr (kBlocked) {
    const int64_t row = block / p.k_blocks;
    const int c = int(block % p.k_blocks);
    const int64_t group = row / p.n_rows;
    const int r = int(row % p.n_rows);
    p.scales[group * p.n_rows * p.k_blocks + mxfp8_blocked_offset(r, c, p.k_blocks)] = uint8_t(s);
  } else {
    p.scales[block] = uint8_t(s);
  }
}

}  // namespace prime_moe
