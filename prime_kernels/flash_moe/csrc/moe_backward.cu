// Launcher of the flash_moe backward on sm_90a (host side of moe_backward.h): its kernels,
// each a composition of the device layer's parts (device/), and their order on the stream.
//
// Per routed pair p = (t, j) of expert e in padded row r, with s its routing weight and
// g, u the kept pre-activations (z):
//   segments  expert e's padded rows, for the K-grouped weight gradients;
//   dh        dh' = gather(dO) w2_e (rows x H x D; w2 read transposed, MN-major), epilogue
//             SwiGluBackward: dz = [dg | du], y1s = bf16(s h), <dh', h> per H slice;
//   dw2       dW2_e = gather(dO)^T y1s over e's rows (D x H x rows, K-grouped);
//   dx        dxe = dz w_e (rows x D x 2H; w read transposed), then the combine sums each
//             token's k rows in order j = 0..k-1;
//   dw        x gathered into padded-row order (xs), then dW_e = dz^T xs over e's rows
//             (2H x D x rows, K-grouped; both operands by TMA);
//   ds        ds[p] = sum of p's <dh', h> slices, in slice order.
// Nothing is accumulated with atomics and every sum has a fixed order, so the gradients are
// bitwise repeatable. A weight gradient is one CTA per output tile over all of the
// expert's rows (as many tiles per expert as the gradient has, so all-tokens-on-k-experts
// routing still fills the GPU for the model shapes here).
#include "moe_backward.h"

#include <string>

#include "device/combine.cuh"
#include "device/moe_gemm.cuh"
#include "moe_launch.h"
#include "prime_kernels/tma.cuh"

namespace prime_moe {
namespace {

// The tiles, chosen once here. 128 rows: moe_align's block. dh's epilogue (it reads g, u
// and writes three outputs) is as long as a third of its mainloop, so dh runs ping-pong:
// each warpgroup owns 128 x 128 tiles (128 accumulators a thread) and stores one under the
// other's mainloop (cooperative 128 x 128, both warpgroups storing at once: ~350 TFLOP/s
// at Qwen3-30B-A3B T = 32768). The others are cooperative 128 x 256, two warpgroups of
// 64 x 256, the largest whose accumulators (128 per consumer thread) fit.
using DhTile = MoeGemmTile<128, 128, 1>;
using WideTile = MoeGemmTile<128, 256, 1>;

using DhKernel = MoeGemm<DhTile, GatherTokenRows<DhTile>, SwiGluBackward, TmaWeightTilesMN<DhTile>,
                         MoeTileScheduler, PingPongConsumers>;
using DxKernel = MoeGemm<WideTile, TmaRows<WideTile>, StoreRows, TmaWeightTilesMN<WideTile>>;
using Dw2Kernel = MoeGemm<WideTile, GatherRowsAlongK<WideTile, Side::kA>, StoreExpertTile,
                          TmaRowsAlongK<WideTile, Side::kB>, ExpertKScheduler>;
// dW reads x in padded-row order from a gathered copy (moe_gather_rows_kernel): gathering its
// 256-wide side along K inside the GEMM ran at 190 TFLOP/s (Qwen3-30B-A3B T = 32768), both
// sides by TMA at dxe's 600; the copy costs a read and a write of the rows, in a buffer that
// is free by then.
using DwKernel = MoeGemm<WideTile, TmaRowsAlongK<WideTile, Side::kA>, StoreExpertTile,
                         TmaRowsAlongK<WideTile, Side::kB>, ExpertKScheduler>;

constexpr int kMaxStages = 8;
constexpr int kMinStages = 2;

// Columns of H each dh consumer holds: one <dh', h> partial per pair per slice.
int routing_grad_slices(int64_t hidden_dim) {
  constexpr int kSlice = DhTile::kBlockN;  // ping-pong: a warpgroup has every column
  return int((hidden_dim + kSlice - 1) / kSlice);
}

struct Workspace {
  __nv_bfloat16* dz;    // (max_padded, 2H): z's memory with overwrite_z
  __nv_bfloat16* rows;  // y1s (max_padded, H) for dw2, dxe (max_padded, D) for dx, then xs
                        // (max_padded, D) for dw
  float* ds_part;       // (T * k, slices) when the routing weights' gradient is asked
  int32_t* segments;    // (2E,): starts[E], then ends[E]
  size_t bytes;
};

Workspace carve_workspace(const MoeBackwardProblem& pr, void* base) {
  uint8_t* p = static_cast<uint8_t*>(base);
  Workspace ws{};
  size_t off = 0;
  const size_t rows = size_t(pr.max_padded);
  if (pr.overwrite_z) {
    ws.dz = pr.z;
  } else {
    ws.dz = reinterpret_cast<__nv_bfloat16*>(p + off);
    off += align256(rows * 2 * pr.hidden_dim * sizeof(__nv_bfloat16));
  }
  // dxe is written after dw2 has read y1s, xs after the combine has read dxe (stream order),
  // so the three share one buffer.
  const bool rows_of_dim = pr.dx != nullptr || pr.dw != nullptr;
  const int64_t width = rows_of_dim && pr.dim > pr.hidden_dim ? pr.dim : pr.hidden_dim;
  ws.rows = reinterpret_cast<__nv_bfloat16*>(p + off);
  off += align256(rows * width * sizeof(__nv_bfloat16));
  if (pr.dtopk_weights != nullptr) {
    ws.ds_part = reinterpret_cast<float*>(p + off);
    off += align256(size_t(pr.num_tokens * pr.top_k) * routing_grad_slices(pr.hidden_dim) *
                    sizeof(float));
  }
  ws.segments = reinterpret_cast<int32_t*>(p + off);
  off += align256(size_t(2 * pr.num_experts) * sizeof(int32_t));
  ws.bytes = off;
  return ws;
}

template <class Kernel>
cudaError_t launch_with_ring(const CUtensorMap& tmap_a, const CUtensorMap& tmap_b,
                             MoeGemmParams params, int device, int num_sms, cudaStream_t stream) {
  params.stages = ring_stages<Kernel>(device, kMaxStages);
  if (params.stages < kMinStages) return cudaErrorInvalidConfiguration;
  return launch_gemm<Kernel>(tmap_a, tmap_b, params, num_sms, stream);
}

}  // namespace

std::string check_moe_backward(const MoeBackwardProblem& pr) {
  if (pr.block_m != DhTile::kBlockM)
    return "the backward needs moe_align's layout for block_m=" + std::to_string(DhTile::kBlockM) +
           ", got block_m=" + std::to_string(pr.block_m);
  const void* pointers[] = {pr.z, pr.dx, pr.dw, pr.dw2};
  for (const void* ptr : pointers)
    if (ptr != nullptr && pr.num_tokens > 0 && !aligned16(ptr))
      return "z and the gradients must be 16-byte aligned (TMA and 16-byte copies)";
  const int limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, pr.device);
  if (ring_stages<DxKernel>(pr.device, kMaxStages) < kMinStages)
    return "device " + std::to_string(pr.device) + " offers too little shared memory per block (" +
           std::to_string(limit) + " bytes) for the backward's 2-stage rings";
  return "";
}

size_t moe_backward_workspace_bytes(const MoeBackwardProblem& problem) {
  return carve_workspace(problem, nullptr).bytes;
}

cudaError_t launch_moe_backward(const MoeBackwardProblem& pr, void* workspace,
                                cudaStream_t stream) {
  const bool any = pr.dx || pr.dw || pr.dw2 || pr.dtopk_weights;
  if (!any) return cudaSuccess;
  const int D = int(pr.dim), H = int(pr.hidden_dim), E = int(pr.num_experts);
  const int num_pairs = int(pr.num_tokens * pr.top_k);
  cudaError_t err;
  // Every expert's weight gradient is written, zeros where it has no rows, also for T = 0.
  if (pr.num_tokens == 0 || pr.max_padded == 0) {
    for (auto [ptr, bytes] : {std::pair<void*, size_t>{pr.dw, size_t(E) * 2 * H * D * 2},
                              {pr.dw2, size_t(E) * D * H * 2}}) {
      if (ptr == nullptr) continue;
      if ((err = cudaMemsetAsync(ptr, 0, bytes, stream)) != cudaSuccess) return err;
    }
    if (pr.dx != nullptr && pr.num_tokens > 0)
      if ((err = cudaMemsetAsync(pr.dx, 0, size_t(pr.num_tokens) * D * 2, stream)) != cudaSuccess)
        return err;
    if (pr.dtopk_weights != nullptr && num_pairs > 0)
      if ((err = cudaMemsetAsync(pr.dtopk_weights, 0, size_t(num_pairs) * 4, stream)) !=
          cudaSuccess)
        return err;
    return cudaSuccess;
  }
  const Workspace ws = carve_workspace(pr, workspace);
  const int num_sms = usable_sms(pr.device);
  if (num_sms == 0) return cudaErrorInvalidDevice;
  const uint64_t rows = uint64_t(pr.max_padded);

  MoeGemmParams g{};
  g.sorted_token_ids = pr.sorted_token_ids;
  g.expert_ids = pr.expert_ids;
  g.num_tokens_post_padded = pr.num_tokens_post_padded;
  g.topk_weights = pr.topk_weights;
  g.ld_x = D;
  g.max_padded = int(pr.max_padded);
  g.num_pairs = num_pairs;
  g.top_k = int(pr.top_k);
  g.num_experts = E;
  g.segments = ws.segments;

  // Expert segments (only the weight gradients read them).
  if (pr.dw != nullptr || pr.dw2 != nullptr) {
    // starts[E] at INT32 0x7F7F7F7F (above any row), ends[E] at 0: an expert no block names
    // keeps an empty range.
    err = cudaMemsetAsync(ws.segments, 0x7F, size_t(E) * sizeof(int32_t), stream);
    if (err != cudaSuccess) return err;
    err = cudaMemsetAsync(ws.segments + E, 0, size_t(E) * sizeof(int32_t), stream);
    if (err != cudaSuccess) return err;
    const int blocks = int(pr.max_padded / pr.block_m);
    moe_expert_segments_kernel<<<(blocks + kSegmentThreads - 1) / kSegmentThreads, kSegmentThreads,
                                 0, stream>>>(pr.expert_ids, pr.num_tokens_post_padded,
                                              int(pr.max_padded), int(pr.block_m), E, ws.segments);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }

  using prime_kernels::make_tma_2d_bf16_sw128;
  CUtensorMap tmap_w2_t, tmap_w_t, tmap_dz_rows, tmap_dz_k, tmap_y1s_k, tmap_xs_k;
  if ((err = make_tma_2d_bf16_sw128(&tmap_w2_t, pr.w2, uint64_t(E) * D, H, 64)) != cudaSuccess)
    return err;
  if ((err = make_tma_2d_bf16_sw128(&tmap_w_t, pr.w, uint64_t(E) * 2 * H, D, 64)) != cudaSuccess)
    return err;
  if ((err = make_tma_2d_bf16_sw128(&tmap_dz_rows, ws.dz, rows, 2 * H, WideTile::kBlockM)) !=
      cudaSuccess)
    return err;
  if ((err = make_tma_2d_bf16_sw128(&tmap_dz_k, ws.dz, rows, 2 * H, 64)) != cudaSuccess) return err;
  if ((err = make_tma_2d_bf16_sw128(&tmap_y1s_k, ws.rows, rows, H, 64)) != cudaSuccess) return err;
  if ((err = make_tma_2d_bf16_sw128(&tmap_xs_k, ws.rows, rows, D, 64)) != cudaSuccess) return err;

  // dh, with the SwiGLU backward: dz, y1s, <dh', h> slices.
  MoeGemmParams dh = g;
  dh.x = pr.grad_out;
  dh.k_dim = D;
  dh.n_dim = H;
  dh.b_rows_per_expert = D;
  dh.out = pr.dx != nullptr || pr.dw != nullptr ? ws.dz : nullptr;  // only dxe and dW read dz
  dh.ld_out = 2 * H;
  dh.z = pr.z;
  dh.y1s = pr.dw2 != nullptr ? ws.rows : nullptr;
  dh.ds_part = ws.ds_part;
  dh.ld_ds = routing_grad_slices(H);
  if ((err = launch_with_ring<DhKernel>(tmap_w2_t, tmap_w2_t, dh, pr.device, num_sms, stream)) !=
      cudaSuccess)
    return err;

  if (pr.dw2 != nullptr) {
    MoeGemmParams dw2 = g;
    dw2.x = pr.grad_out;
    dw2.m_dim = D;
    dw2.n_dim = H;
    dw2.out = pr.dw2;
    dw2.ld_out = H;
    if ((err = launch_with_ring<Dw2Kernel>(tmap_y1s_k, tmap_y1s_k, dw2, pr.device, num_sms,
                                           stream)) != cudaSuccess)
      return err;
  }

  if (pr.dx != nullptr) {
    MoeGemmParams dxe = g;
    dxe.k_dim = 2 * H;
    dxe.n_dim = D;
    dxe.b_rows_per_expert = 2 * H;
    dxe.out = ws.rows;
    dxe.ld_out = D;
    if ((err = launch_with_ring<DxKernel>(tmap_dz_rows, tmap_w_t, dxe, pr.device, num_sms,
                                          stream)) != cudaSuccess)
      return err;
    const CombineParams cp{ws.rows, pr.pair_to_row, nullptr,           pr.dx,
                           D,       int(pr.top_k),  int(pr.max_padded)};
    moe_combine_kernel<<<unsigned(pr.num_tokens), kCombineThreads, 0, stream>>>(cp);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }

  if (pr.dw != nullptr) {
    const GatherRowsParams gp{
        pr.x,          pr.sorted_token_ids, pr.num_tokens_post_padded, ws.rows, D,
        int(pr.top_k), num_pairs,           int(pr.max_padded)};
    moe_gather_rows_kernel<<<unsigned((pr.max_padded + kGatherRowsPerCta - 1) / kGatherRowsPerCta),
                             kGatherRowsThreads, 0, stream>>>(gp);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    MoeGemmParams dw = g;
    dw.m_dim = 2 * H;
    dw.n_dim = D;
    dw.out = pr.dw;
    dw.ld_out = D;
    if ((err = launch_with_ring<DwKernel>(tmap_dz_k, tmap_xs_k, dw, pr.device, num_sms, stream)) !=
        cudaSuccess)
      return err;
  }

  if (pr.dtopk_weights != nullptr) {
    moe_routing_weight_grad_kernel<<<(num_pairs + kRoutingGradThreads - 1) / kRoutingGradThreads,
                                     kRoutingGradThreads, 0, stream>>>(
        ws.ds_part, routing_grad_slices(H), pr.pair_to_row, num_pairs, int(pr.max_padded),
        pr.dtopk_weights);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace prime_moe
