// Host side shared by the flash_moe launchers (fused_moe_bf16.cu, moe_backward.cu): device
// attributes, the persistent grid, and the launch of one composed GEMM kernel.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "device/moe_gemm.cuh"
#include "fused_moe_bf16.h"
#include "prime_kernels/smem_allowance.h"

namespace prime_moe {

inline size_t align256(size_t bytes) {
  return (bytes + 255) & ~size_t(255);
}

// A device attribute, asked of the runtime once per device: a forward call asked 18 of them
// (torch.profiler, about 0.3 us of host time each), and at decode sizes the host's time a call
// comes close to the GPU's (launch_gemm).
inline int device_attribute(cudaDeviceAttr attr, int device) {
  constexpr int kDevices = 64, kAttributes = 256;
  static std::atomic<int> known[kDevices][kAttributes] = {};
  const bool cached = device >= 0 && device < kDevices && int(attr) >= 0 && int(attr) < kAttributes;
  if (cached) {
    const int value = known[device][attr].load(std::memory_order_relaxed);
    if (value != 0) return value;
  }
  int value = 0;
  if (cudaDeviceGetAttribute(&value, attr, device) != cudaSuccess) {
    (void)cudaGetLastError();  // returned as 0: not left for the next launch check to find
    return 0;
  }
  if (cached) known[device][attr].store(value, std::memory_order_relaxed);
  return value;
}

// SMs the persistent kernels may use on this device (set_num_sms caps it).
inline int usable_sms(int device) {
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount, device);
  const int cap = num_sms_setting();
  return cap > 0 ? std::min(cap, sms) : sms;
}

// The deepest ring (at most max_stages) the device's shared memory holds for Kernel.
template <class Kernel>
int ring_stages(int device, int max_stages) {
  size_t limit = size_t(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  // Kernel::kCtasPerSm CTAs share the SM's shared memory, each with its reserved share (an
  // attribute that cannot be read gives 0 stages: the config checks refuse the shape).
  if (Kernel::kCtasPerSm > 1) {
    const size_t per_sm =
        size_t(device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    const size_t reserved =
        size_t(device_attribute(cudaDevAttrReservedSharedMemoryPerBlock, device));
    const size_t share = per_sm / Kernel::kCtasPerSm;
    limit = std::min(limit, share > reserved ? share - reserved : 0);
  }
  int stages = 0;
  while (stages < max_stages && Kernel::smem_bytes(stages + 1) <= limit) ++stages;
  return stages;
}

inline bool aligned16(const void* ptr) {
  return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0;
}

// How many clusters of Kernel with `stages` stages the device runs at once (not every SM
// pairs up: clusters live inside a GPC), into *clusters. Asks of `kernel`, the stub launch_gemm
// launches, whose dynamic shared memory allowance it has raised (smem_allowance.h). Asked once
// per kernel, device and ring depth (a failed query is not kept).
template <class Kernel>
cudaError_t max_active_clusters(const void* kernel, int device, int stages, int* clusters) {
  constexpr int kDevices = 64, kDepths = 16;
  static std::atomic<int> known[kDevices][kDepths] = {};
  const bool cached = device >= 0 && device < kDevices && stages >= 0 && stages < kDepths;
  if (cached && (*clusters = known[device][stages].load(std::memory_order_relaxed)) > 0)
    return cudaSuccess;
  cudaLaunchConfig_t config = {};
  config.gridDim =
      dim3(Kernel::kClusterM * device_attribute(cudaDevAttrMultiProcessorCount, device));
  config.blockDim = dim3(Kernel::kThreads);
  config.dynamicSmemBytes = Kernel::smem_bytes(stages);
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = Kernel::kClusterM;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  const cudaError_t err = cudaOccupancyMaxActiveClusters(clusters, kernel, &config);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // returned here: not left for the next launch check to find
    return err;
  }
  if (*clusters < 1) return cudaErrorInvalidConfiguration;  // the cluster fits no GPC
  if (cached) known[device][stages].store(*clusters, std::memory_order_relaxed);
  return cudaSuccess;
}

template <class Kernel>
cudaError_t launch_gemm(const CUtensorMap& tmap_a, const CUtensorMap& tmap_b,
                        const MoeGemmParams& params, int num_sms, cudaStream_t stream,
                        bool dependent = false) {
  using Tile = typename Kernel::Tile;
  constexpr int kClusterM = Kernel::kClusterM;
  auto* kernel = moe_gemm_kernel<Kernel>;
  const size_t smem = Kernel::smem_bytes(params.stages);
  cudaError_t err = prime_kernels::allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem,
                                                      Kernel::kCtasPerSm > 1);
  if (err != cudaSuccess) return err;
  // Persistent: kCtasPerSm CTAs per SM (or fewer when even the largest routing has fewer tiles); in
  // clusters, as many whole clusters as fit the SMs at once, at least one (set_num_sms(1) gets
  // one cluster of two CTAs). Under a set_num_sms cap below the device's SMs, one CTA per SM:
  // the hardware may place each CTA on an SM of its own, and two per capped SM could pass the cap.
  const int64_t max_tiles =
      Kernel::Scheduler::max_tiles(params, Tile::kBlockM, Tile::kBlockN, kClusterM);
  if constexpr (kClusterM == 1) {
    int ctas_per_sm = Kernel::kCtasPerSm;
    if (ctas_per_sm > 1 && num_sms_setting() > 0) {
      int device = 0;
      if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
      if (num_sms < device_attribute(cudaDevAttrMultiProcessorCount, device)) ctas_per_sm = 1;
    }
    const int grid =
        int(std::max<int64_t>(1, std::min<int64_t>(int64_t(num_sms) * ctas_per_sm, max_tiles)));
    return prime_kernels::launch_kernel(kernel, dim3(grid), dim3(Kernel::kThreads), smem, stream,
                                        dependent, tmap_a, tmap_b, params);
  } else {
    int device = 0, fit = 0;
    if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
    if ((err = max_active_clusters<Kernel>(reinterpret_cast<const void*>(kernel), device,
                                           params.stages, &fit)) != cudaSuccess)
      return err;
    const int64_t clusters = std::max<int64_t>(
        1, std::min<int64_t>({int64_t(fit), num_sms / kClusterM, max_tiles / kClusterM}));
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(unsigned(clusters * kClusterM));
    config.blockDim = dim3(Kernel::kThreads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = kClusterM;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, tmap_a, tmap_b, params);
  }
}

}  // namespace prime_moe
