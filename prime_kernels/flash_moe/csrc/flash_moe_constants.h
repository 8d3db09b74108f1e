// The one place flash_moe's block sizes and shape rules are defined. The kernels, the
// binding's input checks and the Python surface (through the extension's module
// attributes) all read these; nothing else hardcodes them.
#pragma once

namespace prime_moe {

// Rows per expert block that moe_align pads each expert segment to by default, and that
// the fused kernels tile M by: two consumer warpgroups of 64 rows each (wgmma's M is 64).
inline constexpr int kBlockM = 128;

// MXFP8: one e8m0 scale per 32 consecutive elements along a GEMM's reduction dim.
inline constexpr int kMxfp8ScaleBlock = 32;

// bf16 kernels: D (the gate/up GEMM's K and the down GEMM's N) and H (the down GEMM's K
// and the gate/up GEMM's N) must be multiples of one 64-element K step: one 128-byte
// swizzled TMA box row of bf16, so every K tile is full and no tail path is needed.
inline constexpr int kDimMultiple = 64;
inline constexpr int kHiddenMultiple = 64;

// MXFP8 kernels: the blocked scale layout is tiles of 128 rows x 4 scale columns. D is the row
// count of w2's scales and 32 times the scale columns of x's and w's; H is half the row count of
// w's scales (its up rows start a tile) and 32 times w2's scale columns: both multiples of 128.
inline constexpr int kMxfp8DimMultiple = 128;
inline constexpr int kMxfp8HiddenMultiple = 128;

// moe_align keeps one histogram bin per expert in shared memory.
inline constexpr int kMaxExperts = 4096;

// Rows of the padded, expert-sorted order (moe_align's worst case, every expert wasting
// block_m * bpc - 1 rows), pair indices and their offsets are int32 on the device.
inline constexpr long kMaxRows = 2147483647;

}  // namespace prime_moe
