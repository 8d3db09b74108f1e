// Epilogues of the fused MoE GEMMs: from a consumer warpgroup's fp32 accumulators (the
// wgmma layout, several arrays read as one flat 64 x (kNumB * cols) tile) straight to
// global memory. acc_valid is false where no K step ran (the accumulators hold nothing):
// an empty expert's weight gradient (zeros), or a skipped half (rows without a pair). Each says how
// many weight tiles per stage it consumes (kNumB), which the kernel checks against its tile, and
// whether a 64-row half with no routed row must still be written (kWritesPaddingRows: its zeros are
// read later).
//   SwiGluToH<kKeepZ>  gate/up: h = bf16(silu(g) * u) into the (max_padded, H) workspace,
//                      and for training also z = [bf16(g) | bf16(u)] (max_padded, 2H);
//   StoreRows          down, split=true: y = bf16(acc) into the (max_padded, D) workspace,
//                      combined later in a fixed order (deterministic, combine.cuh); the
//                      backward's dx per pair (dxe) likewise;
//   WeightedAtomicAdd  down, split=false: out[token] += topk_weight * acc with 16-byte bf16
//                      reductions (the caller zeroed out; the k contributions land in any order);
//   SwiGluBackward     dh: from dh' = dO w2_e (the accumulators) and the kept z, the SwiGLU
//                      backward dz = [dg | du], y1s = bf16(s h) and <dh', h> per pair
//                      and n tile;
//   StoreExpertTile    weight gradients: bf16 tile of expert e's (m_dim, n_dim) gradient.
// (The MXFP8 re-quantizing SwiGLU is in mxfp8_epilogues.cuh; a shared-memory-staged
// TMA-store epilogue would be a further part of this file's kind.)
#pragma once

#include <cuda_bf16.h>

#include "moe_gemm_params.cuh"
#include "prime_kernels/reduce.cuh"
#include "prime_kernels/wgmma.cuh"
#include "schedulers.cuh"

namespace prime_moe {

// 4x4 transpose of 32-bit words across the 4 lanes of a quad: before, lane q holds
// v[t] = W[t][q]; after, v[t] = W[q][t]. Two butterfly rounds; in each, a lane swaps with
// its partner the two slots whose bit differs from its own lane bit.
__device__ __forceinline__ void quad_transpose(uint32_t (&v)[4]) {
  const int q = threadIdx.x % 4;
#pragma unroll
  for (int m = 1; m <= 2; m <<= 1) {
    const bool upper = (q & m) != 0;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int lo = m == 1 ? 2 * k : k;  // the slot with bit m clear
      const int hi = lo + m;              // and its pair with bit m set
      const uint32_t recv = __shfl_xor_sync(0xFFFFFFFFu, upper ? v[lo] : v[hi], m);
      if (upper)
        v[lo] = recv;
      else
        v[hi] = recv;
    }
  }
}

__device__ __forceinline__ uint32_t bf162_bits(__nv_bfloat162 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ __nv_bfloat162 bit_cast_bf162(uint32_t v) {
  return *reinterpret_cast<__nv_bfloat162*>(&v);
}

// sigmoid(g) = 1 / (1 + 2^(-g log2 e)) with the approximate ex2 and reciprocal, flushing
// subnormals: 2^x is subnormal only for x < -126, i.e. g > 87, where 1 + 2^x rounds to 1
// either way, so the flush changes no result and saves the non-ftz ex2's fix-up (a compare and
// two multiplies per call). Both approximations are within 2 ulp; the results are rounded to
// bf16.
__device__ __forceinline__ float sigmoid_approx(float g) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return r;
}

// Row half i's 32-column group a of a warpgroup's accumulators, times `scale`, as lane q of
// the quad will store it: bf16 columns 32a + 8q .. + 8 (after a quad transpose), so that a
// warp's 16-byte accesses cover whole 32-byte sectors of its rows. Every lane must run it (the
// transpose shuffles the whole warp).
template <int kMmas, int kRegs>
__device__ __forceinline__ void quad_row_group(const float (&acc)[kMmas][kRegs], int i, int a,
                                               float scale, uint32_t (&v)[4]) {
  using namespace prime_kernels;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int j = 4 * a + t;
    v[t] = bf162_bits(__floats2bfloat162_rn(scale * wgmma_acc_at(acc, 4 * j + 2 * i),
                                            scale * wgmma_acc_at(acc, 4 * j + 2 * i + 1)));
  }
  quad_transpose(v);
}

// A warpgroup's bf16 tile into rows of p.out (p.ld_out apart) from row0, col0: for row half i and
// 32-column group a, words(i, a, v) gives the 4 bf16x2 words lane q stores after its quad
// transpose (quad_row_group's layout: columns 32 a + 8 q .. + 8), one 16-byte store a lane, so a
// warp's accesses cover whole 32-byte sectors of its rows. Every lane must run it (the words
// shuffle the whole warp); columns past p.n_dim (a partial last n tile) are not stored.
template <int kGroups, class Words>
__device__ __forceinline__ void store_row_groups(const MoeGemmParams& p, int row0, int col0,
                                                 Words&& words) {
  const int lane_col = 8 * (threadIdx.x % 4);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    __nv_bfloat16* dst = p.out + size_t(row0 + prime_kernels::wgmma_acc_row(i)) * p.ld_out;
#pragma unroll
    for (int a = 0; a < kGroups; ++a) {
      uint32_t v[4];
      words(i, a, v);
      const int col = col0 + 32 * a + lane_col;
      if (col >= p.n_dim) continue;
      *reinterpret_cast<uint4*>(dst + col) = make_uint4(v[0], v[1], v[2], v[3]);
    }
  }
}

// Register-A accumulators (RegisterAConsumers: out^T, an m64 block's rows are 64 output columns,
// its wgmma columns the warpgroup's tokens) regrouped for row-major stores: lanes g and g ^ 1 of
// a column (lane / 4) swap one value per register pair, after which the even lane holds token
// 8 j + 2 q of output columns (g & ~1) + 8 i and the next one, the odd lane token 8 j + 2 q + 1
// of the same two columns: one 4-byte bf16x2 store per pair instead of two 2-byte ones. Every
// lane must run it (a shuffle of the whole warp).
__device__ __forceinline__ int transposed_token(int j) {
  return 8 * j + 2 * (threadIdx.x % 4) + ((threadIdx.x / 4) & 1);
}
__device__ __forceinline__ int transposed_column(int i) {
  return ((threadIdx.x / 32) % 4) * 16 + ((threadIdx.x % 32) / 4 & ~1) + 8 * i;
}
// c0, c1: a value of the thread's tokens 8 j + 2q and 8 j + 2q + 1 (the accumulator registers
// 4 j + 2 i and 4 j + 2 i + 1, or anything computed from them).
__device__ __forceinline__ float2 transposed_pair(float c0, float c1) {
  const bool odd = ((threadIdx.x / 4) & 1) != 0;
  const float other = __shfl_xor_sync(0xFFFFFFFFu, odd ? c0 : c1, 4);
  return odd ? make_float2(other, c1) : make_float2(c0, other);
}
// An accumulator value, or NaN where its weight row held an e4m3 NaN byte (nan_rows: the
// register-A mainloop's, bit 2 mh + i for row r_i of m64 block mh).
__device__ __forceinline__ float nan_row_value(float v, uint32_t nan_rows, int mh, int i) {
  return (nan_rows >> (2 * mh + i)) & 1u ? __int_as_float(0x7FC00000) : v;
}
template <int kMmas, int kRegs>
__device__ __forceinline__ float2 transposed_pair(const float (&acc)[kMmas][kRegs],
                                                  uint32_t nan_rows, int mh, int i, int j) {
  return transposed_pair(nan_row_value(acc[mh][4 * j + 2 * i], nan_rows, mh, i),
                         nan_row_value(acc[mh][4 * j + 2 * i + 1], nan_rows, mh, i));
}

template <bool kKeepZ>
struct SwiGluToH {
  static constexpr int kNumB = 2;  // gate tile, up tile
  static constexpr bool kWritesPaddingRows = false;

  // h rows are the padded-sorted rows; padding rows hold zeros (or nothing, in a skipped
  // half), which only padding rows of the down GEMM see. z's padding rows are never read.
  // 16-byte stores as in StoreRows: lane q of a quad stores the 8 columns of j = 4a + q after
  // a quad transpose, so each row's 32 columns per group are two whole sectors.
  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store(const MoeGemmParams& p, int /*npp*/,
                                               const float (&acc)[kMmas][kRegs], bool /*acc_valid*/,
                                               const MoeWorkTile& /*w*/, int row0, int col0) {
    using namespace prime_kernels;
    constexpr int kHalf = kMmas * kRegs / 2;  // flat offset of the up columns
    constexpr int kGroups = kHalf * 2 / 32;   // 32-column groups of the gate (and up) half
    static_assert(kHalf * 2 % 32 == 0, "whole 32-column groups per warpgroup");
    const int lane_col = 8 * (threadIdx.x % 4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const size_t row = size_t(row0 + wgmma_acc_row(i));
      __nv_bfloat16* dst = p.out + row * p.ld_out;
#pragma unroll
      for (int a = 0; a < kGroups; ++a) {
        uint32_t h[4], g[4], u[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int f = 4 * (4 * a + t) + 2 * i;
          const float g0 = wgmma_acc_at(acc, f), g1 = wgmma_acc_at(acc, f + 1);
          const float u0 = wgmma_acc_at(acc, kHalf + f), u1 = wgmma_acc_at(acc, kHalf + f + 1);
          // silu(g) = g / (1 + e^-g) with the approximate divide (2 ulp while 1 + e^-g <
          // 2^126, i.e. g > -87; below, silu(g) = -0 where the IEEE divide gave ~-1e-36:
          // nothing bf16 h tells apart): the IEEE one is a subroutine, and this epilogue
          // runs while the tensor cores wait.
          h[t] = bf162_bits(__floats2bfloat162_rn(__fdividef(g0, 1.0f + __expf(-g0)) * u0,
                                                  __fdividef(g1, 1.0f + __expf(-g1)) * u1));
          if constexpr (kKeepZ) {
            g[t] = bf162_bits(__floats2bfloat162_rn(g0, g1));
            u[t] = bf162_bits(__floats2bfloat162_rn(u0, u1));
          }
        }
        quad_transpose(h);
        if constexpr (kKeepZ) {
          quad_transpose(g);
          quad_transpose(u);
        }
        const int col = col0 + 32 * a + lane_col;
        if (col >= p.n_dim) continue;  // partial last n tile (H % block_n != 0)
        *reinterpret_cast<uint4*>(dst + col) = make_uint4(h[0], h[1], h[2], h[3]);
        if constexpr (kKeepZ) {
          __nv_bfloat16* z = p.z + row * (2 * size_t(p.n_dim));
          *reinterpret_cast<uint4*>(z + col) = make_uint4(g[0], g[1], g[2], g[3]);
          *reinterpret_cast<uint4*>(z + p.n_dim + col) = make_uint4(u[0], u[1], u[2], u[3]);
        }
      }
    }
  }
};

struct StoreRows {
  static constexpr int kNumB = 1;
  static constexpr bool kWritesPaddingRows = false;

  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store(const MoeGemmParams& p, int /*npp*/,
                                               const float (&acc)[kMmas][kRegs], bool /*acc_valid*/,
                                               const MoeWorkTile& /*w*/, int row0, int col0) {
    store_row_groups<kMmas * kRegs * 2 / 32>(
        p, row0, col0, [&](int i, int a, uint32_t(&v)[4]) { quad_row_group(acc, i, a, 1.0f, v); });
  }

  // Register-A accumulators (acc[mh]: output columns col0 + 64 mh .., tokens row0 ..): a
  // bf16x2 store per token and column pair (transposed_pair), for the first n_tokens tokens
  // (the ones the mainloop multiplied).
  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store_transposed(const MoeGemmParams& p, int /*npp*/,
                                                          const float (&acc)[kMmas][kRegs],
                                                          uint32_t nan_rows,
                                                          const MoeWorkTile& /*w*/, int row0,
                                                          int col0, uint8_t* /*scratch*/,
                                                          int /*barrier_id*/, int n_tokens) {
#pragma unroll
    for (int j = 0; j < kRegs / 4; ++j) {
      if (8 * j >= n_tokens) break;  // the warp's 8 tokens of step j
      __nv_bfloat16* dst = p.out + size_t(row0 + transposed_token(j)) * p.ld_out;
#pragma unroll
      for (int mh = 0; mh < kMmas; ++mh) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float2 v = transposed_pair(acc, nan_rows, mh, i, j);
          const int col = col0 + 64 * mh + transposed_column(i);
          if (col >= p.n_dim) continue;  // partial last n tile (D % block_n != 0)
          *reinterpret_cast<uint32_t*>(dst + col) = bf162_bits(__floats2bfloat162_rn(v.x, v.y));
        }
      }
    }
  }
};

struct WeightedAtomicAdd {
  static constexpr int kNumB = 1;
  static constexpr bool kWritesPaddingRows = false;

  // 16-byte reductions in StoreRows' layout (quad_row_group): a quarter of the requests of one
  // bf16x2 atomic per 2 columns, which made split=false 1.22x split=true's time at
  // Qwen3-30B-A3B T = 32768. out is 16-byte aligned and D a multiple of 64 (the binding's rules).
  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store(const MoeGemmParams& p, int npp,
                                               const float (&acc)[kMmas][kRegs], bool /*acc_valid*/,
                                               const MoeWorkTile& /*w*/, int row0, int col0) {
    using namespace prime_kernels;
    constexpr int kGroups = kMmas * kRegs * 2 / 32;
    const int lane_col = 8 * (threadIdx.x % 4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      // Every lane runs the transposes (full-warp shuffles); a row without a pair adds nothing.
      const int pair = routed_pair(p, npp, row0 + wgmma_acc_row(i));
      const bool routed = pair >= 0;
      const float weight = routed ? p.topk_weights[pair] : 0.0f;
      __nv_bfloat16* dst = p.out + size_t(routed ? pair / p.top_k : 0) * p.ld_out;
#pragma unroll
      for (int a = 0; a < kGroups; ++a) {
        uint32_t v[4];
        quad_row_group(acc, i, a, weight, v);
        const int col = col0 + 32 * a + lane_col;
        if (!routed || col >= p.n_dim) continue;  // col: partial last n tile (D % block_n)
        red_add_bf16x8(dst + col, v);
      }
    }
  }

  // Register-A accumulators (as StoreRows::store_transposed): one bf16x2 reduction per token
  // and column pair, each lane one token per j. Every pair id, then every routing weight, is
  // loaded before the first reduction (16 tokens a lane at 128 tokens: loaded beside the
  // reductions, each would be a dependent round trip the atomics keep the compiler from
  // hoisting).
  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store_transposed(const MoeGemmParams& p, int npp,
                                                          const float (&acc)[kMmas][kRegs],
                                                          uint32_t nan_rows,
                                                          const MoeWorkTile& /*w*/, int row0,
                                                          int col0, uint8_t* /*scratch*/,
                                                          int /*barrier_id*/, int n_tokens) {
    constexpr int kSteps = kRegs / 4;
    int pairs[kSteps];
    float weights[kSteps];
    // Tokens past n_tokens were not multiplied (and have no pair): nothing to add.
#pragma unroll
    for (int j = 0; j < kSteps; ++j)
      pairs[j] = 8 * j < n_tokens ? routed_pair(p, npp, row0 + transposed_token(j)) : -1;
#pragma unroll
    for (int j = 0; j < kSteps; ++j) weights[j] = pairs[j] >= 0 ? p.topk_weights[pairs[j]] : 0.0f;
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      const int pair = pairs[j];
      const bool routed = pair >= 0;
      const float weight = weights[j];
      __nv_bfloat16* dst = p.out + size_t(routed ? pair / p.top_k : 0) * p.ld_out;
#pragma unroll
      for (int mh = 0; mh < kMmas; ++mh) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float2 v = transposed_pair(acc, nan_rows, mh, i, j);
          const int col = col0 + 64 * mh + transposed_column(i);
          if (!routed || col >= p.n_dim) continue;
          atomicAdd(reinterpret_cast<__nv_bfloat162*>(dst + col),
                    __floats2bfloat162_rn(weight * v.x, weight * v.y));
        }
      }
    }
  }
};

// dh = dO_t w2_e^T per routed row (the accumulators: dh', before the routing weight s) and
// the row's kept pre-activations g, u (bf16, from z) give, with h = silu(g) u recomputed in
// fp32:  dz = [dg | du] with dg = s dh' u silu'(g), du = s dh' silu(g), silu'(g) =
// sig(g) (1 + g (1 - sig(g)));  y1s = bf16(s h), the down projection's input scaled by the
// routing weight (dW2's B operand);  ds_part[pair][slice] = sum over the consumer's columns
// (one n tile at block_m = 128) of dh' h (the routing weight's gradient <dO_t, y> = <dh', h>
// without y). Rows with no routed
// pair get zeros in dz and y1s, which the weight gradients read as K rows. A null dz (out),
// y1s or ds_part is an output nothing asked for (x and w, w2, or the routing weights frozen).
struct SwiGluBackward {
  static constexpr int kNumB = 1;
  static constexpr bool kWritesPaddingRows = true;

  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store(const MoeGemmParams& p, int npp,
                                               const float (&acc)[kMmas][kRegs], bool /*acc_valid*/,
                                               const MoeWorkTile& /*w*/, int row0, int col0) {
    using namespace prime_kernels;
    constexpr int kCols = kMmas * kRegs * 2;  // columns of this warpgroup's accumulators
    constexpr int kGroups = kCols / 32;
    static_assert(kCols % 32 == 0, "whole 32-column groups per warpgroup");
    // g and u of two groups in flight at a time: with all eight groups of a 64 x 256 share
    // loaded up front the 232-register consumers spilled 164 bytes (ptxas), with four 16.
    constexpr int kLoadGroups = kGroups < 2 ? kGroups : 2;
    static_assert(kGroups % kLoadGroups == 0, "whole load batches");
    const int H = p.n_dim;
    const int lane_col = 8 * (threadIdx.x % 4);
    // Both of the thread's rows' pair ids and routing weights first: loaded with each row,
    // they put a dependent round trip (pair id, then the z words it gates) in front of every
    // row's loads.
    size_t row[2];
    int pair[2];
    float s[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row[i] = size_t(row0 + wgmma_acc_row(i));
      pair[i] = routed_pair(p, npp, int(row[i]));
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) s[i] = pair[i] >= 0 ? p.topk_weights[pair[i]] : 0.f;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const __nv_bfloat16* z = p.z + row[i] * (2 * size_t(H));
      __nv_bfloat16* dz = p.out + row[i] * (2 * size_t(H));
      __nv_bfloat16* y1s = p.y1s + row[i] * size_t(H);
      const bool routed = pair[i] >= 0;
      // The element math runs in the stores' layout: lane q of a quad owns columns 8q .. 8q + 7
      // of each 32-column group, so g and u arrive by 16-byte loads and dz, y1s leave by
      // 16-byte stores, and only dh' crosses lanes (two quad transposes of fp32 words a group,
      // where the accumulators' layout needed three of the bf16 outputs and 4-byte loads).
      // The loads are unconditional and every one in flight before the first use: a group past
      // H reads the row's last live group, an unrouted row its own z row (it exists), and the
      // values are selected away below. (Loads predicated into registers that otherwise hold 0
      // made ptxas wait for each load before issuing the next: 16 round trips a row.)
      float ds = 0.f;
#pragma unroll
      for (int a0 = 0; a0 < kGroups; a0 += kLoadGroups) {
        uint4 g[kLoadGroups], u[kLoadGroups];
#pragma unroll
        for (int a = 0; a < kLoadGroups; ++a) {
          const int col = min(col0 + 32 * (a0 + a) + lane_col, H - 8);
          g[a] = *reinterpret_cast<const uint4*>(z + col);
          u[a] = *reinterpret_cast<const uint4*>(z + H + col);
        }
        // With overwrite_z, dz's stores below hit z words a clamped load of another lane read:
        // the barrier orders every lane's loads of the row before any lane's stores.
        __syncwarp();
#pragma unroll
        for (int a = 0; a < kLoadGroups; ++a) {
          const int col = col0 + 32 * (a0 + a) + lane_col;
          const bool live = routed && col < H;  // col >= H: partial last n tile
          // dh' of columns 8q + 2t (d0) and 8q + 2t + 1 (d1) into slot t of lane q. An unrouted
          // row's dh' is selected to 0, never multiplied: a skipped half's accumulators hold
          // anything.
          uint32_t d0[4], d1[4];
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            const int j = 4 * (a0 + a) + t;
            d0[t] = routed ? __float_as_uint(wgmma_acc_at(acc, 4 * j + 2 * i)) : 0u;
            d1[t] = routed ? __float_as_uint(wgmma_acc_at(acc, 4 * j + 2 * i + 1)) : 0u;
          }
          quad_transpose(d0);
          quad_transpose(d1);
          const uint32_t gw[4] = {g[a].x, g[a].y, g[a].z, g[a].w};
          const uint32_t uw[4] = {u[a].x, u[a].y, u[a].z, u[a].w};
          uint32_t dg[4], du[4], y[4];
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            // No branch: every element is computed, so ptxas interleaves their MUFU chains. A
            // dead element has g = u = 0, so h = 0; in an unrouted row s = dh' = 0 as well, so
            // its dz and y1s are +0 exactly, as the weight gradients (which read the row as a K
            // row) need; past H, dh' is 0 (TMA zero-fills w2's columns) and nothing is stored.
            const float2 gf = __bfloat1622float2(bit_cast_bf162(live ? gw[t] : 0u));
            const float2 uf = __bfloat1622float2(bit_cast_bf162(live ? uw[t] : 0u));
            const float dh0 = __uint_as_float(d0[t]), dh1 = __uint_as_float(d1[t]);
            const float sig0 = sigmoid_approx(gf.x), sig1 = sigmoid_approx(gf.y);
            const float silu0 = gf.x * sig0, silu1 = gf.y * sig1;
            const float h0 = silu0 * uf.x, h1 = silu1 * uf.y;
            ds += dh0 * h0 + dh1 * h1;
            const float sd0 = s[i] * dh0, sd1 = s[i] * dh1;
            // silu'(g) = sig (1 + g (1 - sig)) = sig + silu - silu sig
            dg[t] =
                bf162_bits(__floats2bfloat162_rn(sd0 * uf.x * (sig0 + fmaf(-silu0, sig0, silu0)),
                                                 sd1 * uf.y * (sig1 + fmaf(-silu1, sig1, silu1))));
            du[t] = bf162_bits(__floats2bfloat162_rn(sd0 * silu0, sd1 * silu1));
            y[t] = bf162_bits(__floats2bfloat162_rn(s[i] * h0, s[i] * h1));
          }
          if (col >= H) continue;
          if (p.out != nullptr) {
            *reinterpret_cast<uint4*>(dz + col) = make_uint4(dg[0], dg[1], dg[2], dg[3]);
            *reinterpret_cast<uint4*>(dz + H + col) = make_uint4(du[0], du[1], du[2], du[3]);
          }
          if (p.y1s != nullptr)
            *reinterpret_cast<uint4*>(y1s + col) = make_uint4(y[0], y[1], y[2], y[3]);
        }
        // The next batch's clamped loads may read this batch's dz words.
        if (a0 + kLoadGroups < kGroups) __syncwarp();
      }
      // The row's columns are spread over the 4 lanes of a quad: a fixed butterfly, so the
      // sum's order is the same on every run.
      ds += __shfl_xor_sync(0xFFFFFFFFu, ds, 1);
      ds += __shfl_xor_sync(0xFFFFFFFFu, ds, 2);
      if (p.ds_part != nullptr && routed && threadIdx.x % 4 == 0)
        p.ds_part[size_t(pair[i]) * p.ld_ds + col0 / kCols] = ds;
    }
  }
};

// Expert w.expert's (m_dim, n_dim) weight gradient at p.out + expert * m_dim * ld_out, row
// major with ld_out elements between rows (n_dim < ld_out: a column slice of the gradient);
// rows and columns past the slice's extent (partial last tiles) are not written.
struct StoreExpertTile {
  static constexpr int kNumB = 1;
  static constexpr bool kWritesPaddingRows = false;

  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store(const MoeGemmParams& p, int /*npp*/,
                                               const float (&acc)[kMmas][kRegs], bool acc_valid,
                                               const MoeWorkTile& w, int row0, int col0) {
    using namespace prime_kernels;
    // 16-byte stores after a quad transpose, as in StoreRows.
    constexpr int kGroups = kMmas * kRegs * 2 / 32;
    const int lane_col = 8 * (threadIdx.x % 4);
    __nv_bfloat16* grad = p.out + size_t(w.expert) * p.m_dim * p.ld_out;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = row0 + wgmma_acc_row(i);
      __nv_bfloat16* dst = grad + size_t(row) * p.ld_out;
#pragma unroll
      for (int a = 0; a < kGroups; ++a) {
        uint32_t v[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int j = 4 * a + t;
          v[t] = acc_valid ? bf162_bits(__floats2bfloat162_rn(wgmma_acc_at(acc, 4 * j + 2 * i),
                                                              wgmma_acc_at(acc, 4 * j + 2 * i + 1)))
                           : 0u;
        }
        quad_transpose(v);
        const int col = col0 + 32 * a + lane_col;
        if (row >= p.m_dim || col >= p.n_dim) continue;  // partial last tiles
        *reinterpret_cast<uint4*>(dst + col) = make_uint4(v[0], v[1], v[2], v[3]);
      }
    }
  }
};

}  // namespace prime_moe
