// Programmatic dependent launch (sm_90): a kernel launched with the programmatic
// stream-serialization attribute may start while the kernel before it in the stream still
// runs, once every CTA of that kernel has called launch_dependent_grids() or exited. Its
// prologue (barrier setup, tensor-map prefetch, and whatever reads nothing the earlier kernel
// writes) then overlaps the earlier kernel's tail. grid_dependency_wait() blocks until the
// earlier kernel has completed and its writes are visible; without the attribute both are
// no-ops.
//
// A kernel launched so must call grid_dependency_wait() in every CTA before it exits: the
// next kernel's wait covers only this one, so this one's completion must imply the earlier
// one's.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace prime_kernels {

// kernel<<<grid, threads, smem, stream>>>(args...), as a programmatic dependent when `dependent`.
template <class... Params, class... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 threads, size_t smem,
                          cudaStream_t stream, bool dependent, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = threads;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

__device__ __forceinline__ void launch_dependent_grids() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// Counters by which a dependent starts on parts of the earlier kernel's output before that kernel
// ends (the MXFP8 decode forward's h rows, moe_gemm.cuh). The writer, after a barrier over the
// threads whose stores the count covers, adds with release semantics; the reader loads with
// acquire semantics, then fences the async proxy so that its TMA and bulk copies issued after
// see what the load made visible (those stores went through the generic proxy).
__device__ __forceinline__ void red_release_gpu_add(uint32_t* address, uint32_t value) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(address), "r"(value) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* address) {
  uint32_t value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

}  // namespace prime_kernels
