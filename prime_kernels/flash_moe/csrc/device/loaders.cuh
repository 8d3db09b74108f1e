// Producer parts of the fused MoE GEMMs: what fills a pipeline stage's A or B tile. Every
// loader says how many producer threads it needs, how many arrivals and TMA bytes the
// stage's full barrier expects from it, whether it writes shared memory through the generic
// proxy (then consumers fence before wgmma), and the layout its tile has (SmemKMajor or
// SmemMNMajor, wgmma.cuh). TMA loaders run on producer thread 0, which also posts the
// stage's expected bytes.
//
// M-grouped GEMMs (K = a fixed dim; tiles are blocks of padded rows):
//   TmaWeightTiles      B: kNumB K-major weight tiles (the forward: w, w2 rows);
//   TmaWeightTilesMN    B: one MN-major weight tile, the weight read transposed (backward:
//                       w2 for dh, w for dx);
//   GatherTokenRows     A: token rows of x (or dO) gathered by cp.async (Hopper's TMA has
//                       no row gather), K-major;
//   TmaRows             A: rows of a dense (max_padded, K) workspace by TMA (h, dz, and
//                       dO copied into padded-row order).
// K-grouped GEMMs (weight gradients; K = the expert's padded rows):
//   TmaRowsAlongK       A or B: 64 workspace rows x kCols columns by TMA, MN-major (the
//                       token rows of x and dO are first copied into padded-row order,
//                       combine.cuh: gathered along K by cp.async they ran at half the
//                       rate).
// The MXFP8 weight loader (raw e4m3 weights and their scales, for the consumers' register
// widening) is in mxfp8_loaders.cuh.
//
// In a 2-CTA cluster whose two tiles read the same B tile (same expert and n tile, MoeGemm
// pairs them), each CTA copies half of the B tile's TMA boxes into both CTAs' stages (TMA
// multicast): B's traffic from L2 halves. A BoxShare says which boxes a loader copies, and
// where to; a TMA loader that can split its tile so says kMulticast.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>

#include "moe_gemm_params.cuh"
#include "prime_kernels/mbarrier.cuh"
#include "prime_kernels/tma.cuh"
#include "prime_kernels/wgmma.cuh"
#include "schedulers.cuh"

namespace prime_moe {

// Which of a tile's TMA boxes this CTA copies: all of them into its own shared memory
// (parts = 1), or the boxes of its half (part 0 or 1 of parts = 2) into both CTAs' of its
// cluster.
// The loaders walk all kBoxes with compile-time indices and skip the other half's (a loop over
// a runtime range kept the producer's unrolled box offsets in local memory: 40 registers).
struct BoxShare {
  int part = 0;
  int parts = 1;

  __device__ __forceinline__ bool copies(int box, int boxes) const {
    return box * parts / boxes == part;
  }
  __device__ __forceinline__ void copy(uint32_t dst, const CUtensorMap* map, uint32_t bar, int col,
                                       int row) const {
    if (parts == 1)
      prime_kernels::tma_load_2d(dst, map, bar, col, row);
    else
      prime_kernels::tma_load_2d_multicast(dst, map, bar, col, row, uint16_t(0b11));
  }
};

// What every TMA loader shares: one thread, completion counted in bytes, async-proxy writes.
struct TmaLoader {
  static constexpr int kThreads = 1;
  static constexpr bool kMulticast = false;  // a B loader whose boxes split says true
  // One thread issuing TMA copies: 24 registers (the least setmaxnreg takes) hold it, and
  // the consumers get 240 (FlashAttention-3 splits its TMA producer the same way).
  static constexpr int kProducerRegs = 24;
  static constexpr uint32_t kFullArrivals = 0;
  static constexpr bool kGenericProxyWrites = false;
  __device__ __forceinline__ explicit TmaLoader(int /*tid*/) {}
  // A stage of a tile with no work (a cluster's missing tile): thread 0's arrival (the
  // kernel's) is the only one the full barrier expects from a TMA loader.
  __device__ __forceinline__ static void arrive_empty(uint64_t* /*full*/) {}
};

// kNumB weight tiles of kBlockN x 64 from the (E * b_rows_per_expert, K) view of the
// weights: expert e's tile b starts at row e * b_rows_per_expert + n0 + b * b_second_offset.
// One TMA box of kBlockN rows per weight tile.
template <class Tile>
struct TmaWeightTiles : TmaLoader {
  using Layout = prime_kernels::SmemKMajor;
  static constexpr bool kMulticast = true;
  static constexpr uint32_t kTmaBytes = Tile::kBBytes;
  static constexpr int kBoxes = Tile::kNumB;

  int b_row = 0;

  using TmaLoader::TmaLoader;

  __device__ __forceinline__ void start_tile(const MoeGemmParams& p, int /*npp*/,
                                             const MoeWorkTile& w) {
    b_row = w.expert * p.b_rows_per_expert + w.n0;
  }

  __device__ __forceinline__ void load(const MoeGemmParams& p, const CUtensorMap* map,
                                       uint8_t* smem_b, uint64_t* full, int kb,
                                       const BoxShare& share = {}) const {
    using namespace prime_kernels;
    const uint32_t dst = smem_addr(smem_b);
#pragma unroll
    for (int b = 0; b < kBoxes; ++b)
      if (share.copies(b, kBoxes))
        share.copy(dst + b * Tile::kBlockN * 128, map, smem_addr(full), kb * Tile::kBlockK,
                   b_row + b * p.b_second_offset);
  }
};

// One weight tile of kBlockN output columns x 64 K rows, from the (E * b_rows_per_expert,
// n_dim) view of a weight whose rows are the GEMM's K (w2 as (E*D, H) for dh = dO w2_e, w as
// (E*2H, D) for dx = dz w_e): kBlockN / 64 boxes of 64 columns x 64 rows, MN-major. Columns
// past n_dim are zero-filled by TMA.
template <class Tile>
struct TmaWeightTilesMN : TmaLoader {
  using Layout = prime_kernels::SmemMNMajor;
  static constexpr bool kMulticast = true;
  static constexpr uint32_t kTmaBytes = Tile::kBBytes;
  static_assert(Tile::kNumB == 1 && Tile::kBlockN % 64 == 0, "whole 64-column chunks");

  int k_row = 0, n0 = 0;

  using TmaLoader::TmaLoader;

  __device__ __forceinline__ void start_tile(const MoeGemmParams& p, int /*npp*/,
                                             const MoeWorkTile& w) {
    k_row = w.expert * p.b_rows_per_expert;
    n0 = w.n0;
  }

  static constexpr int kBoxes = Tile::kBlockN / 64;

  __device__ __forceinline__ void load(const MoeGemmParams& /*p*/, const CUtensorMap* map,
                                       uint8_t* smem_b, uint64_t* full, int kb,
                                       const BoxShare& share = {}) const {
    using namespace prime_kernels;
    const uint32_t dst = smem_addr(smem_b);
#pragma unroll
    for (int c = 0; c < kBoxes; ++c)
      if (share.copies(c, kBoxes))
        share.copy(dst + c * SmemMNMajor::kChunkBytes, map, smem_addr(full), n0 + 64 * c,
                   k_row + kb * Tile::kBlockK);
  }
};

// The block's rows gathered from x: 8 threads per 128-byte row (one 16-byte chunk each),
// 16 rows per pass, padding rows zero-filled. The first n tile of each block also records
// pair -> row for the combine (pair_to_row, when the split path builds it).
template <class Tile>
struct GatherTokenRows {
  using Layout = prime_kernels::SmemKMajor;
  static constexpr int kThreads = 128;
  static constexpr uint32_t kFullArrivals = kThreads;  // one cp.async arrival per thread
  static constexpr uint32_t kTmaBytes = 0;
  static constexpr bool kGenericProxyWrites = true;
  static constexpr bool kMulticast = false;
  static constexpr int kRowsPerThread = Tile::kBlockM / 16;
  static constexpr int kProducerRegs = 40;

  const int chunk, pass_row;
  // Hand-applied 128B swizzle: 16-byte chunk c of row r lands at chunk c ^ (r % 8).
  // pass_row + 16 i has the same r % 8 for every i, so the offset is per thread.
  const uint32_t thread_offset;
  // The thread's gathered rows, as 16-byte-chunk offsets into x (uint32: T*D/8 < 2^32).
  uint32_t src_chunk[kRowsPerThread];
  uint32_t valid_mask = 0;

  __device__ __forceinline__ explicit GatherTokenRows(int tid)
      : chunk(tid & 7),
        pass_row(tid >> 3),
        thread_offset(pass_row * 128 + ((chunk ^ (pass_row & 7)) << 4)) {}

  __device__ __forceinline__ void start_tile(const MoeGemmParams& p, int npp,
                                             const MoeWorkTile& w) {
    // All row ids first: a store between two loads (pair_to_row) would serialize them.
    int pair[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i)
      pair[i] = routed_pair(p, npp, w.row0 + pass_row + 16 * i);
    valid_mask = 0;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const uint32_t token = pair[i] >= 0 ? uint32_t(pair[i] / p.top_k) : 0u;
      src_chunk[i] = token * uint32_t(p.ld_x / 8) + chunk;
      valid_mask |= uint32_t(pair[i] >= 0) << i;
      if (p.pair_to_row != nullptr && w.n0 == 0 && chunk == 0 && pair[i] >= 0)
        p.pair_to_row[pair[i]] = w.row0 + pass_row + 16 * i;
    }
  }

  // A stage's K slice of 64 columns, or of 128 (two 64-column atoms, Tile::kKAtoms).
  __device__ __forceinline__ void load(const MoeGemmParams& p, const CUtensorMap* /*map*/,
                                       uint8_t* smem_a, uint64_t* full, int kb) const {
    using namespace prime_kernels;
    const uint32_t dst = smem_addr(smem_a) + thread_offset;
    const uint4* src = reinterpret_cast<const uint4*>(p.x) + kb * (Tile::kBlockK / 8);
    // One atom's copies at a time: unrolled across atoms, their 64-bit source addresses all
    // lived at once and spilled the producer's 40 registers (ptxas).
#pragma unroll 1
    for (int atom = 0; atom < Tile::kKAtoms; ++atom) {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i)
        cp_async_16_zfill(dst + atom * Tile::kAAtomBytes + i * 16 * 128,
                          src + 8 * atom + src_chunk[i], (valid_mask >> i) & 1);
    }
    if constexpr (Tile::kTokenScaleBytes > 0) {
      // The tokens' four fp32 scales of the stage's K (a_scales: (T, K / 32) from x's pre-pass),
      // 16 bytes a token: thread chunk = i < kRowsPerThread copies those of its row pass_row +
      // 16 i, whose src_chunk is the token's first 16-byte chunk of x plus chunk (token * K / 8 +
      // i), so the token's scales start at chunk src_chunk / 16 = token * K / 128. One copy a
      // thread: a loop of them by one thread spilled the gather's 32 registers at two CTAs an SM
      // (ptxas).
      static_assert(Tile::kBlockK == 128, "one 16-byte chunk of scales a token and stage");
      static_assert(kRowsPerThread <= 8, "a row's scale copier among its chunk threads");
      uint32_t row_chunk = src_chunk[0];
#pragma unroll
      for (int i = 1; i < kRowsPerThread; ++i)
        if (chunk == i) row_chunk = src_chunk[i];
      if (chunk < kRowsPerThread)
        cp_async_16_zfill(smem_addr(smem_a) + Tile::kTokenBytes + (pass_row + 16 * chunk) * 16,
                          reinterpret_cast<const uint4*>(p.a_scales) + kb + (row_chunk >> 4),
                          (valid_mask >> chunk) & 1);
    }
    cp_async_mbarrier_arrive_noinc(full);
  }

  // A stage of a tile with no work (a cluster's missing tile): every thread's arrival, no copy.
  __device__ __forceinline__ static void arrive_empty(uint64_t* full) {
    prime_kernels::mbarrier_arrive(full);
  }
};

// Rows of a TmaRows box: the host makes TmaRows' tensor maps with this many rows.
constexpr int kTmaRowsBoxRows = 64;

// The block's rows of a dense (max_padded, K) workspace by TMA, K-major, in 64-row boxes: a
// 128-row block whose upper half holds no routed pair copies only its lower half (moe_align puts
// an expert's rows first in its blocks). At decode sizes that is most blocks: the down GEMM read
// 16 KB of h rows per K step (a 128-row block of a few tokens) beside 16 KB of w2 (block_n = 64)
// from L2, and now 8. tile_tma_bytes says what a stage of the tile expects.
// The uncopied half holds whatever the stage held before. A cooperative consumer passes such a
// half without a wgmma (moe_gemm.cuh); a ping-pong warpgroup (both halves) and the register-A
// consumers (the half's tokens as wgmma columns) multiply it into output rows of padding only,
// which nothing reads: the combine reads y by pair_to_row, WeightedAtomicAdd drops unrouted rows
// (as the h padding rows of a skipped gate/up half were never written before). An epilogue that
// reduces across rows, or a reader of padding output rows, would have to zero them first.
template <class Tile>
struct TmaRows : TmaLoader {
  using Layout = prime_kernels::SmemKMajor;
  static constexpr int kBoxes = Tile::kBlockM / kTmaRowsBoxRows;  // per 64-column K atom
  static constexpr uint32_t kBoxBytes = kTmaRowsBoxRows * 128;
  static constexpr uint32_t kTmaBytes = Tile::kABytes;  // at most
  static_assert(Tile::kBlockM % kTmaRowsBoxRows == 0, "whole 64-row boxes");

  int row0 = 0;
  int boxes = kBoxes;

  using TmaLoader::TmaLoader;

  __device__ __forceinline__ void start_tile(const MoeGemmParams& p, int npp,
                                             const MoeWorkTile& w) {
    row0 = w.row0;
    boxes = kBoxes;
    // Rows past the first routed-free row are padding in moe_align's layout; with any other
    // routing the upper consumer may multiply a stale half (wrong values for invalid input,
    // nothing read or written out of bounds).
    if constexpr (kBoxes == 2)
      if (routed_pair(p, npp, w.row0 + kTmaRowsBoxRows) < 0) boxes = 1;
  }

  __device__ __forceinline__ uint32_t tile_tma_bytes() const {
    return boxes * kBoxBytes * Tile::kKAtoms;
  }

  __device__ __forceinline__ void load(const MoeGemmParams& /*p*/, const CUtensorMap* map,
                                       uint8_t* smem_a, uint64_t* full, int kb) const {
    using namespace prime_kernels;
#pragma unroll
    for (int atom = 0; atom < Tile::kKAtoms; ++atom) {
#pragma unroll
      for (int box = 0; box < kBoxes; ++box)
        if (box < boxes)
          tma_load_2d(smem_addr(smem_a) + atom * Tile::kAAtomBytes + box * kBoxBytes, map,
                      smem_addr(full), kb * Tile::kBlockK + 64 * atom,
                      row0 + box * kTmaRowsBoxRows);
    }
  }
};

// The e4m3 down tile's token rows (MoeGemmTileE4m3): h's e4m3 rows as TmaRows copies them (a
// 128-byte row a token and K step: the tensor map's boxes are 128 bytes wide), then the stage's
// four runs of kBlockM block scales (fp32, h_scale_index's layout) by bulk copies behind them.
template <class Tile>
struct E4m3TokenRows : TmaRows<Tile> {
  using Base = TmaRows<Tile>;
  static constexpr uint32_t kScaleRunBytes = Tile::kBlockM * 4;
  static constexpr uint32_t kTmaBytes = Tile::kTokenBytes + Tile::kTokenScaleBytes;
  static_assert(Tile::kKAtoms == 1 && Tile::kTokenScaleBytes == Tile::kMxBlocks * kScaleRunBytes,
                "one 128-byte row a token, then the stage's scale runs");

  using Base::Base;

  __device__ __forceinline__ uint32_t tile_tma_bytes() const {
    return Base::tile_tma_bytes() + Tile::kTokenScaleBytes;
  }

  __device__ __forceinline__ void load(const MoeGemmParams& p, const CUtensorMap* map,
                                       uint8_t* smem_a, uint64_t* full, int kb) const {
    using namespace prime_kernels;
    Base::load(p, map, smem_a, full, kb);
    const float* src = p.a_scales + h_scale_index(this->row0, Tile::kMxBlocks * kb, p.k_dim);
#pragma unroll
    for (int b = 0; b < Tile::kMxBlocks; ++b)
      bulk_copy_g2s(smem_addr(smem_a) + Tile::kTokenBytes + b * kScaleRunBytes, src + b * 128,
                    kScaleRunBytes, smem_addr(full));
  }
};

// Which side of a K-grouped GEMM a loader fills: its columns start at the tile's first
// output row (A, the M side) or first output column (B, the N side).
enum class Side { kA, kB };

template <Side kSide>
__device__ __forceinline__ int first_column(const MoeWorkTile& w) {
  return kSide == Side::kA ? w.row0 : w.n0;
}
// Columns a K-grouped loader fills: the tile's M (A) or N (B) extent.
template <class Tile, Side kSide>
inline constexpr int kSideColumns = kSide == Side::kA ? Tile::kBlockM : Tile::kBlockN;

// 64 consecutive padded rows of the expert's segment per stage from a dense (max_padded,
// width) workspace (y1s, dz, dO or x in padded-row order), columns [c0, c0 + kCols), by TMA: kCols
// / 64 boxes of 64 columns x 64 rows, MN-major. Columns past the width are zero-filled by TMA.
template <class Tile, Side kSide>
struct TmaRowsAlongK : TmaLoader {
  static constexpr int kCols = kSideColumns<Tile, kSide>;
  using Layout = prime_kernels::SmemMNMajor;
  static constexpr bool kMulticast = true;
  static constexpr uint32_t kTmaBytes = kCols * Tile::kBlockK * 2;
  static_assert(kCols % 64 == 0, "whole 64-column boxes");

  int k_row0 = 0, c0 = 0;

  using TmaLoader::TmaLoader;

  __device__ __forceinline__ void start_tile(const MoeGemmParams& /*p*/, int /*npp*/,
                                             const MoeWorkTile& w) {
    k_row0 = w.k_row0;
    c0 = first_column<kSide>(w);
  }

  static constexpr int kBoxes = kCols / 64;

  __device__ __forceinline__ void load(const MoeGemmParams& /*p*/, const CUtensorMap* map,
                                       uint8_t* smem, uint64_t* full, int kb,
                                       const BoxShare& share = {}) const {
    using namespace prime_kernels;
    const uint32_t dst = smem_addr(smem);
#pragma unroll
    for (int c = 0; c < kBoxes; ++c)
      if (share.copies(c, kBoxes))
        share.copy(dst + c * SmemMNMajor::kChunkBytes, map, smem_addr(full), c0 + 64 * c,
                   k_row0 + kb * Tile::kBlockK);
  }
};

}  // namespace prime_moe
