// Geometry of one CTA tile of the fused MoE GEMMs and of its pipeline stage, and the
// consumer schedule that splits the tile between the consumer warpgroups. The launcher
// sizes shared memory and the ring from the same struct the kernel is instantiated with.
#pragma once

#include <cstddef>

#include "prime_kernels/pipeline.cuh"
#include "prime_kernels/wgmma.cuh"

namespace prime_moe {

// kBlockM rows (one moe_align block: every row of it belongs to one expert) times kBlockN
// output columns; a stage holds one 64-wide K slice of A (kBlockM x 64) and kNumB weight
// tiles of kBlockN x 64 (gate and up for the first GEMM, one w2 tile for the second).
template <int kBlockM_, int kBlockN_, int kNumB_>
struct MoeGemmTile {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNumB = kNumB_;
  static constexpr int kBlockK = 64;  // one 128-byte swizzle row of bf16
  static constexpr int kABytes = kBlockM * kBlockK * 2;
  static constexpr int kKAtoms = 1;            // 64-wide K atoms of A in a stage
  static constexpr int kAAtomBytes = kABytes;  // bytes of one
  static constexpr int kBBytes = kNumB * kBlockN * kBlockK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kEpilogueBytes = 0;  // the epilogues store from registers
  static constexpr bool kF16Tokens = false;
  static constexpr int kTokenScaleBytes = 0;

  static_assert(kBlockM == 64 || kBlockM == 128, "a block is one or two wgmma M of 64 rows");
  static_assert(kNumB * kBlockN <= 512 && kBlockN <= 256, "TMA box rows are at most 256");
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0,
                "stage buffers keep the 1024-byte alignment of the 128B swizzle atom");

  // Stage buffers (A of every stage, then B of every stage), then the ring's barriers.
  static constexpr size_t smem_bytes(int stages) {
    return 1024 /* alignment slack */ + size_t(stages) * kStageBytes +
           prime_kernels::StageRing::barrier_bytes(stages);
  }
};

// Cooperative consumers: two warpgroups share each tile. With block_m = 128 each takes 64
// rows and all columns; with block_m = 64 both take the 64 rows and half the columns each.
// Both finish a tile together, so the tensor cores idle while they store it.
template <class Tile, class ALayout_, class BLayout_>
struct CooperativeConsumers {
  // How the stage's A and B tiles sit in shared memory (the loaders' layouts, wgmma.cuh).
  using ALayout = ALayout_;
  using BLayout = BLayout_;
  static constexpr int kWarpgroups = 2;
  static constexpr bool kPingPong = false;
  static constexpr bool kRegisterA = false;
  static constexpr bool kE4m3 = false;
  static constexpr bool kTokensAlongN = false;
  static constexpr int kWarpgroupsPerStage = 2;  // both read every stage
  static constexpr int kMmaM = 1;                // 64-row wgmma per warpgroup
  static constexpr int kWgM = Tile::kBlockM / 64;
  static constexpr int kWgN = kWarpgroups / kWgM;
  static constexpr int kWgCols = Tile::kBlockN / kWgN;
  // With block_m = 128 a warpgroup's kNumB tiles sit back to back in shared memory, so one
  // m64n(kNumB * block_n) wgmma covers them (A is read once per K step, half the
  // instructions); with block_m = 64 the warpgroup's column halves are apart: one each.
  static constexpr bool kFuseB = kWgN == 1;
  static constexpr int kNumMma = kFuseB ? 1 : Tile::kNumB;
  static constexpr int kMmaN = kFuseB ? Tile::kNumB * Tile::kBlockN : kWgCols;
  using Mma = prime_kernels::WgmmaBf16<kMmaN, ALayout::kTrans, BLayout::kTrans>;

  static_assert(kWgM * kWgN == kWarpgroups, "the warpgroups cover the tile once");
  static_assert(kMmaN == 32 || kMmaN == 64 || kMmaN == 128 || kMmaN == 256,
                "wgmma N must be one of the instantiated shapes");
  static_assert(kNumMma * Mma::kAccRegs <= 128,
                "accumulators must fit the consumer register budget");
  // An MN-major operand is read in 64-wide chunks: a consumer's share must start on one.
  static_assert(!BLayout::kTrans || (kWgCols % 64 == 0 && Tile::kNumB == 1),
                "an MN-major weight operand takes whole 64-column chunks, one weight tile");

  __device__ __forceinline__ static int m_offset(int consumer) { return (consumer % kWgM) * 64; }
  __device__ __forceinline__ static int n_offset(int consumer) {
    return (consumer / kWgM) * kWgCols;
  }
};

// Ping-pong consumers: each warpgroup owns whole tiles, the CTA's tiles alternating between
// the two, and they take turns at the tensor cores (the kernel's turn barriers): one runs
// its mainloop while the other stores its last tile, so a tile's epilogue costs no MMA
// time. Where the cooperative schedule splits a 128 x 256 tile into two 64 x 256 halves,
// this one gives each warpgroup a whole 128-row tile (two 64-row wgmmas per K slice over all the
// stage's weight rows): the forward's down GEMM 128 x 192, its gate/up GEMM 128 x (96 + 96).
template <class Tile, class ALayout_, class BLayout_>
struct PingPongConsumers {
  using ALayout = ALayout_;
  using BLayout = BLayout_;
  static constexpr int kWarpgroups = 2;
  static constexpr bool kPingPong = true;
  static constexpr bool kRegisterA = false;
  static constexpr bool kE4m3 = false;
  static constexpr bool kTokensAlongN = false;
  static constexpr int kWarpgroupsPerStage = 1;  // a stage belongs to one tile
  static constexpr int kMmaM = Tile::kBlockM / 64;
  static constexpr bool kFuseB = true;  // the warpgroup has every column of the stage
  static constexpr int kNumMma = 1;
  static constexpr int kMmaN = Tile::kNumB * Tile::kBlockN;
  using Mma = prime_kernels::WgmmaBf16<kMmaN, ALayout::kTrans, BLayout::kTrans>;

  static_assert(kMmaN == 64 || kMmaN == 128 || kMmaN == 192 || kMmaN == 256,
                "wgmma N must be one of the instantiated shapes");
  // 192 accumulators (128 x 192) leave 40 to 48 of the 232 to 240 consumer registers (MoeGemm):
  // enough for the store and SwiGLU epilogues (ptxas reports no spills:
  // tests/test_ptxas_report.py), not for more.
  static_assert(kMmaM * Mma::kAccRegs <= 192, "accumulators must fit the consumer register budget");
  static_assert(!BLayout::kTrans || Tile::kNumB == 1,
                "an MN-major weight operand takes whole 64-column chunks, one weight tile");

  __device__ __forceinline__ static int m_offset(int /*consumer*/) { return 0; }
  __device__ __forceinline__ static int n_offset(int /*consumer*/) { return 0; }
};

// The register-A (wgmma RS) form of a tile, for MXFP8 weights widened in the consumers
// (mxfp8_fragment.cuh): the weights are wgmma's A (M = weight rows) and the kBlockM token rows
// its B (N = tokens), so the accumulators hold out^T. A stage holds the token rows as
// MoeGemmTile's A (bf16, K-major, 128-byte swizzle: kABytes) and, in its B buffer, the raw e4m3
// weight tiles (kNumB tiles of kBlockN rows x 64 bytes, 64-byte swizzle, by TMA) followed by the
// 512-byte blocks of the blocked scale layout that hold the step's four scale columns: per tile,
// one per 128 rows (a 64- or 128-row tile: the one its rows lie in; a 96-row tile: the two its
// rows may span). Half the weight bytes of a bf16
// stage, so deeper rings fit. kEpilogueBytes: the transposed MXFP8 epilogue's exchange of
// per-32-row exponents between the two warps of a 32-row block (mxfp8_epilogues.cuh), 512
// bytes a consumer warpgroup.
//
// kBlockK = 128: a stage holds two 64-wide K atoms of each (tokens: two kBlockM x 128-byte
// swizzle tiles; weights: two sets of kNumB 64-byte-swizzled tiles), and a scale block's four
// columns are all the stage's: half the per-stage work of the consumers' loop (the ring wait, the
// proxy fences, the release, the scale reads and the descriptors) per weight byte of 64-wide
// stages, where that work was about a quarter of a decode tile's instructions: 1.03-1.04x at
// T = 64 and 1.02x at T = 1024 (H100, Qwen3-30B-A3B, DeepSeek-V3-32, Mixtral-8x7B). The two-CTA
// 64 x 64 tiles keep only 3 such stages and are where the T = 64 gain is: on 64-wide stages they
// measured as before (docs/flash_moe_mxfp8_design.md, benchmarks/RESULTS.md twentieth session).
//
// kF16Tokens (the decode gate/up tile, WarpgroupMainloopF16): the token rows are x's unscaled e4m3
// values as f16 (x's pre-pass), and after them the stage holds each token's four 32-block scales
// as fp32 ([token][block], 16 bytes a token: GatherTokenRows copies them beside its row).
template <int kBlockM_, int kBlockN_, int kNumB_, bool kF16Tokens_ = false>
struct MoeGemmTileRS {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNumB = kNumB_;
  static constexpr bool kF16Tokens = kF16Tokens_;
  static constexpr int kBlockK = 128;
  static constexpr int kKAtoms = kBlockK / 64;  // 128-byte rows of 16-bit tokens, 64 of e4m3
  static constexpr int kTokenBytes = kBlockM * kBlockK * 2;
  static constexpr int kTokenScaleBytes = kF16Tokens ? kBlockM * (kBlockK / 32) * 4 : 0;
  static constexpr int kABytes = (kTokenBytes + kTokenScaleBytes + 1023) / 1024 * 1024;
  static constexpr int kAAtomBytes = kBlockM * 128;
  // Per weight tile: a 96-row tile starts at n0 % 128 in {0, 32, 64, 96}, so its rows may lie in
  // two 128-row scale blocks.
  static constexpr int kScaleBlocks = kBlockN > 128 ? kBlockN / 128 : kBlockN == 96 ? 2 : 1;
  static constexpr int kWeightAtomK = 64;  // e4m3 weight bytes a row per TMA box (64B swizzle)
  static constexpr int kWeightAtoms = kBlockK / kWeightAtomK;
  static constexpr int kWeightAtomBytes = kNumB * kBlockN * kWeightAtomK;
  static constexpr int kWeightBytes = kNumB * kBlockN * kBlockK;
  static constexpr int kScaleBytes = kNumB * kScaleBlocks * 512;
  static constexpr int kBBytes = (kWeightBytes + kScaleBytes + 1023) / 1024 * 1024;
  static constexpr int kStageBytes = kABytes + kBBytes;
  // RegisterAConsumers' warpgroups: one interleaved m64 block (32 h) each on gate/up tiles up to
  // 96 h wide, else two.
  static constexpr int kConsumerWarpgroups = kNumB == 2 && kBlockN <= 96 ? kBlockN / 32 : 2;
  // Whole 1024-byte blocks: the stages after it keep the 128B swizzle's alignment (three
  // warpgroups' 1536 bytes shifted the token rows by 512 and garbled every product).
  static constexpr int kEpilogueWarpgroupBytes = 512;
  static constexpr int kEpilogueBytes =
      (kEpilogueWarpgroupBytes * kConsumerWarpgroups + 1023) / 1024 * 1024;

  static_assert(kBlockM == 64 || kBlockM == 128, "a block's tokens are at most one wgmma N");
  static_assert(kBlockN == 64 || kBlockN == 128 || kBlockN == 256 || (kBlockN == 96 && kNumB == 2),
                "whole 64-row wgmma M");
  static_assert(kBlockN <= 128 || kBlockN % 128 == 0, "whole 128-row scale tiles");
  static_assert(kWeightAtomBytes % 1024 == 0, "each atom keeps the 64B swizzle's alignment");
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0,
                "stage buffers keep the 1024-byte alignment of the 128B swizzle atom");

  static constexpr size_t smem_bytes(int stages) {
    return 1024 /* alignment slack */ + kEpilogueBytes + size_t(stages) * kStageBytes +
           prime_kernels::StageRing::barrier_bytes(stages);
  }
};

// Cooperative consumers of a register-A tile (MoeGemmTileRS): every consumer warpgroup (two, or
// three: kConsumerWarpgroups) reads every stage and they finish a tile together, each converting
// its own weight rows once (the conversion, not the MMA, is the scarce issue slots) for all the
// tile's tokens. Two row layouts:
//   split rows (weight tiles of 128 rows or more): each warpgroup takes half of every weight
//     tile's rows, kBlockN / 128 m64 blocks per tile; for the gate/up GEMM (kNumB = 2) the
//     gate rows h and up rows H + h of the same h sit in the same registers of its two m64
//     blocks, so the SwiGLU stays in the thread;
//   interleaved (the 64-row gate and up tiles of block_n = 64): one m64 block a warpgroup, whose
//     fragment row slots r0 = 16 w + g and r0 + 8 read gate row h = 32 c + 8 w + g and up row h
//     (the mainloop reads the rows by hand, so any row order is one of addresses): the
//     accumulators' row half i = 0 is g, i = 1 is u of the same h, in the thread.
// At most 2 x 64 accumulators a thread, as the bf16 tiles. A tile's wgmmas multiply only its first
// 16, 32, 64 or kMmaN tokens (tile_tokens, moe_gemm.cuh): the registers of the tokens past those
// hold an older tile's values: an epilogue stores, and reduces over, only the first n_tokens.
//   m_offset: the warpgroup's first token row of the tile (0: its B rows are all the tokens);
//   n_offset: its first output column (weight row inside each weight tile).
template <class Tile, class ALayout_, class BLayout_>
struct RegisterAConsumers {
  using ALayout = ALayout_;  // the token rows (wgmma's B here)
  using BLayout = BLayout_;  // unused: the weights are read by hand
  static constexpr int kWarpgroups = Tile::kConsumerWarpgroups;
  static constexpr bool kPingPong = false;
  static constexpr bool kRegisterA = true;
  static constexpr bool kE4m3 = false;
  static constexpr bool kTokensAlongN = true;  // the accumulators hold out^T
  static constexpr int kWarpgroupsPerStage = kWarpgroups;
  static constexpr bool kInterleaved = Tile::kNumB == 2 && Tile::kBlockN <= 96;
  static constexpr int kMmaPerTile = kInterleaved ? 1 : Tile::kBlockN / 128;
  static constexpr int kMmaM = kInterleaved ? 1 : Tile::kNumB * kMmaPerTile;
  static constexpr int kMmaN = Tile::kBlockM;
  static constexpr int kNumMma = 1;
  static constexpr int kWgRows = Tile::kBlockN / kWarpgroups;  // output columns per warpgroup
  using Mma = prime_kernels::WgmmaBf16RS<kMmaN, ALayout::kTrans>;

  static_assert(!ALayout::kTrans, "the token rows are K-major");
  static_assert(kInterleaved || Tile::kBlockN % 128 == 0, "split rows take whole m64 halves");
  static_assert(kMmaN == 64 || kMmaN == 128, "an instantiated RS wgmma N");
  static_assert(kMmaM * Mma::kAccRegs <= 128, "accumulators must fit the consumer budget");

  __device__ __forceinline__ static int m_offset(int /*consumer*/) { return 0; }
  __device__ __forceinline__ static int n_offset(int consumer) { return consumer * kWgRows; }
  // The stage row (tile * kBlockN + row inside the tile) that accumulator row 16 warp + g + 8 i
  // of m64 block mh reads, for a warpgroup whose n_offset is row_offset. Every one is g modulo 8
  // (the 64-byte swizzle's chunk XOR, (row / 2) % 4, is the thread's own for all of them).
  __host__ __device__ static constexpr int stage_row(int mh, int i, int warp, int g,
                                                     int row_offset) {
    return stage_tile(mh, i) * Tile::kBlockN + tile_row(mh, i, warp, g, row_offset);
  }
  // Its weight tile (a constant) and its row inside that tile (below kBlockN): kept apart, so
  // that no division recovers them (at two CTAs an SM the consumers' registers are scarce).
  __host__ __device__ static constexpr int stage_tile(int mh, int i) {
    return kInterleaved ? i : mh / kMmaPerTile;
  }
  __host__ __device__ static constexpr int tile_row(int mh, int i, int warp, int g,
                                                    int row_offset) {
    return kInterleaved ? row_offset + 8 * warp + g
                        : (mh % kMmaPerTile) * 64 + row_offset + 16 * warp + 8 * i + g;
  }
};

// The e4m3 (wgmma SS) form of the register-A down tile, for MXFP8 weights and an MXFP8 h: both
// operands stay e4m3 in shared memory and one fp8 wgmma a 32-wide MX block sums their exact
// products, which E4m3Consumers' mainloop (mma.cuh) scales by both blocks' scales into the fp32
// accumulators. As in MoeGemmTileRS the weights are wgmma's A (M = weight rows) and the tokens its
// B (N), so the accumulators hold out^T. A stage holds, in its A buffer, kBlockM token rows of 128
// e4m3 bytes (128-byte swizzle, by TMA) followed by the tokens' block scales as fp32 (four 32-wide
// blocks a stage, [block][token]: SwiGluToMxfp8<true> writes them so); in its B buffer kBlockN
// weight rows of 128 bytes (128-byte swizzle) followed by their scale blocks, as
// Mxfp8WeightTiles copies them.
template <int kBlockM_, int kBlockN_>
struct MoeGemmTileE4m3 {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNumB = 1;
  static constexpr int kBlockK = 128;
  static constexpr int kKAtoms = 1;  // a token row of 128 e4m3 is one 128-byte swizzle row
  static constexpr int kTokenBytes = kBlockM * kBlockK;
  static constexpr int kAAtomBytes = kTokenBytes;
  static constexpr int kMxBlocks = kBlockK / 32;
  static constexpr int kTokenScaleBytes = kMxBlocks * kBlockM * 4;
  static constexpr int kABytes = (kTokenBytes + kTokenScaleBytes + 1023) / 1024 * 1024;
  static constexpr int kScaleBlocks = kBlockN > 128 ? kBlockN / 128 : 1;
  static constexpr int kWeightAtomK = 128;  // one 128-byte swizzle row a weight row
  static constexpr int kWeightAtoms = 1;
  static constexpr int kWeightAtomBytes = kBlockN * kWeightAtomK;
  static constexpr int kWeightBytes = kBlockN * kBlockK;
  static constexpr int kScaleBytes = kScaleBlocks * 512;
  static constexpr int kBBytes = (kWeightBytes + kScaleBytes + 1023) / 1024 * 1024;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kEpilogueBytes = 0;  // the down epilogues store from registers
  static constexpr int kEpilogueWarpgroupBytes = 0;
  static constexpr bool kF16Tokens = false;

  static_assert(kBlockM == 64 || kBlockM == 128, "a block's tokens are at most one wgmma N");
  static_assert(kBlockN % 128 == 0 && kBlockN <= 256, "whole 128-row scale tiles, TMA box rows");
  static_assert(kTokenBytes % 1024 == 0 && kWeightBytes % 1024 == 0,
                "operand tiles keep the 1024-byte alignment of the 128B swizzle atom");

  static constexpr size_t smem_bytes(int stages) {
    return 1024 /* alignment slack */ + kEpilogueBytes + size_t(stages) * kStageBytes +
           prime_kernels::StageRing::barrier_bytes(stages);
  }
};

// Cooperative consumers of an e4m3 tile (MoeGemmTileE4m3): each warpgroup takes half of the
// weight rows (kBlockN / 128 m64 blocks) against all the tile's tokens, the wgmmas cut to the
// first 16, 32, 64 or kMmaN tokens as RegisterAConsumers' (tile_tokens, moe_gemm.cuh).
//   m_offset: the warpgroup's first token row of the tile (0);
//   n_offset: its first output column (weight row of the tile).
template <class Tile, class ALayout_, class BLayout_>
struct E4m3Consumers {
  using ALayout = ALayout_;  // the token rows (wgmma's B here)
  using BLayout = BLayout_;  // the weight rows (wgmma's A)
  static constexpr int kWarpgroups = 2;
  static constexpr bool kPingPong = false;
  static constexpr bool kRegisterA = false;
  static constexpr bool kE4m3 = true;
  static constexpr bool kTokensAlongN = true;  // the accumulators hold out^T
  static constexpr int kWarpgroupsPerStage = 2;
  static constexpr int kWgRows = Tile::kBlockN / 2;  // output columns per warpgroup
  static constexpr int kMmaM = kWgRows / 64;
  static constexpr int kMmaN = Tile::kBlockM;
  static constexpr int kNumMma = 1;
  using Mma = prime_kernels::WgmmaE4m3<kMmaN>;

  static_assert(!ALayout::kTrans && !BLayout::kTrans, "fp8 wgmma takes K-major operands only");
  static_assert(kWgRows % 64 == 0, "whole m64 blocks a warpgroup");

  __device__ __forceinline__ static int m_offset(int /*consumer*/) { return 0; }
  __device__ __forceinline__ static int n_offset(int consumer) { return consumer * kWgRows; }
};

}  // namespace prime_moe
