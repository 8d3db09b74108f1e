// The fused MoE's grouped GEMM on sm_90a: persistent, warp-specialized, one CTA per SM (two
// for the 64-token register-A tiles: kCtasPerSm),
// composed of this folder's parts. Kernel = Tile x A loader x epilogue x B loader x
// scheduler x consumer schedule (the MMA mainloop follows from the tile, the schedule and
// the loaders' layouts):
//   warpgroup 0      producer: the A and B tiles of each K step into the stage ring, by TMA
//                    (thread 0) or cp.async gathers (the loaders, loaders.cuh); MXFP8 weights
//                    as raw e4m3 and scales by TMA (mxfp8_loaders.cuh);
//   warpgroups 1, 2  consumers (and 3 on the MXFP8 block_n = 96 gate/up tile): the MMA
//                    mainloop over the ring into fp32 registers, then the epilogue from
//                    registers to global memory. With MXFP8 weights
//                    (RegisterAConsumers, tile.cuh) they widen the weights in registers and
//                    feed them as wgmma's register A operand, or (E4m3Consumers: MXFP8 h too)
//                    multiply both e4m3 operands by fp8 wgmma and scale each MX block's sum:
//                    either way the accumulators hold out^T, and the epilogues'
//                    store_transposed writes them.
// The consumers either share each tile (CooperativeConsumers) or own alternate tiles and
// take turns at the tensor cores (PingPongConsumers: one's epilogue under the other's
// mainloop), tile.cuh. Tiles come from the scheduler: M-grouped over moe_align's expert blocks (the
// forward, and the backward's activation gradients) or K-grouped over each expert's padded rows
// (the weight gradients).
//
// kClusterM = 2 (the backward's GEMMs, moe_backward.cu): CTAs run in clusters of two, and the
// scheduler hands the two the tiles of consecutive M (expert blocks, or a weight gradient's m
// tiles) at the same n. Where both exist and read the same B tile (same expert: for M-grouped
// tiles, blocks of one expert), each CTA's producer copies half of B into both CTAs' stages (TMA
// multicast; the loaders' BoxShare): per K step a CTA reads A and half of B from L2 instead of A
// and B. Otherwise each copies its own B, and a missing tile (past the last block or m tile, or a
// block with a garbage expert id) passes its stages empty. Either way both CTAs walk the same
// stages in the same order, which multicasting into each other's stages needs: a stage is refilled
// only when the consumers of both CTAs released it.
//
// Launched as a programmatic dependent (grid_dependency.cuh), the kernel sets up its barriers
// before it waits for the kernel ahead of it, and lets the next kernel launch right after that
// wait. kBBeforeWait (the forward's down GEMM, launched right after its gate/up GEMM) goes
// further: the producer copies the B (weight) tiles of its first tile's first stages before the
// wait; only A (h) waits. The weights and the routing it reads to find that tile were complete
// when the gate/up GEMM passed its own wait, before it let this kernel launch: whatever wrote
// them (moe_align; fused_moe_mxfp8's widening pre-pass, a plain launch ahead of the gate/up
// GEMM) finished before that wait returned. At decode sizes the weight stream of the down GEMM then
// starts on each SM as soon as a gate/up CTA leaves it.
//
// RowsReady (the MXFP8 decode forward, forward_kernels.h) lets the down GEMM start on h's rows
// before the whole gate/up GEMM ends. The gate/up GEMM (kSignal) counts each consumer
// warpgroup's stored tile into its 64 rows' counter (a warpgroup barrier, then one release add);
// the down GEMM (kAwait) copies a tile's h only once that counter holds every gate/up
// warpgroup tile of those rows (an acquire load, then the async-proxy fence before its TMA).
// Its consumers then skip the wait for the gate/up GEMM: they read only what arrives in the stage
// and the routing. One idle producer warp waits for it instead and then lets the combine launch
// (it reads pair_to_row, which the gate/up producer writes, before its own wait): every CTA still
// waits before it exits, and the combine's wait still covers the gate/up GEMM. At decode sizes
// the gate/up GEMM completes its blocks in order (the scheduler's raster groups), so by the
// time its last CTAs leave their SMs to the down GEMM, the rows of the down GEMM's first tiles
// were stored long before, and the down GEMM streams w2 during the gate/up GEMM's tail.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "epilogues.cuh"
#include "loaders.cuh"
#include "mma.cuh"
#include "moe_gemm_params.cuh"
#include "prime_kernels/cluster.cuh"
#include "prime_kernels/grid_dependency.cuh"
#include "prime_kernels/mbarrier.cuh"
#include "prime_kernels/pipeline.cuh"
#include "prime_kernels/tma.cuh"
#include "schedulers.cuh"
#include "tile.cuh"

namespace prime_moe {

// How a forward GEMM hands h to the next one (above): not at all (the next one waits for the whole
// kernel), by counting its stored tiles, or by copying a tile's h once it is counted.
enum class RowsReady { kNone, kSignal, kAwait };

// Whether clusters of cluster_m CTAs can share BLoad's tiles: its TMA boxes split evenly.
template <class BLoad>
constexpr bool splits_b(int cluster_m) {
  if constexpr (BLoad::kMulticast)
    return BLoad::kBoxes % cluster_m == 0;
  else
    return cluster_m == 1;
}

template <class Tile_, class ALoad_, class Epilogue_, class BLoad_ = TmaWeightTiles<Tile_>,
          class Scheduler_ = MoeTileScheduler,
          template <class, class, class> class Consumers_ = CooperativeConsumers,
          int kClusterM_ = 1, bool kBBeforeWait_ = false, int kCtasPerSm_ = 1,
          RowsReady kRowsReady_ = RowsReady::kNone>
struct MoeGemm {
  using Tile = Tile_;
  using ALoad = ALoad_;
  using BLoad = BLoad_;
  using Epilogue = Epilogue_;
  using Scheduler = Scheduler_;
  using Consumers = Consumers_<Tile, typename ALoad::Layout, typename BLoad::Layout>;
  static constexpr int kClusterM = kClusterM_;
  static constexpr bool kBBeforeWait = kBBeforeWait_;
  static constexpr int kCtasPerSm = kCtasPerSm_;
  static constexpr RowsReady kRowsReady = kRowsReady_;
  static constexpr bool kFenceGenericWrites =
      ALoad::kGenericProxyWrites || BLoad::kGenericProxyWrites;
  // Register-A consumers (MXFP8 weights widened in registers, or converted to f16 on a tile of
  // f16 tokens) and e4m3 ones (fp8 wgmma, each MX block promoted) run their own K loops over the
  // same ring (mma.cuh).
  using Mainloop = std::conditional_t<
      Consumers::kE4m3, WarpgroupMainloopE4m3<Tile, Consumers, kFenceGenericWrites>,
      std::conditional_t<
          Consumers::kRegisterA,
          std::conditional_t<Tile::kF16Tokens,
                             WarpgroupMainloopF16<Tile, Consumers, kFenceGenericWrites>,
                             WarpgroupMainloopRS<Tile, Consumers, kFenceGenericWrites>>,
          WarpgroupMainloop<Tile, Consumers, kFenceGenericWrites, kClusterM>>>;

  static constexpr int kThreads = 128 * (1 + Consumers::kWarpgroups);
  static constexpr int kProducerThreads =
      ALoad::kThreads > BLoad::kThreads ? ALoad::kThreads : BLoad::kThreads;
  // Register split (sm_90a setmaxnreg, multiples of 8). The CTA launches with kLaunchRegs a
  // thread (__launch_bounds__(384, kCtasPerSm): 168 for one CTA an SM, 80 for two; 128 for 512
  // threads with three consumers) and can only move those kThreads x kLaunchRegs between its
  // warpgroups: 128 * (producer + consumers) <= kThreads * kLaunchRegs, or setmaxnreg.inc waits
  // forever. The loaders say what the producer needs (24 for
  // one TMA thread, 40 for the gather; 40 in a cluster, whose producer also works out its share
  // of the boxes and the multicast masks), the consumers get the rest: 224 to 240 registers,
  // room for their 128 to 192 fp32 accumulators and the epilogue. Two CTAs an SM (register-A
  // tiles of 64 tokens, 32 accumulators) give the gather 32, which it fits (ptxas reports no
  // spills), so that the consumers get 104 rather than 96.
  static constexpr int kLaunchRegs = 65536 / (kThreads * kCtasPerSm) / 8 * 8;
  static constexpr int kLoaderRegs =
      ALoad::kProducerRegs > BLoad::kProducerRegs ? ALoad::kProducerRegs : BLoad::kProducerRegs;
  // Three consumer warpgroups (of 152 registers) leave the producer 56, which the gather beside
  // two scale blocks a weight tile takes (at 40 it spilled 16 bytes, ptxas).
  static constexpr int kProducerRegs = Consumers::kWarpgroups > 2 ? 56
                                       : kCtasPerSm > 1 ? (kLoaderRegs < 32 ? kLoaderRegs : 32)
                                       : kClusterM > 1 && kLoaderRegs < 40 ? 40
                                                                           : kLoaderRegs;
  static constexpr int kConsumerRegs =
      ((kThreads / 128 * kLaunchRegs - kProducerRegs) / Consumers::kWarpgroups) / 8 * 8;
  static constexpr uint32_t kFullArrivals = 1 + ALoad::kFullArrivals + BLoad::kFullArrivals;
  // Every consumer thread arrives; in a cluster one lane per consumer warp of each CTA
  // (StageRing::consumer_release_cluster).
  static constexpr uint32_t kEmptyArrivals = kClusterM == 1
                                                 ? 128 * Consumers::kWarpgroupsPerStage
                                                 : 4 * Consumers::kWarpgroupsPerStage * kClusterM;

  static_assert(Epilogue::kNumB == Tile::kNumB, "the epilogue reads the stage's weight tiles");
  static_assert(kCtasPerSm == 1 || kCtasPerSm == 2, "one or two CTAs an SM");
  static_assert(
      Tile::kEpilogueBytes % 1024 == 0,
      "the stages after the epilogue's bytes keep the 128B swizzle's 1024-byte alignment");
  static_assert(kCtasPerSm == 2 || Consumers::kWarpgroups > 2 || kConsumerRegs >= 224,
                "the consumers keep their accumulators in registers");
  static_assert(Consumers::kWarpgroups == 2 ||
                    (kCtasPerSm == 1 && Consumers::kTokensAlongN && Consumers::kMmaM == 1 &&
                     Consumers::Mma::kAccRegs <= 64 && kConsumerRegs >= 152),
                "three consumer warpgroups leave each 152 registers: 64 out^T accumulators");
  static_assert(kCtasPerSm == 1 || (Consumers::kTokensAlongN && Consumers::kMmaM == 1 &&
                                    Consumers::Mma::kAccRegs <= 32 && kClusterM == 1),
                "two CTAs an SM leave a consumer 104 registers: 32 out^T accumulators");
  static_assert(Consumers::kMmaM * Consumers::kNumMma * Consumers::Mma::kAccRegs <= 128 ||
                    kConsumerRegs >= 232,
                "past 128 accumulators a thread the consumers need 232 registers or more (a "
                "producer of 40 at most; ptxas's report says whether the epilogue fits)");
  static_assert(kProducerRegs + Consumers::kWarpgroups * kConsumerRegs <=
                    (1 + Consumers::kWarpgroups) * kLaunchRegs,
                "setmaxnreg moves, never adds");
  static_assert(kProducerThreads >= 1 && kProducerThreads <= 128,
                "the loaders run in the producer warpgroup, thread 0 included");
  static_assert(ALoad::kTmaBytes <= Tile::kABytes && BLoad::kTmaBytes <= Tile::kBBytes,
                "a loader fills at most its tile's stage buffer");
  static_assert(!Epilogue::kWritesPaddingRows || Scheduler::kMGrouped,
                "padding rows are rows of M-grouped tiles");

  static_assert(kClusterM == 1 || kClusterM == 2, "clusters of one or two CTAs along M");
  static_assert(!Consumers::kTokensAlongN || kClusterM == 1,
                "the register-A and e4m3 loops have no clusters");
  static_assert(!kBBeforeWait || (ALoad::kThreads == 1 && BLoad::kThreads == 1 && kClusterM == 1),
                "copies before the wait are issued by the one TMA thread of a single CTA");
  static_assert(splits_b<BLoad>(kClusterM),
                "a cluster splits the B tile's TMA boxes between its CTAs");
  static_assert(kRowsReady == RowsReady::kNone ||
                    (Consumers::kTokensAlongN && Tile::kBlockM == kRowsReadyTileRows),
                "rows-ready counters count 64-row tiles of the register-A forward");
  static_assert(kRowsReady != RowsReady::kSignal || !Consumers::kPingPong,
                "each consumer warpgroup of the tile counts its own stored columns");
  static_assert(kRowsReady != RowsReady::kAwait || (kBBeforeWait && kProducerThreads <= 32),
                "the one TMA thread awaits the rows; warp 1 of the producer waits for the kernel");

  // The epilogue's shared memory (Tile::kEpilogueBytes, inside Tile::smem_bytes), the ring, then
  // (ping-pong) the two turn barriers.
  static constexpr size_t smem_bytes(int stages) {
    return Tile::smem_bytes(stages) + (Consumers::kPingPong ? 2 * sizeof(uint64_t) : 0);
  }
};

// Ping-pong turns: turn[c] completes a phase when the other warpgroup has issued every wgmma
// of its mainloop (not yet waited for them), so warpgroup c may start its next one. Warpgroup 0
// takes the first tile without waiting; after that each waits once per tile it owns, and every wait
// has exactly one matching phase (a warpgroup cannot signal twice before the other waited:
// its next signal needs the other's). A signal nobody waits for (the CTA's last tile) only
// leaves a phase completed.
struct ConsumerTurns {
  uint64_t* turn;  // [2], 128 arrivals (the signalling warpgroup's threads) per phase
  uint32_t waits = 0;

  __device__ __forceinline__ void wait_turn(int consumer) {
    prime_kernels::mbarrier_wait(&turn[consumer], waits & 1);
    ++waits;
  }
  __device__ __forceinline__ void pass_turn(int consumer) const {
    prime_kernels::mbarrier_arrive(&turn[consumer ^ 1]);
  }
};

// The TMA bytes a stage of the loader's current tile brings: its tile_tma_bytes() where it
// has one (TmaRows copies only the halves of a block that hold routed rows), else kTmaBytes.
template <class Load, class = void>
struct HasTileTmaBytes : std::false_type {};
template <class Load>
struct HasTileTmaBytes<Load, std::void_t<decltype(std::declval<const Load&>().tile_tma_bytes())>>
    : std::true_type {};
template <class Load>
__device__ __forceinline__ uint32_t tile_tma_bytes(const Load& load) {
  if constexpr (HasTileTmaBytes<Load>::value)
    return load.tile_tma_bytes();
  else
    return Load::kTmaBytes;
}

// The tokens a register-A tile's wgmmas multiply (their N): the smallest of 16, 32, 64 and kRows
// that covers every routed row of the tile. moe_align puts an expert's rows first in its
// blocks, so at decode sizes a block is a few tokens and then padding, and a register-A tile's
// tensor time is proportional to its N: at Qwen3-30B-A3B T = 64 (four tokens an expert) all 128
// rows took about 0.23 ms of tensor time against about 0.14 ms of streaming the fp8 weights.
// token: the calling thread's row of the tile (every row has one); a barrier per halving.
template <int kRows>
__device__ __forceinline__ int tile_tokens(bool routed, int token, int barrier_id) {
  int n = kRows;
  while (n > 16 && !prime_kernels::warpgroup_any(routed && token >= n / 2, barrier_id)) n /= 2;
  return n;
}

// RowsReady::kAwait: waits until every gate/up warpgroup tile of the tile's 64 rows has stored its
// part of h. The counts cannot fall short (both GEMMs skip the same tiles: the scheduler's work()
// on the same routing), but if one ever did, the wait for the whole gate/up GEMM after about 0.1 s
// of polls makes it a slow call rather than a hang; all_stored then remembers that every tile is,
// so that the CTA's later tiles do not poll again.
__device__ __forceinline__ void await_rows(const MoeGemmParams& p, const MoeWorkTile& w,
                                           bool& all_stored) {
  using namespace prime_kernels;
  if (all_stored) return;
  constexpr int kMaxPolls = 1 << 17;
  const uint32_t* counter = p.rows_ready + w.row0 / kRowsReadyTileRows;
  for (int polls = 0; ld_acquire_gpu(counter) < uint32_t(p.rows_ready_count); ++polls) {
    if (polls == kMaxPolls) {
      grid_dependency_wait();
      all_stored = true;
      break;
    }
    __nanosleep(256);
  }
  fence_proxy_async_global();
}

// B loaders that can split their tile take the cluster's BoxShare; the others copy it whole.
template <class BLoad>
__device__ __forceinline__ void load_b(BLoad& b_load, const MoeGemmParams& p,
                                       const CUtensorMap* map, uint8_t* smem_b, uint64_t* full,
                                       int kb, const BoxShare& share) {
  if constexpr (BLoad::kMulticast)
    b_load.load(p, map, smem_b, full, kb, share);
  else
    b_load.load(p, map, smem_b, full, kb);
}

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, Kernel::kCtasPerSm)
    moe_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a,
                    const __grid_constant__ CUtensorMap tmap_b, const MoeGemmParams p) {
  using namespace prime_kernels;
  using Tile = typename Kernel::Tile;
  using Consumers = typename Kernel::Consumers;
  using Mainloop = typename Kernel::Mainloop;
  using Scheduler = typename Kernel::Scheduler;
  using ALoad = typename Kernel::ALoad;
  using BLoad = typename Kernel::BLoad;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int stages = p.stages;
  uint8_t* smem_epilogue = smem;
  uint8_t* smem_a = smem_epilogue + Tile::kEpilogueBytes;
  uint8_t* smem_b = smem_a + size_t(stages) * Tile::kABytes;
  const StageRing ring(smem_b + size_t(stages) * Tile::kBBytes, stages);
  uint64_t* turn_barriers = ring.empty + stages;

  constexpr bool kCluster = Kernel::kClusterM > 1;
  const int warpgroup = threadIdx.x / 128;
  const int tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    ring.init(Kernel::kFullArrivals, Kernel::kEmptyArrivals);
    if constexpr (Consumers::kPingPong) {
      mbarrier_init(&turn_barriers[0], 128);
      mbarrier_init(&turn_barriers[1], 128);
      mbarrier_init_fence();
    }
    if constexpr (ALoad::kTmaBytes > 0) tma_prefetch_descriptor(&tmap_a);
    if constexpr (BLoad::kTmaBytes > 0) tma_prefetch_descriptor(&tmap_b);
  }
  // Both CTAs' barriers are initialized before either copies into or arrives on the other's.
  if constexpr (kCluster)
    cluster_sync();
  else
    __syncthreads();
  // Everything below reads what the kernel ahead wrote (the routing, A), except the B copies
  // of a kBBeforeWait producer (its own wait follows them). Every thread triggers its
  // dependents only after its own wait: a dependent may then read, before its wait, what the
  // kernels before this one wrote (moe_combine_kernel reads pair_to_row so).
  constexpr bool kAwaitRows = Kernel::kRowsReady == RowsReady::kAwait;
  const bool b_before_wait = Kernel::kBBeforeWait && warpgroup == 0;
  if (!b_before_wait && !kAwaitRows) {
    grid_dependency_wait();
    launch_dependent_grids();
  }

  const Scheduler sched(p, Tile::kBlockM, Tile::kBlockN, Tile::kBlockK, Kernel::kClusterM);
  const int num_tiles = sched.num_tiles();
  RingState rs;
  MoeWorkTile w;

  if (warpgroup == 0) {
    setmaxnreg_dec<Kernel::kProducerRegs>();
    if (kAwaitRows && tid / 32 == 1) {
      grid_dependency_wait();
      launch_dependent_grids();
    }
    if (tid < Kernel::kProducerThreads) {
      ALoad a_load(tid);
      BLoad b_load(tid);
      // kBBeforeWait: the K steps of the CTA's first tile whose stages hold B, and the A copies
      // behind the wait.
      int first_steps = 0;
      bool all_rows_stored = false;  // RowsReady::kAwait: await_rows fell back to the wait
      if constexpr (Kernel::kBBeforeWait) {
        if (int(blockIdx.x) < num_tiles && sched.work(blockIdx.x, p, w)) {
          a_load.start_tile(p, sched.npp, w);
          b_load.start_tile(p, sched.npp, w);
          first_steps = min(stages, w.num_k_blocks);
          // The ring is fresh: stage kb is free, and its phase is the first.
          for (int kb = 0; kb < first_steps; ++kb) {
            mbarrier_arrive_expect_tx(&ring.full[kb],
                                      tile_tma_bytes(a_load) + tile_tma_bytes(b_load));
            load_b(b_load, p, &tmap_b, smem_b + size_t(kb) * Tile::kBBytes, &ring.full[kb], kb,
                   BoxShare{});
          }
        }
        if constexpr (kAwaitRows) {
          if (first_steps > 0) await_rows(p, w, all_rows_stored);
        } else {
          grid_dependency_wait();
          launch_dependent_grids();
        }
        for (int kb = 0; kb < first_steps; ++kb)
          a_load.load(p, &tmap_a, smem_a + size_t(kb) * Tile::kABytes, &ring.full[kb], kb);
        rs.advance(stages, first_steps);
      }
      // Tile t's cluster partner is t ^ 1 (the scheduler pairs them; blockIdx.x % 2 is the
      // CTA's rank, and gridDim.x is even).
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const bool has_tile = sched.work(t, p, w);
        // The first tile's first K steps went out above (kBBeforeWait).
        const int kb_begin = t == int(blockIdx.x) ? first_steps : 0;
        BoxShare share;
        if constexpr (kCluster) {
          MoeWorkTile pw;
          const bool partner_has_tile = sched.work(t ^ 1, p, pw);
          // The pair shares n (the scheduler's order); both CTAs decide this from the same
          // routing, so they agree (a disagreement would hang both, not miscompute).
          if (has_tile && partner_has_tile && pw.expert == w.expert) share = BoxShare{t & 1, 2};
        } else if (!has_tile) {
          continue;
        }
        if (has_tile && kb_begin == 0) {
          if (tid < ALoad::kThreads) a_load.start_tile(p, sched.npp, w);
          if (tid < BLoad::kThreads) b_load.start_tile(p, sched.npp, w);
        }
        for (int kb = kb_begin; kb < w.num_k_blocks; ++kb) {
          ring.producer_acquire(rs);
          uint64_t* full = ring.full_barrier(rs);
          if constexpr (kCluster) {
            if (!has_tile) {  // a cluster's missing tile: the stage passes through empty
              if (tid == 0) mbarrier_arrive(full);
              if (tid < ALoad::kThreads) ALoad::arrive_empty(full);
              if (tid < BLoad::kThreads) BLoad::arrive_empty(full);
              rs.advance(stages);
              continue;
            }
          }
          // The partner's half of a shared B tile lands on this barrier too.
          if (tid == 0)
            mbarrier_arrive_expect_tx(full, tile_tma_bytes(a_load) + tile_tma_bytes(b_load));
          // TMA (one thread) before the gathers, so thread 0's copies are not queued behind
          // its share of a gather.
          if constexpr (kAwaitRows) {
            // The weights need no wait: they go first.
            load_b(b_load, p, &tmap_b, smem_b + size_t(rs.stage) * Tile::kBBytes, full, kb, share);
            if (kb == 0) await_rows(p, w, all_rows_stored);
            a_load.load(p, &tmap_a, smem_a + size_t(rs.stage) * Tile::kABytes, full, kb);
          } else if constexpr (ALoad::kThreads <= BLoad::kThreads) {
            if (tid < ALoad::kThreads)
              a_load.load(p, &tmap_a, smem_a + size_t(rs.stage) * Tile::kABytes, full, kb);
            if (tid < BLoad::kThreads)
              load_b(b_load, p, &tmap_b, smem_b + size_t(rs.stage) * Tile::kBBytes, full, kb,
                     share);
          } else {
            if (tid < BLoad::kThreads)
              load_b(b_load, p, &tmap_b, smem_b + size_t(rs.stage) * Tile::kBBytes, full, kb,
                     share);
            if (tid < ALoad::kThreads)
              a_load.load(p, &tmap_a, smem_a + size_t(rs.stage) * Tile::kABytes, full, kb);
          }
          rs.advance(stages);
        }
      }
    }
  } else {
    setmaxnreg_inc<Kernel::kConsumerRegs>();
    const int consumer = warpgroup - 1;
    const int m_offset = Consumers::m_offset(consumer);
    const int n_offset = Consumers::n_offset(consumer);
    // Rows of the tile this warpgroup holds: its tokens are wgmma's N with out^T consumers.
    constexpr int kRows = Consumers::kTokensAlongN ? Consumers::kMmaN : 64 * Consumers::kMmaM;
    ConsumerTurns turns{turn_barriers};
    typename Mainloop::Accumulators acc;
    int seq = 0;  // the tile's place among the CTA's tiles (a cluster's missing ones too)
    // RowsReady::kSignal: the first row of the tile whose h this warpgroup has stored and not yet
    // counted, or -1. Counted at the next tile's start rather than right after its epilogue: a
    // barrier there cost the two-CTA tile's 104 consumer registers a spill (ptxas).
    int stored_rows = -1;
    const auto count_stored_rows = [&] {
      if constexpr (Kernel::kRowsReady == RowsReady::kSignal) {
        if (stored_rows >= 0) {
          named_barrier_sync(1 + consumer, 128);
          if (tid == 0) red_release_gpu_add(p.rows_ready + stored_rows / kRowsReadyTileRows, 1);
          stored_rows = -1;
        }
      }
    };
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      count_stored_rows();
      const bool has_tile = sched.work(t, p, w);
      if (!kCluster && !has_tile) continue;  // in a cluster its stages still pass (producer)
      const int this_seq = seq++;
      if constexpr (Consumers::kPingPong) {
        if (this_seq % 2 != consumer) {  // the other warpgroup's tile: its stages too
          rs.advance(stages, w.num_k_blocks);
          continue;
        }
      }
      const int row0 = w.row0 + m_offset;
      const int col0 = w.n0 + n_offset;
      bool routed = false;     // the thread's row of the tile (tid % kRows) has a pair
      bool any_routed = true;  // some row of the warpgroup's does
      if constexpr (Scheduler::kMGrouped) {
        // Read before the turn: a ping-pong warpgroup's load of the routing and its vote then
        // run under the other's mainloop, not between the two warpgroups' wgmmas (ncu, down GEMM
        // at Qwen3-30B-A3B T = 32768, 12 K slices a tile: tensor pipe 89% active with them
        // after the turn).
        if (has_tile) {
          routed = routed_pair(p, sched.npp, row0 + tid % kRows) >= 0;
          any_routed = warpgroup_any(routed, 1 + consumer);
        }
      }
      if constexpr (Consumers::kPingPong)
        if (this_seq > 0) turns.wait_turn(consumer);
      if (!has_tile) {  // a cluster's missing tile: nothing to compute or store
        Mainloop::skip(ring, rs, w.num_k_blocks);
        if constexpr (Consumers::kPingPong) turns.pass_turn(consumer);
        continue;
      }
      bool has_work = w.num_k_blocks > 0;
      bool skipped = false;
      // Rows with no routed pair (the padded tail of an expert's segment: most rows at decode
      // sizes) only pass their stages through: no wgmma. Their output rows are left unwritten
      // unless the epilogue's zeros are read later.
      if (!any_routed) {
        Mainloop::skip(ring, rs, w.num_k_blocks);
        skipped = true;
        has_work = false;
      }
      // An expert with no rows gets a zero weight gradient; a skipped tile's padding rows
      // are written as zeros. The accumulators are not zeroed for that: a non-wgmma write
      // to them anywhere in the kernel makes ptxas serialize every wgmma (C7515), so the
      // epilogue is told instead.
      const auto pass_turn = [&] {
        if constexpr (Consumers::kPingPong) turns.pass_turn(consumer);
      };
      // The warpgroup's columns of this tile's h are counted as stored at the next tile's start
      // or the loop's end (RowsReady::kSignal).
      const auto signal_rows = [&] { stored_rows = w.row0; };
      if constexpr (Consumers::kTokensAlongN) {
        // The accumulators are out^T: token rows row0 .. + kMmaN, output columns from col0; only
        // the first n_tokens are computed and stored.
        static_assert(Scheduler::kMGrouped, "register-A and e4m3 tiles are M-grouped");
        // Decided before the mainloop (a skipped tile runs none), so that nothing of it stays
        // live across the loop: at two CTAs an SM that flag spilled (ptxas).
        if (skipped && !Kernel::Epilogue::kWritesPaddingRows) {
          signal_rows();
          continue;
        }
        const int n_tokens = !Mainloop::kCutsTokens ? kRows
                             : has_work ? tile_tokens<kRows>(routed, tid % kRows, 1 + consumer)
                                        : 0;
        const uint32_t nan_rows =
            has_work ? Mainloop::run(acc, ring, rs, smem_a, smem_b, m_offset, n_offset, w.n0 % 128,
                                     w.num_k_blocks, n_tokens, 1 + consumer, pass_turn)
                     : 0u;
        Kernel::Epilogue::store_transposed(p, sched.npp, acc, nan_rows, w, row0, col0,
                                           smem_epilogue + consumer * Tile::kEpilogueWarpgroupBytes,
                                           1 + consumer, n_tokens);
        signal_rows();
      } else {
        if (has_work)
          Mainloop::run(acc, ring, rs, smem_a, smem_b, m_offset, n_offset, w.num_k_blocks,
                        pass_turn);
        else
          pass_turn();
        if (skipped && !Kernel::Epilogue::kWritesPaddingRows) continue;
#pragma unroll
        for (int mh = 0; mh < Consumers::kMmaM; ++mh)
          Kernel::Epilogue::store(p, sched.npp, acc[mh], has_work, w, row0 + 64 * mh, col0);
      }
    }
    count_stored_rows();
  }
  // The partner may still copy into this CTA's stages or arrive on its barriers until both
  // are done: neither exits before.
  if constexpr (kCluster) cluster_sync();
}

}  // namespace prime_moe
