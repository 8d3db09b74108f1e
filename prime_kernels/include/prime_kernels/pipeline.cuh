// The shared-memory stage ring between a producer (TMA, cp.async) and its consumers
// (wgmma), written once for every kernel: `stages` stages, each guarded by a full barrier
// (the producer's copies landed) and an empty barrier (every consumer is done reading).
// Both sides walk the ring with a RingState; a phase flips each time the ring wraps.
#pragma once

#include <cstdint>

#include "prime_kernels/cluster.cuh"
#include "prime_kernels/mbarrier.cuh"

namespace prime_kernels {

struct RingState {
  int stage = 0;
  uint32_t phase = 0;

  __device__ __forceinline__ void advance(int stages) {
    if (++stage == stages) {
      stage = 0;
      phase ^= 1;
    }
  }
  // Past `count` stages another consumer takes (a ping-pong schedule's other warpgroup).
  __device__ __forceinline__ void advance(int stages, int count) {
    const int next = stage + count;
    phase ^= uint32_t(next / stages) & 1;
    stage = next % stages;
  }
};

struct StageRing {
  uint64_t* full;   // [stages]
  uint64_t* empty;  // [stages]
  int stages;

  // Barriers live right after the stage buffers; bytes they take for `stages` stages.
  static constexpr size_t barrier_bytes(int stages) { return 2 * size_t(stages) * 8; }

  __device__ __forceinline__ StageRing(void* barriers, int stages_)
      : full(static_cast<uint64_t*>(barriers)),
        empty(static_cast<uint64_t*>(barriers) + stages_),
        stages(stages_) {}

  // One thread, before the CTA barrier that precedes any use.
  __device__ __forceinline__ void init(uint32_t full_arrivals, uint32_t empty_arrivals) const {
    for (int s = 0; s < stages; ++s) {
      mbarrier_init(&full[s], full_arrivals);
      mbarrier_init(&empty[s], empty_arrivals);
    }
    mbarrier_init_fence();
  }

  // Producer: waits until the consumers released the stage (the first pass finds it free).
  __device__ __forceinline__ void producer_acquire(const RingState& s) const {
    mbarrier_wait(&empty[s.stage], s.phase ^ 1);
  }
  __device__ __forceinline__ uint64_t* full_barrier(const RingState& s) const {
    return &full[s.stage];
  }

  // Consumer: waits until the stage's copies landed, and gives it back when done.
  __device__ __forceinline__ void consumer_wait(const RingState& s) const {
    mbarrier_wait(&full[s.stage], s.phase);
  }
  __device__ __forceinline__ void consumer_release(int stage) const {
    mbarrier_arrive(&empty[stage]);
  }
  // The same in a cluster of kCtas CTAs that copy into each other's stages (TMA multicast): a
  // stage may be refilled only when the consumers of every CTA are done with it, so lane c of
  // each consumer warp that read the stage arrives on CTA c's barrier (empty_arrivals: those
  // warps x kCtas). A warp's lanes leave wgmma's wait together, so one lane speaks for it.
  template <int kCtas>
  __device__ __forceinline__ void consumer_release_cluster(int stage) const {
    const uint32_t lane = threadIdx.x % 32;
    if (lane < kCtas) mbarrier_arrive_cluster(&empty[stage], lane);
  }
};

}  // namespace prime_kernels
