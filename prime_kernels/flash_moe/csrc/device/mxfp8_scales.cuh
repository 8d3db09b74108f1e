// The blocked layout of MXFP8 scales and its inverse: pack_scales_blocked and
// unpack_scales_blocked of prime_kernels/flash_moe/mxfp8.py (its docstring is the contract), bit
// for bit. Scales are a (rows, kb) byte matrix, rows % 128 == 0, kb = K/32 with kb % 4 == 0;
// leading dims fold into rows, since each leading index's MN rows are whole 128-row tiles whose
// blocked bytes follow the previous index's, as the next tile rows of one taller matrix would.
//
// In 4-byte words (the 4 scales of one row in one column tile), row-major word (r, c) of tile
// row r / 128 is word c * 128 + (r % 32) * 4 + (r % 128) / 32 of that tile row's 128 * kb
// contiguous blocked bytes: a transpose in which a 16-byte blocked vector gathers rows r, r + 32,
// r + 64 and r + 96 of one column tile. One CTA moves a chunk of whole tile rows (several when
// rows are short) by at most kMxfp8ScalesChunkTiles column tiles through shared memory, reading
// and writing coalesced vectors on both sides: the chunk's blocked bytes are contiguous and its
// row-major bytes are whole rows (contiguous) or 128-byte row segments. Vectors are 16 bytes
// where both pointers and, for row segments, kb are 16-byte multiples; 4 bytes otherwise.
#pragma once

#include <cstdint>
#include <type_traits>

namespace prime_moe {

constexpr int kMxfp8ScalesThreads = 128;
constexpr int kMxfp8ScalesChunkBytes = 16384;
// A column tile of a tile row: 128 rows x 4 scales, 512 bytes, 128 words.
constexpr int kMxfp8ScalesChunkTiles = kMxfp8ScalesChunkBytes / 512;

struct Mxfp8ScalesParams {
  const uint32_t* src;  // row-major scale words (pack), or blocked (unpack)
  uint32_t* dst;        // the other layout
  int64_t tile_rows;    // rows / 128
  int words;            // kb / 4: words of a row, column tiles of a tile row
  int chunk_words;      // column tiles per CTA: all of a row, or kMxfp8ScalesChunkTiles
  int chunk_tile_rows;  // tile rows per CTA: with chunk_words, at most ChunkBytes
  int row_chunks;       // CTAs per tile row
};

// A thread's walk over its vectors u = threadIdx.x + k * kMxfp8ScalesThreads of a chunk w words
// (column tiles) wide, staged row-major with row stride `stride`: each layout's walk gives the
// vector's word offset in memory and the staging index of each of its words. The divisions are
// done once; a step only adds.
template <int kVecWords>
struct Mxfp8RowMajorWalk {
  static constexpr int kStep = kMxfp8ScalesThreads * kVecWords;
  int w, pad;           // the chunk's width; stride - w
  int64_t wrap_offset;  // words - w: from past a row's chunk to the next row's
  int c, at;            // chunk column of the vector's first word, its staging index
  int64_t offset;       // and its offset in memory
  int dc, step_at;      // a step's increments
  int64_t step_offset;

  __device__ Mxfp8RowMajorWalk(int64_t base, int words, int w_, int stride)
      : w(w_), pad(stride - w_), wrap_offset(words - w_) {
    const int i = int(threadIdx.x) * kVecWords;
    const int r = i / w, dr = kStep / w;
    c = i - r * w;
    dc = kStep - dr * w;
    at = r * stride + c;
    step_at = dr * stride + dc;
    offset = base + int64_t(r) * words + c;
    step_offset = int64_t(dr) * words + dc;
  }
  // A vector spans two rows only when the chunk's rows are whole, hence contiguous in memory.
  __device__ void stage_index(int (&index)[kVecWords]) const {
    int cc = c, a = at;
#pragma unroll
    for (int q = 0; q < kVecWords; ++q) {
      index[q] = a++;
      if (++cc == w) cc = 0, a += pad;
    }
  }
  __device__ void next() {
    c += dc;
    at += step_at;
    offset += step_offset;
    if (c >= w) c -= w, at += pad, offset += wrap_offset;
  }
};

template <int kVecWords>
struct Mxfp8BlockedWalk {
  static constexpr int kStep = kMxfp8ScalesThreads * kVecWords;
  static_assert(kStep % 128 == 0, "a step moves by whole column tiles");
  int w, wrap_at;         // the chunk's width; from past a tile row's chunk to the next row's
  int c, tile_at;         // the vector's column tile in the chunk, the staging index of its row 0
  int64_t offset;         // the vector's offset in memory
  int dc, step_at;        // a step's increments
  int row_at[kVecWords];  // each word's row in its tile row times the stride; a step keeps it

  __device__ Mxfp8BlockedWalk(int64_t base, int w_, int stride)
      : w(w_), wrap_at(128 * stride - w_) {
    const int i = int(threadIdx.x) * kVecWords;
    const int t = i / 128, g = t / w, dg = kStep / 128 / w;
    c = t - g * w;
    dc = kStep / 128 - dg * w;
    tile_at = g * 128 * stride + c;
    step_at = dg * 128 * stride + dc;
    offset = base + i;
#pragma unroll
    for (int q = 0; q < kVecWords; ++q) {
      const int j = (i + q) % 128;  // (r % 32) * 4 + (r % 128) / 32
      row_at[q] = ((j % 4) * 32 + j / 4) * stride;
    }
  }
  __device__ void stage_index(int (&index)[kVecWords]) const {
#pragma unroll
    for (int q = 0; q < kVecWords; ++q) index[q] = tile_at + row_at[q];
  }
  __device__ void next() {
    c += dc;
    tile_at += step_at;
    offset += kStep;
    if (c >= w) c -= w, tile_at += wrap_at;
  }
};

template <int kVecWords>
using Mxfp8ScalesVec = std::conditional_t<kVecWords == 4, uint4, uint32_t>;
template <int kVecWords>
constexpr int kMxfp8ScalesPerThread = kMxfp8ScalesChunkBytes /
                                      (kMxfp8ScalesThreads * 4 * kVecWords);

// Every load of the thread is issued before its first staging store.
template <int kVecWords, typename Walk>
__device__ __forceinline__ void mxfp8_scales_stage_in(const Walk& walk, const uint32_t* src,
                                                      int units, uint32_t* stage) {
  constexpr int kPerThread = kMxfp8ScalesPerThread<kVecWords>;
  Mxfp8ScalesVec<kVecWords> v[kPerThread];
  Walk load = walk;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    if (int(threadIdx.x) + k * kMxfp8ScalesThreads < units) {
      v[k] = *reinterpret_cast<const Mxfp8ScalesVec<kVecWords>*>(src + load.offset);
    }
    load.next();
  }
  Walk store = walk;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    if (int(threadIdx.x) + k * kMxfp8ScalesThreads < units) {
      int at[kVecWords];
      store.stage_index(at);
      const uint32_t* words = reinterpret_cast<const uint32_t*>(&v[k]);
#pragma unroll
      for (int q = 0; q < kVecWords; ++q) stage[at[q]] = words[q];
    }
    store.next();
  }
}

template <int kVecWords, typename Walk>
__device__ __forceinline__ void mxfp8_scales_stage_out(Walk walk, uint32_t* dst, int units,
                                                       const uint32_t* stage) {
#pragma unroll
  for (int k = 0; k < kMxfp8ScalesPerThread<kVecWords>; ++k) {
    if (int(threadIdx.x) + k * kMxfp8ScalesThreads < units) {
      int from[kVecWords];
      walk.stage_index(from);
      Mxfp8ScalesVec<kVecWords> v;
      uint32_t* words = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
      for (int q = 0; q < kVecWords; ++q) words[q] = stage[from[q]];
      *reinterpret_cast<Mxfp8ScalesVec<kVecWords>*>(dst + walk.offset) = v;
    }
    walk.next();
  }
}

template <bool kUnpack, int kVecWords>
__global__ void __launch_bounds__(kMxfp8ScalesThreads)
    mxfp8_scales_kernel(const Mxfp8ScalesParams p) {
  extern __shared__ uint32_t stage[];
  const int64_t tile_row0 = int64_t(blockIdx.x / p.row_chunks) * p.chunk_tile_rows;
  const int c0 = int(blockIdx.x % p.row_chunks) * p.chunk_words;
  const int tile_rows = int(min(int64_t(p.chunk_tile_rows), p.tile_rows - tile_row0));
  const int w = min(p.chunk_words, p.words - c0);
  // Odd, so that the rows r % 32 = 0..31 of one column, which a warp's 32 blocked vectors read
  // at once, lie in 32 different banks.
  const int stride = w | 1;
  const int units = tile_rows * 128 * w / kVecWords;
  const Mxfp8RowMajorWalk<kVecWords> row_major(tile_row0 * 128 * p.words + c0, p.words, w, stride);
  const Mxfp8BlockedWalk<kVecWords> blocked((tile_row0 * p.words + c0) * 128, w, stride);
  if constexpr (kUnpack) {
    mxfp8_scales_stage_in<kVecWords>(blocked, p.src, units, stage);
    __syncthreads();
    mxfp8_scales_stage_out<kVecWords>(row_major, p.dst, units, stage);
  } else {
    mxfp8_scales_stage_in<kVecWords>(row_major, p.src, units, stage);
    __syncthreads();
    mxfp8_scales_stage_out<kVecWords>(blocked, p.dst, units, stage);
  }
}

}  // namespace prime_moe
