// The probes' check of a CUDA runtime call: print what failed and return 1 from main.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

#define CK(x)                                        \
  do {                                               \
    cudaError_t e = (x);                             \
    if (e != cudaSuccess) {                          \
      printf("%s: %s\n", #x, cudaGetErrorString(e)); \
      return 1;                                      \
    }                                                \
  } while (0)
