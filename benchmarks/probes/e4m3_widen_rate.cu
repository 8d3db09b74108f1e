// How fast an SM widens e4m3 to f16 (the f16-wgmma lead of docs/flash_moe_mxfp8_design.md):
// cvt.rn.f16x2.e4m3x2 (F2FP.F16.E4M3.UNPACK_B in SASS, NaN kept as NaN) against the integer bit
// trick ((w & 0x80008000) | ((w & 0x7F007F00) >> 1), the value times 2^-8; then w << 8 for the
// other pair). Eight independent chains a thread, 4 blocks of 512 threads an SM; prints e4m3
// values widened per SM per clock at the board's top clock (a lower bound where it ran slower).
// Build and run (sm_90a):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a \
//     benchmarks/probes/e4m3_widen_rate.cu -o e4m3_widen_rate && ./e4m3_widen_rate
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include "cuda_check.h"
constexpr int kChains = 8, kIters = 4096;

// One word of four e4m3 widened to two f16x2 registers.
struct CvtWiden {
  static constexpr const char* kName = "cvt.rn.f16x2.e4m3x2";
  __device__ __forceinline__ static void widen(uint32_t w, uint32_t& lo, uint32_t& hi) {
    asm volatile("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"(uint16_t(w)));
    asm volatile("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"(uint16_t(w >> 16)));
  }
};
struct BitTrickWiden {
  static constexpr const char* kName = "bit trick";
  __device__ __forceinline__ static void widen(uint32_t w, uint32_t& lo, uint32_t& hi) {
    hi = (w & 0x80008000u) | ((w & 0x7F007F00u) >> 1);
    w <<= 8;
    lo = (w & 0x80008000u) | ((w & 0x7F007F00u) >> 1);
  }
};

template <class Widen>
__global__ void widen_kernel(uint32_t* out, uint32_t seed) {
  uint32_t x[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) x[c] = seed * (threadIdx.x + 7 * c + 1);
  for (int i = 0; i < kIters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      uint32_t lo, hi;
      Widen::widen(x[c], lo, hi);
      x[c] = (lo ^ hi) + c;  // both registers folded into the next word: a dependent chain
    }
  }
  uint32_t r = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) r ^= x[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = r;
}

template <class Widen>
int time_widen(const cudaDeviceProp& prop, int clk_khz, uint32_t* out, int blocks, int threads,
               cudaEvent_t a, cudaEvent_t b) {
  for (int rep = 0; rep < 3; ++rep) {
    CK(cudaEventRecord(a));
    widen_kernel<Widen><<<blocks, threads>>>(out, 12345u + rep);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    CK(cudaGetLastError());
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    const double values = 4.0 * blocks * threads * kIters * kChains;
    printf("%s: %.3f ms, %.1f G e4m3 widened/s, %.1f e4m3 per SM per clock at %d MHz max\n",
           Widen::kName, ms, values / ms / 1e6,
           values / (ms * 1e-3) / prop.multiProcessorCount / (clk_khz * 1e3), clk_khz / 1000);
  }
  return 0;
}

int main() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int blocks = prop.multiProcessorCount * 4, threads = 512;
  uint32_t* out;
  CK(cudaMalloc(&out, size_t(blocks) * threads * 4));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  int clk_khz = 0;
  CK(cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, 0));
  if (time_widen<CvtWiden>(prop, clk_khz, out, blocks, threads, a, b) != 0) return 1;
  return time_widen<BitTrickWiden>(prop, clk_khz, out, blocks, threads, a, b);
}
