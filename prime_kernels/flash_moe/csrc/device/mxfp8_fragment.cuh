// MXFP8 weights widened in registers: e4m3 bytes and their e8m0 scales into the bf16x2 A
// fragment of a register-A wgmma (WgmmaBf16RS, wgmma.cuh), exactly as mxfp8.py dequantizes them
// (each value is e4m3 x 2^(s - 127), rounded once to bf16; that rounding only acts below 2^-133,
// bf16's subnormal step, and is round-to-nearest-even as in mxfp8_loaders.cuh's
// mxfp8_pair_to_bf16x2).
//
// The fragment of one k16 step and 64 weight rows (wgmma.cuh's WgmmaBf16RS layout): thread (warp
// w, lane l, g = l / 4, q = l % 4) holds rows r0 = 16w + g and r1 = r0 + 8, columns 2q, 2q + 1
// (a[0], a[1]) and 2q + 8, 2q + 9 (a[2], a[3]). It reads them as four 2-byte pieces and packs
// them by one byte permute per column pair into a word whose even bytes are row r0's pair and
// whose odd bytes are row r1's (mxfp8_fragment_word; PTX prmt selector 0x5140).
//
// Fast path (the Marlin "LOP3" dequantization, vllm gptq_marlin dequant.h, rewritten here): an
// e4m3 byte's sign, 4 exponent and 3 mantissa bits moved to bf16's sign bit and the low bits of
// its exponent and top of its mantissa give the bf16 of value x 2^-120 exactly (e4m3's bias is
// 7, bf16's 127; an e4m3 subnormal, exponent 0, becomes the bf16 subnormal of the same value x
// 2^-120). One bf16x2 multiply (mul.rn.bf16x2, HMUL2.BF16) by 2^(s - 7), the bf16 word with
// exponent field s + 120, then gives value x 2^(s - 127) rounded once: exact unless below 2^-133,
// where it rounds to nearest even like the fp32 route. 2^(s - 7) is a normal bf16 for s in
// [0, 134] (exponent field 120 .. 254); the product cannot overflow there (448 x 2^7).
//
// Slow path (per thread, per fragment): a scale above 134 (2^(s - 7) overflows bf16), a NaN
// scale (255: the whole block is NaN) or an e4m3 NaN byte (S.1111.111, which the bit move would
// turn into the finite 1.875 x 2^-112) goes through today's exact fp32 route,
// mxfp8_pair_to_bf16x2. Quantized data has NaN bytes only in NaN-scaled blocks and scales near
// 2^8 only for values near 2^16, so the slow path is for the contract, not for speed.
//
// tests/test_mxfp8_fragment.py checks a host twin of these bit operations over every e4m3 byte
// and scale byte against mxfp8.py on the CPU, and these device functions on the GPU.
#pragma once

#include <cstdint>

#include "mxfp8_loaders.cuh"

namespace prime_moe {

// Largest e8m0 scale whose 2^(s - 7) is a normal bf16 (exponent field s + 120 <= 254).
constexpr uint32_t kMxfp8FastScaleMax = 134;

// A 2-byte shared-memory read by address (ld.shared: a generic pointer into the dynamic shared
// memory compiles to a generic LD, which pays the address-space check). Volatile, with a
// memory clobber: the bytes come from TMA, so the read must stay between the stage's full-barrier
// wait and its release (both asm with memory clobbers).
__device__ __forceinline__ uint32_t ld_shared_u16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr) : "memory");
  return v;
}

// Row r0's two bytes (lo16_r0: column c in the low byte, c + 1 in the high) and row r1's as one
// word: bytes {r0[c], r1[c], r0[c + 1], r1[c + 1]} (even bytes r0, odd bytes r1).
__device__ __forceinline__ uint32_t mxfp8_fragment_word(uint32_t lo16_r0, uint32_t lo16_r1) {
  return __byte_perm(lo16_r0, lo16_r1, 0x5140);
}

// The bf16x2 of value x 2^-120 of a word's odd bytes (1, 3: the low half from byte 1) and of its
// even bytes (0, 2), exact (the header's fast path).
__device__ __forceinline__ uint32_t e4m3_odd_bytes_biased_bf16x2(uint32_t w) {
  return (w & 0x80008000u) | ((w >> 4) & 0x07F007F0u);
}
__device__ __forceinline__ uint32_t e4m3_even_bytes_biased_bf16x2(uint32_t w) {
  return ((w << 8) & 0x80008000u) | ((w << 4) & 0x07F007F0u);
}

// 2^(s - 7) in both halves of a bf16x2 word (s <= kMxfp8FastScaleMax).
__device__ __forceinline__ uint32_t mxfp8_fast_scale_bf16x2(uint32_t s) {
  return (s + 120u) * 0x00800080u;  // exponent field s + 120 at bits 7 and 23
}

__device__ __forceinline__ uint32_t bf16x2_mul_rn(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Whether any byte of the two words is an e4m3 NaN (low 7 bits all ones): adding 1 to a byte's
// low 7 bits carries into its bit 7 exactly then, and never into the next byte.
__device__ __forceinline__ bool e4m3_has_nan(uint32_t lo, uint32_t hi) {
  const uint32_t t = ((lo & 0x7F7F7F7Fu) + 0x01010101u) | ((hi & 0x7F7F7F7Fu) + 0x01010101u);
  return (t & 0x80808080u) != 0;
}

// The fragment's 4 bf16x2 registers from its two words (columns 2q, 2q + 1 and 2q + 8, 2q + 9;
// mxfp8_fragment_word) and the e8m0 scales s0 (row r0) and s1 (row r1) of its 32-block.
// fast0, fast1: mxfp8_fast_scale_bf16x2 of s0, s1, and scales_fast: both at most
// kMxfp8FastScaleMax, worked out once per stage by the mainloop (a 32-block spans two k16
// steps). One branch: the two conditions are combined without short-circuit, which would nest
// two.
__device__ __forceinline__ void mxfp8_fragment(uint32_t lo, uint32_t hi, uint32_t s0, uint32_t s1,
                                               uint32_t fast0, uint32_t fast1, bool scales_fast,
                                               uint32_t (&a)[4]) {
  if (scales_fast & !e4m3_has_nan(lo, hi)) {
    a[0] = bf16x2_mul_rn(e4m3_even_bytes_biased_bf16x2(lo), fast0);
    a[1] = bf16x2_mul_rn(e4m3_odd_bytes_biased_bf16x2(lo), fast1);
    a[2] = bf16x2_mul_rn(e4m3_even_bytes_biased_bf16x2(hi), fast0);
    a[3] = bf16x2_mul_rn(e4m3_odd_bytes_biased_bf16x2(hi), fast1);
  } else {
    // The even (odd) bytes as one 2-byte pair, low byte first, through the fp32 route.
    const float scale0 = mxfp8_scale_value(s0), scale1 = mxfp8_scale_value(s1);
    a[0] = mxfp8_pair_to_bf16x2(__byte_perm(lo, 0, 0x4420), scale0);
    a[1] = mxfp8_pair_to_bf16x2(__byte_perm(lo, 0, 0x4431), scale1);
    a[2] = mxfp8_pair_to_bf16x2(__byte_perm(hi, 0, 0x4420), scale0);
    a[3] = mxfp8_pair_to_bf16x2(__byte_perm(hi, 0, 0x4431), scale1);
  }
}

// The same from the two words and scale bytes alone (the per-stage parts worked out here).
__device__ __forceinline__ void mxfp8_fragment(uint32_t lo, uint32_t hi, uint32_t s0, uint32_t s1,
                                               uint32_t (&a)[4]) {
  mxfp8_fragment(lo, hi, s0, s1, mxfp8_fast_scale_bf16x2(s0), mxfp8_fast_scale_bf16x2(s1),
                 max(s0, s1) <= kMxfp8FastScaleMax, a);
}

}  // namespace prime_moe
