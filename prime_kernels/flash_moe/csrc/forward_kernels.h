// The fused MoE forward's kernels and launch sequence on sm_90a, written once for every weight
// format (host side; fused_moe_bf16.cu and fused_moe_mxfp8.cu are its two users). A weights
// policy says what differs: the B loader that fills a stage's weight tiles, the tensor map
// it reads the weights through, and the gate/up epilogue (how h is stored for the down GEMM).
//   Bf16Weights   TmaWeightTiles (bf16 by TMA), SwiGluToH: h rounded to bf16;
//   Mxfp8Weights  Mxfp8WeightTiles (raw e4m3 plus blocked scales into the stage, widened to
//                 bf16 in the consumers' registers and fed as wgmma's register A operand: the
//                 GEMMs compute out^T = w x^T, RegisterAConsumers), SwiGluToMxfp8: h
//                 re-quantized to MXFP8, stored dequantized (the epilogues' transposed forms);
//   Mxfp8WidenedWeights  MXFP8 weights widened to bf16 once, before the GEMMs (a pre-pass):
//                 Bf16Weights' loader and tiles, SwiGluToMxfp8 in the bf16 layout.
// The A side is the same for both: gate/up gathers bf16 token rows (x, or MXFP8 x dequantized
// by a pre-pass), down reads the h workspace by TMA.
//
// split=true:  memset pair_to_row to -1 (not for inference at decode sizes), gate/up GEMM
//              (+ SwiGLU, + pair_to_row scatter) into h, down GEMM into y, deterministic
//              combine into out: 3 or 4 stream ops. Training (problem.keep_z, bf16 only): the
//              same, with the gate/up epilogue also keeping z = [g | u] and pair_to_row
//              written to the caller's tensors, for backward.
// split=false: gate/up GEMM into h, then the down GEMM adds weight * y straight into the
//              caller-zeroed out with 16-byte bf16 reductions: two kernels, since the down
//              GEMM of a block needs all H columns of h, which come from ceil(H / block_n)
//              CTAs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "device/combine.cuh"
#include "device/moe_gemm.cuh"
#include "device/mxfp8_epilogues.cuh"
#include "device/mxfp8_loaders.cuh"
#include "flash_moe_constants.h"
#include "fused_moe_bf16.h"
#include "moe_launch.h"
#include "prime_kernels/tma.cuh"

namespace prime_moe {
namespace forward {

struct Bf16Weights {
  static constexpr const char* kName = "fused_moe_bf16";
  static constexpr bool kRegisterA = false;  // bf16 weights are read by wgmma from shared memory
  // The down GEMM's ping-pong tile width (ForwardKernels).
  static constexpr int kDownPingPongN = 192;
  // The block_n of the gate/up GEMM's ping-pong tile: 128 tokens x (96 gate + 96 up) weight
  // rows a warpgroup (ForwardKernels; block_m = 128 only).
  static constexpr int kGateUpPingPongN = 96;
  template <class Tile>
  using BLoad = TmaWeightTiles<Tile>;
  using GateUpEpilogue = SwiGluToH<false>;
  using GateUpKeepZEpilogue = SwiGluToH<true>;
  static constexpr bool kKeepsZ = true;
  // The cooperative gate/up tile in 2-CTA clusters where an expert's blocks would fetch its
  // weight tiles from DRAM apart (kClusterGateUpRowsPerExpert).
  static constexpr bool kGateUpClusters = true;
  static cudaError_t weight_map(CUtensorMap* map, const void* w, uint64_t rows, uint64_t cols,
                                uint32_t box_rows) {
    return prime_kernels::make_tma_2d_bf16_sw128(map, w, rows, cols, box_rows);
  }
};

// MXFP8 weights as wgmma's register A operand (docs/flash_moe_mxfp8_design.md): the producer
// copies raw e4m3 tiles (64-byte swizzle) and scale blocks into the stage, the consumers widen
// them in registers (mxfp8_fragment.cuh) and multiply them by the stage's token rows.
struct Mxfp8Weights {
  static constexpr const char* kName = "fused_moe_mxfp8";
  static constexpr bool kRegisterA = true;
  using GateUpEpilogue = SwiGluToMxfp8<>;
  using GateUpKeepZEpilogue = void;  // no training forward keeps z from MXFP8 inputs
  static constexpr bool kKeepsZ = false;
  static cudaError_t weight_map(CUtensorMap* map, const void* w, uint64_t rows, uint64_t cols,
                                uint32_t box_rows) {
    return prime_kernels::make_tma_2d_u8_sw64(map, w, rows, cols, box_rows);
  }
};

// MXFP8 weights widened once to bf16 by a pre-pass (mxfp8_dequantize.cuh) into the workspace, at
// prefill sizes (fused_moe_mxfp8.cu says when): the bf16 forward's kernels on them, with h
// re-quantized to MXFP8 (SwiGluToMxfp8 in the bf16 accumulators' layout).
struct Mxfp8WidenedWeights : Bf16Weights {
  static constexpr const char* kName = "fused_moe_mxfp8";
  using GateUpEpilogue = SwiGluToMxfp8<>;
  using GateUpKeepZEpilogue = void;  // no training forward keeps z from MXFP8 inputs
  static constexpr bool kKeepsZ = false;
  // Widened only above 256 rows an expert, where the clusters are never picked: no such kernel.
  static constexpr bool kGateUpClusters = false;
};

// Up to this many (token, expert) pairs the forward's kernels launch as programmatic dependents
// of the one before (grid_dependency.cuh), so each kernel's setup, and the down GEMM's first
// weight tiles, overlap the tail of the kernel before. H200, T = 64 / 1024, dependent launches
// against plain ones (benchmarks/RESULTS.md 2026-12-04 night): orig 1.031x / 1.022x faster (its
// GEMMs stream weights for ~115 of the call's ~140 us), OLMoE 1.012x / 1.004x, Qwen3-30B-A3B
// 1.013x / 1.008x, Mixtral-8x7B and DeepSeek-V3-32 within 1-2% either way. At T = 8192 they
// measured 0.98-1.0x (a launch gap is microseconds of milliseconds there): larger problems
// launch plainly.
inline constexpr int64_t kDependentLaunchMaxPairs = 16384;
// The down GEMM's producer copies its first tile's weight tiles before it waits for the gate/up
// GEMM (moe_gemm.cuh): they start streaming on each SM a gate/up CTA leaves. Sound while every
// kernel that writes the weights (fused_moe_mxfp8's widening pre-pass) runs before the gate/up
// GEMM's wait returns: launched plainly ahead of it, never as a dependent of it.
inline constexpr bool kDownBBeforeWait = true;

// A forward GEMM (M-grouped tiles; kClusterM CTAs a cluster, 1 but for the clustered gate/up tile)
// with ping-pong or cooperative consumers.
template <bool kPingPong, class Tile, class ALoad, class Epilogue, class BLoad,
          bool kBBeforeWait = false, int kClusterM = 1>
using ScheduledMoeGemm = std::conditional_t<kPingPong,
                                            MoeGemm<Tile, ALoad, Epilogue, BLoad, MoeTileScheduler,
                                                    PingPongConsumers, kClusterM, kBBeforeWait>,
                                            MoeGemm<Tile, ALoad, Epilogue, BLoad, MoeTileScheduler,
                                                    CooperativeConsumers, kClusterM, kBBeforeWait>>;

// The forward's kernels for one gate/up tile of block_m x block_n.
// The down GEMM (K = H, often only 12 K steps) spends a large share of each tile in its
// epilogue; at the large tile it runs ping-pong, one warpgroup's stores under the other's
// mainloop (Qwen3-30B-A3B T = 32768: cooperative 128 x 256 at ~465 TFLOP/s, ping-pong 128 x
// 128 at ~610). A ping-pong tile reads its B tile once per 64-row half, so shared memory
// carries 160 bytes a clock at full MMA rate with 128 x 128 (wgmma reads 96, the stage fills
// 64) against the SM's 128: 192 columns bring that to 138 (Weights::kDownPingPongN).
// Elsewhere (decode sizes, block_m = 64) it is cooperative and 2 * block_n wide, so that
// both GEMMs' stages are the same size.
//
// block_n = 96 (block_m = 128, prefill sizes: resolve_config) runs the gate/up GEMM ping-pong
// too, 128 x (96 gate + 96 up) a warpgroup, with the same down tile as 128: the cooperative 128 x
// (128 + 128) tile idles the tensor cores while both warpgroups run the SwiGLU epilogue (ncu,
// Qwen3-30B-A3B T = 32768: tensor pipe 81% active, against 92-93% for the long-K weight-gradient
// GEMMs); 2 x 96 columns keep a ping-pong tile's shared-memory reads per MMA within 7% of the
// cooperative tile's, and H = 768 is 8 such tiles. A ping-pong warpgroup multiplies both 64-row
// halves of its block, where a cooperative one skips an empty half: not at decode sizes.
// Measured against the cooperative tile (H200, 3 interleaved rounds, benchmarks/RESULTS.md
// 2026-12-04 ninth session): Qwen3-30B-A3B (H = 768) T = 8192 1.04x, T = 32768 1.02x.
template <class Weights, int kBlockM, int kBlockN, bool kRegisterA = Weights::kRegisterA>
struct ForwardKernels {
  static constexpr bool kGateUpPingPong = kBlockM == 128 && kBlockN == Weights::kGateUpPingPongN;
  static constexpr bool kDownPingPong = kBlockM == 128 && (kBlockN == 128 || kGateUpPingPong);
  static_assert(kBlockN != Weights::kGateUpPingPongN || kGateUpPingPong,
                "the ping-pong gate/up tile is 128 rows");
  using GateUpTile = MoeGemmTile<kBlockM, kBlockN, 2>;
  using DownTile = MoeGemmTile<kBlockM, kDownPingPong ? Weights::kDownPingPongN : 2 * kBlockN, 1>;
  template <class Epilogue>
  using DownGemm = ScheduledMoeGemm<kDownPingPong, DownTile, TmaRows<DownTile>, Epilogue,
                                    typename Weights::template BLoad<DownTile>, kDownBBeforeWait>;
  template <class Epilogue, int kClusterM = 1>
  using GateUpGemm =
      ScheduledMoeGemm<kGateUpPingPong, GateUpTile, GatherTokenRows<GateUpTile>, Epilogue,
                       typename Weights::template BLoad<GateUpTile>, false, kClusterM>;
  using GateUp = GateUpGemm<typename Weights::GateUpEpilogue>;
  using GateUpKeepZ = GateUpGemm<typename Weights::GateUpKeepZEpilogue>;  // kKeepsZ only
  // The cooperative 128 x (128 + 128) gate/up tile also in 2-CTA clusters sharing each weight
  // tile (cpc = 2: resolve_config, kClusterGateUpRowsPerExpert, gate_up_weights_outgrow_l2).
  static constexpr bool kGateUpClusters =
      Weights::kGateUpClusters && kBlockM == 128 && kBlockN == 128;
  using GateUpClustered = GateUpGemm<typename Weights::GateUpEpilogue, 2>;
  using GateUpKeepZClustered = GateUpGemm<typename Weights::GateUpKeepZEpilogue, 2>;
  using DownStore = DownGemm<StoreRows>;
  using DownAtomic = DownGemm<WeightedAtomicAdd>;
  static_assert(DownStore::smem_bytes(3) == DownAtomic::smem_bytes(3));

  // h between the GEMMs is bf16 (K-major 128-byte swizzle rows for the down GEMM's TMA), and the
  // down GEMM reads w2 through the weights policy's map; the gate/up GEMM gathers bf16 x.
  static constexpr bool kE4m3Down = false;
  static constexpr bool kF16GateUp = false;
  static constexpr bool kRowsReady = false;
  static cudaError_t h_map(CUtensorMap* map, const void* h, uint64_t rows, uint64_t hidden) {
    return prime_kernels::make_tma_2d_bf16_sw128(map, h, rows, hidden, kTmaRowsBoxRows);
  }
  static cudaError_t down_weight_map(CUtensorMap* map, const void* w2, uint64_t rows,
                                     uint64_t hidden) {
    return Weights::weight_map(map, w2, rows, hidden, DownTile::kBlockN);
  }

  // The down GEMM's ring takes the shared memory of the gate/up ring's `stages` (at block_n 96
  // both stages are 40 KB, 5 of them; at 128 the cooperative gate/up tile's 48 KB stages give
  // the 40 KB down stages 4, where 5 would fit), as far as the device holds.
  static int down_stages(int stages, int device, int max_stages) {
    const int same_bytes = int(stages * GateUpTile::kStageBytes / DownTile::kStageBytes);
    return std::min(same_bytes, ring_stages<DownStore>(device, max_stages));
  }
};

// The register-A forward (Mxfp8Weights): every tile of the bf16 forward, with out^T accumulators.
// Gate/up: block_m tokens x (block_n gate + block_n up) weight rows, as the bf16 tile; the two
// consumer warpgroups split the h rows, each converting its own weight rows once for all the
// tokens (at block_n = 64 with gate and up rows interleaved in one m64 block, tile.cuh). Down:
// block_m tokens x 2 block_n output columns, cooperative (the bf16 forward's ping-pong 128 x 192
// would need a 192-row weight tile: 3 m64 blocks of 64 tokens, 96 accumulators; not written yet),
// so both GEMMs' stages are about the same size. The 64 x 64 tiles (32 accumulators a thread)
// run two CTAs an SM (tile_block_m says why).
//
// On the 64 x 64 tiles (decode sizes: tile_block_m) the gate/up epilogue stores h as MXFP8 (e4m3
// bytes and fp32 block scales) and the down GEMM multiplies it by the e4m3 w2 with fp8 wgmma, each
// 32-wide MX block's sum scaled into the fp32 accumulators (MoeGemmTileE4m3,
// WarpgroupMainloopE4m3; numerics: mma.cuh): no instruction widens a w2 byte, half the register-A
// loop's instructions a stage at N = 16 (SASS). H100, moe_align + fused_moe_mxfp8 at T = 64
// against the register-A down GEMM: 1.036x Qwen3-30B-A3B, 1.028x DeepSeek-V3-32, 1.012x
// Mixtral-8x7B; on the 128-row tiles of Qwen3-30B-A3B T = 1024 (N = 64, whose promotion costs
// about what the widening does) 0.938x, so those keep the register-A down GEMM on a bf16 h
// (benchmarks/RESULTS.md twenty-second session). Their gate/up GEMM takes x as f16 with fp32
// factors (x's pre-pass, mxfp8_dequantize.cuh: each token rebased where exact) and converts the
// weights to f16 rather than widening them to bf16, each block's sum promoted by the weight scale
// and the token's factor (WarpgroupMainloopF16, mma.cuh).
//
// The decode tiles' down GEMM starts on h's rows as the gate/up GEMM stores them, not when it ends
// (RowsReady, moe_gemm.cuh): the counters live beside x's f16 rows, and x's pre-pass zeroes them.
// H200, T = 64, against waiting for the whole gate/up GEMM: DeepSeek-V3-32 1.022x, orig 1.026x,
// Qwen3-30B-A3B and OLMoE 1.000-1.007x, Mixtral-8x7B 0.994x (benchmarks/RESULTS.md).
//
// Stages are 128 wide in K (MoeGemmTileRS says why).
template <class Weights, int kBlockM, int kBlockN>
struct ForwardKernels<Weights, kBlockM, kBlockN, true> {
  static constexpr bool kDownPingPong = false;
  static constexpr bool kGateUpPingPong = false;
  static constexpr bool kDecodeTile = kBlockM == 64 && kBlockN == 64;
  static constexpr bool kE4m3Down = kDecodeTile;
  static constexpr bool kF16GateUp = kDecodeTile;
  static constexpr bool kRowsReady = kDecodeTile;
  using GateUpTile = MoeGemmTileRS<kBlockM, kBlockN, 2, kF16GateUp>;
  // block_n = 96 (three consumer warpgroups on the gate/up tile) keeps the 128-wide down tile.
  static constexpr int kDownN = kBlockN == 96 ? 128 : 2 * kBlockN;
  using DownTile = std::conditional_t<kE4m3Down, MoeGemmTileE4m3<kBlockM, kDownN>,
                                      MoeGemmTileRS<kBlockM, kDownN, 1>>;
  static constexpr int kCtasPerSm = kDecodeTile ? 2 : 1;
  template <class Epilogue>
  using DownGemm = std::conditional_t<
      kE4m3Down,
      MoeGemm<DownTile, E4m3TokenRows<DownTile>, Epilogue, Mxfp8WeightTiles<DownTile>,
              MoeTileScheduler, E4m3Consumers, 1, kDownBBeforeWait, kCtasPerSm,
              kRowsReady ? RowsReady::kAwait : RowsReady::kNone>,
      MoeGemm<DownTile, TmaRows<DownTile>, Epilogue, Mxfp8WeightTiles<DownTile>, MoeTileScheduler,
              RegisterAConsumers, 1, kDownBBeforeWait, kCtasPerSm>>;
  using GateUp = MoeGemm<GateUpTile, GatherTokenRows<GateUpTile>, SwiGluToMxfp8<kE4m3Down>,
                         Mxfp8WeightTiles<GateUpTile>, MoeTileScheduler, RegisterAConsumers, 1,
                         false, kCtasPerSm, kRowsReady ? RowsReady::kSignal : RowsReady::kNone>;
  static_assert(!kRowsReady || kF16GateUp, "x's f16 pre-pass zeroes the rows-ready counters");
  using GateUpKeepZ = void;  // kKeepsZ is false
  static constexpr bool kGateUpClusters = false;
  using GateUpClustered = void;
  using GateUpKeepZClustered = void;
  using DownStore = DownGemm<StoreRows>;
  using DownAtomic = DownGemm<WeightedAtomicAdd>;

  static int down_stages(int stages, int device, int max_stages) {
    const int same_bytes = int(stages * GateUpTile::kStageBytes / DownTile::kStageBytes);
    return std::min(same_bytes, ring_stages<DownStore>(device, max_stages));
  }
  // h's e4m3 rows: 128-byte boxes with the 128-byte swizzle, as fp8 wgmma reads them; else bf16.
  static cudaError_t h_map(CUtensorMap* map, const void* h, uint64_t rows, uint64_t hidden) {
    if constexpr (kE4m3Down)
      return prime_kernels::make_tma_2d_u8_sw128(map, h, rows, hidden, kTmaRowsBoxRows);
    else
      return prime_kernels::make_tma_2d_bf16_sw128(map, h, rows, hidden, kTmaRowsBoxRows);
  }
  static cudaError_t down_weight_map(CUtensorMap* map, const void* w2, uint64_t rows,
                                     uint64_t hidden) {
    if constexpr (kE4m3Down)
      return prime_kernels::make_tma_2d_u8_sw128(map, w2, rows, hidden, DownTile::kBlockN);
    else
      return Weights::weight_map(map, w2, rows, hidden, DownTile::kBlockN);
  }
};

// The (block_m, block_n) tiles this build instantiates: the only place their values are
// written. block_m 64 and 128 are one and two wgmma M; block_n 64 and 128 keep the gate/up
// accumulators (2 x block_n columns per consumer) within the register budget; block_n 96 is the
// ping-pong gate/up tile with bf16 weights and the three-consumer one with MXFP8 weights in
// registers (block_m 128 only: has_tile).
using TileBlockMs = std::integer_sequence<int, 64, 128>;
using TileBlockNs = std::integer_sequence<int, 64, 96, 128>;
static_assert(kBlockM == 128, "moe_align's default block_m is one of the instantiated tiles");
template <class Weights>
constexpr bool has_tile(int block_m, int block_n) {
  return block_n != Bf16Weights::kGateUpPingPongN || block_m == 128;
}

template <class Weights, int kBlockM, int kBlockN, class F>
bool dispatch_tile(int block_n, F& f) {
  if constexpr (has_tile<Weights>(kBlockM, kBlockN)) {
    if (block_n == kBlockN) {
      f(ForwardKernels<Weights, kBlockM, kBlockN>{});
      return true;
    }
  }
  return false;
}
template <class Weights, int kBlockM, class F, int... kBlockN>
bool dispatch_block_n(int block_n, F& f, std::integer_sequence<int, kBlockN...>) {
  return (dispatch_tile<Weights, kBlockM, kBlockN>(block_n, f) || ...);
}
template <class Weights, class F, int... kBlockM>
bool dispatch_block_m(int block_m, int block_n, F& f, std::integer_sequence<int, kBlockM...>) {
  return ((block_m == kBlockM && dispatch_block_n<Weights, kBlockM>(block_n, f, TileBlockNs{})) ||
          ...);
}
// Calls f(ForwardKernels<Weights, block_m, block_n>{}); false when no such tile is instantiated.
template <class Weights, class F>
bool with_forward_kernels(int block_m, int block_n, F&& f) {
  return dispatch_block_m<Weights>(block_m, block_n, f, TileBlockMs{});
}
template <class Weights>
bool is_instantiated(int block_m, int block_n) {
  return with_forward_kernels<Weights>(block_m, block_n, [](auto) {});
}
// The block_n values instantiated for this block_m and weight format, for error messages.
template <class Weights, int... kValues>
std::string list_block_ns(int block_m, std::integer_sequence<int, kValues...>) {
  std::string text;
  ((text += has_tile<Weights>(block_m, kValues)
                ? (text.empty() ? "" : ", ") + std::to_string(kValues)
                : std::string()),
   ...);
  return text;
}
template <int... kValues>
bool contains(std::integer_sequence<int, kValues...>, int64_t value) {
  return ((value == kValues) || ...);
}
template <int... kValues>
std::string list_values(std::integer_sequence<int, kValues...>) {
  std::string text;
  ((text += (text.empty() ? "" : ", ") + std::to_string(kValues)), ...);
  return text;
}

// The warp_n this kernel takes and reports: its tiles run two consumer warpgroups (three on the
// MXFP8 block_n = 96 gate/up tile, which takes warp_n = 2 as the others do).
inline constexpr int kConsumerWarpgroups = 2;
inline constexpr int kMinStages = 2;  // one stage would serialize copies and math
// Past 8 stages (8 x 32 KB at block_n = 64) the ring already covers DRAM latency.
inline constexpr int kMaxStages = 8;
// Whether the routed experts (at most E, at most one a pair) hold `rows` rows each or fewer on
// average: the size test behind the tile and path choices below.
inline bool mean_rows_per_expert_at_most(const FusedMoeBf16Problem& problem, int64_t rows) {
  const int64_t pairs = problem.num_tokens * problem.top_k;
  return pairs <= std::min(problem.num_experts, pairs) * rows;
}

// Mean rows per routed expert at or below which the forward takes decode-sized tiles
// (resolve_config): a quarter of a 128-row block or less is real.
inline constexpr int64_t kDecodeRowsPerExpert = 32;
// The same for register-A (MXFP8) tiles of 64-row blocks (the 128-row ones past decode sizes
// take three consumer warpgroups: tuned_block_n), whose 64-wide gate/up tile and 128-row down tile
// widen one m64 block a warpgroup in rounds of two k16 steps (mma.cuh), against the 128-wide tiles'
// two m64 blocks of single steps, which gather each token block for twice the weight rows. With
// 128-wide K stages the 128-wide tiles win at 256 rows an expert (H200, T = 1024: DeepSeek-V3-32
// 1.09x, Mixtral-8x7B 1.07x; benchmarks/RESULTS.md twentieth session); at 64 rows (Qwen3-30B-A3B
// T = 1024) and at decode sizes the 64-wide tiles stay (as measured with 64-wide stages, 2.4-11%).
inline constexpr int64_t kRegisterANarrowRowsPerExpert = 128;
// When the cooperative 128 x (128 + 128) gate/up tile runs in 2-CTA clusters (cpc = 2), each
// weight tile multicast to both CTAs (ForwardKernels): where an expert's blocks would otherwise
// fetch the same weight tile from DRAM apart. The tiles run group-major (MoeTileScheduler::kGroup
// n tiles of one block after another), so the SMs cover about sms / kGroup consecutive blocks at
// once: sms / kGroup / (blocks an expert) experts, kGroup weight tiles of 2 block_n rows of D
// each. Where those tiles outgrow L2, the blocks of an expert, run apart once the CTAs have
// drifted, each read them from DRAM again (ncu, H100, DeepSeek-V3-32 T = 1024: 3.23 GB read for
// 1.88 GB of weights; clustered 2.21 GB, the kernel 1.18 -> 0.96 ms); where they fit, L2 serves
// the blocks and the pair's lockstep only costs. H100, clustered against single CTAs
// (benchmarks/RESULTS.md twenty-sixth and twenty-seventh sessions), by the bytes in flight
// against the 50 MiB L2:
//   DeepSeek-V3-32 T = 1024 / 2048 / 4096 (235 / 117 / 59 MB): 1.095x / 1.124x / 1.100x;
//   OLMoE T = 1024 (134 MB) 1.014x; orig T = 1024 1.007x;
//   OLMoE and orig T = 4096 (34 MB): 0.991x and 0.985x; DeepSeek-V3-32 and OLMoE T = 8192 (29
//   and 17 MB): 0.977x and 0.974x (the H200 measured the same at prefill sizes,
//   docs/flash_moe_forward_prefill.md).
// Up to 256 rows an expert the tile always clusters: every benchmark shape there outgrows L2
// anyway, and where an expert has one block (no pair shares a tile) the lockstep cost nothing
// measurable (Qwen3-30B-A3B T = 1024, 1.003x). Small problems whose tiles L2 would hold, as in
// the tests, cluster there unmeasured.
inline constexpr int64_t kClusterGateUpRowsPerExpert = 256;
inline bool gate_up_weights_outgrow_l2(const FusedMoeBf16Problem& problem, int block_m,
                                       int block_n) {
  const int64_t pairs = problem.num_tokens * problem.top_k;
  const int64_t routed = std::max<int64_t>(1, std::min(problem.num_experts, pairs));
  const int64_t blocks_per_expert = std::max<int64_t>(1, (pairs / routed + block_m - 1) / block_m);
  const int64_t group =
      std::min<int64_t>(MoeTileScheduler::kGroup, (problem.hidden_dim + block_n - 1) / block_n);
  const int64_t experts = std::min(
      routed, std::max<int64_t>(1, usable_sms(problem.device) / group / blocks_per_expert));
  // The clustered tiles read bf16 weights (Weights::kGateUpClusters).
  const int64_t bytes =
      experts * group * 2 * block_n * problem.dim * int64_t(sizeof(__nv_bfloat16));
  return bytes > device_attribute(cudaDevAttrL2CacheSize, problem.device);
}
// Mean rows per routed expert from which the bf16 forward takes the ping-pong gate/up tile
// (block_n = 96, ForwardKernels): two or more full 128-row blocks an expert.
inline constexpr int64_t kPingPongRowsPerExpert = 256;
// ... where H fills the 96-wide tiles to within 1%: H200 against the 128 tile, H = 768 (Qwen3,
// whole tiles) 1.02-1.04x and H = 14336 (Mixtral, 0.4% padding) 1.01-1.04x, but H = 1024 and 2048
// (3% padding) 0.97-1.02x at T >= 8192 (OLMoE, orig, DeepSeek-V3-32).
inline bool fills_ping_pong_tiles(int64_t hidden_dim) {
  const int64_t n = Bf16Weights::kGateUpPingPongN;
  return ((hidden_dim + n - 1) / n * n - hidden_dim) * 100 <= hidden_dim;
}
// Mean rows per routed expert above which fused_moe_mxfp8 widens the weights to bf16 once, in a
// pre-pass, and runs the bf16 kernels on them (Mxfp8WidenedWeights), instead of widening each
// weight tile in registers for every token block that meets it. The pre-pass moves 3 bytes a
// weight (e4m3 read, bf16 written) at the copy rate, a fixed cost the register path does not pay;
// the register widening's cost grows with the token blocks. H200 (benchmarks/RESULTS.md,
// 2026-12-04 seventh session): at 256 rows an expert the register path takes 0.80-0.89x the
// widened path's time (Qwen3-30B-A3B, DeepSeek-V3-32, Mixtral-8x7B, OLMoE, orig); at 512 the
// widened path 0.91-0.97x the register path's (Qwen3, DeepSeek, Mixtral), at T = 32768 0.71x
// (Qwen3).
inline constexpr int64_t kMxfp8WidenRowsPerExpert = 256;
inline bool mxfp8_widens_weights(const FusedMoeBf16Problem& problem) {
  return !mean_rows_per_expert_at_most(problem, kMxfp8WidenRowsPerExpert);
}

// The rows of the forward's tiles: moe_align's block_m, except for register-A (MXFP8) tiles at
// decode sizes, which take 64-row tiles of its 128-row blocks (MoeTileScheduler skips an upper
// tile with no routed row) and run two CTAs an SM (ForwardKernels): at T = 64 the interleaved
// gate/up tile's widening chains wait on their latency (ncu, benchmarks/RESULTS.md 2026-12-04),
// and twice the consumer warps a scheduler hide it. Their 32 accumulators a thread are what
// lets two CTAs' registers fit. H100, T = 64, moe_align + fused_moe_mxfp8 against one CTA an SM
// of 128-row tiles (benchmarks/RESULTS.md 2026-12-05): 1.16x at DeepSeek-V3-32 and Mixtral-8x7B
// in one sitting; with the upper tiles scheduled last (1.04x more at Qwen3-30B-A3B), 1.18x at
// all three against two sittings' figures. Past kDecodeRowsPerExpert they lose to the 128-row
// tiles, whose loops do not promote each block's sum (H100, T = 1024, benchmarks/RESULTS.md
// twenty-ninth session): taken up to 64 rows an expert, Qwen3-30B-A3B 0.87x (0.95x with x's
// tokens rebased); up to 128, OLMoE and orig 0.73x. 64-row tiles with the widening loops (two CTAs
// an SM) up to 64 rows: 0.92x, an expert past 64 rows converting its weights twice (thirty-sixth
// session). Nor does the f16 loop beat the widening one on the 128-row tiles (0.94x at T = 1024).
template <class Weights>
int tile_block_m(const FusedMoeBf16Problem& pr, int block_n) {
  if constexpr (Weights::kRegisterA) {
    if (pr.block_m == 128 && block_n == 64 &&
        mean_rows_per_expert_at_most(pr, kDecodeRowsPerExpert))
      return 64;
  }
  return int(pr.block_m);
}

// Whether the forward of this problem and block_n gathers x as f16 with fp32 factors
// (ForwardKernels::kF16GateUp): what x's MXFP8 pre-pass must write.
template <class Weights>
bool f16_gate_up(const FusedMoeBf16Problem& pr, int block_n) {
  bool f16 = false;
  with_forward_kernels<Weights>(tile_block_m<Weights>(pr, block_n), block_n,
                                [&](auto kernels) { f16 = decltype(kernels)::kF16GateUp; });
  return f16;
}

// Whether this tile has a clustered gate/up kernel (ForwardKernels::kGateUpClusters).
template <class Weights>
bool has_gate_up_clusters(int block_m, int block_n) {
  bool clusters = false;
  with_forward_kernels<Weights>(
      block_m, block_n, [&](auto kernels) { clusters = decltype(kernels)::kGateUpClusters; });
  return clusters;
}

// The deepest ring the device's shared memory holds for this tile (0: not instantiated).
template <class Weights>
int max_stages(int block_m, int block_n, int device) {
  int stages = 0;
  with_forward_kernels<Weights>(block_m, block_n, [&](auto kernels) {
    stages = ring_stages<typename decltype(kernels)::GateUp>(device, kMaxStages);
  });
  return stages;
}

// The original's spelling of its Blackwell tiles: warp_n warps along N with these block_n.
inline bool is_original_tile(int block_n, int warp_n) {
  return (block_n == 64 && warp_n == 4) || (block_n == 32 && warp_n == 8);
}

// The gate/up block_n the shape takes when the caller leaves it to the kernel (block_n 0).
template <class Weights>
int tuned_block_n(const FusedMoeBf16Problem& problem) {
  const int block_m = int(problem.block_m);
  // 128: gate/up tiles of block_m x (128 gate + 128 up), the largest whose fp32
  // accumulators (128 per consumer thread) fit the 232-register consumer budget, and the
  // down GEMM's ping-pong tiles (128 x 192 for bf16, ForwardKernels). 64 when even that gives
  // fewer tiles than SMs, or when a routed expert has at most kDecodeRowsPerExpert rows on
  // average: decode-sized T, where the blocks are mostly padding and the kernels stream
  // weights, and more, narrower tiles keep more of them in flight (H200, T = 64, all five
  // benchmark configs: 0.3-5% less time, Mixtral-8x7B 84% -> 88% of the copy rate; at T =
  // 1024, 64 to 256 rows an expert, 64 costs up to 11%). Register-A (MXFP8) tiles of 64-row
  // blocks take 64 up to kRegisterANarrowRowsPerExpert. Real blocks are at most one partial
  // block per routed expert plus T*k / block_m full ones.
  const int64_t pairs = problem.num_tokens * problem.top_k;
  const int64_t routed = std::min(problem.num_experts, pairs);
  const int64_t blocks = std::min(problem.max_padded / block_m, routed + pairs / block_m);
  const int64_t tiles = blocks * ((problem.hidden_dim + 127) / 128);
  const bool narrow = mean_rows_per_expert_at_most(
      problem, Weights::kRegisterA ? kRegisterANarrowRowsPerExpert : kDecodeRowsPerExpert);
  // The ping-pong gate/up tile (96) where blocks are full (kPingPongRowsPerExpert rows an
  // expert on average) and H fills its tiles.
  const bool ping_pong =
      !Weights::kRegisterA && has_tile<Weights>(block_m, Bf16Weights::kGateUpPingPongN) &&
      pairs >= routed * kPingPongRowsPerExpert && fills_ping_pong_tiles(problem.hidden_dim);
  // Register-A tiles of 128-row blocks past decode sizes (33 to kMxfp8WidenRowsPerExpert rows
  // an expert): three consumer warpgroups (block_n = 96), whatever H (a partial last tile
  // included). The two-warpgroup tiles' loops are bound by their latency; a third
  // warpgroup hides more of it without widening any weight twice. H100, moe_align +
  // fused_moe_mxfp8 (benchmarks/RESULTS.md thirty-eighth session): against the 64-wide tile at
  // 64-128 rows an expert, Qwen3-30B-A3B T = 1024 1.100x (its gate/up kernel 342.6 -> 289.6 us
  // under ncu), T = 2048 1.077x, OLMoE and orig T = 1024 1.065x, 1.087x, DeepSeek-V3-32 and
  // Mixtral-8x7B T = 512 1.019x, 1.059x; against the 128-wide tile at 256 rows, Qwen3-30B-A3B
  // T = 4096 1.038x, OLMoE and orig T = 2048 1.051x, 1.016x, Mixtral-8x7B T = 1024 1.028x,
  // DeepSeek-V3-32 T = 1024 0.994x.
  const bool three_consumers = Weights::kRegisterA && block_m == 128 &&
                               !mean_rows_per_expert_at_most(problem, kDecodeRowsPerExpert);
  if (three_consumers) return Bf16Weights::kGateUpPingPongN;
  return (problem.hidden_dim <= 64 || tiles < usable_sms(problem.device) || narrow) ? 64
         : ping_pong ? Bf16Weights::kGateUpPingPongN
                     : 128;
}

// The original's defaults, and the most stages its tiles take: check_config's stage_limit for
// bf16 (the original takes 5 without split only; here they are hints either way) and for MXFP8.
inline constexpr int kOriginalBlockN = 64;
inline constexpr int kOriginalWarpN = 4;
inline constexpr int kOriginalMaxStages = 5;
inline constexpr int kOriginalMxfp8MaxStages = 4;

// Whether the hints spell one of the original's Blackwell tiles (block_n, warp_n, stages), which
// name no tile of this kernel and take the tuned choice, as 0 does: warp_n 4 or 8; or, with
// warp_n left 0, the original's block_n (64, or left 0) and stages that its tiles take and this
// kernel's ring at that block_n does not (1, or past what the shared memory holds here). The
// original's wrapper defaults (64, 4) make a call that spells out only its stages one of its
// tiles, so such a call is one here too.
template <class Weights>
bool spells_original_tile(const FusedMoeBf16Problem& problem, const FusedMoeBf16Config& requested) {
  if (requested.warp_n == 4 || requested.warp_n == 8) return true;
  if (requested.warp_n != 0 || (requested.block_n != 0 && requested.block_n != kOriginalBlockN) ||
      requested.stages < 1 || requested.stages > kOriginalMaxStages)
    return false;
  const int block_n = requested.block_n != 0 ? requested.block_n : tuned_block_n<Weights>(problem);
  const int own_limit =
      max_stages<Weights>(tile_block_m<Weights>(problem, block_n), block_n, problem.device);
  return requested.stages < kMinStages || requested.stages > own_limit;
}

template <class Weights>
FusedMoeBf16Config resolve_config(const FusedMoeBf16Problem& problem,
                                  const FusedMoeBf16Config& requested) {
  FusedMoeBf16Config c = requested;
  // The original's tiles take the tuned choice: callers that spell out the original's defaults
  // (64, 4, 2) get the fast tile, not a 2-stage one.
  const bool original = spells_original_tile<Weights>(problem, requested);
  if (original || requested.block_n == 0) c.block_n = tuned_block_n<Weights>(problem);
  // warp_n only chose the tile above and reads 2 back (the MXFP8 block_n = 96 gate/up tile runs
  // three consumer warpgroups: describe_config prints the kernel's count).
  c.warp_n = kConsumerWarpgroups;
  // As deep as the shared memory allows (4 stages of 48 KB at 128 x 128): the ring hides
  // DRAM latency and the gather's cp.async round trips.
  if (original || requested.stages == 0)
    c.stages =
        max_stages<Weights>(tile_block_m<Weights>(problem, c.block_n), c.block_n, problem.device);
  // cpc: the CTAs of a gate/up cluster, a choice of this kernel's (the original's 1 and 0 are
  // hints for it, as its tiles are).
  const int tile_m = tile_block_m<Weights>(problem, c.block_n);
  const bool clusters = has_gate_up_clusters<Weights>(tile_m, c.block_n) &&
                        (mean_rows_per_expert_at_most(problem, kClusterGateUpRowsPerExpert) ||
                         gate_up_weights_outgrow_l2(problem, tile_m, c.block_n));
  c.cpc = clusters ? 2 : 1;
  return c;
}

// The rules both weight formats share: sizes, the routing layout and the tuning values.
// `stage_limit` is the most stages the original's tiles accept.
template <class Weights>
std::string check_config(const FusedMoeBf16Problem& pr, const FusedMoeBf16Config& c,
                         int stage_limit) {
  const std::string sm90 = " is not supported on sm_90";
  const std::string block_ms = list_values(TileBlockMs{});
  const std::string block_ns = list_block_ns<Weights>(int(pr.block_m), TileBlockNs{});
  if (!contains(TileBlockMs{}, pr.block_m))
    return "block_m=" + std::to_string(pr.block_m) + sm90 + "; use " + block_ms +
           " (and the same block_m for moe_align)";
  if (pr.dim <= 0 || pr.dim % kDimMultiple != 0)
    return "dim=" + std::to_string(pr.dim) + sm90 + "; it must be a positive multiple of " +
           std::to_string(kDimMultiple);
  if (pr.hidden_dim <= 0 || pr.hidden_dim % kHiddenMultiple != 0)
    return "hidden_dim=" + std::to_string(pr.hidden_dim) + sm90 +
           "; it must be a positive multiple of " + std::to_string(kHiddenMultiple);
  if (pr.num_experts <= 0)
    return "num_experts=" + std::to_string(pr.num_experts) + " must be positive";
  if (pr.top_k <= 0) return "top_k=" + std::to_string(pr.top_k) + " must be positive";
  if (pr.num_tokens < 0)
    return "num_tokens=" + std::to_string(pr.num_tokens) + " must be non-negative";
  if (pr.max_padded < 0 || pr.max_padded % pr.block_m != 0)
    return "max_padded=" + std::to_string(pr.max_padded) +
           " must be a non-negative multiple of block_m=" + std::to_string(pr.block_m);
  // Rows, pair indices and TMA coordinates are 32-bit; gathered x chunks are 32-bit
  // offsets in units of 8 elements.
  if (pr.num_tokens * pr.top_k > kMaxRows || pr.max_padded > kMaxRows ||
      pr.num_experts * 2 * pr.hidden_dim > kMaxRows || pr.num_experts * pr.dim > kMaxRows ||
      pr.num_tokens * pr.dim / 8 > int64_t(0xFFFFFFFF))
    return "num_tokens=" + std::to_string(pr.num_tokens) +
           ", num_experts=" + std::to_string(pr.num_experts) +
           " are too large: rows, pairs and weight rows must "
           "stay below 2^31 (and T*D/8 below 2^32)";
  if (c.bpc < 1) return "bpc=" + std::to_string(c.bpc) + " must be at least 1";
  if (c.cpc != 0 && c.cpc != 1)
    return "cpc=" + std::to_string(c.cpc) + sm90 +
           " as a request (this kernel picks its gate/up clusters by the shape); use 1 or 0";
  if (spells_original_tile<Weights>(pr, c)) {
    if (!is_original_tile(c.block_n != 0 ? c.block_n : kOriginalBlockN,
                          c.warp_n != 0 ? c.warp_n : kOriginalWarpN))
      return "block_n=" + std::to_string(c.block_n) + " with warp_n=" + std::to_string(c.warp_n) +
             sm90 + "; the original's tiles are (block_n, warp_n) = (64, 4) or (32, 8), and " +
             "this kernel's block_n " + block_ns + " with warp_n 0 or 2";
    if (c.stages < 0 || c.stages > stage_limit)
      return "stages=" + std::to_string(c.stages) + sm90 + " with the original's tiles; use 1.." +
             std::to_string(stage_limit) + " or 0 for the tuned choice";
  } else if (c.warp_n == 0 || c.warp_n == kConsumerWarpgroups) {
    if (c.block_n != 0 && !is_instantiated<Weights>(int(pr.block_m), c.block_n))
      return "block_n=" + std::to_string(c.block_n) + sm90 + "; use " + block_ns +
             ", 0 for the tuned choice, or the original's (64, 4) / (32, 8) with warp_n";
    if (c.stages != 0) {
      const FusedMoeBf16Config resolved = resolve_config<Weights>(pr, c);
      const int tile_m = tile_block_m<Weights>(pr, resolved.block_n);
      const int limit = max_stages<Weights>(tile_m, resolved.block_n, pr.device);
      const std::string tiles = tile_m == pr.block_m
                                    ? ""
                                    : " (at this size " + std::to_string(tile_m) +
                                          "-row tiles, two CTAs an SM, each with half the SM's "
                                          "shared memory)";
      if (c.stages < kMinStages || c.stages > limit)
        return "stages=" + std::to_string(c.stages) + sm90 +
               " at block_m=" + std::to_string(pr.block_m) +
               ", block_n=" + std::to_string(resolved.block_n) + tiles + "; use " +
               std::to_string(kMinStages) + ".." + std::to_string(limit) +
               " (shared memory) or 0 for the tuned choice";
    }
  } else {
    return "warp_n=" + std::to_string(c.warp_n) + sm90 +
           "; use 0 or 2 (this kernel's two consumer warpgroups), or the original's 4 or 8";
  }
  return "";
}

// What the hints resolve to must be a ring this device's shared memory holds.
template <class Weights>
std::string check_ring(const FusedMoeBf16Problem& pr, const FusedMoeBf16Config& c) {
  const FusedMoeBf16Config resolved = resolve_config<Weights>(pr, c);
  if (resolved.stages < kMinStages)
    return "device " + std::to_string(pr.device) + " offers too little shared memory per block (" +
           std::to_string(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, pr.device)) +
           " bytes) for a " + std::to_string(kMinStages) + "-stage ring of the " +
           std::to_string(pr.block_m) + "x" + std::to_string(resolved.block_n) + " tile";
  return "";
}

// Scratch of one forward, carved from one allocation: x_rows_bytes of bf16 token rows first
// (MXFP8 x dequantized; 0 for bf16), then the buffers of the launch sequence.
struct Workspace {
  __nv_bfloat16* x_rows;  // (T, D) when x_rows_bytes > 0
  // MXFP8 x as the decode gate/up tile reads it (ForwardKernels::kF16GateUp): x_rows holds x's
  // unscaled e4m3 values as f16 and x_scales their block scales as fp32 (T, D / 32), set by the
  // MXFP8 launcher inside its x_rows_bytes.
  const float* x_scales;
  int32_t* pair_to_row;  // (T * k,) split only: the caller's when training keeps it
  __nv_bfloat16* h;      // (max_padded, H)
  // With an e4m3 h (ForwardKernels::kE4m3Down) h's bytes are (max_padded, H) e4m3, and its block
  // scales (moe_gemm_params.cuh's layout, 128-row blocks) follow them in the same buffer.
  float* h_scales;
  // The decode tiles' rows-ready counters (ForwardKernels::kRowsReady),
  // rows_ready_tiles(max_padded) of them: set, and zeroed by x's pre-pass, by the MXFP8 launcher
  // inside its x_rows_bytes.
  uint32_t* rows_ready;
  __nv_bfloat16* y;  // (max_padded, D) split only
  size_t bytes;
};

// The rows-ready counters of a problem whose padded order has max_padded rows.
inline size_t rows_ready_tiles(int64_t max_padded) {
  return size_t((max_padded + kRowsReadyTileRows - 1) / kRowsReadyTileRows);
}

inline Workspace carve_workspace(const FusedMoeBf16Problem& pr, bool split, size_t x_rows_bytes,
                                 void* base) {
  uint8_t* p = static_cast<uint8_t*>(base);
  Workspace ws{};
  size_t off = 0;
  if (x_rows_bytes > 0) {
    ws.x_rows = reinterpret_cast<__nv_bfloat16*>(p + off);
    off += align256(x_rows_bytes);
  }
  if (split && pr.keep_pair_to_row != nullptr) {
    ws.pair_to_row = pr.keep_pair_to_row;
  } else if (split) {
    ws.pair_to_row = reinterpret_cast<int32_t*>(p + off);
    off += align256(size_t(pr.num_tokens * pr.top_k) * sizeof(int32_t));
  }
  ws.h = reinterpret_cast<__nv_bfloat16*>(p + off);
  const size_t h_e4m3_bytes = align256(size_t(pr.max_padded * pr.hidden_dim));
  ws.h_scales = reinterpret_cast<float*>(p + off + h_e4m3_bytes);
  const size_t h_scale_bytes = size_t((pr.max_padded + 127) / 128 * 128) * (pr.hidden_dim / 32) * 4;
  off += align256(std::max(size_t(pr.max_padded * pr.hidden_dim) * sizeof(__nv_bfloat16),
                           h_e4m3_bytes + h_scale_bytes));
  if (split) {
    ws.y = reinterpret_cast<__nv_bfloat16*>(p + off);
    off += align256(size_t(pr.max_padded * pr.dim) * sizeof(__nv_bfloat16));
  }
  ws.bytes = off;
  return ws;
}

// The weights in the policy's format: pr.w, pr.w2 are not read (their type is bf16's).
struct WeightOperands {
  const void* w;             // (E, 2H, D)
  const void* w2;            // (E, D, H)
  const uint8_t* w_scales;   // MXFP8: blocked scales of each expert's (2H, D/32)
  const uint8_t* w2_scales;  // MXFP8: blocked scales of each expert's (D, H/32)
};

// A config that did not come from resolve (or a device that changed) never launches;
// training keeps z and pair_to_row both or neither, on the split path.
template <class Weights>
bool launchable(const FusedMoeBf16Problem& pr, const FusedMoeBf16Config& c) {
  const int tile_m = tile_block_m<Weights>(pr, c.block_n);
  if (!is_instantiated<Weights>(tile_m, c.block_n) || c.stages < kMinStages ||
      c.stages > max_stages<Weights>(tile_m, c.block_n, pr.device))
    return false;
  if (c.cpc != 1 && !(c.cpc == 2 && has_gate_up_clusters<Weights>(tile_m, c.block_n))) return false;
  return (pr.keep_z != nullptr) == (pr.keep_pair_to_row != nullptr) &&
         (pr.keep_z == nullptr || (c.split && Weights::kKeepsZ));
}

// A kernel type passed as a value (C++17 has no std::type_identity).
template <class T>
struct KernelTag {
  using type = T;
};

// Enqueues the launch sequence (header comment) with a resolved config; the gate/up GEMM
// gathers token rows from x_rows (bf16 (T, D)).
template <class Weights>
cudaError_t launch_forward(const FusedMoeBf16Problem& pr, const __nv_bfloat16* x_rows,
                           const WeightOperands& weights, const FusedMoeBf16Config& c,
                           const Workspace& ws, cudaStream_t stream) {
  if (pr.num_tokens == 0) return cudaSuccess;  // out is empty
  if (!launchable<Weights>(pr, c)) return cudaErrorInvalidValue;
  const int num_sms = usable_sms(pr.device);
  if (num_sms == 0) return cudaErrorInvalidDevice;
  const int num_pairs = int(pr.num_tokens * pr.top_k);
  const bool dependent = num_pairs <= kDependentLaunchMaxPairs;
  cudaError_t err;
  // The pair_to_row training keeps says -1 for a dropped pair, and larger problems fill theirs
  // too (all bytes 0xFF); the gate/up producer scatters the routed pairs' rows. At decode sizes
  // the inference forward skips the fill and its combine checks each row against the routing:
  // without a stream operation between them, the gate/up GEMM launches as moe_align's
  // programmatic dependent, 3.5 us sooner (H200, orig T = 64: 1.019x the call with the fill).
  // Past kDependentLaunchMaxPairs pairs the checks' round trips cost the combine more than the
  // fill saves (orig T = 32768: 0.94x, Qwen3-30B-A3B T = 8192: 0.98x).
  const bool fill_pair_to_row = c.split && (pr.keep_pair_to_row != nullptr || !dependent);
  if (fill_pair_to_row) {
    err = cudaMemsetAsync(ws.pair_to_row, 0xFF, size_t(num_pairs) * sizeof(int32_t), stream);
    if (err != cudaSuccess) return err;
  }
  if (pr.max_padded > 0) {
    const int D = int(pr.dim), H = int(pr.hidden_dim), E = int(pr.num_experts);
    MoeGemmParams g{};
    g.sorted_token_ids = pr.sorted_token_ids;
    g.expert_ids = pr.expert_ids;
    g.num_tokens_post_padded = pr.num_tokens_post_padded;
    g.x = x_rows;
    g.ld_x = D;
    g.topk_weights = pr.topk_weights;
    g.max_padded = int(pr.max_padded);
    g.num_pairs = num_pairs;
    g.top_k = int(pr.top_k);
    g.num_experts = E;
    g.stages = c.stages;
    g.expert_block_rows = int(pr.block_m);

    // Gate/up: A gathered from x_rows (no tensor map; tmap_w is passed twice as a filler).
    CUtensorMap tmap_w, tmap_h, tmap_w2;
    MoeGemmParams gate_up = g;
    gate_up.pair_to_row = c.split ? ws.pair_to_row : nullptr;
    gate_up.out = ws.h;
    gate_up.z = pr.keep_z;
    gate_up.ld_out = H;
    gate_up.k_dim = D;
    gate_up.n_dim = H;
    gate_up.b_rows_per_expert = 2 * H;
    gate_up.b_second_offset = H;
    gate_up.b_scales = weights.w_scales;

    MoeGemmParams down = g;
    down.out = c.split ? ws.y : pr.out;
    down.ld_out = D;
    down.k_dim = H;
    down.n_dim = D;
    down.b_rows_per_expert = D;
    down.b_second_offset = 0;
    down.b_scales = weights.w2_scales;

    const int tile_m = tile_block_m<Weights>(pr, c.block_n);
    const bool found = with_forward_kernels<Weights>(tile_m, c.block_n, [&](auto kernels) {
      using K = decltype(kernels);
      err = Weights::weight_map(&tmap_w, weights.w, uint64_t(E) * 2 * H, D, K::GateUpTile::kBlockN);
      if (err != cudaSuccess) return;
      err = K::h_map(&tmap_h, ws.h, uint64_t(pr.max_padded), H);
      if (err != cudaSuccess) return;
      if constexpr (K::kE4m3Down) {
        gate_up.out_scales = ws.h_scales;
        down.a_scales = ws.h_scales;
      }
      if constexpr (K::kF16GateUp) gate_up.a_scales = ws.x_scales;
      if constexpr (K::kRowsReady) {
        gate_up.rows_ready = down.rows_ready = ws.rows_ready;
        down.rows_ready_count = K::GateUp::Consumers::kWarpgroups *
                                ((H + K::GateUpTile::kBlockN - 1) / K::GateUpTile::kBlockN);
      }
      // A clustered gate/up GEMM launches plainly (launch_gemm), after moe_align's end.
      const auto launch_gate_up = [&](auto single, auto clustered) {
        using Single = typename decltype(single)::type;
        using Clustered = typename decltype(clustered)::type;
        if constexpr (K::kGateUpClusters) {
          if (c.cpc == 2)
            return launch_gemm<Clustered>(tmap_w, tmap_w, gate_up, num_sms, stream, dependent);
        }
        return launch_gemm<Single>(tmap_w, tmap_w, gate_up, num_sms, stream, dependent);
      };
      if constexpr (Weights::kKeepsZ) {
        err = pr.keep_z != nullptr ? launch_gate_up(KernelTag<typename K::GateUpKeepZ>{},
                                                    KernelTag<typename K::GateUpKeepZClustered>{})
                                   : launch_gate_up(KernelTag<typename K::GateUp>{},
                                                    KernelTag<typename K::GateUpClustered>{});
      } else {
        err = launch_gate_up(KernelTag<typename K::GateUp>{},
                             KernelTag<typename K::GateUpClustered>{});
      }
      if (err != cudaSuccess) return;
      err = K::down_weight_map(&tmap_w2, weights.w2, uint64_t(E) * D, H);
      if (err != cudaSuccess) return;
      down.stages = K::down_stages(c.stages, pr.device, kMaxStages);
      err = c.split ? launch_gemm<typename K::DownStore>(tmap_h, tmap_w2, down, num_sms, stream,
                                                         dependent)
                    : launch_gemm<typename K::DownAtomic>(tmap_h, tmap_w2, down, num_sms, stream,
                                                          dependent);
    });
    if (!found) return cudaErrorInvalidValue;  // unreachable after the checks
    if (err != cudaSuccess) return err;
  }
  if (c.split) {
    CombineParams cp{ws.y,        ws.pair_to_row, pr.topk_weights,   pr.out,
                     int(pr.dim), int(pr.top_k),  int(pr.max_padded)};
    if (!fill_pair_to_row) {
      cp.sorted_token_ids = pr.sorted_token_ids;
      cp.expert_ids = pr.expert_ids;
      cp.num_tokens_post_padded = pr.num_tokens_post_padded;
      cp.block_m = int(pr.block_m);
      cp.num_experts = int(pr.num_experts);
    }
    err = prime_kernels::launch_kernel(moe_combine_kernel,
                                       combine_grid(pr.num_tokens, int(pr.dim), num_sms),
                                       dim3(kCombineThreads), 0, stream, dependent, cp);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <class Weights>
std::string describe_config(const FusedMoeBf16Problem& pr, const FusedMoeBf16Config& requested,
                            const FusedMoeBf16Config& c, const std::string& loaders) {
  const std::string bm = std::to_string(pr.block_m);
  const std::string bn = std::to_string(c.block_n);
  std::string down = "?", gate_up = "?";
  int consumers = 0;
  with_forward_kernels<Weights>(tile_block_m<Weights>(pr, c.block_n), c.block_n, [&](auto kernels) {
    using K = decltype(kernels);
    const std::string n = std::to_string(K::GateUpTile::kBlockN);
    const std::string tm = std::to_string(K::GateUpTile::kBlockM);
    const std::string ctas = K::GateUp::kCtasPerSm > 1 ? ", 2 CTAs an SM" : "";
    consumers = K::GateUp::Consumers::kWarpgroups;
    gate_up = tm + "x(" + n + "+" + n + ")" + (K::kGateUpPingPong ? " ping-pong" : " cooperative") +
              ctas + (c.cpc == 2 ? ", 2-CTA clusters sharing each weight tile" : "");
    down = tm + "x" + std::to_string(K::DownTile::kBlockN) +
           (K::kDownPingPong ? " ping-pong" : " cooperative") +
           (K::kE4m3Down ? ", e4m3 wgmma on an MXFP8 h" : "") + ", " +
           std::to_string(K::down_stages(c.stages, pr.device, kMaxStages)) + " stages";
  });
  std::string text =
      std::string(Weights::kName) + " sm_90a: block_m=" + bm + " block_n=" + bn +
      " (gate/up tile " + gate_up + ", down tile " + down +
      ") consumer warpgroups=" + std::to_string(consumers) + " stages=" + std::to_string(c.stages) +
      " bpc=" + std::to_string(c.bpc) + " cpc=" + std::to_string(c.cpc) +
      (c.split ? " split=true" : " split=false") + " sms=" + std::to_string(usable_sms(pr.device)) +
      " " + loaders + "; asked block_n=" + std::to_string(requested.block_n) +
      " warp_n=" + std::to_string(requested.warp_n) +
      " stages=" + std::to_string(requested.stages) + " cpc=" + std::to_string(requested.cpc);
  if (spells_original_tile<Weights>(pr, requested))
    text += " (the original's Blackwell tile: the tuned tile here)";
  return text;
}

}  // namespace forward
}  // namespace prime_moe
