// The MXFP8 weight loader of the fused MoE GEMMs: fills a stage's bf16 weight tiles from e4m3
// weights and their e8m0 scales, dequantized exactly, so the bf16 wgmma mainloop runs unchanged.
//
// Why bf16 and not fp8 wgmma: Hopper has no block-scaled MMA, and applying a scale per 32 K
// elements to fp8 wgmma results means promoting the accumulators every 32 K (half a wgmma K
// step), which leaves most of the tensor core idle. Every e4m3 value times a power-of-two scale
// is exact in bf16 (3 mantissa bits in 7; bf16 has fp32's exponent range), except products
// below 2^-133 (bf16's smallest subnormal step: an e4m3 subnormal at scale 2^-127 and the like),
// which round to nearest even. So the weights travel as fp8 (half of bf16's bytes) and are
// widened in shared memory by the producer warpgroup.
//
// Per K step (64 columns) and weight tile, thread 0 brings the tile's kBlockN x 64 e4m3 bytes by
// TMA (unswizzled: row r at 64 r bytes) and the 512-byte blocks of the blocked scale layout that
// hold the step's two scale columns (bulk copies) into a staging slot with its own mbarrier. The
// slots live in shared memory past the stage ring (kExtraSmemBytes, which MoeGemm::smem_bytes
// counts), not in the bf16 stage itself: a step's fp8 is fetched kSlots - 1 steps before the
// stage it widens into is acquired, so DRAM latency is hidden by the staging ring, and a stage
// is written only once it is the producer's. The 128 producer threads (the same ones that gather
// the A rows) then widen the step's slot into the stage: thread t takes 16-byte chunk t % 8 of
// rows t / 8 + 16 i, reads its 8 e4m3 bytes and the row's scale, writes 8 bf16 at the chunk the
// 128-byte swizzle gives (chunk c of row r at chunk c ^ (r % 8), the layout TMA writes for
// TmaWeightTiles), fences the generic writes for the async proxy (wgmma) and arrives on the
// stage's full barrier. A named barrier over the 128 threads at the next step frees the slot
// just read before thread 0 refills it. The tile's first kSlots - 1 steps are fetched at its
// first step: the ring of bf16 stages ahead of the consumers covers that one wait per tile.
// Slots: about 64 KB of fp8 per CTA (mxfp8_staging_slots: 4 for the 128 x (128 + 128) gate/up
// tile, whose ring then holds 3 stages of 48 KB instead of bf16's 4).
//
// Scales: expert e's (MN, K/32) scales in the blocked layout (mxfp8.pack_scales_blocked): scale
// (r, c) at byte ((r / 128) * (K/32 / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 +
// c % 4 of its MN * K/32 bytes. K step kb uses columns 2 kb and 2 kb + 1, which share column tile
// kb / 2: one 512-byte block per 128 weight rows per step. A tile row past MN (the last n tile of
// the down GEMM when D % kBlockN != 0) reads the expert's last block instead: those weight rows
// only make output columns the epilogue drops.
//
// Measured (H200, benchmarks/flash_moe.py, MXFP8 rows, split=True, vs our bf16 forward): exact
// (every test against the exact-MX emulation within 3e-3) but 0.56-0.67x of bf16's speed at
// Qwen3-30B-A3B, DeepSeek-V3-32 and Mixtral-8x7B, T = 64 to 32768; at T = 64 the fp8 bytes move
// at 28-31% of the copy rate. Where the time goes, by arithmetic: at full MMA rate a 128 x
// (128 + 128) stage lasts ~1024 cycles, in which shared memory serves wgmma's 48 KB (A and the
// bf16 B), the gather's 16 KB, the staging's 16 KB of fp8 and this widening's 16 KB read and
// 32 KB written: 128 KB, all that the SM's shared memory moves in that time; at decode sizes the
// 4-8 staging slots hold ~64 KB of fp8 per SM against bf16's 128-192 KB of stages, and each tile
// starts its staging from scratch. The forward now widens in registers instead
// (Mxfp8WeightTilesRS below, mma.cuh's WarpgroupMainloopRS: the weights as wgmma's register A
// operand, out^T = w x^T, so fp8 is read once from shared memory and never written back, and the
// ring itself holds the fp8 in flight); this loader stays for an A/B (forward_kernels.h's
// Mxfp8SmemWeights).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstddef>
#include <cstdint>

#include "loaders.cuh"
#include "moe_gemm_params.cuh"
#include "mxfp8_quantize.cuh"
#include "prime_kernels/mbarrier.cuh"
#include "prime_kernels/tma.cuh"
#include "prime_kernels/wgmma.cuh"
#include "schedulers.cuh"

namespace prime_moe {

// 2^(s - 127) for an e8m0 byte s; NaN for s = 0xFF (the whole block is NaN, as mxfp8.py).
__device__ __forceinline__ float mxfp8_scale_value(uint32_t s) {
  return s == kE8m0Nan ? __int_as_float(0x7FC00000) : mxfp8_pow2(int(s) - 127);
}

// Two e4m3 values (the low byte first) times `scale`, as a bf16x2 word (the low half first):
// e4m3 -> fp16 -> fp32 are exact, the product is exact in fp32 (a power-of-two scale; no flush
// to zero in this build), the bf16 rounding is exact down to 2^-133.
__device__ __forceinline__ uint32_t mxfp8_pair_to_bf16x2(uint32_t two, float scale) {
  const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two), __NV_E4M3);
  const float2 f = __half22float2(__half2(raw));
  const __nv_bfloat162 b = __floats2bfloat162_rn(__fmul_rn(f.x, scale), __fmul_rn(f.y, scale));
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Eight e4m3 bytes (uint2, element 0 in the low byte) times `scale` as eight bf16 (uint4).
__device__ __forceinline__ uint4 mxfp8_widen8(uint2 v, float scale) {
  return make_uint4(
      mxfp8_pair_to_bf16x2(v.x & 0xFFFF, scale), mxfp8_pair_to_bf16x2(v.x >> 16, scale),
      mxfp8_pair_to_bf16x2(v.y & 0xFFFF, scale), mxfp8_pair_to_bf16x2(v.y >> 16, scale));
}

// Staging slots for a tile: 64 to 72 KB of fp8 in flight per CTA (a decode-sized forward is
// bound by the weights' bandwidth, which needs many bytes in flight per SM), a power of two (the
// slot and phase of a step are a mask and a shift): 8 slots where a stage holds at most 128
// weight rows, 4 where it holds 256.
template <class Tile>
constexpr int mxfp8_staging_slots() {
  return Tile::kNumB * Tile::kBlockN <= 128 ? 8 : 4;
}

// kNumB weight tiles of kBlockN x 64 from the (E * b_rows_per_expert, K) e4m3 view of the
// weights (tile b of expert e starts at row e * b_rows_per_expert + n0 + b * b_second_offset), as
// TmaWeightTiles, with p.b_scales the blocked scales of each expert's (b_rows_per_expert, K/32).
template <class Tile, int kSlots_ = mxfp8_staging_slots<Tile>()>
struct Mxfp8WeightTiles {
  using Layout = prime_kernels::SmemKMajor;
  static constexpr int kThreads = 128;
  static constexpr uint32_t kFullArrivals = kThreads;  // every thread after its widened rows
  static constexpr uint32_t kTmaBytes = 0;             // the stage is written by the threads
  static constexpr bool kGenericProxyWrites = true;
  static constexpr bool kMulticast = false;  // widened by this CTA's threads
  // The gather's row offsets and this loader's state share the producer's registers: 56 leaves
  // the consumers (3 * 168 - 56) / 2 = 224, as 48 would after rounding down to a multiple of 8.
  static constexpr int kProducerRegs = 56;

  static constexpr int kSlots = kSlots_;
  static constexpr int kRows = Tile::kNumB * Tile::kBlockN;  // weight rows of a stage
  static constexpr int kRowsPerThread = kRows / 16;
  static constexpr int kScaleBlocks = Tile::kBlockN > 128 ? Tile::kBlockN / 128 : 1;  // per tile
  static constexpr int kValueBytes = kRows * 64;
  static constexpr int kSlotBytes = kValueBytes + Tile::kNumB * kScaleBlocks * 512;
  static constexpr size_t kExtraSmemBytes =
      (size_t(kSlots) * kSlotBytes + kSlots * sizeof(uint64_t) + 1023) / 1024 * 1024;
  // Named barrier of the producer warpgroup (ids 1 and 2 are the consumers', moe_gemm.cuh).
  static constexpr int kSlotBarrierId = 3;

  static_assert(kSlots >= 2 && (kSlots & (kSlots - 1)) == 0,
                "a slot is refilled while the next one is widened; a power of two");
  static_assert(Tile::kBlockN % 64 == 0 && kRows % 16 == 0, "16 rows per pass of 128 threads");
  static_assert(Tile::kBlockN <= 128 || Tile::kBlockN % 128 == 0, "whole 128-row scale tiles");
  static_assert(kSlotBytes % 512 == 0, "TMA and bulk-copy destinations stay 128-byte aligned");

  const int chunk, pass_row;
  const uint32_t stage_offset;      // the thread's chunk in the swizzled bf16 stage, row pass_row
  uint8_t* slots = nullptr;         // [kSlots][kSlotBytes], then kSlots mbarriers
  uint32_t step = 0;                // K steps of every tile so far: slot step % kSlots
  const uint8_t* scales = nullptr;  // the expert's blocked scales
  int value_row = 0;                // tile 0's first row in the (E * rows, K) view
  int n0 = 0, num_k_blocks = 0;

  __device__ __forceinline__ explicit Mxfp8WeightTiles(int tid)
      : chunk(tid & 7),
        pass_row(tid >> 3),
        stage_offset(pass_row * 128 + ((chunk ^ (pass_row & 7)) << 4)) {}

  __device__ __forceinline__ static uint64_t* slot_barriers(uint8_t* extra) {
    return reinterpret_cast<uint64_t*>(extra + size_t(kSlots) * kSlotBytes);
  }
  // Thread 0, before the CTA barrier that precedes any use: one arrival (thread 0's expect_tx)
  // plus the slot's bytes per phase.
  __device__ __forceinline__ static void init_extra(uint8_t* extra) {
    for (int s = 0; s < kSlots; ++s) prime_kernels::mbarrier_init(&slot_barriers(extra)[s], 1);
    prime_kernels::mbarrier_init_fence();
  }
  __device__ __forceinline__ void attach(uint8_t* extra) { slots = extra; }

  __device__ __forceinline__ void start_tile(const MoeGemmParams& p, int /*npp*/,
                                             const MoeWorkTile& w) {
    value_row = w.expert * p.b_rows_per_expert + w.n0;
    n0 = w.n0;
    num_k_blocks = w.num_k_blocks;
    scales = p.b_scales + size_t(w.expert) * size_t(p.b_rows_per_expert) * size_t(p.k_dim / 32);
  }

  // Thread 0: K step kb of this tile (the step-th of the CTA) into its slot.
  __device__ __forceinline__ void fetch(const MoeGemmParams& p, const CUtensorMap* map,
                                        uint32_t at_step, int kb) const {
    using namespace prime_kernels;
    const uint32_t slot = at_step % kSlots;
    const uint32_t dst = smem_addr(slots + slot * kSlotBytes);
    const uint32_t bar = smem_addr(&slot_barriers(slots)[slot]);
    // The slot's last reads (generic proxy) before the copies' writes (async proxy).
    fence_proxy_async_shared();
    mbarrier_arrive_expect_tx(&slot_barriers(slots)[slot], kSlotBytes);
    const int row_tiles = p.b_rows_per_expert / 128;
    const int col_tiles = p.k_dim / 128;  // (K/32) / 4 scale column tiles
#pragma unroll
    for (int b = 0; b < Tile::kNumB; ++b) {
      tma_load_2d(dst + b * Tile::kBlockN * 64, map, bar, kb * Tile::kBlockK,
                  value_row + b * p.b_second_offset);
      const int row_tile = (n0 + b * p.b_second_offset) / 128;
#pragma unroll
      for (int j = 0; j < kScaleBlocks; ++j) {
        const int t = min(row_tile + j, row_tiles - 1);
        bulk_copy_g2s(dst + kValueBytes + (b * kScaleBlocks + j) * 512,
                      scales + (size_t(t) * col_tiles + kb / 2) * 512, 512, bar);
      }
    }
  }

  __device__ __forceinline__ void load(const MoeGemmParams& p, const CUtensorMap* map,
                                       uint8_t* smem_b, uint64_t* full, int kb) {
    using namespace prime_kernels;
    // Every thread is done with the previous step's slot, which the fetch below refills.
    named_barrier_sync(kSlotBarrierId, kThreads);
    if (chunk == 0 && pass_row == 0) {
      if (kb == 0) {
        for (int s = 0; s < kSlots - 1 && s < num_k_blocks; ++s) fetch(p, map, step + s, s);
      }
      if (kb + kSlots - 1 < num_k_blocks) fetch(p, map, step + kSlots - 1, kb + kSlots - 1);
    }
    const uint32_t slot = step % kSlots;
    mbarrier_wait(&slot_barriers(slots)[slot], (step / kSlots) & 1);
    const uint8_t* src = slots + slot * kSlotBytes;
    // Row pass_row + 16 i of the stage is row m = n0 % 128 + 16 i % kBlockN + pass_row of
    // weight tile b = 16 i / kBlockN's scale tiles. n0 % 128 is 64 only for 64-row tiles (a
    // multiple of 32 that keeps m below 128) and 16 i % 32 + pass_row < 32, so the scale's byte
    // is a per-thread base plus a constant of i. The thread's scale column of the step: its
    // chunk's 8 elements lie in one 32-block.
    const uint8_t* scale_src =
        src + kValueBytes + (n0 % 128) / 8 + pass_row * 16 + (kb & 1) * 2 + (chunk >> 2);
    const uint8_t* value_src = src + pass_row * 64 + chunk * 8;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = 16 * i % Tile::kBlockN;  // tile row of the pass, less pass_row
      const int scale_at = (16 * i / Tile::kBlockN * kScaleBlocks + r / 128) * 512 +
                           (16 * i % 32) * 16 + (r % 128) / 32 * 4;
      const uint32_t s = scale_src[scale_at];
      const uint2 v = *reinterpret_cast<const uint2*>(value_src + i * 16 * 64);
      *reinterpret_cast<uint4*>(smem_b + stage_offset + i * 16 * 128) =
          mxfp8_widen8(v, mxfp8_scale_value(s));
    }
    fence_proxy_async_shared();
    mbarrier_arrive(full);
    ++step;
  }
};

// The register-A path's weight loader (MoeGemmTileRS, RegisterAConsumers): thread 0 copies the
// step's raw e4m3 weight tiles by TMA (64-byte swizzle: the consumers' 2-byte fragment reads of 8
// rows hit 8 distinct bank groups, mxfp8_fragment.cuh) and the step's scale blocks (bulk copies)
// straight into the stage; the consumers widen them in registers. No staging slots and no
// producer threads besides thread 0: the ring itself is the fp8 in flight (33 KB stages at 128
// tokens x 256 weight rows, 6 of them, against the widening path's 4 slots and 3 bf16 stages).
// Rows and scale blocks as Mxfp8WeightTiles: a tile row past the expert's rows reads the last
// scale block (its output columns are dropped).
template <class Tile>
struct Mxfp8WeightTilesRS : TmaLoader {
  using Layout = prime_kernels::SmemKMajor;  // not read: the consumers address the bytes
  static constexpr uint32_t kTmaBytes = Tile::kWeightBytes + Tile::kScaleBytes;

  const uint8_t* scales = nullptr;  // the expert's blocked scales
  int value_row = 0;                // tile 0's first row in the (E * rows, K) view
  int n0 = 0;

  using TmaLoader::TmaLoader;

  __device__ __forceinline__ void start_tile(const MoeGemmParams& p, int /*npp*/,
                                             const MoeWorkTile& w) {
    value_row = w.expert * p.b_rows_per_expert + w.n0;
    n0 = w.n0;
    scales = p.b_scales + size_t(w.expert) * size_t(p.b_rows_per_expert) * size_t(p.k_dim / 32);
  }

  __device__ __forceinline__ void load(const MoeGemmParams& p, const CUtensorMap* map,
                                       uint8_t* smem_b, uint64_t* full, int kb) const {
    using namespace prime_kernels;
    const uint32_t dst = smem_addr(smem_b);
    const uint32_t bar = smem_addr(full);
    const int row_tiles = p.b_rows_per_expert / 128;
    const int col_tiles = p.k_dim / 128;  // (K/32) / 4 scale column tiles
#pragma unroll
    for (int b = 0; b < Tile::kNumB; ++b) {
      tma_load_2d(dst + b * Tile::kBlockN * Tile::kBlockK, map, bar, kb * Tile::kBlockK,
                  value_row + b * p.b_second_offset);
      const int row_tile = (n0 + b * p.b_second_offset) / 128;
#pragma unroll
      for (int j = 0; j < Tile::kScaleBlocks; ++j) {
        const int t = min(row_tile + j, row_tiles - 1);
        bulk_copy_g2s(dst + Tile::kWeightBytes + (b * Tile::kScaleBlocks + j) * 512,
                      scales + (size_t(t) * col_tiles + kb / 2) * 512, 512, bar);
      }
    }
  }
};

}  // namespace prime_moe
