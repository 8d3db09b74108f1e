// Thread-block cluster helpers (sm_90): the cluster-wide barrier, and arrivals on another
// CTA's mbarrier (distributed shared memory).
#pragma once

#include <cstdint>

#include "prime_kernels/mbarrier.cuh"

namespace prime_kernels {

// Every thread of every CTA of the cluster: what each did to shared memory (barrier
// inits included) is visible to the others after it. A CTA must not exit while another
// may still write its shared memory, so cluster kernels end with it too.
__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
}

// One arrival on the mbarrier at the same shared-memory offset as `bar` in CTA `cta` of
// the cluster (this CTA's own rank included). Default (CTA-scope) release, as CUTLASS's
// ClusterBarrier: what it orders is wgmma's reads of this CTA's stage, done at the arrival.
// `.release.cluster` would put a MEMBAR.ALL.GPU before every arrival, which waits for the
// thread's outstanding global stores (the last tile's epilogue): measured 1.3-2x slower GEMMs.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_addr(bar)),
      "r"(cta)
      : "memory");
}

}  // namespace prime_kernels
