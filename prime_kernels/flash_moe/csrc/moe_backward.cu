// Launcher of the flash_moe backward on sm_90a (host side of moe_backward.h): its kernels,
// each a composition of the device layer's parts (device/), and their order on the stream.
//
// Per routed pair p = (t, j) of expert e in padded row r, with s its routing weight and
// g, u the kept pre-activations (z):
//   segments  expert e's padded rows, for the K-grouped weight gradients;
//   dOs       dO's token rows copied into padded-row order (moe_scatter_rows_kernel), so
//             that dh and dW2 read it by TMA;
//   dh        dh' = dOs w2_e (rows x H x D; w2 read transposed, MN-major), epilogue
//             SwiGluBackward: dz = [dg | du], y1s = bf16(s h), <dh', h> per H slice;
//   dw2       dW2_e = dOs^T y1s over e's rows (D x H x rows, K-grouped);
//   dx        dxe = dz w_e (rows x D x 2H; w read transposed), then the combine sums each
//             token's k rows in order j = 0..k-1;
//   ds        ds[p] = sum of p's <dh', h> slices, in slice order;
//   dw        (the second launch) x copied into padded-row order (xs), then dW_e = dz^T xs
//             over e's rows (2H x D x rows, K-grouped), one column slice of x at a time
//             where that saves memory (dw_column_chunk).
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

// The tiles, chosen once here. 128 rows: moe_align's block. Every GEMM is cooperative 128 x 256,
// two warpgroups of 64 x 256, the largest whose accumulators (128 per consumer thread) fit. dh
// (whose epilogue reads g, u and writes three outputs) ran ping-pong 128 x 128 tiles, one
// warpgroup's epilogue under the other's mainloop, until its epilogue had become short: then the
// wide tile's half-as-much shared-memory and L2 traffic per flop won (H200, benchmarks/ab.py
// --mode train, 3 rounds, T = 8192, whole step: DeepSeek-V3-32 1.017, Mixtral-8x7B 1.011,
// Qwen3-30B-A3B 1.014; dxe ping-pong 128 x 128 was no faster either).
using WideTile = MoeGemmTile<128, 256, 1>;

// Every operand in padded-row order is read by TMA. dO and x are first copied into that
// order (moe_scatter_rows_kernel: a read of the token rows, a write of the padded rows):
// gathering their token rows inside the GEMMs by cp.async held dh at ~370 TFLOP/s and dW2 at ~290
// (Qwen3-30B-A3B T = 32768), the gather's rate, not the tensor cores'. Every GEMM runs in 2-CTA
// clusters that share the B tile of two M-consecutive tiles (the weight tile of two blocks of one
// expert; for a weight gradient the same rows of y1s or x), moe_gemm.cuh: a CTA reads a third less
// from L2 per K step. Measured against single CTAs (H200, benchmarks/ab.py --mode train, 3 rounds,
// with the forward's GEMMs in clusters too): Qwen3-30B-A3B 0.995 / 1.000 and Mixtral-8x7B 0.999
// / 1.026 at T = 8192 / 32768; ncu had put L2 at 58-75% of its peak, so there was little to win.
// (The forward's GEMMs ran 3.5% slower in clusters, forward op alone, and stay single.)
constexpr int kClusterM = 2;
using DhKernel = MoeGemm<WideTile, TmaRows<WideTile>, SwiGluBackward, TmaWeightTilesMN<WideTile>,
                         MoeTileScheduler, CooperativeConsumers, kClusterM>;
using DxKernel = MoeGemm<WideTile, TmaRows<WideTile>, StoreRows, TmaWeightTilesMN<WideTile>,
                         MoeTileScheduler, CooperativeConsumers, kClusterM>;
// dW2 and dW: a K-grouped weight gradient, both operands MN-major by TMA.
using WeightGradKernel =
    MoeGemm<WideTile, TmaRowsAlongK<WideTile, Side::kA>, StoreExpertTile,
            TmaRowsAlongK<WideTile, Side::kB>, ExpertKScheduler, CooperativeConsumers, kClusterM>;

constexpr int kMaxStages = 8;
constexpr int kMinStages = 2;

// Columns of H each dh consumer holds: one <dh', h> partial per pair per slice.
int routing_grad_slices(int64_t hidden_dim) {
  constexpr int kSlice = DhKernel::Consumers::kWgCols;
  return int((hidden_dim + kSlice - 1) / kSlice);
}

// What both launches read: dz and the experts' segments.
struct Workspace {
  __nv_bfloat16* dz;  // (max_padded, 2H): z's memory with overwrite_z
  int32_t* segments;  // (2E,): starts[E], then ends[E]
  size_t bytes;
};

// What only the first launch reads, released before dW's output is allocated.
struct Scratch {
  __nv_bfloat16* rows;  // (max_padded, D): dOs for dh and dw2, then dxe for dx
  __nv_bfloat16* y1s;   // (max_padded, H) when dW2 is asked
  float* ds_part;       // (T * k, slices) when the routing weights' gradient is asked
  size_t bytes;
};

Workspace carve_workspace(const MoeBackwardProblem& pr, void* base) {
  uint8_t* p = static_cast<uint8_t*>(base);
  Workspace ws{};
  size_t off = 0;
  if (pr.overwrite_z) {
    ws.dz = pr.z;
  } else {
    ws.dz = reinterpret_cast<__nv_bfloat16*>(p + off);
    off += align256(size_t(pr.max_padded) * 2 * pr.hidden_dim * sizeof(__nv_bfloat16));
  }
  ws.segments = reinterpret_cast<int32_t*>(p + off);
  off += align256(size_t(2 * pr.num_experts) * sizeof(int32_t));
  ws.bytes = off;
  return ws;
}

// dxe is written after dw2 has read dOs (stream order), so the two share one buffer.
Scratch carve_scratch(const MoeBackwardProblem& pr, void* base) {
  uint8_t* p = static_cast<uint8_t*>(base);
  Scratch sc{};
  size_t off = 0;
  sc.rows = reinterpret_cast<__nv_bfloat16*>(p + off);
  off += align256(size_t(pr.max_padded) * pr.dim * sizeof(__nv_bfloat16));
  if (pr.dw2 != nullptr) {
    sc.y1s = reinterpret_cast<__nv_bfloat16*>(p + off);
    off += align256(size_t(pr.max_padded) * pr.hidden_dim * sizeof(__nv_bfloat16));
  }
  if (pr.dtopk_weights != nullptr) {
    sc.ds_part = reinterpret_cast<float*>(p + off);
    off += align256(size_t(pr.num_tokens * pr.top_k) * routing_grad_slices(pr.hidden_dim) *
                    sizeof(float));
  }
  sc.bytes = off;
  return sc;
}

// Columns of x that dW's padded-row copy xs holds at a time. The copy is the largest buffer
// of dW's launch, alive next to dW itself: in two column halves it takes half the memory,
// each half a launch of its own, which reads dz a second time. That costs at most dW's own
// write traffic (max_padded * 2H <= E * 2H * D) where it is done; at larger T (where every
// gradient is small next to the activations) xs stays whole. Each half is whole n tiles
// of dW's tile, so halving adds no MMA work.
int dw_column_chunk(const MoeBackwardProblem& pr) {
  const bool halve =
      pr.dim % (2 * WideTile::kBlockN) == 0 && pr.max_padded <= pr.num_experts * pr.dim;
  return int(halve ? pr.dim / 2 : pr.dim);
}

MoeGemmParams routing_params(const MoeBackwardProblem& pr, const Workspace& ws) {
  MoeGemmParams g{};
  g.sorted_token_ids = pr.sorted_token_ids;
  g.expert_ids = pr.expert_ids;
  g.num_tokens_post_padded = pr.num_tokens_post_padded;
  g.topk_weights = pr.topk_weights;
  g.ld_x = int(pr.dim);
  g.max_padded = int(pr.max_padded);
  g.num_pairs = int(pr.num_tokens * pr.top_k);
  g.top_k = int(pr.top_k);
  g.num_experts = int(pr.num_experts);
  g.segments = ws.segments;
  return g;
}

// Expert e's padded rows [segments[e], segments[E + e]) for the K-grouped weight gradients.
cudaError_t launch_expert_segments(const MoeBackwardProblem& pr, const Workspace& ws,
                                   cudaStream_t stream) {
  const int E = int(pr.num_experts);
  // starts[E] at INT32 0x7F7F7F7F (above any row), ends[E] at 0: an expert no block names
  // keeps an empty range.
  cudaError_t err = cudaMemsetAsync(ws.segments, 0x7F, size_t(E) * sizeof(int32_t), stream);
  if (err != cudaSuccess) return err;
  err = cudaMemsetAsync(ws.segments + E, 0, size_t(E) * sizeof(int32_t), stream);
  if (err != cudaSuccess) return err;
  const int blocks = int(pr.max_padded / pr.block_m);
  moe_expert_segments_kernel<<<(blocks + kSegmentThreads - 1) / kSegmentThreads, kSegmentThreads, 0,
                               stream>>>(pr.expert_ids, pr.num_tokens_post_padded,
                                         int(pr.max_padded), int(pr.block_m), E, ws.segments);
  return cudaGetLastError();
}

// Columns [col0, col0 + cols) of src's token rows (T, D): x or dO, into padded-row order in
// dst (max_padded, cols), zeros in every other row below the padded total.
cudaError_t launch_scatter_rows(const MoeBackwardProblem& pr, const __nv_bfloat16* src, int col0,
                                int cols, __nv_bfloat16* dst, cudaStream_t stream) {
  const ScatterRowsParams sp{
      src,  pr.sorted_token_ids, pr.pair_to_row, pr.num_tokens_post_padded, dst, int(pr.dim), col0,
      cols, int(pr.num_tokens),  int(pr.top_k),  int(pr.max_padded)};
  const int64_t token_ctas = (pr.num_tokens + kScatterRowsWarps - 1) / kScatterRowsWarps;
  const int64_t zero_ctas = (pr.max_padded + 32 * kScatterRowsWarps - 1) / (32 * kScatterRowsWarps);
  moe_scatter_rows_kernel<<<unsigned(token_ctas + zero_ctas), kScatterRowsThreads, 0, stream>>>(
      sp, int(token_ctas));
  return cudaGetLastError();
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
  if (pr.block_m != WideTile::kBlockM)
    return "the backward needs moe_align's layout for block_m=" +
           std::to_string(WideTile::kBlockM) + ", got block_m=" + std::to_string(pr.block_m);
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

size_t moe_backward_scratch_bytes(const MoeBackwardProblem& problem) {
  return carve_scratch(problem, nullptr).bytes;
}

size_t moe_backward_dw_scratch_bytes(const MoeBackwardProblem& problem) {
  if (!problem.need_dw) return 0;
  return align256(size_t(problem.max_padded) * dw_column_chunk(problem) * sizeof(__nv_bfloat16));
}

cudaError_t launch_moe_backward(const MoeBackwardProblem& pr, void* workspace, void* scratch,
                                cudaStream_t stream) {
  const bool any = pr.dx || pr.need_dw || pr.dw2 || pr.dtopk_weights;
  if (!any) return cudaSuccess;
  const int D = int(pr.dim), H = int(pr.hidden_dim), E = int(pr.num_experts);
  const int num_pairs = int(pr.num_tokens * pr.top_k);
  cudaError_t err;
  // Every expert's weight gradient is written, zeros where it has no rows, also for T = 0.
  if (pr.num_tokens == 0 || pr.max_padded == 0) {
    if (pr.dw2 != nullptr)
      if ((err = cudaMemsetAsync(pr.dw2, 0, size_t(E) * D * H * 2, stream)) != cudaSuccess)
        return err;
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
  const Scratch sc = carve_scratch(pr, scratch);
  const MoeGemmParams g = routing_params(pr, ws);

  if (pr.dw2 != nullptr)
    if ((err = launch_expert_segments(pr, ws, stream)) != cudaSuccess) return err;
  if ((err = launch_scatter_rows(pr, pr.grad_out, 0, D, sc.rows, stream)) != cudaSuccess)
    return err;

  using prime_kernels::make_tma_2d_bf16_sw128;
  CUtensorMap tmap_w2_t, tmap_w_t, tmap_dos_rows, tmap_dos_k, tmap_y1s_k, tmap_dz_rows;
  if ((err = make_tma_2d_bf16_sw128(&tmap_w2_t, pr.w2, uint64_t(E) * D, H, 64)) != cudaSuccess)
    return err;
  if ((err = make_tma_2d_bf16_sw128(&tmap_w_t, pr.w, uint64_t(E) * 2 * H, D, 64)) != cudaSuccess)
    return err;
  if ((err = make_tma_2d_bf16_sw128(&tmap_dos_rows, sc.rows, rows, D, kTmaRowsBoxRows)) !=
      cudaSuccess)
    return err;
  if ((err = make_tma_2d_bf16_sw128(&tmap_dos_k, sc.rows, rows, D, 64)) != cudaSuccess) return err;
  if ((err = make_tma_2d_bf16_sw128(&tmap_dz_rows, ws.dz, rows, 2 * H, kTmaRowsBoxRows)) !=
      cudaSuccess)
    return err;
  if (pr.dw2 != nullptr)
    if ((err = make_tma_2d_bf16_sw128(&tmap_y1s_k, sc.y1s, rows, H, 64)) != cudaSuccess) return err;

  // dh, with the SwiGLU backward: dz, y1s, <dh', h> slices.
  MoeGemmParams dh = g;
  dh.k_dim = D;
  dh.n_dim = H;
  dh.b_rows_per_expert = D;
  dh.out = pr.dx != nullptr || pr.need_dw ? ws.dz : nullptr;  // only dxe and dW read dz
  dh.ld_out = 2 * H;
  dh.z = pr.z;
  dh.y1s = sc.y1s;
  dh.ds_part = sc.ds_part;
  dh.ld_ds = routing_grad_slices(H);
  if ((err = launch_with_ring<DhKernel>(tmap_dos_rows, tmap_w2_t, dh, pr.device, num_sms,
                                        stream)) != cudaSuccess)
    return err;

  if (pr.dw2 != nullptr) {
    MoeGemmParams dw2 = g;
    dw2.m_dim = D;
    dw2.n_dim = H;
    dw2.out = pr.dw2;
    dw2.ld_out = H;
    if ((err = launch_with_ring<WeightGradKernel>(tmap_dos_k, tmap_y1s_k, dw2, pr.device, num_sms,
                                                  stream)) != cudaSuccess)
      return err;
  }

  if (pr.dx != nullptr) {
    MoeGemmParams dxe = g;
    dxe.k_dim = 2 * H;
    dxe.n_dim = D;
    dxe.b_rows_per_expert = 2 * H;
    dxe.out = sc.rows;
    dxe.ld_out = D;
    if ((err = launch_with_ring<DxKernel>(tmap_dz_rows, tmap_w_t, dxe, pr.device, num_sms,
                                          stream)) != cudaSuccess)
      return err;
    const CombineParams cp{sc.rows, pr.pair_to_row, nullptr,           pr.dx,
                           D,       int(pr.top_k),  int(pr.max_padded)};
    moe_combine_kernel<<<combine_grid(pr.num_tokens, D, num_sms), kCombineThreads, 0, stream>>>(cp);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }

  if (pr.dtopk_weights != nullptr) {
    moe_routing_weight_grad_kernel<<<(num_pairs + kRoutingGradThreads - 1) / kRoutingGradThreads,
                                     kRoutingGradThreads, 0, stream>>>(
        sc.ds_part, routing_grad_slices(H), pr.pair_to_row, num_pairs, int(pr.max_padded),
        pr.dtopk_weights);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t launch_moe_backward_dw(const MoeBackwardProblem& pr, void* workspace, void* dw_scratch,
                                   cudaStream_t stream) {
  if (!pr.need_dw) return cudaSuccess;
  if (pr.dw == nullptr) return cudaErrorInvalidValue;
  const int D = int(pr.dim), H = int(pr.hidden_dim), E = int(pr.num_experts);
  if (pr.num_tokens == 0 || pr.max_padded == 0)
    return cudaMemsetAsync(pr.dw, 0, size_t(E) * 2 * H * D * 2, stream);
  const Workspace ws = carve_workspace(pr, workspace);
  const int num_sms = usable_sms(pr.device);
  if (num_sms == 0) return cudaErrorInvalidDevice;
  cudaError_t err;
  // The first launch built the segments for dW2.
  if (pr.dw2 == nullptr)
    if ((err = launch_expert_segments(pr, ws, stream)) != cudaSuccess) return err;
  const uint64_t rows = uint64_t(pr.max_padded);
  using prime_kernels::make_tma_2d_bf16_sw128;
  CUtensorMap tmap_dz_k;
  if ((err = make_tma_2d_bf16_sw128(&tmap_dz_k, ws.dz, rows, 2 * H, 64)) != cudaSuccess) return err;
  __nv_bfloat16* xs = static_cast<__nv_bfloat16*>(dw_scratch);
  const int chunk = dw_column_chunk(pr);
  // Each column slice of x: copied into padded-row order (xs), then dW's columns
  // [col0, col0 + chunk) of every expert = dz^T xs (the copy of the next slice waits, in
  // stream order, for this GEMM to have read xs).
  for (int col0 = 0; col0 < D; col0 += chunk) {
    if ((err = launch_scatter_rows(pr, pr.x, col0, chunk, xs, stream)) != cudaSuccess) return err;
    CUtensorMap tmap_xs_k;
    if ((err = make_tma_2d_bf16_sw128(&tmap_xs_k, xs, rows, chunk, 64)) != cudaSuccess) return err;
    MoeGemmParams dw = routing_params(pr, ws);
    dw.m_dim = 2 * H;
    dw.n_dim = chunk;
    dw.out = pr.dw + col0;
    dw.ld_out = D;
    if ((err = launch_with_ring<WeightGradKernel>(tmap_dz_k, tmap_xs_k, dw, pr.device, num_sms,
                                                  stream)) != cudaSuccess)
      return err;
  }
  return cudaSuccess;
}

}  // namespace prime_moe
