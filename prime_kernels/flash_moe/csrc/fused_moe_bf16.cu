// Launcher of the bf16 fused MoE forward on sm_90a (host side of fused_moe_bf16.h): its kernels
// and launch sequence are forward_kernels.h's with bf16 weights (TmaWeightTiles, SwiGluToH).
#include "fused_moe_bf16.h"

#include <algorithm>
#include <atomic>
#include <string>

#include "forward_kernels.h"
#include "moe_launch.h"

namespace prime_moe {
namespace {

using forward::Bf16Weights;

std::atomic<int> g_num_sms{0};

}  // namespace

void set_num_sms(int num_sms) {
  g_num_sms.store(std::max(num_sms, 0), std::memory_order_relaxed);
}
int num_sms_setting() {
  return g_num_sms.load(std::memory_order_relaxed);
}

FusedMoeBf16Config resolve_fused_moe_bf16_config(const FusedMoeBf16Problem& problem,
                                                 const FusedMoeBf16Config& requested) {
  return forward::resolve_config<Bf16Weights>(problem, requested);
}

std::string check_fused_moe_bf16(const FusedMoeBf16Problem& pr, const FusedMoeBf16Config& c) {
  std::string error = forward::check_config<Bf16Weights>(pr, c, forward::kOriginalMaxStages);
  if (!error.empty()) return error;
  if (pr.num_tokens > 0 &&
      (!aligned16(pr.x) || !aligned16(pr.w) || !aligned16(pr.w2) || !aligned16(pr.out)))
    return "x, w, w2 and out must be 16-byte aligned (TMA and 16-byte copies)";
  return forward::check_ring<Bf16Weights>(pr, c);
}

size_t fused_moe_bf16_workspace_bytes(const FusedMoeBf16Problem& problem,
                                      const FusedMoeBf16Config& config) {
  return forward::carve_workspace(problem, config.split, 0, nullptr).bytes;
}

cudaError_t launch_fused_moe_bf16(const FusedMoeBf16Problem& pr, const FusedMoeBf16Config& c,
                                  void* workspace, cudaStream_t stream) {
  const forward::Workspace ws = forward::carve_workspace(pr, c.split, 0, workspace);
  return forward::launch_forward<Bf16Weights>(pr, pr.x, {pr.w, pr.w2, nullptr, nullptr}, c, ws,
                                              stream);
}

std::string describe_fused_moe_bf16_config(const FusedMoeBf16Problem& pr,
                                           const FusedMoeBf16Config& requested,
                                           const FusedMoeBf16Config& c) {
  return forward::describe_config<Bf16Weights>(pr, requested, c, "gather=cp.async+swizzle");
}

}  // namespace prime_moe
