// MXFP8 weights widened in registers: e4m3 bytes and their e8m0 scales into the bf16x2 A
// fragment of a register-A wgmma (WgmmaBf16RS, wgmma.cuh), exactly as mxfp8.py dequantizes them
// (each value is e4m3 x 2^(s - 127), rounded once to bf16; that rounding only acts below about
// 2^-130, where bf16's subnormals (steps of 2^-133) hold fewer than 4 significant bits, and is
// round-to-nearest-even as in mxfp8_loaders.cuh's mxfp8_pair_to_bf16x2).
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
// exponent field s + 120, then gives value x 2^(s - 127) rounded once: exact unless below about
// 2^-130, where it rounds to nearest even like the fp32 route. 2^(s - 7) is a normal bf16 for s in
// [0, 134] (exponent field 120 .. 254); the product cannot overflow there (448 x 2^7).
//
// Slow path (per thread, per fragment): a scale above 134 (2^(s - 7) overflows bf16) or a NaN
// scale (255: the whole block is NaN) goes through the exact fp32 route, mxfp8_pair_to_bf16x2.
// Quantized data has scales near 2^8 only for values near 2^16, so the slow path is for the
// contract, not for speed. Which path a fragment takes is known from the scales alone, once per
// stage, so the branch resolves off the conversion's dependent chain.
//
// An e4m3 NaN byte (S.1111.111) comes out of the fast path finite (the bit move makes it 1.875 x
// 2^-112): the consumer collects NaN bytes with e4m3_nan_bytes as it goes, and the epilogue makes
// the outputs of a weight row that held one NaN (a NaN weight makes every product of its row
// NaN; mxfp8.py dequantizes the byte to NaN). Testing each fragment for NaN bytes to decide the
// branch put the test and the branch's resolution on every k16 step's dependent chain (ncu,
// benchmarks/RESULTS.md 2026-12-04).
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

// The same, 4 bytes (a 4-byte aligned address).
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// The same, one byte.
__device__ __forceinline__ uint32_t ld_shared_u8(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u8 %0, [%1];" : "=h"(v) : "r"(addr) : "memory");
  return v;
}

// The same, 8 bytes (an 8-byte aligned address).
__device__ __forceinline__ uint2 ld_shared_u32x2(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

// The same, two floats (an 8-byte aligned address).
__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

// A scale word's four e8m0 bytes (the low byte first) as fp32 2^(s - 127): each byte moved into
// an fp32 exponent field, unless a byte is 0x00 (2^-127, an fp32 subnormal) or 0xFF (NaN), which
// take mxfp8_scale_value. The promoting loops' row scales (WarpgroupMainloopE4m3 and
// WarpgroupMainloopF16, mma.cuh): one 4-byte read a weight row and stage.
__device__ __forceinline__ void mxfp8_scale_values(uint32_t word, float (&scale)[4]) {
  const uint32_t zero = (word - 0x01010101u) & ~word, ones = (~word - 0x01010101u) & word;
  if (((zero | ones) & 0x80808080u) == 0) {
#pragma unroll
    for (int b = 0; b < 4; ++b) scale[b] = __uint_as_float(((word >> (8 * b)) & 0xFFu) << 23);
  } else {
#pragma unroll
    for (int b = 0; b < 4; ++b) scale[b] = mxfp8_scale_value((word >> (8 * b)) & 0xFFu);
  }
}

// Two e4m3 bytes (the low 16 bits of pair, the lower column in the low byte) as f16x2, unscaled:
// exact (every e4m3 value is an f16), and an e4m3 NaN stays NaN. One instruction
// (F2FP.F16.E4M3.UNPACK_B) where the bf16 widening takes about nine a word: the decode gate/up
// loop's operand (WarpgroupMainloopF16, mma.cuh).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t pair) {
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(uint16_t(pair)));
  return h;
}

// The same of the high 16 bits of word (F2FP's .H1 operand: no shift).
__device__ __forceinline__ uint32_t e4m3x2_hi_to_f16x2(uint32_t word) {
  uint32_t h;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}"
      : "=r"(h)
      : "r"(word));
  return h;
}

// Where the decode gate/up loop (WarpgroupMainloopF16) wants element j of a 32-wide MX block of
// the token rows, so that its thread q finds its weight bytes for the block's two k16 steps in
// one 8-byte read (bytes 8 q .. 8 q + 7 of the row): byte m = j % 8 of thread q = j / 8 is
// column 2q + m % 2 (m = 0, 1), 2q + 8 + m % 2 (m = 2, 3), and the same plus 16 (m = 4 .. 7) of
// the wgmma A fragment layout (wgmma.cuh). A permutation inside each block, so each block's sum
// is still its own: x's pre-pass writes the tokens' K in this order.
__host__ __device__ constexpr int mxfp8_f16_position(int j) {
  return 16 * ((j % 8) / 4) + 8 * ((j % 4) / 2) + 2 * (j / 8) + j % 2;
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

__device__ __forceinline__ uint32_t f16x2_mul_rn(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Bit 7 of each byte set where that byte of lo or of hi is an e4m3 NaN (low 7 bits all ones:
// adding 1 to them carries into bit 7 exactly then, and never into the next byte); other bits
// are left to the caller's mask. With mxfp8_fragment_word's words, bits 7 and 23 are row r0's
// bytes, bits 15 and 31 row r1's.
__device__ __forceinline__ uint32_t e4m3_nan_bytes(uint32_t lo, uint32_t hi) {
  return ((lo & 0x7F7F7F7Fu) + 0x01010101u) | ((hi & 0x7F7F7F7Fu) + 0x01010101u);
}
constexpr uint32_t kNanBytesRow0 = 0x00800080u;
constexpr uint32_t kNanBytesRow1 = 0x80008000u;

// The e8m0 scale back from its mxfp8_fast_scale_bf16x2 word (the low half's 9 bits from bit 7
// hold s + 120 <= 375 for every s), so the mainloop keeps one register per scale, not two.
__device__ __forceinline__ uint32_t mxfp8_scale_of_fast_word(uint32_t fast) {
  return ((fast >> 7) & 0x1FFu) - 120u;
}

// The 4 bf16x2 registers of each of kN fragments of one 32-block from its two words (columns
// 2q, 2q + 1 and 2q + 8, 2q + 9; mxfp8_fragment_word) and the block's scales: fast0, fast1:
// mxfp8_fast_scale_bf16x2 of s0 (row r0) and s1 (row r1), and scales_fast: both at most
// kMxfp8FastScaleMax, worked out once per stage by the mainloop. One branch for all kN, so that
// their conversions interleave. Exact for every byte that is not an e4m3 NaN; a NaN byte is
// exact (NaN) only on the slow path (the header).
template <int kN>
__device__ __forceinline__ void mxfp8_fragments(const uint32_t (&words)[kN][2], uint32_t fast0,
                                                uint32_t fast1, bool scales_fast,
                                                uint32_t (&a)[kN][4]) {
  if (scales_fast) {
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const uint32_t lo = words[n][0], hi = words[n][1];
      a[n][0] = bf16x2_mul_rn(e4m3_even_bytes_biased_bf16x2(lo), fast0);
      a[n][1] = bf16x2_mul_rn(e4m3_odd_bytes_biased_bf16x2(lo), fast1);
      a[n][2] = bf16x2_mul_rn(e4m3_even_bytes_biased_bf16x2(hi), fast0);
      a[n][3] = bf16x2_mul_rn(e4m3_odd_bytes_biased_bf16x2(hi), fast1);
    }
  } else {
    // The even (odd) bytes as one 2-byte pair, low byte first, through the fp32 route.
    const float scale0 = mxfp8_scale_value(mxfp8_scale_of_fast_word(fast0));
    const float scale1 = mxfp8_scale_value(mxfp8_scale_of_fast_word(fast1));
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const uint32_t lo = words[n][0], hi = words[n][1];
      a[n][0] = mxfp8_pair_to_bf16x2(__byte_perm(lo, 0, 0x4420), scale0);
      a[n][1] = mxfp8_pair_to_bf16x2(__byte_perm(lo, 0, 0x4431), scale1);
      a[n][2] = mxfp8_pair_to_bf16x2(__byte_perm(hi, 0, 0x4420), scale0);
      a[n][3] = mxfp8_pair_to_bf16x2(__byte_perm(hi, 0, 0x4431), scale1);
    }
  }
}

// The same from the two words and scale bytes alone (the per-stage parts worked out here).
__device__ __forceinline__ void mxfp8_fragment(uint32_t lo, uint32_t hi, uint32_t s0, uint32_t s1,
                                               uint32_t (&a)[4]) {
  const uint32_t words[1][2] = {{lo, hi}};
  uint32_t out[1][4];
  mxfp8_fragments(words, mxfp8_fast_scale_bf16x2(s0), mxfp8_fast_scale_bf16x2(s1),
                  max(s0, s1) <= kMxfp8FastScaleMax, out);
#pragma unroll
  for (int r = 0; r < 4; ++r) a[r] = out[0][r];
}

}  // namespace prime_moe
