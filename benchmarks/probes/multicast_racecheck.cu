// Which 2-CTA ring patterns compute-sanitizer racecheck flags, among correct rings whose
// consumers read their stages with plain ld.shared: the register-A gate/up clusters' pattern
// (MXFP8: e4m3 values and scale blocks read by ld.shared), where racecheck reported hazards
// between the scale blocks' bulk copies and the consumers' scale reads. A consumer warp per CTA
// waits on its full barrier, sums the stage's two 512-byte blocks, fences the proxy and releases
// the stage. Modes:
//   cta      each CTA's producer multicasts one block into both CTAs (cp.async.bulk ...
//            multicast::cluster); the consumers release to both producers by a remote arrive
//            with the default (CTA-scope) release, as the kernels do (prime_kernels/cluster.cuh);
//   cluster  the same with .release.cluster;
//   local    each producer copies both blocks into its own CTA only, and the consumers still
//            release to both CTAs' producers (the clustered kernels' release, with the scale
//            blocks copied locally);
//   mixed    local copies; the consumers release their own CTA's stage by a local arrive and
//            the partner's by a remote one;
//   single   local copies and a local arrive on the CTA's own barrier (the single-CTA kernels).
// The sums are checked, so a real race shows as a wrong sum even without the sanitizer.
// Build and run (sm_90a):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Iprime_kernels/include \
//     benchmarks/probes/multicast_racecheck.cu -o multicast_racecheck
//   compute-sanitizer --tool racecheck ./multicast_racecheck cta|cluster|local|mixed|single
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda_check.h"
#include "prime_kernels/cluster.cuh"
#include "prime_kernels/mbarrier.cuh"
#include "prime_kernels/tma.cuh"

constexpr int kStages = 2, kSteps = 64, kBlockBytes = 512, kWords = kBlockBytes / 4;

__device__ __forceinline__ void bulk_copy_multicast(uint32_t dst, const void* src, uint32_t bytes,
                                                    uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "h"(uint16_t(0b11))
      : "memory");
}

__device__ __forceinline__ void arrive_cluster_release(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(
          prime_kernels::smem_addr(bar)),
      "r"(cta)
      : "memory");
}

enum Mode { kCta, kCluster, kLocal, kMixed, kSingle };

// src: kSteps x 2 blocks of kWords words; sums[cta * kSteps + step]: the stage's word sum.
template <Mode kMode>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(64)
    ring_kernel(const uint32_t* src, uint32_t* sums) {
  using namespace prime_kernels;
  constexpr bool kMulticast = kMode == kCta || kMode == kCluster;
  constexpr uint32_t kReleasers = kMode == kSingle ? 1 : 2;  // consumer warps that release
  __shared__ alignas(128) uint32_t stage[kStages][2][kWords];
  __shared__ alignas(8) uint64_t full[kStages], empty[kStages];
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kReleasers);
    }
    mbarrier_init_fence();
  }
  cluster_sync();
  if (threadIdx.x == 0) {  // producer
    for (int step = 0; step < kSteps; ++step) {
      const int s = step % kStages;
      if (step >= kStages) mbarrier_wait(&empty[s], ((step / kStages) - 1) & 1);
      mbarrier_arrive_expect_tx(&full[s], 2 * kBlockBytes);
      if constexpr (kMulticast) {
        bulk_copy_multicast(smem_addr(&stage[s][rank][0]), src + (step * 2 + rank) * kWords,
                            kBlockBytes, smem_addr(&full[s]));
      } else {
        for (int b = 0; b < 2; ++b)
          bulk_copy_g2s(smem_addr(&stage[s][b][0]), src + (step * 2 + b) * kWords, kBlockBytes,
                        smem_addr(&full[s]));
      }
    }
  } else if (threadIdx.x >= 32) {  // consumer warp
    const int lane = threadIdx.x - 32;
    for (int step = 0; step < kSteps; ++step) {
      const int s = step % kStages;
      mbarrier_wait(&full[s], (step / kStages) & 1);
      uint32_t sum = 0;
      for (int w = lane; w < 2 * kWords; w += 32) {
        uint32_t v;
        asm volatile("ld.shared.u32 %0, [%1];"
                     : "=r"(v)
                     : "r"(smem_addr(&stage[s][0][0]) + 4 * w)
                     : "memory");
        sum += v;
      }
      for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (lane == 0) sums[rank * kSteps + step] = sum;
      fence_proxy_async_shared();
      __syncwarp();
      if constexpr (kMode == kSingle) {
        if (lane == 0) mbarrier_arrive(&empty[s]);
      } else if constexpr (kMode == kMixed) {
        if (lane == 0) mbarrier_arrive(&empty[s]);
        if (lane == 1) mbarrier_arrive_cluster(&empty[s], rank ^ 1);
      } else if (lane < 2) {
        if constexpr (kMode == kCluster)
          arrive_cluster_release(&empty[s], lane);
        else
          mbarrier_arrive_cluster(&empty[s], lane);
      }
    }
  }
  cluster_sync();
}

int main(int argc, char** argv) {
  const char* names[] = {"cta", "cluster", "local", "mixed", "single"};
  int mode = 0;
  while (mode < 5 && !(argc > 1 && std::strcmp(argv[1], names[mode]) == 0)) ++mode;
  if (mode == 5) {
    fprintf(stderr, "usage: %s cta|cluster|local|mixed|single\n", argv[0]);
    return 2;
  }
  std::vector<uint32_t> host(kSteps * 2 * kWords);
  for (size_t i = 0; i < host.size(); ++i) host[i] = uint32_t(i * 2654435761u);
  uint32_t *src, *sums;
  CK(cudaMalloc(&src, host.size() * 4));
  CK(cudaMalloc(&sums, 2 * kSteps * 4));
  CK(cudaMemcpy(src, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(sums, 0xff, 2 * kSteps * 4));
  for (int launch = 0; launch < 16; ++launch) {
    if (mode == kCta) ring_kernel<kCta><<<2, 64>>>(src, sums);
    if (mode == kCluster) ring_kernel<kCluster><<<2, 64>>>(src, sums);
    if (mode == kLocal) ring_kernel<kLocal><<<2, 64>>>(src, sums);
    if (mode == kMixed) ring_kernel<kMixed><<<2, 64>>>(src, sums);
    if (mode == kSingle) ring_kernel<kSingle><<<2, 64>>>(src, sums);
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<uint32_t> got(2 * kSteps);
  CK(cudaMemcpy(got.data(), sums, got.size() * 4, cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (int step = 0; step < kSteps; ++step) {
    uint32_t want = 0;
    for (int w = 0; w < 2 * kWords; ++w) want += host[step * 2 * kWords + w];
    wrong += (got[step] != want) + (got[kSteps + step] != want);
  }
  printf("%s: %d of %d stage sums wrong\n", names[mode], wrong, 2 * kSteps);
  return wrong != 0;
}
