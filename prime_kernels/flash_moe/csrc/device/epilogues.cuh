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
//   WeightedAtomicAdd  down, split=false: out[token] += topk_weight * acc with bf16x2
//                      atomics (the caller zeroed out; the k contributions land in any order);
//   SwiGluBackward     dh: from dh' = dO w2_e (the accumulators) and the kept z, the SwiGLU
//                      backward dz = [dg | du], y1s = bf16(s h) and <dh', h> per pair
//                      and n tile;
//   StoreExpertTile    weight gradients: bf16 tile of expert e's (m_dim, n_dim) gradient.
// (The MXFP8 re-quantizing SwiGLU is in mxfp8_epilogues.cuh; a shared-memory-staged
// TMA-store epilogue would be a further part of this file's kind.)
#pragma once

#include <cuda_bf16.h>

#include "moe_gemm_params.cuh"
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
    using namespace prime_kernels;
    // 16-byte stores, as in SwiGluBackward: lane q of a quad stores the 8 columns of j = 4a + q
    // after a quad transpose, so a warp's store covers whole 32-byte sectors of its rows.
    constexpr int kGroups = kMmas * kRegs * 2 / 32;
    const int lane_col = 8 * (threadIdx.x % 4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      __nv_bfloat16* dst = p.out + size_t(row0 + wgmma_acc_row(i)) * p.ld_out;
#pragma unroll
      for (int a = 0; a < kGroups; ++a) {
        uint32_t v[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int j = 4 * a + t;
          v[t] = bf162_bits(__floats2bfloat162_rn(wgmma_acc_at(acc, 4 * j + 2 * i),
                                                  wgmma_acc_at(acc, 4 * j + 2 * i + 1)));
        }
        quad_transpose(v);
        const int col = col0 + 32 * a + lane_col;
        if (col >= p.n_dim) continue;  // partial last n tile (D % block_n != 0)
        *reinterpret_cast<uint4*>(dst + col) = make_uint4(v[0], v[1], v[2], v[3]);
      }
    }
  }
};

struct WeightedAtomicAdd {
  static constexpr int kNumB = 1;
  static constexpr bool kWritesPaddingRows = false;

  template <int kMmas, int kRegs>
  __device__ __forceinline__ static void store(const MoeGemmParams& p, int npp,
                                               const float (&acc)[kMmas][kRegs], bool /*acc_valid*/,
                                               const MoeWorkTile& /*w*/, int row0, int col0) {
    using namespace prime_kernels;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int pair = routed_pair(p, npp, row0 + wgmma_acc_row(i));
      if (pair < 0) continue;
      const float weight = p.topk_weights[pair];
      __nv_bfloat16* dst = p.out + size_t(pair / p.top_k) * p.ld_out;
#pragma unroll
      for (int j = 0; j < kMmas * kRegs / 4; ++j) {
        const int col = col0 + wgmma_acc_col(j);
        if (col >= p.n_dim) continue;
        atomicAdd(reinterpret_cast<__nv_bfloat162*>(dst + col),
                  __floats2bfloat162_rn(weight * wgmma_acc_at(acc, 4 * j + 2 * i),
                                        weight * wgmma_acc_at(acc, 4 * j + 2 * i + 1)));
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
    const int H = p.n_dim;
    const int lane_col = 8 * (threadIdx.x % 4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const size_t row = size_t(row0 + wgmma_acc_row(i));
      const int pair = routed_pair(p, npp, int(row));
      const float s = pair >= 0 ? p.topk_weights[pair] : 0.f;
      const __nv_bfloat16* z = p.z + row * (2 * size_t(H));
      __nv_bfloat16* dz = p.out + row * (2 * size_t(H));
      __nv_bfloat16* y1s = p.y1s + row * size_t(H);
      // The row's g and u in the accumulators' own layout (bf16x2 at the accumulator's
      // columns: a quad reads 16 contiguous bytes, L1 merges the two halves of a sector),
      // every load in flight at once (a store between two loads would serialize them). The epilogue
      // runs under the other warpgroup's mainloop only while it is shorter, so its instructions
      // count: no transpose here.
      uint32_t g[kGroups][4], u[kGroups][4];
#pragma unroll
      for (int j = 0; j < kGroups * 4; ++j) {
        const int col = col0 + wgmma_acc_col(j);
        const bool live = pair >= 0 && col < H;  // col >= H: partial last n tile
        g[j / 4][j % 4] = live ? *reinterpret_cast<const uint32_t*>(z + col) : 0u;
        u[j / 4][j % 4] = live ? *reinterpret_cast<const uint32_t*>(z + H + col) : 0u;
      }
      // With overwrite_z, dz's stores below hit the z words other lanes of the quad loaded:
      // the barrier orders every lane's loads of the row before any lane's stores.
      __syncwarp();
      float ds = 0.f;
#pragma unroll
      for (int a = 0; a < kGroups; ++a) {
        uint32_t dg[4], du[4], y[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int j = 4 * a + t;
          if (pair >= 0) {  // a skipped half's accumulators hold nothing: never read them
            const float2 gf = __bfloat1622float2(bit_cast_bf162(g[a][t]));
            const float2 uf = __bfloat1622float2(bit_cast_bf162(u[a][t]));
            const float d0 = wgmma_acc_at(acc, 4 * j + 2 * i);
            const float d1 = wgmma_acc_at(acc, 4 * j + 2 * i + 1);
            // Approximate reciprocal (2 ulp while g > -87, then 0 as sigmoid's tail is):
            // the results are rounded to bf16.
            const float sig0 = __fdividef(1.0f, 1.0f + __expf(-gf.x));
            const float sig1 = __fdividef(1.0f, 1.0f + __expf(-gf.y));
            const float silu0 = gf.x * sig0, silu1 = gf.y * sig1;
            const float h0 = silu0 * uf.x, h1 = silu1 * uf.y;
            ds += d0 * h0 + d1 * h1;  // columns past H: g = u = 0, so h = 0
            const float sd0 = s * d0, sd1 = s * d1;
            dg[t] = bf162_bits(
                __floats2bfloat162_rn(sd0 * uf.x * sig0 * (1.0f + gf.x * (1.0f - sig0)),
                                      sd1 * uf.y * sig1 * (1.0f + gf.y * (1.0f - sig1))));
            du[t] = bf162_bits(__floats2bfloat162_rn(sd0 * silu0, sd1 * silu1));
            y[t] = bf162_bits(__floats2bfloat162_rn(s * h0, s * h1));
          } else {
            dg[t] = du[t] = y[t] = 0u;
          }
        }
        // 16-byte stores: lane q of a quad stores the 8 columns of j = 4a + q after a 4x4
        // transpose of bf16x2 words inside the quad, so each row's 32 columns per group are
        // two whole sectors, not eight half-written ones.
        quad_transpose(dg);
        quad_transpose(du);
        quad_transpose(y);
        const int col = col0 + 32 * a + lane_col;
        if (col >= H) continue;
        if (p.out != nullptr) {
          *reinterpret_cast<uint4*>(dz + col) = make_uint4(dg[0], dg[1], dg[2], dg[3]);
          *reinterpret_cast<uint4*>(dz + H + col) = make_uint4(du[0], du[1], du[2], du[3]);
        }
        if (p.y1s != nullptr)
          *reinterpret_cast<uint4*>(y1s + col) = make_uint4(y[0], y[1], y[2], y[3]);
      }
      // The row's columns are spread over the 4 lanes of a quad: a fixed butterfly, so the
      // sum's order is the same on every run.
      ds += __shfl_xor_sync(0xFFFFFFFFu, ds, 1);
      ds += __shfl_xor_sync(0xFFFFFFFFu, ds, 2);
      if (p.ds_part != nullptr && pair >= 0 && threadIdx.x % 4 == 0)
        p.ds_part[size_t(pair) * p.ld_ds + col0 / kCols] = ds;
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
