// Launcher of the bf16 fused MoE forward on sm_90a (host side of fused_moe_bf16.h).
//
// split=true:  memset pair_to_row to -1, gate/up GEMM (+ SwiGLU, + pair_to_row scatter)
//              into h, down GEMM into y, deterministic combine into out: 4 stream ops.
// split=false: gate/up GEMM into h, then the down GEMM adds weight * y straight into the
//              caller-zeroed out with bf16x2 atomics: two kernels, since the down GEMM of a
//              block needs all H columns of h, which come from ceil(H / block_n) CTAs.
#include "fused_moe_bf16.h"

#include <algorithm>
#include <string>

#include "flash_moe_constants.h"
#include "fused_moe_combine.cuh"
#include "fused_moe_down.cuh"
#include "fused_moe_gate_up.cuh"
#include "prime_kernels/tma.cuh"

namespace prime_moe {
namespace {

constexpr int kConsumerWarpgroups = 2;  // fixed by the kernel (warp_n)
constexpr int kMinStages = 2;
// Past 8 stages (8 x 32 KB at block_n = 64) the ring already covers DRAM latency.
constexpr int kMaxStages = 8;

size_t align256(size_t bytes) {
  return (bytes + 255) & ~size_t(255);
}

int device_attribute(cudaDeviceAttr attr, int device) {
  int value = 0;
  if (cudaDeviceGetAttribute(&value, attr, device) != cudaSuccess) return 0;
  return value;
}

// Bytes of one pipeline stage; gate/up (A + gate + up tiles) and down (A + one tile of
// 2 * block_n rows) are the same size by construction.
size_t stage_bytes(int block_m, int block_n) {
  return size_t(block_m) * 64 * 2 + size_t(2 * block_n) * 64 * 2;
}

size_t smem_bytes(int block_m, int block_n, int stages) {
  return 1024 + size_t(stages) * stage_bytes(block_m, block_n) + 2 * size_t(stages) * 8;
}

int max_stages(int block_m, int block_n, int device) {
  const size_t limit = size_t(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  int stages = 0;
  while (stages < kMaxStages && smem_bytes(block_m, block_n, stages + 1) <= limit) ++stages;
  return stages;
}

struct Workspace {
  int32_t* pair_to_row;  // (T * k,) split only
  __nv_bfloat16* h;      // (max_padded, H)
  __nv_bfloat16* y;      // (max_padded, D) split only
  size_t bytes;
};

Workspace carve_workspace(const FusedMoeBf16Problem& pr, bool split, void* base) {
  uint8_t* p = static_cast<uint8_t*>(base);
  Workspace ws{};
  size_t off = 0;
  if (split) {
    ws.pair_to_row = reinterpret_cast<int32_t*>(p + off);
    off += align256(size_t(pr.num_tokens * pr.top_k) * sizeof(int32_t));
  }
  ws.h = reinterpret_cast<__nv_bfloat16*>(p + off);
  off += align256(size_t(pr.max_padded * pr.hidden_dim) * sizeof(__nv_bfloat16));
  if (split) {
    ws.y = reinterpret_cast<__nv_bfloat16*>(p + off);
    off += align256(size_t(pr.max_padded * pr.dim) * sizeof(__nv_bfloat16));
  }
  ws.bytes = off;
  return ws;
}

template <int kBlockM, int kBlockN, class Variant>
cudaError_t launch_gemm(const CUtensorMap& tmap_a, const CUtensorMap& tmap_b,
                        const MoeGemmParams& params, int num_sms, cudaStream_t stream) {
  using Cfg = MoeGemmConfig<kBlockM, kBlockN, Variant>;
  auto* kernel = moe_gemm_kernel<Cfg, Variant>;
  const size_t smem = Cfg::smem_bytes(params.stages);
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  // Persistent: one CTA per SM (or fewer when even the padded maximum has fewer tiles).
  const int64_t max_tiles =
      int64_t(params.max_padded / kBlockM) * ((params.n_dim + kBlockN - 1) / kBlockN);
  const int grid = int(std::max<int64_t>(1, std::min<int64_t>(num_sms, max_tiles)));
  kernel<<<grid, Cfg::kThreads, smem, stream>>>(tmap_a, tmap_b, params);
  return cudaGetLastError();
}

// Dispatch on the resolved block_m (64, 128) and block_n (64, 128); the down GEMM's tile
// is 2 * block_n columns so that both GEMMs' stages are the same size.
template <class Variant, int kTileScale>
cudaError_t dispatch_gemm(int block_m, int block_n, const CUtensorMap& tmap_a,
                          const CUtensorMap& tmap_b, const MoeGemmParams& params, int num_sms,
                          cudaStream_t stream) {
  if (block_m == 128 && block_n == 128)
    return launch_gemm<128, 128 * kTileScale, Variant>(tmap_a, tmap_b, params, num_sms, stream);
  if (block_m == 128 && block_n == 64)
    return launch_gemm<128, 64 * kTileScale, Variant>(tmap_a, tmap_b, params, num_sms, stream);
  if (block_m == 64 && block_n == 128)
    return launch_gemm<64, 128 * kTileScale, Variant>(tmap_a, tmap_b, params, num_sms, stream);
  if (block_m == 64 && block_n == 64)
    return launch_gemm<64, 64 * kTileScale, Variant>(tmap_a, tmap_b, params, num_sms, stream);
  return cudaErrorInvalidValue;  // unreachable after check_fused_moe_bf16
}

bool aligned16(const void* ptr) {
  return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0;
}

}  // namespace

FusedMoeBf16Config resolve_fused_moe_bf16_config(const FusedMoeBf16Problem& problem,
                                                 FusedMoeBf16Config requested) {
  FusedMoeBf16Config c = requested;
  const int64_t block_m = problem.block_m > 0 ? problem.block_m : kBlockM;
  if (c.block_n == 0) {
    // 128: gate/up tiles of 128 x (128 gate + 128 up) and down tiles of 128 x 256, the
    // largest whose fp32 accumulators (128 per consumer thread) fit the 232-register
    // consumer budget. 64 when even that gives fewer tiles than SMs (decode-sized T,
    // weight-bandwidth-bound): more CTAs streaming weights. Real blocks are at most one
    // partial block per routed expert plus T*k / block_m full ones.
    const int64_t pairs = problem.num_tokens * problem.top_k;
    const int64_t blocks = std::min(problem.max_padded / block_m,
                                    std::min(problem.num_experts, pairs) + pairs / block_m);
    const int64_t tiles = blocks * ((problem.hidden_dim + 127) / 128);
    c.block_n = (problem.hidden_dim <= 64 ||
                 tiles < device_attribute(cudaDevAttrMultiProcessorCount, problem.device))
                    ? 64
                    : 128;
  }
  if (c.warp_n == 0) c.warp_n = kConsumerWarpgroups;  // the only shape the kernel has
  if (c.stages == 0 && (c.block_n == 64 || c.block_n == 128) && (block_m == 64 || block_m == 128))
    // As deep as the shared memory allows: 4 stages of 48 KB at 128 x 128.
    c.stages = max_stages(int(block_m), c.block_n, problem.device);
  if (c.cpc == 0) c.cpc = 1;  // no TMA multicast: one CTA per cluster
  return c;
}

std::string check_fused_moe_bf16(const FusedMoeBf16Problem& pr, const FusedMoeBf16Config& c) {
  const std::string sm90 = " is not supported on sm_90";
  if (pr.block_m != 64 && pr.block_m != 128)
    return "block_m=" + std::to_string(pr.block_m) + sm90 +
           "; use 64 or 128 (and the same block_m for moe_align)";
  if (pr.dim <= 0 || pr.dim % kDimMultiple != 0)
    return "dim=" + std::to_string(pr.dim) + sm90 + "; it must be a positive multiple of " +
           std::to_string(kDimMultiple);
  if (pr.hidden_dim <= 0 || pr.hidden_dim % kHiddenMultiple != 0)
    return "hidden_dim=" + std::to_string(pr.hidden_dim) + sm90 +
           "; it must be a positive multiple of " + std::to_string(kHiddenMultiple);
  if (pr.num_experts <= 0)
    return "num_experts=" + std::to_string(pr.num_experts) + " must be positive";
  if (pr.top_k <= 0) return "top_k=" + std::to_string(pr.top_k) + " must be positive";
  if (pr.num_tokens < 0)
    return "num_tokens=" + std::to_string(pr.num_tokens) + " must be non-negative";
  if (pr.max_padded < 0 || pr.max_padded % pr.block_m != 0)
    return "max_padded=" + std::to_string(pr.max_padded) +
           " must be a non-negative multiple of block_m=" + std::to_string(pr.block_m);
  // Rows, pair indices and TMA coordinates are 32-bit; gathered x chunks are 32-bit
  // offsets in units of 8 elements.
  if (pr.num_tokens * pr.top_k > kMaxRows || pr.max_padded > kMaxRows ||
      pr.num_experts * 2 * pr.hidden_dim > kMaxRows || pr.num_experts * pr.dim > kMaxRows ||
      pr.num_tokens * pr.dim / 8 > int64_t(0xFFFFFFFF))
    return "num_tokens=" + std::to_string(pr.num_tokens) +
           ", num_experts=" + std::to_string(pr.num_experts) +
           " are too large: rows, pairs and weight rows must "
           "stay below 2^31 (and T*D/8 below 2^32)";
  if (c.block_n != 64 && c.block_n != 128)
    return "block_n=" + std::to_string(c.block_n) + sm90 +
           "; use 64, 128 or 0 for the tuned choice";
  if (c.warp_n != kConsumerWarpgroups)
    return "warp_n=" + std::to_string(c.warp_n) + sm90 +
           "; use 2 (two consumer warpgroups) or 0 for the tuned choice";
  const int limit = max_stages(int(pr.block_m), c.block_n, pr.device);
  if (c.stages < kMinStages || c.stages > limit)
    return "stages=" + std::to_string(c.stages) + sm90 +
           " at block_m=" + std::to_string(pr.block_m) + ", block_n=" + std::to_string(c.block_n) +
           "; use " + std::to_string(kMinStages) + ".." + std::to_string(limit) +
           " (shared memory) or 0 for the tuned choice";
  if (c.bpc < 1) return "bpc=" + std::to_string(c.bpc) + " must be at least 1";
  if (c.cpc != 1)
    return "cpc=" + std::to_string(c.cpc) + sm90 + " (no TMA multicast in this kernel); use 1 or 0";
  if (pr.num_tokens > 0 &&
      (!aligned16(pr.x) || !aligned16(pr.w) || !aligned16(pr.w2) || !aligned16(pr.out)))
    return "x, w, w2 and out must be 16-byte aligned (TMA and 16-byte copies)";
  return "";
}

size_t fused_moe_bf16_workspace_bytes(const FusedMoeBf16Problem& problem,
                                      const FusedMoeBf16Config& config) {
  return carve_workspace(problem, config.split, nullptr).bytes;
}

cudaError_t launch_fused_moe_bf16(const FusedMoeBf16Problem& pr, const FusedMoeBf16Config& c,
                                  void* workspace, cudaStream_t stream) {
  if (pr.num_tokens == 0) return cudaSuccess;  // out is empty
  const Workspace ws = carve_workspace(pr, c.split, workspace);
  const int num_sms = device_attribute(cudaDevAttrMultiProcessorCount, pr.device);
  if (num_sms == 0) return cudaErrorInvalidDevice;
  const int num_pairs = int(pr.num_tokens * pr.top_k);
  cudaError_t err;
  if (c.split) {
    // All bytes 0xFF = -1: no row; the gate/up producer scatters the routed ones.
    err = cudaMemsetAsync(ws.pair_to_row, 0xFF, size_t(num_pairs) * sizeof(int32_t), stream);
    if (err != cudaSuccess) return err;
  }
  if (pr.max_padded > 0) {
    const int D = int(pr.dim), H = int(pr.hidden_dim), E = int(pr.num_experts);
    MoeGemmParams g{};
    g.sorted_token_ids = pr.sorted_token_ids;
    g.expert_ids = pr.expert_ids;
    g.num_tokens_post_padded = pr.num_tokens_post_padded;
    g.x = pr.x;
    g.topk_weights = pr.topk_weights;
    g.max_padded = int(pr.max_padded);
    g.num_pairs = num_pairs;
    g.top_k = int(pr.top_k);
    g.num_experts = E;
    g.stages = c.stages;

    // Gate/up: A gathered from x (no tensor map; tmap_b is passed twice as a filler).
    CUtensorMap tmap_w, tmap_h, tmap_w2;
    err = prime_kernels::make_tma_2d_bf16_sw128(&tmap_w, pr.w, uint64_t(E) * 2 * H, D, c.block_n);
    if (err != cudaSuccess) return err;
    MoeGemmParams gate_up = g;
    gate_up.pair_to_row = c.split ? ws.pair_to_row : nullptr;
    gate_up.out = ws.h;
    gate_up.ld_out = H;
    gate_up.k_dim = D;
    gate_up.n_dim = H;
    gate_up.b_rows_per_expert = 2 * H;
    gate_up.b_second_offset = H;
    err = dispatch_gemm<GateUpSwiglu, 1>(int(pr.block_m), c.block_n, tmap_w, tmap_w, gate_up,
                                         num_sms, stream);
    if (err != cudaSuccess) return err;

    err = prime_kernels::make_tma_2d_bf16_sw128(&tmap_h, ws.h, uint64_t(pr.max_padded), H,
                                                uint32_t(pr.block_m));
    if (err != cudaSuccess) return err;
    err = prime_kernels::make_tma_2d_bf16_sw128(&tmap_w2, pr.w2, uint64_t(E) * D, H, 2 * c.block_n);
    if (err != cudaSuccess) return err;
    MoeGemmParams down = g;
    down.out = c.split ? ws.y : pr.out;
    down.ld_out = D;
    down.k_dim = H;
    down.n_dim = D;
    down.b_rows_per_expert = D;
    down.b_second_offset = 0;
    err = c.split ? dispatch_gemm<DownStore, 2>(int(pr.block_m), c.block_n, tmap_h, tmap_w2, down,
                                                num_sms, stream)
                  : dispatch_gemm<DownAtomic, 2>(int(pr.block_m), c.block_n, tmap_h, tmap_w2, down,
                                                 num_sms, stream);
    if (err != cudaSuccess) return err;
  }
  if (c.split) {
    CombineParams cp{ws.y, ws.pair_to_row, pr.topk_weights, pr.out, int(pr.dim), int(pr.top_k)};
    moe_combine_kernel<<<unsigned(pr.num_tokens), kCombineThreads, 0, stream>>>(cp);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

std::string describe_fused_moe_bf16_config(const FusedMoeBf16Problem& pr,
                                           const FusedMoeBf16Config& c) {
  const std::string bm = std::to_string(pr.block_m);
  return "fused_moe_bf16 sm_90a: block_m=" + bm + " block_n=" + std::to_string(c.block_n) +
         " (gate/up tile " + bm + "x(" + std::to_string(c.block_n) + "+" +
         std::to_string(c.block_n) + "), down tile " + bm + "x" + std::to_string(2 * c.block_n) +
         ") warp_n=" + std::to_string(c.warp_n) + " stages=" + std::to_string(c.stages) +
         " bpc=" + std::to_string(c.bpc) + " cpc=" + std::to_string(c.cpc) +
         (c.split ? " split=true" : " split=false") + " gather=cp.async+swizzle";
}

}  // namespace prime_moe
