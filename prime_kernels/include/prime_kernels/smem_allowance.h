// A kernel's dynamic shared memory allowance, raised once per launched address and device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <utility>

namespace prime_kernels {

// Raises `kernel`'s dynamic shared memory allowance to at least smem bytes on the current device
// (with the largest carveout where two CTAs share an SM), set once per kernel and device: the
// allowance only grows, and a forward call made four cudaFuncSetAttribute calls of about 1.4 us
// each. At decode sizes the host's time a call comes close to the GPU's (H100 host, MXFP8 at orig
// T = 64: 64-103 us of host time a call over three processes, against 97-105 us a call back to
// back on the GPU).
// Keyed by the address launched, not by the kernel's type: every translation unit that
// instantiates a kernel template has its own host stub, registered with its own module, and the
// linker may take the inline function that sets the attribute from one unit and the one that
// launches from another (a type-keyed cache so set one stub and launched the other with the
// default 48 KB: cudaErrorInvalidValue). The attribute is an absolute value: it is set, and the
// allowance raised, under one lock, so that a thread setting less cannot undo another's larger
// setting. A failure is returned, not kept (the next call asks again), and cleared from the
// runtime's last error, so that a caller with a fallback leaves nothing for the next launch check
// to find.
inline cudaError_t allow_dynamic_smem(const void* kernel, size_t smem, bool max_carveout) {
  static std::mutex mutex;
  static auto* allowed = new std::map<std::pair<const void*, int>, size_t>();  // never freed
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    const std::lock_guard<std::mutex> lock(mutex);
    size_t& bytes = (*allowed)[{kernel, device}];
    if (smem <= bytes) return cudaSuccess;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    // Two CTAs' shared memory on one SM needs the largest carveout; the default lets the driver
    // pick one that may fit only one.
    if (err == cudaSuccess && max_carveout)
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 cudaSharedmemCarveoutMaxShared);
    if (err == cudaSuccess) bytes = smem;
  }
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}

}  // namespace prime_kernels
