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

}  // namespace prime_kernels
