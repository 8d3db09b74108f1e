// wgmma (sm_90a) helpers: shared-memory matrix descriptors for the 128-byte swizzle (K-major
// and MN-major operand tiles), the fence/commit/wait instructions, and m64nNk16 bf16 x bf16
// -> fp32 with either operand K-major or MN-major (transposed) in shared memory, or with A in
// registers (WgmmaBf16RS). Only the N
// values the flash_moe kernels use are spelled out (wgmma takes its accumulators as an
// explicit register list, so each N is its own asm).
#pragma once

#include <cstdint>

namespace prime_kernels {

// Descriptor of a K-major tile whose rows are 128 bytes (64 bf16) and were written with
// the 128-byte swizzle (TMA's CU_TENSOR_MAP_SWIZZLE_128B, or the same XOR done by hand).
// Eight rows form one 1024-byte swizzle atom, so the stride between 8-row groups (SBO) is
// 1024 bytes; the leading byte offset is unused for swizzled K-major layouts. The tile
// base must be 1024-byte aligned. Advancing K by 16 elements adds 32 bytes (2 in the
// address field, which is in 16-byte units) to the descriptor.
__device__ __forceinline__ uint64_t make_smem_desc_sw128(const void* smem_ptr) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);  // bits 0-13: start address
  desc |= static_cast<uint64_t>(1) << 16;                // bits 16-29: LBO (unused)
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;        // bits 32-45: SBO = 1024 B
  desc |= static_cast<uint64_t>(1) << 62;                // bits 62-63: 1 = 128B swizzle
  return desc;
}

// desc advanced by offset (16-byte units) with a 32-bit add to its start address field, which
// cannot carry out of it (shared memory addresses are below 2^18). With a 64-bit add ptxas
// carries into the high half for every wgmma; this way the high half, built from constants, stays
// a constant. The 128 x 192 down kernel: 4064 -> 3800 SASS instructions (122 -> 58 R2UR), 4%
// fewer executed and 1.8% less time at Qwen3-30B-A3B T = 32768 (ncu, H100).
__device__ __forceinline__ uint64_t desc_add(uint64_t desc, uint32_t offset) {
  return (desc >> 32) << 32 | uint32_t(uint32_t(desc) + offset);
}

// How an operand tile sits in shared memory, as the wgmma mainloop needs it: its descriptor,
// how far the descriptor moves per 16-element K step, and wgmma's transpose flag.
//
// SmemKMajor: one 128-byte row per M (or N) index holding 64 K elements (a TMA box of
// rows x 64 with the 128-byte swizzle, or the same layout gathered by hand). The forward's
// operands: token rows of x or h, weight rows of w or w2.
struct SmemKMajor {
  static constexpr int kTrans = 0;
  static constexpr uint64_t kDescPerK16 = 32 >> 4;  // 16 bf16 along the row
  __device__ __forceinline__ static uint64_t desc(const void* tile) {
    return make_smem_desc_sw128(tile);
  }
};

// SmemMNMajor: chunks of 64 M (or N) indices, each 64 K rows of 128 bytes (one TMA box of 64
// contiguous elements x 64 rows, 128-byte swizzle), chunk c at c * 8 KB. In the canonical
// MN-major SW128 layout ((8,8,m),(8,k)):((1,8,LBO),(64,SBO)) the leading byte offset is the
// chunk stride (8 KB) and the stride byte offset the 8-row group stride (1 KB); a 16-row K
// step moves 2 KB. Used where the reduction runs along a tensor's rows: the weights read
// transposed by the backward's activation gradients, and both operands of the weight
// gradients (tokens are their K). An index n of the tile sits at (n / 64) * 8 KB =
// n * 128 bytes for multiples of 64, as in SmemKMajor, so tile offsets are the same.
struct SmemMNMajor {
  static constexpr int kTrans = 1;
  static constexpr int kChunk = 64;             // MN indices per 128-byte row
  static constexpr int kChunkBytes = 64 * 128;  // 64 K rows
  static constexpr uint64_t kDescPerK16 = (16 * 128) >> 4;
  __device__ __forceinline__ static uint64_t desc(const void* tile) {
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
    uint64_t d = 0;
    d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);   // start address
    d |= static_cast<uint64_t>(kChunkBytes >> 4) << 16;  // LBO: next 64 MN indices
    d |= static_cast<uint64_t>(1024 >> 4) << 32;         // SBO: next 8 K rows
    d |= static_cast<uint64_t>(1) << 62;                 // 128B swizzle
    return d;
  }
};

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across wgmma issue/wait.
template <int kRegs>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D(64 x N, fp32) (+)= A(64 x 16, smem) * B(N x 16, smem)^T. scale_d = 0 overwrites D.
// kTransA / kTransB: 0 for a K-major operand tile, 1 for an MN-major one (bf16 allows both).
// Accumulator layout (per thread t of the warpgroup, warp w = t / 32, lane l): register
// 4*j + 2*i + c holds row 16*w + l/4 + 8*i, column 8*j + 2*(l%4) + c.
template <int N, int kTransA = 0, int kTransB = 0>
struct WgmmaBf16;

// What every bf16 atom shares: K = 16 per instruction (the operand layouts say how far
// their descriptors move per step).
struct WgmmaBf16K16 {
  static constexpr int kK = 16;
};

// Row and column, inside the warpgroup's 64 x N accumulator tile, of the calling thread's
// registers 4*j + 2*i + c (c = 0, 1 are adjacent columns).
__device__ __forceinline__ int wgmma_acc_row(int i) {
  return ((threadIdx.x / 32) % 4) * 16 + (threadIdx.x % 32) / 4 + 8 * i;
}
__device__ __forceinline__ int wgmma_acc_col(int j) {
  return 8 * j + 2 * (threadIdx.x % 4);
}

// Element f of several accumulator arrays read as one flat array (f is a compile-time
// constant after unrolling, so this stays in registers).
template <int kMmas, int kRegs>
__device__ __forceinline__ float wgmma_acc_at(const float (&acc)[kMmas][kRegs], int f) {
  return acc[f / kRegs][f % kRegs];
}

template <int kTransA, int kTransB>
struct WgmmaBf16<32, kTransA, kTransB> : WgmmaBf16K16 {
  static constexpr int kAccRegs = 16;
  __device__ __forceinline__ static void mma(float (&d)[16], uint64_t desc_a, uint64_t desc_b,
                                             int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, "
        "1, %19, %20;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
  }
};

template <int kTransA, int kTransB>
struct WgmmaBf16<64, kTransA, kTransB> : WgmmaBf16K16 {
  static constexpr int kAccRegs = 32;
  __device__ __forceinline__ static void mma(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                             int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, "
        "%36;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
  }
};

template <int kTransA, int kTransB>
struct WgmmaBf16<128, kTransA, kTransB> : WgmmaBf16K16 {
  static constexpr int kAccRegs = 64;
  __device__ __forceinline__ static void mma(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                             int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, "
        "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
        "%55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
  }
};

template <int kTransA, int kTransB>
struct WgmmaBf16<192, kTransA, kTransB> : WgmmaBf16K16 {
  static constexpr int kAccRegs = 96;
  __device__ __forceinline__ static void mma(float (&d)[96], uint64_t desc_a, uint64_t desc_b,
                                             int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, "
        "%26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, "
        "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
        "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, "
        "%77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, "
        "%94, %95}, %96, %97, p, 1, 1, %99, %100;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
          "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
          "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
          "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
  }
};

template <int kTransA, int kTransB>
struct WgmmaBf16<256, kTransA, kTransB> : WgmmaBf16K16 {
  static constexpr int kAccRegs = 128;
  __device__ __forceinline__ static void mma(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                             int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, "
        "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
        "%55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, "
        "%73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, "
        "%91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, "
        "%107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, "
        "%122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
          "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
          "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
          "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
          "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
          "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
          "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
          "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
  }
};

// D(64 x N, fp32) (+)= A(64 x 16, registers) * B(N x 16, smem)^T: wgmma with its A operand in
// registers ("RS"), for an A that is computed rather than copied (MXFP8 weights widened to bf16
// in the consumer, device/mxfp8_fragment.cuh). A is four b32 registers of packed bf16x2 in
// mma.m16n8k16's A layout, warp w of the warpgroup holding rows 16w .. 16w + 15 (PTX ISA
// "Register Fragments", wgmma .m64nNk16 A): for lane l, g = l / 4, q = l % 4,
//   a[0] = {A[16w + g][2q], A[16w + g][2q + 1]}        a[1] = the same columns of row 16w + g + 8
//   a[2] = {A[16w + g][2q + 8], A[16w + g][2q + 9]}    a[3] = the same columns of row 16w + g + 8
// (the low half holds the lower column). The accumulators are laid out as WgmmaBf16's.
// kTransB: 0 for a K-major B tile, 1 for an MN-major one.
// kF16: A and B are f16 instead of bf16, the layouts the same (the MXFP8 decode gate/up loop,
// WarpgroupMainloopF16 in flash_moe's mma.cuh, whose N is 16 or 32: the only f16 shapes).
template <int N, int kTransB = 0, bool kF16 = false>
struct WgmmaRS;
template <int N, int kTransB = 0>
using WgmmaBf16RS = WgmmaRS<N, kTransB, false>;
template <int N, int kTransB = 0>
using WgmmaF16RS = WgmmaRS<N, kTransB, true>;

// The A registers of an RS wgmma are read asynchronously too: they must be fenced like the
// accumulators (wgmma_fence before the wgmma that reads them, and no write to them before the
// wgmma_wait that retires it), and this keeps the compiler from moving their writes across
// the issue (ptxas then serializes the wgmmas, C7515).
__device__ __forceinline__ void wgmma_fence_operands(uint32_t (&a)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

template <int kTransB, bool kF16>
struct WgmmaRS<16, kTransB, kF16> : WgmmaBf16K16 {
  static constexpr int kAccRegs = 8;
  template <int kRegs>
  __device__ __forceinline__ static void mma(float (&d)[kRegs], const uint32_t (&a)[4],
                                             uint64_t desc_b, int scale_d) {
    static_assert(kRegs >= kAccRegs, "the accumulators' first kAccRegs registers");
    if constexpr (kF16)
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, %14;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
            "+f"(d[7])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));
    else
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, %14;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
            "+f"(d[7])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));
  }
};

template <int kTransB, bool kF16>
struct WgmmaRS<32, kTransB, kF16> : WgmmaBf16K16 {
  static constexpr int kAccRegs = 16;
  template <int kRegs>
  __device__ __forceinline__ static void mma(float (&d)[kRegs], const uint32_t (&a)[4],
                                             uint64_t desc_b, int scale_d) {
    static_assert(kRegs >= kAccRegs, "the accumulators' first kAccRegs registers");
    if constexpr (kF16)
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, "
          "%19}, %20, p, 1, 1, %22;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
            "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
            "+f"(d[14]), "+f"(d[15])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));
    else
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, "
          "%19}, %20, p, 1, 1, %22;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
            "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
            "+f"(d[14]), "+f"(d[15])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));
  }
};

template <int kTransB, bool kF16>
struct WgmmaRS<64, kTransB, kF16> : WgmmaBf16K16 {
  static constexpr int kAccRegs = 32;
  template <int kRegs>
  __device__ __forceinline__ static void mma(float (&d)[kRegs], const uint32_t (&a)[4],
                                             uint64_t desc_b, int scale_d) {
    static_assert(kRegs >= kAccRegs, "the accumulators' first kAccRegs registers");
    static_assert(!kF16, "f16 RS wgmma is instantiated at N = 16 and 32 only");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, "
        "%36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));
  }
};

template <int kTransB, bool kF16>
struct WgmmaRS<128, kTransB, kF16> : WgmmaBf16K16 {
  static constexpr int kAccRegs = 64;
  template <int kRegs>
  __device__ __forceinline__ static void mma(float (&d)[kRegs], const uint32_t (&a)[4],
                                             uint64_t desc_b, int scale_d) {
    static_assert(kRegs >= kAccRegs, "the accumulators' first kAccRegs registers");
    static_assert(!kF16, "f16 RS wgmma is instantiated at N = 16 and 32 only");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
        "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
        "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, "
        "1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));
  }
};

// D(64 x N, fp32) (+)= A(64 x 32, e4m3, smem) * B(N x 32, e4m3, smem)^T: one wgmma per 32 K,
// both operands K-major with the 128-byte swizzle (a 128-byte row holds 128 e4m3 values; a
// 32-wide K step adds 32 bytes, 2 in the descriptor's address field). fp8 wgmma takes no
// transpose flags. The tensor core sums the 32 exact products with about 14 significant bits
// (benchmarks/probes/fp8_wgmma_sums.cu): callers that need more sum fewer products per wgmma or
// promote each wgmma's result themselves. Accumulators as WgmmaBf16's.
template <int N>
struct WgmmaE4m3;

struct WgmmaE4m3K32 {
  static constexpr int kK = 32;
  static constexpr uint64_t kDescPerK32 = 32 >> 4;
};

template <>
struct WgmmaE4m3<16> : WgmmaE4m3K32 {
  static constexpr int kAccRegs = 8;
  template <int kRegs>
  __device__ __forceinline__ static void mma(float (&d)[kRegs], uint64_t desc_a, uint64_t desc_b,
                                             int scale_d) {
    static_assert(kRegs >= kAccRegs, "the temporaries' first kAccRegs registers");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

template <>
struct WgmmaE4m3<32> : WgmmaE4m3K32 {
  static constexpr int kAccRegs = 16;
  template <int kRegs>
  __device__ __forceinline__ static void mma(float (&d)[kRegs], uint64_t desc_a, uint64_t desc_b,
                                             int scale_d) {
    static_assert(kRegs >= kAccRegs, "the temporaries' first kAccRegs registers");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, "
        "1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

template <>
struct WgmmaE4m3<64> : WgmmaE4m3K32 {
  static constexpr int kAccRegs = 32;
  template <int kRegs>
  __device__ __forceinline__ static void mma(float (&d)[kRegs], uint64_t desc_a, uint64_t desc_b,
                                             int scale_d) {
    static_assert(kRegs >= kAccRegs, "the temporaries' first kAccRegs registers");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

template <>
struct WgmmaE4m3<128> : WgmmaE4m3K32 {
  static constexpr int kAccRegs = 64;
  template <int kRegs>
  __device__ __forceinline__ static void mma(float (&d)[kRegs], uint64_t desc_a, uint64_t desc_b,
                                             int scale_d) {
    static_assert(kRegs >= kAccRegs, "the temporaries' first kAccRegs registers");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, "
        "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
        "%55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

}  // namespace prime_kernels
