// Vector reductions into global memory (sm_90): one instruction adds 8 packed bf16 to 16
// aligned bytes, where atomicAdd(__nv_bfloat162*) adds 2 to 4 bytes: a quarter of the
// reduction requests for the same sum (each still rounded to bf16 once, in L2, in any order).
#pragma once

#include <cstdint>

namespace prime_kernels {

// *dst += v as four bf16x2 lanes (dst 16-byte aligned); relaxed, no return value.
__device__ __forceinline__ void red_add_bf16x8(void* dst, const uint32_t (&v)[4]) {
  asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v[0]),
               "r"(v[1]), "r"(v[2]), "r"(v[3])
               : "memory");
}

}  // namespace prime_kernels
