// The consumer's K loop over the stage ring for one tile: per K slice, wgmma from shared
// memory into fp32 registers, keeping one slice's wgmmas in flight and handing the stage
// before it back to the producer. The MMA atom is a parameter (Consumers::Mma, bf16 wgmma
// k16 today), so an fp8 atom or a dequantizing step slots in without another loop; so are
// the operand layouts (Consumers::ALayout, BLayout: K-major or MN-major tiles, wgmma.cuh),
// which give the descriptors and their K step.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mxfp8_fragment.cuh"
#include "prime_kernels/mbarrier.cuh"
#include "prime_kernels/pipeline.cuh"
#include "prime_kernels/wgmma.cuh"

namespace prime_moe {

// kClusterCtas > 1: the CTAs of a cluster fill each other's stages (multicast), and a stage
// goes back to the producers of all of them (StageRing::consumer_release_cluster).
template <class Tile, class Consumers, bool kFenceGenericWrites, int kClusterCtas = 1>
struct WarpgroupMainloop {
  using Mma = typename Consumers::Mma;
  using ALayout = typename Consumers::ALayout;
  using BLayout = typename Consumers::BLayout;
  // [64-row half of the warpgroup's rows][weight tile][wgmma registers]
  using Accumulators = float[Consumers::kMmaM][Consumers::kNumMma][Mma::kAccRegs];

  __device__ __forceinline__ static void release(const prime_kernels::StageRing& ring, int stage) {
    if constexpr (kClusterCtas == 1)
      ring.consumer_release(stage);
    else
      ring.consumer_release_cluster<kClusterCtas>(stage);
  }
  // The release of a stage the warpgroup also read through the generic proxy (ld.shared of
  // register-A fragments, scales, token factors), which the producer's TMA rewrites through the
  // async one: after a proxy fence, as the PTX ISA asks. The arrive alone does not wait for those
  // loads to return: ptxas issues it ahead of the uses of the e4m3 and f16 loops' last scale and
  // factor loads (SASS), and without the fence the refill overwrote some of them. At T = 1000,
  // E = 256, k = 8, zipf routing, split=false (H100, benchmarks/probes/mxfp8_repeat.py --poison)
  // 19 of 400 calls added wrong or NaN values into a tile's columns of out; with it, 0 of 400,
  // and the decode call measured even (T = 64: 0.999x).
  __device__ __forceinline__ static void release_read(const prime_kernels::StageRing& ring,
                                                      int stage) {
    prime_kernels::fence_proxy_async_shared();
    release(ring, stage);
  }

  // A tile this warpgroup has no work in (a 64-row half of padding, or a cluster's missing
  // tile) only passes its stages through, so the ring stays in step with the producer.
  __device__ __forceinline__ static void skip(const prime_kernels::StageRing& ring,
                                              prime_kernels::RingState& rs, int num_k_blocks) {
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      ring.consumer_wait(rs);
      release(ring, rs.stage);
      rs.advance(ring.stages);
    }
  }

  // acc = A[m_offset .. + 64 kMmaM) x B[n_offset .. + kNumMma * kMmaN)^T over all K slices.
  // issued() runs once every wgmma of the tile is issued, before they are waited for: a
  // ping-pong consumer passes its turn there, so the other warpgroup's first wgmmas queue
  // behind this one's last and the tensor pipe does not drain between tiles (CUTLASS's
  // ping-pong kernel does the same).
  template <class Issued>
  __device__ __forceinline__ static void run(Accumulators& acc,
                                             const prime_kernels::StageRing& ring,
                                             prime_kernels::RingState& rs, uint8_t* smem_a,
                                             uint8_t* smem_b, int m_offset, int n_offset,
                                             int num_k_blocks, Issued&& issued) {
    using namespace prime_kernels;
    // Fenced on both sides: without this one, ptxas may move the previous tile's epilogue
    // reads of the accumulators past the first wgmma and then serializes every wgmma of the
    // kernel (C7520, "WG.AR in divergent path"; dh's epilogue in the stores' layout did so:
    // 2.12 ms instead of 1.59 at Qwen3-30B-A3B T = 32768).
#pragma unroll
    for (int mh = 0; mh < Consumers::kMmaM; ++mh) {
#pragma unroll
      for (int b = 0; b < Consumers::kNumMma; ++b) wgmma_fence_operands(acc[mh][b]);
    }
    int prev_stage = 0;
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      ring.consumer_wait(rs);
      // cp.async wrote the A tile through the generic proxy; wgmma reads through the
      // async proxy.
      if constexpr (kFenceGenericWrites) fence_proxy_async_shared();
      // Row m (n) of a tile starts m * 128 bytes in, in either layout (wgmma.cuh).
      const uint64_t desc_a =
          ALayout::desc(smem_a + size_t(rs.stage) * Tile::kABytes + m_offset * 128);
      const uint64_t desc_b =
          BLayout::desc(smem_b + size_t(rs.stage) * Tile::kBBytes + n_offset * 128);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Tile::kBlockK / Mma::kK; ++kk) {
#pragma unroll
        for (int mh = 0; mh < Consumers::kMmaM; ++mh) {
#pragma unroll
          for (int b = 0; b < Consumers::kNumMma; ++b)
            Mma::mma(acc[mh][b], desc_add(desc_a, (mh * 64 * 128 >> 4) + ALayout::kDescPerK16 * kk),
                     desc_add(desc_b, (b * Tile::kBlockN * 128 >> 4) + BLayout::kDescPerK16 * kk),
                     (kb | kk) != 0);
        }
      }
      wgmma_commit();
      // Keep this K slice's wgmmas in flight; the previous slice's are done, so its stage
      // goes back to the producer.
      wgmma_wait<1>();
      if (kb > 0) release(ring, prev_stage);
      prev_stage = rs.stage;
      rs.advance(ring.stages);
    }
    issued();
    wgmma_wait<0>();
#pragma unroll
    for (int mh = 0; mh < Consumers::kMmaM; ++mh) {
#pragma unroll
      for (int b = 0; b < Consumers::kNumMma; ++b) wgmma_fence_operands(acc[mh][b]);
    }
    release(ring, prev_stage);
  }
};

// Calls f(std::integral_constant<int, N>{}) with N the smallest of 16, 32, 64 and kMaxN (a tile's
// tokens: the largest wgmma N) that covers n_tokens: the register-A and e4m3 loops cut their
// wgmmas' N to a tile's routed tokens so (tile_tokens, moe_gemm.cuh).
template <int kMaxN, class F>
__device__ __forceinline__ auto with_token_n(int n_tokens, F&& f) {
  if (n_tokens <= 16) return f(std::integral_constant<int, 16>{});
  if (n_tokens <= 32) return f(std::integral_constant<int, 32>{});
  if constexpr (kMaxN > 64) {
    if (n_tokens <= 64) return f(std::integral_constant<int, 64>{});
  }
  return f(std::integral_constant<int, kMaxN>{});
}

// Byte offset in a stage's B buffer of weight row r's scale word (the stage's four 32-blocks of
// the row, a byte each) in weight tile `tile`: the blocked layout's 128-row scale tiles
// (mxfp8_loaders.cuh) after the tiles' weight bytes; r counts from the tile's first scale block.
template <class Tile>
__device__ __forceinline__ int stage_scale_word(int tile, int r) {
  return Tile::kWeightBytes + (tile * Tile::kScaleBlocks + r / 128) * 512 + (r % 32) * 16 +
         (r % 128) / 32 * 4;
}

// The register-A consumers' per-thread addresses in a stage's B buffer (WarpgroupMainloopRS and
// WarpgroupMainloopF16): byte offsets of the thread's fragment rows r0 (i = 0) and r1 (i = 1) of
// each m64 block (Consumers::stage_row) in the stage's K atom 0, at the thread's first byte column
// (column), and of their scale bytes in the tile's scale blocks (scale_row0: the tile's first
// weight row modulo 128).
template <class Tile, class Consumers>
__device__ __forceinline__ void register_a_rows(int warp, int g, int column, int row_offset,
                                                int scale_row0,
                                                int (&value_at)[Consumers::kMmaM][2],
                                                int (&scale_at)[Consumers::kMmaM][2]) {
#pragma unroll
  for (int mh = 0; mh < Consumers::kMmaM; ++mh) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int tile = Consumers::stage_tile(mh, i);
      const int row = Consumers::tile_row(mh, i, warp, g, row_offset);
      value_at[mh][i] = (tile * Tile::kBlockN + row) * 64 + column;
      scale_at[mh][i] = stage_scale_word<Tile>(tile, scale_row0 + row);
    }
  }
}

// k16 step kk's descriptor of a stage's token rows (wgmma's B in the register-A loops), from the
// stage's.
template <class Tile, class ALayout>
__device__ __forceinline__ uint64_t token_desc_step(uint64_t desc, int kk) {
  return prime_kernels::desc_add(
      desc, (kk / 4) * (Tile::kAAtomBytes >> 4) + ALayout::kDescPerK16 * (kk % 4));
}

// The register-A consumer loop (RegisterAConsumers, MoeGemmTileRS): per K slice, each thread
// reads its weight rows' e4m3 bytes and scale bytes from the stage (LDS.U16, conflict-free in
// the 64-byte swizzle), widens them to bf16 A fragments in registers (mxfp8_fragment.cuh) and
// issues wgmma RS against the stage's token rows (B by descriptor): acc = W[rows] x T^T, out^T.
// The ring handling (waits, releases, skip) is WarpgroupMainloop's.
//
// Per k16 step kk (one commit group: the kMmaM m64 wgmmas), the fragments are double-buffered:
// step kk's are converted while step kk - 1's wgmmas run, into the buffer step kk - 2 used,
// which wgmma_wait<1> after step kk - 1's issue retired; the next step's bytes are loaded
// before that wait, so their latency hides behind it. A stage goes back to the producer once its
// last step's group is retired (at the next slice's first wait), after a proxy fence
// (WarpgroupMainloop::release_read).
template <class Tile, class Consumers, bool kFenceGenericWrites>
struct WarpgroupMainloopRS : WarpgroupMainloop<Tile, Consumers, kFenceGenericWrites> {
  using Base = WarpgroupMainloop<Tile, Consumers, kFenceGenericWrites>;
  using Mma = typename Consumers::Mma;
  using ALayout = typename Consumers::ALayout;
  static constexpr int kMmaM = Consumers::kMmaM;
  static constexpr int kSteps = Tile::kBlockK / Mma::kK;
  // [m64 block][wgmma registers]
  using Accumulators = float[kMmaM][Mma::kAccRegs];

  // k16 steps widened and issued together: two (a 32-block) with one m64 block a warpgroup,
  // whose widening chains were too few to hide their latency (ncu: one instruction issued every
  // 5-6 cycles a warp, benchmarks/RESULTS.md 2026-12-04); one with two m64 blocks, whose
  // registers are spent.
  static constexpr int kRound = kMmaM == 1 ? 2 : 1;
  static constexpr int kRounds = kSteps / kRound;
  static_assert(kRounds % 2 == 0, "a slice's rounds alternate the two fragment buffers");
  static_assert(kRound * Mma::kK <= 32, "a round's steps share one 32-block's scales");

  // token_offset: the warpgroup's first token row (Consumers::m_offset); row_offset: its first
  // weight row of each tile (n_offset); scale_row0: the tile's first weight row modulo 128 (n0 %
  // 128: 64 for the odd 64-row tiles, which sit in the upper half of a 128-row scale block;
  // 0, 96, 64 or 32 for the 96-row tiles). Rows past the tile's scale blocks cannot occur: a
  // 64- or 128-row tile starting at n0 % 128 in {0, 64} ends inside its 128-row block, a 96-row
  // one ends inside the second of its two (n0 % 128 + 96 <= 192), a larger one starts at 0.
  // Whether the tile cuts its wgmmas' N to its tokens: not the gate/up tile with two m64 blocks
  // of weight rows a warpgroup (block_n >= 128: 128 accumulators beside the SwiGLU's gate and
  // up fragments), where a K loop per N spilled 100 bytes (ptxas); its decode-sized
  // configurations take block_n = 64 instead (resolve_config).
  static constexpr bool kCutsTokens = !(Tile::kNumB == 2 && kMmaM == 2);

  // n_tokens: the tokens wgmma multiplies, a multiple of 16 that covers every routed row of the
  // tile (tile_tokens, moe_gemm.cuh); the accumulators of the tokens past it are left as they
  // were (a non-wgmma write to them would serialize every wgmma, C7515), and the epilogues skip
  // them. Returns the tile's NaN rows: bit 2 mh + i set where the thread's weight row r_i of
  // m64 block mh held an e4m3 NaN byte in any column (mxfp8_fragment.cuh), whose outputs the
  // epilogue makes NaN (the accumulators cannot be written here, for the same reason).
  // barrier_id: the warpgroup's named barrier (moe_gemm.cuh), for loops that vote per tile.
  template <class Issued>
  __device__ __forceinline__ static uint32_t run(Accumulators& acc,
                                                 const prime_kernels::StageRing& ring,
                                                 prime_kernels::RingState& rs, uint8_t* smem_a,
                                                 uint8_t* smem_b, int token_offset, int row_offset,
                                                 int scale_row0, int num_k_blocks, int n_tokens,
                                                 int /*barrier_id*/, Issued&& issued) {
    if (!kCutsTokens)
      return run_n<Mma>(acc, ring, rs, smem_a, smem_b, token_offset, row_offset, scale_row0,
                        num_k_blocks, issued);
    return with_token_n<2 * Mma::kAccRegs>(n_tokens, [&](auto n) {
      return run_n<prime_kernels::WgmmaBf16RS<n, ALayout::kTrans>>(
          acc, ring, rs, smem_a, smem_b, token_offset, row_offset, scale_row0, num_k_blocks,
          issued);
    });
  }

  // The K loop with wgmma N = MmaN's (at most Mma's: the accumulators' first registers).
  template <class MmaN, class Issued>
  __device__ __forceinline__ static uint32_t run_n(Accumulators& acc,
                                                   const prime_kernels::StageRing& ring,
                                                   prime_kernels::RingState& rs, uint8_t* smem_a,
                                                   uint8_t* smem_b, int token_offset,
                                                   int row_offset, int scale_row0, int num_k_blocks,
                                                   Issued& issued) {
    using namespace prime_kernels;
    static_assert(MmaN::kAccRegs <= Mma::kAccRegs, "a prefix of the tile's tokens");
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int g = lane / 4, q = lane % 4;
    // The 64-byte swizzle XORs the 16-byte chunk with (row / 2) % 4, which is (g / 2) % 4 for
    // all the thread's rows (every stage row is g modulo 8).
    const int swizzle = (g >> 1) & 3;
    int value_at[kMmaM][2], scale_at[kMmaM][2];
    register_a_rows<Tile, Consumers>(warp, g, 2 * q, row_offset, scale_row0, value_at, scale_at);
#pragma unroll
    for (int mh = 0; mh < kMmaM; ++mh) wgmma_fence_operands(acc[mh]);
    uint32_t frag[2][kMmaM][kRound][4];
    // e4m3_nan_bytes of every fragment of the tile, m64 block mh's shifted right by mh: one
    // register (one per block spilled in the gate/up tile with two m64 blocks a warpgroup).
    uint32_t nan_bytes = 0;
    int prev_stage = 0;
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      ring.consumer_wait(rs);
      if constexpr (kFenceGenericWrites) fence_proxy_async_shared();
      const uint32_t weights = smem_addr(smem_b) + rs.stage * Tile::kBBytes;
      const uint64_t desc_b =
          ALayout::desc(smem_a + size_t(rs.stage) * Tile::kABytes + token_offset * 128);
      const auto desc_b_step = [&](int kk) { return token_desc_step<Tile, ALayout>(desc_b, kk); };
      // The slice's four 32-blocks' scales of rows r0 and r1 (one 4-byte read each, a byte a
      // block); each round works out its block's bf16x2 multipliers and whether both are
      // fast-path scales (kept for the whole slice, the four blocks' of them spilled at two CTAs
      // an SM).
      uint32_t scales[kMmaM][2];
#pragma unroll
      for (int mh = 0; mh < kMmaM; ++mh) {
#pragma unroll
        for (int i = 0; i < 2; ++i) scales[mh][i] = ld_shared_u32(weights + scale_at[mh][i]);
      }
      // A round is kRound k16 steps of one 32-block: their fragments are widened under one
      // branch (mxfp8_fragments) and their wgmmas issued as one commit group.
      uint32_t raw[kMmaM][kRound][2];
      const auto load_raw = [&](int round) {
#pragma unroll
        for (int s = 0; s < kRound; ++s) {
          const int kk = round * kRound + s;
#pragma unroll
          for (int mh = 0; mh < kMmaM; ++mh) {
            // 64-byte rows of K atom kk / 4, 16-byte chunk kk % 4 (swizzled)
            const uint32_t chunk = (kk / 4) * Tile::kWeightAtomBytes + 16 * ((kk % 4) ^ swizzle);
            const uint32_t r0 = weights + value_at[mh][0] + chunk;
            const uint32_t r1 = weights + value_at[mh][1] + chunk;
            const uint32_t r0_lo = ld_shared_u16(r0);
            const uint32_t r1_lo = ld_shared_u16(r1);
            const uint32_t r0_hi = ld_shared_u16(r0 + 8);
            const uint32_t r1_hi = ld_shared_u16(r1 + 8);
            raw[mh][s][0] = mxfp8_fragment_word(r0_lo, r1_lo);
            raw[mh][s][1] = mxfp8_fragment_word(r0_hi, r1_hi);
          }
        }
      };
      load_raw(0);
#pragma unroll
      for (int round = 0; round < kRounds; ++round) {
        const int buf = round % 2;
        const int block = round * kRound / 2;  // the round's 32-block: a byte of the scale reads
#pragma unroll
        for (int mh = 0; mh < kMmaM; ++mh) {
          const uint32_t s0 = (scales[mh][0] >> (8 * block)) & 0xFF;
          const uint32_t s1 = (scales[mh][1] >> (8 * block)) & 0xFF;
          mxfp8_fragments(raw[mh], mxfp8_fast_scale_bf16x2(s0), mxfp8_fast_scale_bf16x2(s1),
                          max(s0, s1) <= kMxfp8FastScaleMax, frag[buf][mh]);
#pragma unroll
          for (int s = 0; s < kRound; ++s) {
            nan_bytes |= (e4m3_nan_bytes(raw[mh][s][0], raw[mh][s][1]) & 0x80808080u) >> mh;
            wgmma_fence_operands(frag[buf][mh][s]);
          }
        }
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < kRound; ++s) {
          const int kk = round * kRound + s;
#pragma unroll
          for (int mh = 0; mh < kMmaM; ++mh)
            MmaN::mma(acc[mh], frag[buf][mh][s], desc_b_step(kk), (kb | kk) != 0);
        }
        wgmma_commit();
        if (round + 1 < kRounds) load_raw(round + 1);
        wgmma_wait<1>();
        if (round == 0 && kb > 0) Base::release_read(ring, prev_stage);
      }
      prev_stage = rs.stage;
      rs.advance(ring.stages);
    }
    issued();
    wgmma_wait<0>();
#pragma unroll
    for (int mh = 0; mh < kMmaM; ++mh) wgmma_fence_operands(acc[mh]);
    Base::release_read(ring, prev_stage);
    uint32_t nan_rows = 0;
#pragma unroll
    for (int mh = 0; mh < kMmaM; ++mh) {
      nan_rows |= uint32_t((nan_bytes & (kNanBytesRow0 >> mh)) != 0) << (2 * mh);
      nan_rows |= uint32_t((nan_bytes & (kNanBytesRow1 >> mh)) != 0) << (2 * mh + 1);
    }
    // A thread holds 4 of each k16 step's 16 columns of its rows: the quad's four threads hold
    // the rest, and each writes other token columns of the same rows, so every one of them
    // needs the whole rows' flags.
    nan_rows |= __shfl_xor_sync(0xFFFFFFFFu, nan_rows, 1);
    nan_rows |= __shfl_xor_sync(0xFFFFFFFFu, nan_rows, 2);
    return nan_rows;
  }
};

// The e4m3 consumer loop (E4m3Consumers, MoeGemmTileE4m3): per 32-wide MX block of a stage, one
// fp8 wgmma (SS: weights as A, token rows as B, both by descriptor) sums the block's exact e4m3
// products into a temporary (scale-d = 0), and the thread adds it into its fp32 accumulators
// times the weight row's scale and the token's (powers of two: exact but past fp32's range). So
// no instruction touches a weight byte, and per block and m64 a thread spends N fp32 operations
// on the promotion, against the register-A loop's widening of its weight fragment (about 60
// instructions a block whatever N): fewer at decode sizes (N = 16 to 64).
//
// Numerics: the tensor core keeps about 14 significant bits of a block's 32 products
// (benchmarks/probes/fp8_wgmma_sums.cu); in the down GEMM that leaves the forward 5.7-9.1e-4 from
// exact MX against the tests' 3e-3 (emulated, docs/flash_moe_mxfp8_design.md), where the gate/up
// GEMM would flip h's re-quantizations. An e4m3 NaN byte makes its products NaN in the tensor
// core, and a NaN scale (0xFF weight scale, or the NaN h scale of a block holding NaN or +-Inf)
// the block's promotion: no flags.
//
// The wgmmas of kBatch blocks (as many temporaries as the tile's own accumulators hold) are
// issued together and waited for together, then promoted: reading one temporary while a wgmma
// into another is in flight makes ptxas serialize every wgmma (C7514), so the overlap of the
// promotion with the tensor core comes from the other consumer warps (two CTAs an SM at decode
// sizes: four a scheduler), as in DeepGEMM's and CUTLASS's fp8 block-scaled mainloops. A stage
// goes back to the producer once its last block is promoted (the promotion reads its scales),
// after a proxy fence (WarpgroupMainloop::release_read).
template <class Tile, class Consumers, bool kFenceGenericWrites>
struct WarpgroupMainloopE4m3 : WarpgroupMainloop<Tile, Consumers, kFenceGenericWrites> {
  using Base = WarpgroupMainloop<Tile, Consumers, kFenceGenericWrites>;
  using Mma = typename Consumers::Mma;
  static constexpr int kMmaM = Consumers::kMmaM;
  static constexpr int kBlocks = Tile::kBlockK / Mma::kK;  // MX blocks a stage
  using Accumulators = float[kMmaM][Mma::kAccRegs];
  static constexpr bool kCutsTokens = true;
  static_assert(Mma::kK == 32, "one wgmma a 32-wide MX block");
  static_assert(kBlocks == Tile::kMxBlocks, "the stage's token scale runs");

  // As WarpgroupMainloopRS::run (n_tokens: the tokens the wgmmas multiply); returns no NaN rows.
  template <class Issued>
  __device__ __forceinline__ static uint32_t run(Accumulators& acc,
                                                 const prime_kernels::StageRing& ring,
                                                 prime_kernels::RingState& rs, uint8_t* smem_a,
                                                 uint8_t* smem_b, int token_offset, int row_offset,
                                                 int scale_row0, int num_k_blocks, int n_tokens,
                                                 int /*barrier_id*/, Issued&& issued) {
    with_token_n<2 * Mma::kAccRegs>(n_tokens, [&](auto n) {
      run_n<prime_kernels::WgmmaE4m3<n>>(acc, ring, rs, smem_a, smem_b, token_offset, row_offset,
                                         scale_row0, num_k_blocks, issued);
    });
    return 0u;
  }

  template <class MmaN, class Issued>
  __device__ __forceinline__ static void run_n(Accumulators& acc,
                                               const prime_kernels::StageRing& ring,
                                               prime_kernels::RingState& rs, uint8_t* smem_a,
                                               uint8_t* smem_b, int token_offset, int row_offset,
                                               int scale_row0, int num_k_blocks, Issued& issued) {
    using namespace prime_kernels;
    constexpr int kRegs = MmaN::kAccRegs;
    constexpr int kTokenPairs = kRegs / 4;  // the thread's token pairs (8 j + 2 q, + 1)
    constexpr int kBatch = Mma::kAccRegs / kRegs < kBlocks ? Mma::kAccRegs / kRegs : kBlocks;
    static_assert(kBatch >= 1 && kBlocks % kBatch == 0, "whole batches of a stage's blocks");
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int g = lane / 4, q = lane % 4;
    // The thread's weight rows r_i = 16 warp + g + 8 i of each m64 block: their scale bytes (one a
    // block of the stage) in the stage's scale blocks, as the register-A loop reads them.
    int scale_at[kMmaM][2];
#pragma unroll
    for (int mh = 0; mh < kMmaM; ++mh) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        scale_at[mh][i] =
            stage_scale_word<Tile>(0, scale_row0 + row_offset + 64 * mh + 16 * warp + 8 * i + g);
      }
    }
    const int token_scale_at = Tile::kTokenBytes + (token_offset + 2 * q) * 4;
    float tmp[kBatch][kMmaM][kRegs];
    // The stage's weight row scales as fp32 (row r_i of m64 block mh, block b): one 4-byte read a
    // row, each byte moved into an fp32 exponent field (2^(s - 127) for s in [1, 254]); a word
    // holding 0x00 (2^-127, an fp32 subnormal) or 0xFF (NaN) takes mxfp8_scale_value.
    float row_scale[kMmaM][2][kBlocks];
    const auto read_row_scales = [&](uint32_t stage_b) {
#pragma unroll
      for (int mh = 0; mh < kMmaM; ++mh) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          mxfp8_scale_values(ld_shared_u32(stage_b + scale_at[mh][i]), row_scale[mh][i]);
        }
      }
    };
    // acc += tmp x the block's weight row scale x its token scale, for every accumulator of the
    // thread (register 4 j + 2 i + c: row r_i, token 8 j + 2 q + c).
    const auto promote = [&](const float(&t)[kMmaM][kRegs], uint32_t stage_a, int b) {
      float2 token_scale[kTokenPairs];
      const uint32_t run = stage_a + token_scale_at + b * Tile::kBlockM * 4;
#pragma unroll
      for (int j = 0; j < kTokenPairs; ++j) token_scale[j] = ld_shared_f32x2(run + 32 * j);
#pragma unroll
      for (int mh = 0; mh < kMmaM; ++mh) {
#pragma unroll
        for (int r = 0; r < kRegs; ++r) {
          const float2 ts = token_scale[r / 4];
          acc[mh][r] =
              fmaf(t[mh][r] * row_scale[mh][(r / 2) % 2][b], r % 2 ? ts.y : ts.x, acc[mh][r]);
        }
      }
    };
#pragma unroll
    for (int mh = 0; mh < kMmaM; ++mh) {
#pragma unroll
      for (int r = 0; r < kRegs; ++r) acc[mh][r] = 0.0f;
    }
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      ring.consumer_wait(rs);
      if constexpr (kFenceGenericWrites) fence_proxy_async_shared();
      const uint32_t stage_a = smem_addr(smem_a + size_t(rs.stage) * Tile::kABytes);
      const uint32_t stage_b = smem_addr(smem_b + size_t(rs.stage) * Tile::kBBytes);
      // The blocks' K steps and the m64 blocks' rows by desc_add (64-bit adds took 40 IMAD and
      // IADD3 a stage at N = 16, SASS).
      const uint64_t desc_w =
          SmemKMajor::desc(smem_b + size_t(rs.stage) * Tile::kBBytes + row_offset * 128);
      const uint64_t desc_t =
          SmemKMajor::desc(smem_a + size_t(rs.stage) * Tile::kABytes + token_offset * 128);
      read_row_scales(stage_b);
#pragma unroll
      for (int b0 = 0; b0 < kBlocks; b0 += kBatch) {
#pragma unroll
        for (int bb = 0; bb < kBatch; ++bb) {
#pragma unroll
          for (int mh = 0; mh < kMmaM; ++mh) wgmma_fence_operands(tmp[bb][mh]);
        }
        wgmma_fence();
#pragma unroll
        for (int bb = 0; bb < kBatch; ++bb) {
          const uint32_t k_step = uint32_t(b0 + bb) * MmaN::kDescPerK32;
#pragma unroll
          for (int mh = 0; mh < kMmaM; ++mh)
            MmaN::mma(tmp[bb][mh], desc_add(desc_w, (64 * mh * 128 >> 4) + k_step),
                      desc_add(desc_t, k_step), 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int bb = 0; bb < kBatch; ++bb) {
#pragma unroll
          for (int mh = 0; mh < kMmaM; ++mh) wgmma_fence_operands(tmp[bb][mh]);
          promote(tmp[bb], stage_a, b0 + bb);
        }
      }
      Base::release_read(ring, rs.stage);
      rs.advance(ring.stages);
    }
    issued();
  }
};

// The f16 consumer loop of the decode gate/up tile (RegisterAConsumers on MoeGemmTileRS with
// kF16Tokens): the register-A loop's operands with the e4m3 loop's promotion. Per 32-wide MX
// block a thread reads 8 bytes of each of its two weight rows with one LDS.64 and converts each
// byte pair by one cvt.rn.f16x2.e4m3x2 to f16, unscaled (exact: e4m3's range is inside f16's);
// the token rows are x's unscaled e4m3 values as f16, each block's K in the order those reads
// give the fragments (x's pre-pass, mxfp8_f16_position). Per block two f16
// wgmma RS sum the block's exact products into a temporary, which the thread adds into its fp32
// accumulators times the weight row's scale and the token's, as WarpgroupMainloopE4m3 does.
//
// Why: at decode sizes the register-A loop's widening to bf16 (about nine instructions a
// fragment word, NaN flags, the scale tests) made the gate/up GEMM issue-bound: ncu, H100,
// Qwen3-30B-A3B T = 64: issue slots 70% busy, about 426 instructions a warp per 128-wide stage at
// N = 16, and on an H200 the MXFP8 decode call ran barely faster than on an H100 (benchmarks/
// RESULTS.md twenty-third session). Here a block costs 2 loads, 8 conversions, 2 wgmmas and the
// promotion's 2 N/8 fp32 operations a thread. The N = 16 loop: 314 SASS instructions a warp per
// 128-wide stage (8 LDS.64 and 32 F2FP for the weights, 32 FMUL and 32 FFMA for the promotion),
// 295 executed a stage under ncu, against about 426 executed by the widening loop. H100, moe_align
// + fused_moe_mxfp8 at T = 64 against the widening loop: 1.058x Qwen3-30B-A3B, 1.017x
// DeepSeek-V3-32 with byte-pair reads (LDS.U16), 1.003-1.012x more with the 8-byte reads, where
// memory comes close to binding. At N = 64 the promotion costs about what the widening does, so
// the loop is the 64 x 64 tile's only.
//
// Numerics: f16 products of two 4-bit significands are exact and the tensor core sums f16
// products as it sums bf16 ones (fp32); each block's promotion rounds once in fp32: exact MX to
// the tests' 3e-3, as the e4m3 down GEMM. An e4m3 NaN byte converts to an f16 NaN, which the
// tensor core propagates (no flags), and a NaN scale (0xFF) makes the block's promotion NaN.
//
// A batch of blocks (as many temporaries and fragments as the two-CTA tile's 104 registers
// leave beside its 32 accumulators: two blocks at N = 16, one above) is issued, waited for and
// promoted together: a promotion that read one temporary while a wgmma into another was in
// flight made ptxas serialize every wgmma (C7514, WarpgroupMainloopE4m3). The other consumer
// warps (four a scheduler at two CTAs an SM) overlap the wait. A stage goes back to the producer
// once its last block is promoted (the promotion reads its scales).
template <class Tile, class Consumers, bool kFenceGenericWrites>
struct WarpgroupMainloopF16 : WarpgroupMainloop<Tile, Consumers, kFenceGenericWrites> {
  using Base = WarpgroupMainloop<Tile, Consumers, kFenceGenericWrites>;
  using Mma = typename Consumers::Mma;
  using ALayout = typename Consumers::ALayout;
  static constexpr int kMmaM = Consumers::kMmaM;
  static constexpr int kBlocks = Tile::kBlockK / 32;  // MX blocks a stage
  using Accumulators = float[kMmaM][Mma::kAccRegs];
  static constexpr bool kCutsTokens = true;
  static_assert(Tile::kF16Tokens && Tile::kTokenScaleBytes == Tile::kBlockM * kBlocks * 4,
                "f16 token rows, then their fp32 scales");
  static_assert(Mma::kK == 16, "two k16 steps a 32-wide block");

  // As WarpgroupMainloopRS::run (n_tokens: the tokens the wgmmas multiply); returns no NaN rows.
  template <class Issued>
  __device__ __forceinline__ static uint32_t run(Accumulators& acc,
                                                 const prime_kernels::StageRing& ring,
                                                 prime_kernels::RingState& rs, uint8_t* smem_a,
                                                 uint8_t* smem_b, int token_offset, int row_offset,
                                                 int scale_row0, int num_k_blocks, int n_tokens,
                                                 int barrier_id, Issued&& issued) {
    with_token_n<2 * Mma::kAccRegs>(n_tokens, [&](auto n) {
      constexpr int kChunkN = n < kMaxChunkN ? int(n) : kMaxChunkN;
      using MmaN = prime_kernels::WgmmaF16RS<kChunkN, ALayout::kTrans>;
      constexpr int kChunks = n / kChunkN;
      if (tokens_rebased<MmaN::kAccRegs, kChunks>(ring, rs, smem_a, token_offset, barrier_id))
        run_n<MmaN, kChunks, true>(acc, ring, rs, smem_a, smem_b, token_offset, row_offset,
                                   scale_row0, num_k_blocks, issued);
      else
        run_n<MmaN, kChunks, false>(acc, ring, rs, smem_a, smem_b, token_offset, row_offset,
                                    scale_row0, num_k_blocks, issued);
    });
    return 0u;
  }

  // Byte offset in a stage's A buffer of the factor of block b of the thread's token
  // 8 j + 2 q + cc of chunk c (kRegs accumulators a chunk), from the thread's first
  // (token_factors_at): [token][block] after the token rows.
  __device__ __forceinline__ static int token_factors_at(int token_offset) {
    return Tile::kTokenBytes + (token_offset + 2 * (threadIdx.x % 4)) * 16;
  }
  template <int kRegs>
  __device__ __forceinline__ static constexpr int token_factor_offset(int c, int j, int cc, int b) {
    return (2 * kRegs * c + 8 * j + cc) * 16 + b * 4;
  }

  // Whether x's pre-pass rebased every token of the tile (mxfp8_dequantize.cuh: each factor of a
  // rebased token is -2^(b - 127), NaN's sign set for b = 255; a row with no pair is zero-filled):
  // then each block's sum needs only the weight row's scale, and the token's factor comes once at
  // the end (12% fewer instructions in the N = 16 loop; at T = 64 on an H200, where this loop is
  // what binds, 1.03x at Qwen3-30B-A3B and 1.06x at DeepSeek-V3-32 and Mixtral-8x7B). Read from
  // the tile's first stage, whose wait the loop's first wait repeats.
  template <int kRegs, int kChunks>
  __device__ __forceinline__ static bool tokens_rebased(const prime_kernels::StageRing& ring,
                                                        const prime_kernels::RingState& rs,
                                                        uint8_t* smem_a, int token_offset,
                                                        int barrier_id) {
    using namespace prime_kernels;
    ring.consumer_wait(rs);
    if constexpr (kFenceGenericWrites) fence_proxy_async_shared();
    const uint32_t factors =
        smem_addr(smem_a) + rs.stage * Tile::kABytes + token_factors_at(token_offset);
    bool rebased = true;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
#pragma unroll
      for (int j = 0; j < kRegs / 4; ++j) {
#pragma unroll
        for (int cc = 0; cc < 2; ++cc)
          rebased &= int32_t(ld_shared_u32(factors + token_factor_offset<kRegs>(c, j, cc, 0))) <= 0;
      }
    }
    return !warpgroup_any(!rebased, barrier_id);
  }

  // The wgmmas' N is at most 32 tokens: a tile of 64 runs each block as two 32-token chunks on
  // the same fragments, each waited for and promoted before the next (a 64-token temporary beside
  // the 32 accumulators spilled 28 bytes at two CTAs an SM, ptxas).
  static constexpr int kMaxChunkN = 32;

  template <class MmaN, int kChunks, bool kRebased, class Issued>
  __device__ __forceinline__ static void run_n(Accumulators& acc,
                                               const prime_kernels::StageRing& ring,
                                               prime_kernels::RingState& rs, uint8_t* smem_a,
                                               uint8_t* smem_b, int token_offset, int row_offset,
                                               int scale_row0, int num_k_blocks, Issued& issued) {
    using namespace prime_kernels;
    constexpr int kRegs = MmaN::kAccRegs;   // a chunk's accumulator registers
    constexpr int kTokenPairs = kRegs / 4;  // the thread's token pairs of a chunk (8 j + 2 q, + 1)
    constexpr int kBatch = kRegs <= 8 ? 2 : 1;
    static_assert(kBlocks % kBatch == 0, "whole batches of a stage's blocks");
    static_assert(kChunks == 1 || kBatch == 1, "chunks of one block at a time");
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int g = lane / 4, q = lane % 4;
    // The thread's fragment rows r0 (i = 0) and r1 (i = 1) of each m64 block in the stage's weight
    // atoms, and their scale bytes, as WarpgroupMainloopRS addresses them; but the thread reads a
    // block's bytes 8 q .. 8 q + 7 of each row with one 8-byte load (x's pre-pass writes the
    // tokens' K in the matching order, mxfp8_f16_position): 16-byte chunk 2 (b % 2) + q / 2 of
    // the row's 64-byte atom row, swizzled, and its half q % 2.
    const int swizzle = (g >> 1) & 3;
    const uint32_t block_chunk[2] = {uint32_t(16 * ((q >> 1) ^ swizzle)),
                                     uint32_t(16 * ((2 + (q >> 1)) ^ swizzle))};
    int value_at[kMmaM][2], scale_at[kMmaM][2];
    register_a_rows<Tile, Consumers>(warp, g, 8 * (q & 1), row_offset, scale_row0, value_at,
                                     scale_at);
    // The stage's weight row scales as fp32, worked out once a stage (WarpgroupMainloopE4m3); at
    // 64 tokens, where those 8 registers spilled (ptxas), each block's from the scale words.
    constexpr bool kScaleTable = kChunks == 1;
    float row_scale[kMmaM][2][kBlocks];
    uint32_t row_scale_word[kMmaM][2];
    const auto read_row_scales = [&](uint32_t weights) {
#pragma unroll
      for (int mh = 0; mh < kMmaM; ++mh) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const uint32_t word = ld_shared_u32(weights + scale_at[mh][i]);
          if constexpr (kScaleTable)
            mxfp8_scale_values(word, row_scale[mh][i]);
          else
            row_scale_word[mh][i] = word;
        }
      }
    };
    // The factor of block b of the thread's token 8 j + 2 q + cc of chunk c.
    const int factors_at = token_factors_at(token_offset);
    const auto token_factor = [&](uint32_t stage_a, int c, int j, int cc, int b) {
      return __uint_as_float(
          ld_shared_u32(stage_a + factors_at + token_factor_offset<kRegs>(c, j, cc, b)));
    };
    // acc += tmp x the block's weight row scale (x its token's factor unless kRebased: a rebased
    // token's factor, the same for every block, is applied once after the loop), for the tokens
    // of chunk c (register 4 j + 2 i + c' of the chunk: row r_i, token kChunkN c + 8 j + 2 q + c',
    // which is the tile's register kRegs c + 4 j + 2 i + c'). A tile of some rebased tokens and
    // some not takes every block's factors: a rebased token's are negative, hence fabsf.
    const auto promote = [&](const float(&t)[kMmaM][kRegs], uint32_t stage_a, int b, int c) {
      float token_scale[kTokenPairs][2];
      if constexpr (!kRebased) {
#pragma unroll
        for (int j = 0; j < kTokenPairs; ++j) {
#pragma unroll
          for (int cc = 0; cc < 2; ++cc)
            token_scale[j][cc] = fabsf(token_factor(stage_a, c, j, cc, b));
        }
      }
#pragma unroll
      for (int mh = 0; mh < kMmaM; ++mh) {
        float rows[2];
#pragma unroll
        for (int i = 0; i < 2; ++i)
          rows[i] = kScaleTable ? row_scale[mh][i][b]
                                : mxfp8_scale_value((row_scale_word[mh][i] >> (8 * b)) & 0xFFu);
#pragma unroll
        for (int r = 0; r < kRegs; ++r) {
          float& a = acc[mh][kRegs * c + r];
          if constexpr (kRebased)
            a = fmaf(t[mh][r], rows[(r / 2) % 2], a);
          else
            a = fmaf(t[mh][r] * rows[(r / 2) % 2], token_scale[r / 4][r % 2], a);
        }
      }
    };
#pragma unroll
    for (int mh = 0; mh < kMmaM; ++mh) {
#pragma unroll
      for (int r = 0; r < kRegs * kChunks; ++r) acc[mh][r] = 0.0f;
    }
    float tmp[kBatch][kMmaM][kRegs];
    uint32_t frag[kBatch][kMmaM][2][4];
    for (int kb = 0; kb < num_k_blocks; ++kb) {
      ring.consumer_wait(rs);
      if constexpr (kFenceGenericWrites) fence_proxy_async_shared();
      const uint32_t weights = smem_addr(smem_b) + rs.stage * Tile::kBBytes;
      const uint32_t stage_a = smem_addr(smem_a) + rs.stage * Tile::kABytes;
      const uint64_t desc_b =
          ALayout::desc(smem_a + size_t(rs.stage) * Tile::kABytes + token_offset * 128);
      const auto desc_b_step = [&](int kk) { return token_desc_step<Tile, ALayout>(desc_b, kk); };
      read_row_scales(weights);
#pragma unroll
      for (int b0 = 0; b0 < kBlocks; b0 += kBatch) {
#pragma unroll
        for (int bb = 0; bb < kBatch; ++bb) {
          const int b = b0 + bb;
          const uint32_t chunk = (b / 2) * Tile::kWeightAtomBytes + block_chunk[b % 2];
#pragma unroll
          for (int mh = 0; mh < kMmaM; ++mh) {
            // Bytes m = 0 .. 7 of rows r0 and r1: the pairs m = 0-1 and 2-3 are k16 step 0's
            // columns 2q, 2q + 1 and 2q + 8, 2q + 9; m = 4-7 the same of step 1.
            const uint2 w0 = ld_shared_u32x2(weights + value_at[mh][0] + chunk);
            const uint2 w1 = ld_shared_u32x2(weights + value_at[mh][1] + chunk);
            frag[bb][mh][0][0] = e4m3x2_to_f16x2(w0.x);
            frag[bb][mh][0][1] = e4m3x2_to_f16x2(w1.x);
            frag[bb][mh][0][2] = e4m3x2_hi_to_f16x2(w0.x);
            frag[bb][mh][0][3] = e4m3x2_hi_to_f16x2(w1.x);
            frag[bb][mh][1][0] = e4m3x2_to_f16x2(w0.y);
            frag[bb][mh][1][1] = e4m3x2_to_f16x2(w1.y);
            frag[bb][mh][1][2] = e4m3x2_hi_to_f16x2(w0.y);
            frag[bb][mh][1][3] = e4m3x2_hi_to_f16x2(w1.y);
#pragma unroll
            for (int s = 0; s < 2; ++s) wgmma_fence_operands(frag[bb][mh][s]);
          }
#pragma unroll
          for (int mh = 0; mh < kMmaM; ++mh) wgmma_fence_operands(tmp[bb][mh]);
        }
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          // Chunk c's token rows start kChunkN c rows (of 128 bytes) into each K atom.
          const uint32_t chunk_rows = uint32_t(2 * kRegs * c * 128) >> 4;
          if (c > 0) {
#pragma unroll
            for (int mh = 0; mh < kMmaM; ++mh) wgmma_fence_operands(tmp[0][mh]);
          }
          wgmma_fence();
#pragma unroll
          for (int bb = 0; bb < kBatch; ++bb) {
#pragma unroll
            for (int s = 0; s < 2; ++s) {
#pragma unroll
              for (int mh = 0; mh < kMmaM; ++mh)
                MmaN::mma(tmp[bb][mh], frag[bb][mh][s],
                          desc_add(desc_b_step(2 * (b0 + bb) + s), chunk_rows), s);
            }
          }
          wgmma_commit();
          wgmma_wait<0>();
#pragma unroll
          for (int bb = 0; bb < kBatch; ++bb) {
#pragma unroll
            for (int mh = 0; mh < kMmaM; ++mh) wgmma_fence_operands(tmp[bb][mh]);
            promote(tmp[bb], stage_a, b0 + bb, c);
          }
        }
      }
      // kRebased: the tokens' factors, once, from the tile's last stage before its release (held
      // in registers across the loop's back edge, they spilled at two CTAs an SM, ptxas).
      if constexpr (kRebased) {
        if (kb == num_k_blocks - 1) {
#pragma unroll
          for (int c = 0; c < kChunks; ++c) {
#pragma unroll
            for (int j = 0; j < kTokenPairs; ++j) {
#pragma unroll
              for (int cc = 0; cc < 2; ++cc) {
                const float factor = -token_factor(stage_a, c, j, cc, 0);
#pragma unroll
                for (int mh = 0; mh < kMmaM; ++mh) {
#pragma unroll
                  for (int i = 0; i < 2; ++i) acc[mh][kRegs * c + 4 * j + 2 * i + cc] *= factor;
                }
              }
            }
          }
        }
      }
      Base::release_read(ring, rs.stage);
      rs.advance(ring.stages);
    }
    issued();
  }
};

}  // namespace prime_moe
