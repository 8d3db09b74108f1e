// How exactly does an e4m3 wgmma sum its products? The MXFP8 decode lead (docs/
// flash_moe_mxfp8_design.md, "fp8 wgmma with per-32 promotion") needs each m64nNk32 wgmma's
// 32-term sum close enough to exact that h re-quantized to e4m3 stays within 3e-3 of the
// exact-MX emulation; a first try measured 3.0-3.2e-3. This probe feeds the tensor core e4m3
// operands whose exact sums fp64 holds (a product has at most 8 significant bits and spans
// 2^-18..2^17.6, so 128 of them fit in 53 bits) and reports, per data set:
//   - how a single k32 sum (scale-d = 0) differs from exact: the share exact, the error's sign
//     against the exact sum's (truncation toward zero gives only one), and its size in units of
//     2^(e - 13) for e the exponent of the exact sum and of the largest product (which of the two
//     the hardware aligns to is what the half-unit correction needs);
//   - the relative Frobenius error of a k128 dot product summed four ways: four k32 wgmmas
//     promoted in fp32 (as the lead does), the same with the half-unit bit set on each nonzero
//     k32 result, four k32 wgmmas chained in the tensor core (scale-d = 1), and fp32 in order.
// Build and run (sm_90a):
//   nvcc -std=c++17 -O2 -gencode arch=compute_90a,code=sm_90a -I prime_kernels/include \
//     benchmarks/probes/fp8_wgmma_sums.cu -o fp8_wgmma_sums && ./fp8_wgmma_sums
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "prime_kernels/wgmma.cuh"

namespace {

constexpr int kM = 64, kN = 16, kK = 128, kKStep = 32, kSteps = kK / kKStep;
constexpr int kThreads = 128;
constexpr int kOutPerProblem = (kSteps + 1) * kM * kN;  // four k32 sums, then the chained k128

#define CHECK_CUDA(call)                                                 \
  do {                                                                   \
    cudaError_t err_ = (call);                                           \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, \
                   cudaGetErrorString(err_));                            \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

// Copies a (rows x 128) byte tile into shared memory with the 128-byte swizzle that
// make_smem_desc_sw128 describes: 16-byte chunk c of row r lands in chunk c ^ (r % 8).
__device__ void load_swizzled(uint8_t* smem, const uint8_t* src, int rows) {
  for (int idx = threadIdx.x; idx < rows * 8; idx += blockDim.x) {
    const int r = idx / 8, c = idx % 8;
    *reinterpret_cast<uint4*>(smem + r * 128 + ((c ^ (r % 8)) * 16)) =
        *reinterpret_cast<const uint4*>(src + r * 128 + c * 16);
  }
}

__global__ void __launch_bounds__(kThreads)
    fp8_sums_kernel(const uint8_t* a, const uint8_t* b, float* out) {
  // The 128-byte swizzle needs 1024-byte aligned tiles; align by hand rather than trust the
  // static allocation's alignment.
  __shared__ uint8_t smem_raw[kM * kK + kN * kK + 1024];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  uint8_t* smem_a = smem_raw + ((1024 - raw % 1024) % 1024);
  uint8_t* smem_b = smem_a + kM * kK;
  const int problem = blockIdx.x;
  load_swizzled(smem_a, a + size_t(problem) * kM * kK, kM);
  load_swizzled(smem_b, b + size_t(problem) * kN * kK, kN);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic stores -> wgmma
  __syncthreads();
  const uint64_t desc_a = prime_kernels::make_smem_desc_sw128(smem_a);
  const uint64_t desc_b = prime_kernels::make_smem_desc_sw128(smem_b);
  float* dst = out + size_t(problem) * kOutPerProblem;
  auto store = [&](const float(&d)[8], int slot) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int row = prime_kernels::wgmma_acc_row(i), col = prime_kernels::wgmma_acc_col(j);
          dst[slot * kM * kN + row * kN + col + c] = d[4 * j + 2 * i + c];
        }
  };
  // A k32 step is 32 bytes along the row: 2 in the descriptor's 16-byte address units.
  for (int s = 0; s < kSteps; ++s) {
    float d[8] = {};
    prime_kernels::wgmma_fence();
    prime_kernels::WgmmaE4m3<16>::mma(d, desc_a + 2 * s, desc_b + 2 * s, 0);
    prime_kernels::wgmma_commit();
    prime_kernels::wgmma_wait<0>();
    prime_kernels::wgmma_fence_operands(d);
    store(d, s);
  }
  float d[8] = {};
  prime_kernels::wgmma_fence();
  for (int s = 0; s < kSteps; ++s)
    prime_kernels::WgmmaE4m3<16>::mma(d, desc_a + 2 * s, desc_b + 2 * s, s > 0);
  prime_kernels::wgmma_commit();
  prime_kernels::wgmma_wait<0>();
  prime_kernels::wgmma_fence_operands(d);
  store(d, kSteps);
}

double e4m3_value(uint8_t bits) {
  const int sign = bits >> 7, exp = (bits >> 3) & 0xF, man = bits & 7;
  const double mag = exp == 0 ? std::ldexp(man / 8.0, -6) : std::ldexp(1.0 + man / 8.0, exp - 7);
  return sign ? -mag : mag;
}

bool e4m3_finite(uint8_t bits) {
  return (bits & 0x7F) != 0x7F;
}

// Round to nearest e4m3, ties to the even code, saturating to +-448 (the MX conversion).
uint8_t e4m3_encode(double v) {
  static std::vector<std::pair<double, uint8_t>> table = [] {
    std::vector<std::pair<double, uint8_t>> t;
    for (int code = 0; code < 0x7F; ++code) t.push_back({e4m3_value(uint8_t(code)), uint8_t(code)});
    return t;
  }();
  const double mag = std::min(std::fabs(v), 448.0);
  auto hi = std::lower_bound(table.begin(), table.end(), std::make_pair(mag, uint8_t(0)));
  uint8_t code;
  if (hi == table.end()) {
    code = table.back().second;
  } else if (hi == table.begin() || hi->first == mag) {
    code = hi->second;
  } else {
    auto lo = hi - 1;
    const double dl = mag - lo->first, dh = hi->first - mag;
    code = dl < dh   ? lo->second
           : dh < dl ? hi->second
                     : ((lo->second & 1) ? hi->second : lo->second);
  }
  return uint8_t(code | (v < 0 ? 0x80 : 0));
}

// MX quantization of a row of Gaussians: per 32-block, scale 2^(floor(log2 amax) - 8), the
// values divided by it and rounded to e4m3 (what the kernel's operands hold; the scales are
// applied outside the wgmma).
void fill_mx_gaussian(std::vector<uint8_t>& dst, size_t rows, std::mt19937_64& rng,
                      double outlier_share) {
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> uniform;
  std::vector<double> block(kKStep);
  for (size_t r = 0; r < rows; ++r)
    for (int k0 = 0; k0 < kK; k0 += kKStep) {
      double amax = 0;
      for (auto& v : block) {
        v = normal(rng) * (uniform(rng) < outlier_share ? 30.0 : 1.0);
        amax = std::max(amax, std::fabs(v));
      }
      const double scale = amax > 0 ? std::ldexp(1.0, int(std::floor(std::log2(amax))) - 8) : 1.0;
      for (int k = 0; k < kKStep; ++k) dst[r * kK + k0 + k] = e4m3_encode(block[k] / scale);
    }
}

void fill_random_codes(std::vector<uint8_t>& dst, std::mt19937_64& rng) {
  for (auto& v : dst) {
    do v = uint8_t(rng());
    while (!e4m3_finite(v));
  }
}

void fill_small_integers(std::vector<uint8_t>& dst, std::mt19937_64& rng) {
  for (auto& v : dst) v = e4m3_encode(double(int(rng() % 9) - 4));
}

float set_half_unit(float v) {  // the bit below the 13th fraction bit, on nonzero values
  if (v == 0.0f) return v;
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits |= 1u << 9;
  std::memcpy(&v, &bits, 4);
  return v;
}

struct Report {
  long sums = 0, exact = 0, below = 0, above = 0;
  double max_ulp_of_sum = 0, max_ulp_of_largest = 0, mean_ulp_of_sum = 0;
  long low_bits_nonzero = 0;      // results with any of the fp32 fraction's low 10 bits set
  double err2[4] = {}, ref2 = 0;  // promoted, promoted + half unit, chained, fp32 in order
};

void run(const char* name, int problems, int data_set, std::mt19937_64& rng) {
  std::vector<uint8_t> a(size_t(problems) * kM * kK), b(size_t(problems) * kN * kK);
  if (data_set == 0) {
    fill_mx_gaussian(a, size_t(problems) * kM, rng, 0.0);
    fill_mx_gaussian(b, size_t(problems) * kN, rng, 0.0);
  } else if (data_set == 1) {
    fill_mx_gaussian(a, size_t(problems) * kM, rng, 0.01);
    fill_mx_gaussian(b, size_t(problems) * kN, rng, 0.01);
  } else if (data_set == 2) {
    fill_random_codes(a, rng);
    fill_random_codes(b, rng);
  } else {
    fill_small_integers(a, rng);
    fill_small_integers(b, rng);
  }
  uint8_t *d_a, *d_b;
  float* d_out;
  const size_t out_count = size_t(problems) * kOutPerProblem;
  CHECK_CUDA(cudaMalloc(&d_a, a.size()));
  CHECK_CUDA(cudaMalloc(&d_b, b.size()));
  CHECK_CUDA(cudaMalloc(&d_out, out_count * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(d_a, a.data(), a.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_b, b.data(), b.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(d_out, 0xFF, out_count * sizeof(float)));  // NaN poison
  fp8_sums_kernel<<<problems, kThreads>>>(d_a, d_b, d_out);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> out(out_count);
  CHECK_CUDA(cudaMemcpy(out.data(), d_out, out_count * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(d_a));
  CHECK_CUDA(cudaFree(d_b));
  CHECK_CUDA(cudaFree(d_out));

  Report rep;
  for (int p = 0; p < problems; ++p)
    for (int m = 0; m < kM; ++m)
      for (int n = 0; n < kN; ++n) {
        const uint8_t* ar = &a[(size_t(p) * kM + m) * kK];
        const uint8_t* br = &b[(size_t(p) * kN + n) * kK];
        const float* o = &out[size_t(p) * kOutPerProblem + m * kN + n];
        double total = 0;
        float promoted = 0, promoted_half = 0, in_order = 0;
        for (int s = 0; s < kSteps; ++s) {
          double exact = 0, largest = 0;
          for (int k = s * kKStep; k < (s + 1) * kKStep; ++k) {
            const double prod = e4m3_value(ar[k]) * e4m3_value(br[k]);
            exact += prod;
            largest = std::max(largest, std::fabs(prod));
            in_order += float(prod);
          }
          const float got = o[s * kM * kN];
          total += exact;
          promoted += got;
          promoted_half += set_half_unit(got);
          ++rep.sums;
          uint32_t bits;
          std::memcpy(&bits, &got, 4);
          rep.low_bits_nonzero += (bits & 0x3FF) != 0;
          const double err = double(got) - exact;
          if (err == 0) {
            ++rep.exact;
            continue;
          }
          // Toward zero: the error's sign opposite to the exact sum's.
          (err * exact < 0 ? rep.below : rep.above) += 1;
          const double ulp_sum = std::ldexp(1.0, std::ilogb(exact != 0 ? exact : largest) - 13);
          const double ulp_largest = std::ldexp(1.0, std::ilogb(largest) - 13);
          rep.max_ulp_of_sum = std::max(rep.max_ulp_of_sum, std::fabs(err) / ulp_sum);
          rep.max_ulp_of_largest = std::max(rep.max_ulp_of_largest, std::fabs(err) / ulp_largest);
          rep.mean_ulp_of_sum += std::fabs(err) / ulp_sum;
        }
        const double chained = o[kSteps * kM * kN];
        const double got[4] = {promoted, promoted_half, chained, in_order};
        for (int w = 0; w < 4; ++w) rep.err2[w] += (got[w] - total) * (got[w] - total);
        rep.ref2 += total * total;
      }
  const long inexact = rep.sums - rep.exact;
  std::printf(
      "%-28s k32 sums %ld: exact %.4f; of the inexact, toward zero %.4f, away %.4f; "
      "|err| max %.3g / mean %.3g units of 2^(e_sum-13), max %.3g units of "
      "2^(e_largest-13); low 10 fraction bits nonzero in %.4f\n",
      name, rep.sums, double(rep.exact) / rep.sums, inexact ? double(rep.below) / inexact : 0.0,
      inexact ? double(rep.above) / inexact : 0.0, rep.max_ulp_of_sum,
      inexact ? rep.mean_ulp_of_sum / inexact : 0.0, rep.max_ulp_of_largest,
      double(rep.low_bits_nonzero) / rep.sums);
  const char* ways[4] = {"promoted k32 in fp32", "promoted + half unit", "chained in the MMA",
                         "fp32 in order"};
  for (int w = 0; w < 4; ++w)
    std::printf("%-28s   k128 rel. Frobenius error, %-22s %.3e\n", "", ways[w],
                std::sqrt(rep.err2[w] / rep.ref2));
}

}  // namespace

int main() {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, sm_%d%d; m64n16k32 e4m3 x e4m3 -> f32, %d x %d outputs a problem\n", prop.name,
              prop.major, prop.minor, kM, kN);
  std::mt19937_64 rng(2026);
  run("small integers (exact)", 64, 3, rng);
  run("MX Gaussian", 512, 0, rng);
  run("MX Gaussian, 1% outliers", 512, 1, rng);
  run("every finite code, uniform", 512, 2, rng);
  return 0;
}
