// moe_align in three passes, deterministic (no order-dependent atomics reach the output):
//   1. per chunk of kMoeAlignChunk pairs, a histogram of experts (shared-memory atomics on
//      integer counts: any order gives the same counts);
//   2. one block turns the (chunk, expert) counts into padded expert offsets and, per chunk,
//      the first row that chunk's pairs of each expert go to; it also writes expert_ids and
//      the padded total;
//   3. one warp per chunk walks its pairs in index order and places them, ranking equal
//      experts inside a step (lanes_with_expert), so each segment is stable by pair index.
// Passes 2 and 3 launch as programmatic dependents of the pass before (grid_dependency.cuh).
// At decode and small prefill sizes one block does the whole align instead (moe_align_small).
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "flash_moe_constants.h"
#include "moe_align.h"
#include "prime_kernels/grid_dependency.cuh"
#include "prime_kernels/smem_allowance.h"

namespace prime_moe {
namespace {

constexpr int kHistogramThreads = 256;
constexpr int kScanThreads = 1024;
constexpr int kExpertsPerScanThread = kMaxExperts / kScanThreads;
constexpr int kScatterWarps = 4;
static_assert(kMaxExperts % kScanThreads == 0, "the scan gives each thread whole experts");
static_assert(kMoeAlignChunk % 32 == 0, "a chunk is whole warp steps");

__device__ __forceinline__ bool routed(int32_t expert, int num_experts) {
  return expert >= 0 && expert < num_experts;
}

// The lanes of the warp holding this lane's expert (-1 for a pair routed nowhere): what
// __match_any_sync returns, by one ballot per bit of expert + 1 (expert_bits of them). Measured
// against MATCH.ANY (ncu, H100, Qwen3-30B-A3B T = 1024: 8192 pairs over 128 experts, 8 steps of 32
// warps in moe_align_small): the block 25.8 us instead of 30.7.
__device__ __forceinline__ int expert_bits(int num_experts) {
  return 32 - __clz(num_experts);
}
__device__ __forceinline__ unsigned lanes_with_expert(int32_t expert, int bits) {
  const uint32_t value = uint32_t(expert + 1);
  unsigned peers = 0xffffffffu;
  for (int b = 0; b < bits; ++b) {
    const bool set = (value >> b) & 1u;
    const unsigned voted = __ballot_sync(0xffffffffu, set);
    peers &= set ? voted : ~voted;
  }
  return peers;
}

__global__ void __launch_bounds__(kHistogramThreads)
    moe_align_histogram(const int32_t* __restrict__ topk_ids, int64_t num_pairs, int num_experts,
                        int32_t* __restrict__ chunk_counts) {
  prime_kernels::launch_dependent_grids();  // the offsets pass waits for this one's end
  extern __shared__ int32_t counts[];
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kMoeAlignChunk;
  for (int i = threadIdx.x; i < kMoeAlignChunk; i += blockDim.x) {
    const int64_t pair = begin + i;
    if (pair < num_pairs) {
      const int32_t expert = topk_ids[pair];
      if (routed(expert, num_experts)) atomicAdd(&counts[expert], 1);
    }
  }
  __syncthreads();
  int32_t* row = chunk_counts + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) row[e] = counts[e];
}

// One expert's column of (chunk, expert) counts (or moe_align_small's (run, expert) bins) over
// chunks [c0, c1): its sum, and the counts turned into each chunk's first row from `row` on
// (returning the row after them). The
// counts are read kColumnBatch at a time: the stores may alias the next loads as far as the
// compiler knows, so a plain loop would wait for each load in turn.
constexpr int kColumnBatch = 8;
__device__ __forceinline__ int32_t column_sum(const int32_t* counts, int num_experts, int expert,
                                              int64_t c0, int64_t c1) {
  int32_t sum = 0;
  for (int64_t c = c0; c < c1; c += kColumnBatch) {
#pragma unroll
    for (int j = 0; j < kColumnBatch; ++j)
      if (c + j < c1) sum += counts[(c + j) * num_experts + expert];
  }
  return sum;
}
__device__ __forceinline__ int32_t column_rows(int32_t* counts, int num_experts, int expert,
                                               int64_t c0, int64_t c1, int32_t row) {
  for (int64_t c = c0; c < c1; c += kColumnBatch) {
    int32_t count[kColumnBatch];
#pragma unroll
    for (int j = 0; j < kColumnBatch; ++j)
      count[j] = c + j < c1 ? counts[(c + j) * num_experts + expert] : 0;
#pragma unroll
    for (int j = 0; j < kColumnBatch; ++j) {
      if (c + j < c1) counts[(c + j) * num_experts + expert] = row;
      row += count[j];
    }
  }
  return row;
}

// How many runs of chunks pass 2 splits each expert's column into, a thread a run. With one
// expert a thread over all chunks, 32 of the block's threads worked at 128 experts: the offsets
// kernel took 38.8 us at 256 chunks (H200, Qwen3-30B-A3B T = 32768, torch.profiler, its wait for
// the histogram included), most of moe_align's time there. Up to 32 runs and no more than there
// are chunks, so that the run sums an owner adds up stay few; 1 past kScanThreads / 2 experts
// (each thread then owns whole columns, as the scan does).
constexpr int kMaxColumnRuns = 32;
__device__ __forceinline__ int column_runs(int num_experts, int64_t num_chunks) {
  if (num_experts > kScanThreads / 2 || num_chunks <= 1) return 1;
  const int most = min(kMaxColumnRuns, kScanThreads / num_experts);
  return num_chunks < most ? int(num_chunks) : most;
}

// Pass 2, by a block of kScanThreads threads. chunk_counts (global or shared memory): the
// (chunk, expert) counts in, each chunk's first row of each expert out.
__device__ __forceinline__ void align_offsets(int64_t num_chunks, int num_experts, int block_m,
                                              int pad, int64_t max_padded, int32_t* chunk_counts,
                                              int32_t* __restrict__ expert_ids,
                                              int32_t* __restrict__ num_tokens_post_padded) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  // Run r of expert e is slot r * E + e, thread slot's: its sum, then its first row.
  __shared__ int32_t run_rows[kScanThreads];

  const int runs = column_runs(num_experts, num_chunks);
  const int64_t run_chunks = (num_chunks + runs - 1) / runs;
  const int slot = threadIdx.x;
  const int slot_expert = slot % num_experts;
  const int64_t run_begin = min(num_chunks, slot / num_experts * run_chunks);
  const int64_t run_end = min(num_chunks, run_begin + run_chunks);
  const bool has_run = runs > 1 && slot < runs * num_experts;
  if (runs > 1) {
    run_rows[slot] =
        has_run ? column_sum(chunk_counts, num_experts, slot_expert, run_begin, run_end) : 0;
    __syncthreads();
  }

  // Thread t owns experts [t * kExpertsPerScanThread, ...): a blocked arrangement, so the
  // block-wide exclusive scan of padded sizes gives each expert its segment start. An owner
  // reads its experts' columns of the run sums, or of the chunk counts when there is one run.
  int32_t* owner_counts = runs > 1 ? run_rows : chunk_counts;
  const int64_t owner_rows = runs > 1 ? runs : num_chunks;
  int32_t padded[kExpertsPerScanThread];
  for (int i = 0; i < kExpertsPerScanThread; ++i) {
    const int expert = threadIdx.x * kExpertsPerScanThread + i;
    int32_t total = 0;
    if (expert < num_experts) {
      total = column_sum(owner_counts, num_experts, expert, 0, owner_rows);
    }
    padded[i] = (total + pad - 1) / pad * pad;
  }
  int32_t start[kExpertsPerScanThread];
  int32_t padded_total;
  Scan(scan_storage).ExclusiveSum(padded, start, padded_total);

  const int64_t num_blocks = max_padded / block_m;
  for (int64_t b = padded_total / block_m + threadIdx.x; b < num_blocks; b += blockDim.x) {
    expert_ids[b] = -1;
  }
  for (int i = 0; i < kExpertsPerScanThread; ++i) {
    const int expert = threadIdx.x * kExpertsPerScanThread + i;
    if (expert >= num_experts) break;
    for (int32_t b = start[i] / block_m; b < (start[i] + padded[i]) / block_m; ++b) {
      expert_ids[b] = expert;
    }
    // Each chunk's (or run's) count becomes its first destination row for this expert.
    column_rows(owner_counts, num_experts, expert, 0, owner_rows, start[i]);
  }
  if (runs > 1) {
    __syncthreads();
    if (has_run)
      column_rows(chunk_counts, num_experts, slot_expert, run_begin, run_end, run_rows[slot]);
  }
  if (threadIdx.x == 0) *num_tokens_post_padded = padded_total;
}

// Pass 3 for one chunk, by one warp. next_row (global or shared memory): the chunk's next row
// of each expert. The warp's steps depend on each other through next_row, not through the ids:
// those are loaded kStepBatch steps at a time, so one load latency covers several steps.
constexpr int kStepBatch = 8;
static_assert(kMoeAlignChunk % (32 * kStepBatch) == 0, "whole batches of steps");
__device__ __forceinline__ void align_scatter_chunk(const int32_t* __restrict__ topk_ids,
                                                    int64_t num_pairs, int num_experts,
                                                    int64_t chunk, int32_t* next_row,
                                                    int32_t* __restrict__ sorted_token_ids) {
  const int lane = threadIdx.x % 32;
  const unsigned lanes_below = (1u << lane) - 1;
  const int bits = expert_bits(num_experts);
  for (int batch = 0; batch < kMoeAlignChunk; batch += 32 * kStepBatch) {
    int32_t experts[kStepBatch];
#pragma unroll
    for (int j = 0; j < kStepBatch; ++j) {
      const int64_t pair = chunk * kMoeAlignChunk + batch + 32 * j + lane;
      experts[j] = pair < num_pairs ? topk_ids[pair] : -1;
    }
#pragma unroll
    for (int j = 0; j < kStepBatch; ++j) {
      const int64_t pair = chunk * kMoeAlignChunk + batch + 32 * j + lane;
      int32_t expert = experts[j];
      const bool keep = routed(expert, num_experts);
      if (!keep) expert = -1;
      const unsigned peers = lanes_with_expert(expert, bits);
      int32_t row = 0;
      if (keep) row = next_row[expert] + __popc(peers & lanes_below);
      __syncwarp();
      if (keep) {
        sorted_token_ids[row] = static_cast<int32_t>(pair);
        if ((peers & lanes_below) == 0) next_row[expert] = row + __popc(peers);
      }
      __syncwarp();
    }
  }
}

__global__ void __launch_bounds__(kScanThreads)
    moe_align_offsets(int64_t num_chunks, int num_experts, int block_m, int pad, int64_t max_padded,
                      int32_t* __restrict__ chunk_counts, int32_t* __restrict__ expert_ids,
                      int32_t* __restrict__ num_tokens_post_padded) {
  prime_kernels::grid_dependency_wait();
  prime_kernels::launch_dependent_grids();
  align_offsets(num_chunks, num_experts, block_m, pad, max_padded, chunk_counts, expert_ids,
                num_tokens_post_padded);
}

// Up to kScatterSharedExperts experts, a warp's next rows live in shared memory while it steps:
// each step reads back what the step before stored, a round trip to L2 in global memory.
constexpr int kScatterSharedExperts = 1024;  // 16 KB for the block's 4 warps

__global__ void __launch_bounds__(kScatterWarps * 32)
    moe_align_scatter(const int32_t* __restrict__ topk_ids, int64_t num_pairs, int num_experts,
                      int64_t num_chunks, int32_t* __restrict__ chunk_rows,
                      int32_t* __restrict__ sorted_token_ids) {
  __shared__ int32_t shared_rows[kScatterWarps][kScatterSharedExperts];
  prime_kernels::grid_dependency_wait();
  const int warp = threadIdx.x / 32;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kScatterWarps + warp;
  if (chunk >= num_chunks) return;
  int32_t* next_row = chunk_rows + chunk * num_experts;
  if (num_experts <= kScatterSharedExperts) {
    for (int e = threadIdx.x % 32; e < num_experts; e += 32) shared_rows[warp][e] = next_row[e];
    __syncwarp();
    next_row = shared_rows[warp];
  }
  align_scatter_chunk(topk_ids, num_pairs, num_experts, chunk, next_row, sorted_token_ids);
}

// Decode and small prefill sizes: the whole align in one block of kScanThreads threads, the
// -1 fill too. The four stream operations of the three passes spanned 14 us of the whole
// forward's 141 at T = 64 (H200, orig config: E = 32, k = 4), most of it launch latency and the
// gaps between them. A first one-block form (the passes' parts in turn: per-chunk histogram,
// align_offsets, a warp a chunk placing pairs) still took 12.3 us at that shape (ncu on an H100,
// clocks locked): its 1830 executed instructions ran mostly on one warp (the owners of E = 32
// experts, 64-bit column walks, then the chunk's serial scatter), 47% of warp cycles waiting at
// barriers. This one takes 6.3 us there, every phase spread over the block and short:
//   1. warp w < runs loads its run of steps * 32 consecutive pairs into registers (one load
//      latency for all), while the block fills the rows with -1 (sorted_token_ids, or their
//      staged copy: below) and zeroes the bins;
//   2. per step, lanes with one expert find each other (lanes_with_expert) and the first adds
//      their number to bin (w, e) with a shared atomic whose old value is how many of e the
//      warp's earlier steps held: each pair's rank in its run, kept in a register;
//   3. thread e owns expert e's column of bins: its total, a block scan of padded totals (the
//      segment starts), expert_ids, and the column turned into each run's first row of e;
//   4. each pair goes to its run's first row of e plus its rank.
// Runs hold consecutive pairs, so each expert's rows come in pair order (stable).
// Up to kSmallStagedRows padded rows, sorted_token_ids is built in shared memory (the -1 fill
// and phase 4's scattered rows) and written out once, coalesced: phase 4's scattered 4-byte stores
// to global memory, and the shared loads between them, held 36% of the block's stall samples at
// 8192 pairs (ncu, H100, Qwen3-30B-A3B T = 1024); staged, the block takes 19.4 us instead of
// 25.8 (orig T = 1024: 13.6 instead of 15.7), and the forward at T = 1024 1.00-1.02x (bf16) and
// 1.00-1.03x (MXFP8) in all five benchmark configs, T = 64 unchanged.
constexpr int kSmallSteps = 8;           // a warp's pairs and ranks sit in 2 x 8 registers
constexpr int kSmallBins = 8192;         // 32 KB of shared memory: (run, expert) counts
constexpr int64_t kSmallRows = 65536;    // the -1 fill: 64 coalesced stores a thread
constexpr int kSmallStagedRows = 40960;  // 160 KB: with the bins, 196 KB of sm_90's 227 a block
constexpr int kSmallWarps = kScanThreads / 32;
static_assert(kMaxExperts <= kSmallBins, "at least one run at the most experts");

// As many runs as there are warps and the bins allow.
int most_small_runs(int num_experts) {
  return std::min(kSmallWarps, kSmallBins / std::max(num_experts, 1));
}

// Runs of 32 pairs or more.
int small_runs(int64_t num_pairs, int num_experts) {
  const int64_t warps_with_pairs = (num_pairs + 31) / 32;
  return int(
      std::max<int64_t>(1, std::min<int64_t>(most_small_runs(num_experts), warps_with_pairs)));
}

bool align_in_one_block(int64_t num_pairs, int num_experts, int64_t max_padded) {
  return num_pairs <= int64_t(most_small_runs(num_experts)) * 32 * kSmallSteps &&
         max_padded <= kSmallRows;
}

__global__ void __launch_bounds__(kScanThreads)
    moe_align_small(const int32_t* __restrict__ topk_ids, int num_pairs, int num_experts, int runs,
                    int steps, int block_m, int pad, int max_padded, bool staged,
                    int32_t* __restrict__ sorted_token_ids, int32_t* __restrict__ expert_ids,
                    int32_t* __restrict__ num_tokens_post_padded) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int32_t bins[kSmallBins];      // bin (w, e) at w * num_experts + e
  extern __shared__ int32_t staged_rows[];  // max_padded rows where staged
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first_pair = warp * steps * 32 + lane;
  const bool has_run = warp < runs;

  int32_t expert[kSmallSteps];
#pragma unroll
  for (int s = 0; s < kSmallSteps; ++s) {
    const int pair = first_pair + s * 32;
    expert[s] = has_run && s < steps && pair < num_pairs ? topk_ids[pair] : -1;
  }
  if (staged) {
    for (int row = threadIdx.x; row < max_padded; row += kScanThreads) staged_rows[row] = -1;
  } else {
    for (int row = threadIdx.x; row < max_padded; row += kScanThreads) sorted_token_ids[row] = -1;
  }
  for (int i = threadIdx.x; i < runs * num_experts; i += kScanThreads) bins[i] = 0;
  __syncthreads();

  // From here on a pair is (expert << 8 | rank), or -1: its rank in the run is below 32 *
  // kSmallSteps, and the 8 registers this saves keep the block's 64 clear of spills.
  static_assert(32 * kSmallSteps <= 256, "a rank fits 8 bits");
  if (has_run) {
    const unsigned lanes_below = (1u << lane) - 1;
    const int bits = expert_bits(num_experts);
#pragma unroll
    for (int s = 0; s < kSmallSteps; ++s) {
      if (s >= steps) break;
      const int32_t e = routed(expert[s], num_experts) ? expert[s] : -1;
      const unsigned peers = lanes_with_expert(e, bits);
      const int first = __ffs(peers) - 1;
      int32_t before = 0;
      if (lane == first && e >= 0) before = atomicAdd(&bins[warp * num_experts + e], __popc(peers));
      const int32_t rank = __shfl_sync(0xffffffffu, before, first) + __popc(peers & lanes_below);
      expert[s] = e >= 0 ? e << 8 | rank : -1;
      __syncwarp();  // the next step's atomics (other lanes, maybe) come after this step's
    }
  }
  __syncthreads();

  int32_t padded_total = 0;
  for (int e0 = 0; e0 < num_experts; e0 += kScanThreads) {
    const int e = e0 + threadIdx.x;
    const bool owner = e < num_experts;
    const int32_t total = owner ? column_sum(bins, num_experts, e, 0, runs) : 0;
    const int32_t padded = (total + pad - 1) / pad * pad;
    int32_t start, round_total;
    Scan(scan_storage).ExclusiveSum(padded, start, round_total);
    start += padded_total;
    padded_total += round_total;
    if (owner) {
      for (int b = start / block_m; b < (start + padded) / block_m; ++b) expert_ids[b] = e;
      column_rows(bins, num_experts, e, 0, runs, start);  // each run's first row of e
    }
    __syncthreads();  // the scan's storage is reused; the rows are read below
  }
  for (int b = padded_total / block_m + threadIdx.x; b < max_padded / block_m; b += kScanThreads)
    expert_ids[b] = -1;
  if (threadIdx.x == 0) *num_tokens_post_padded = padded_total;

  if (has_run) {
#pragma unroll
    for (int s = 0; s < kSmallSteps; ++s) {
      if (s >= steps) break;
      if (expert[s] < 0) continue;
      const int row = bins[warp * num_experts + (expert[s] >> 8)] + (expert[s] & 0xff);
      // Two stores, not one through a pointer chosen by `staged`: that one compiles to a
      // generic store, which resolves its address space at run time.
      if (staged)
        staged_rows[row] = first_pair + s * 32;
      else
        sorted_token_ids[row] = first_pair + s * 32;
    }
  }
  if (staged) {
    __syncthreads();
    for (int row = threadIdx.x; row < max_padded; row += kScanThreads)
      sorted_token_ids[row] = staged_rows[row];
  }
}

}  // namespace

size_t moe_align_workspace_bytes(int64_t num_pairs, int64_t num_experts, int64_t max_padded) {
  if (num_experts < 1 || align_in_one_block(num_pairs, int(num_experts), max_padded)) return 0;
  return static_cast<size_t>(moe_align_num_chunks(num_pairs)) * num_experts * sizeof(int32_t);
}

cudaError_t launch_moe_align(const int32_t* topk_ids, int64_t num_pairs, int num_experts,
                             int block_m, int bpc, int32_t* sorted_token_ids, int32_t* expert_ids,
                             int32_t* num_tokens_post_padded, int64_t max_padded,
                             int32_t* workspace, cudaStream_t stream) {
  const int pad = block_m * bpc;
  const int64_t num_chunks = moe_align_num_chunks(num_pairs);
  if (align_in_one_block(num_pairs, num_experts, max_padded)) {
    const int runs = small_runs(num_pairs, num_experts);
    const int steps = int((num_pairs + runs * 32 - 1) / (runs * 32));
    // Staged where the device's blocks hold kSmallStagedRows rows beside the bins; otherwise
    // the rows go to global memory directly.
    const bool staged =
        max_padded <= kSmallStagedRows &&
        prime_kernels::allow_dynamic_smem(reinterpret_cast<const void*>(moe_align_small),
                                          kSmallStagedRows * sizeof(int32_t), false) == cudaSuccess;
    moe_align_small<<<1, kScanThreads, staged ? size_t(max_padded) * sizeof(int32_t) : 0, stream>>>(
        topk_ids, int(num_pairs), num_experts, runs, steps, block_m, pad, int(max_padded), staged,
        sorted_token_ids, expert_ids, num_tokens_post_padded);
    return cudaGetLastError();
  }
  // -1 everywhere first: padding rows and the tail past the padded total stay -1.
  cudaError_t status =
      cudaMemsetAsync(sorted_token_ids, 0xff, max_padded * sizeof(int32_t), stream);
  if (status != cudaSuccess) return status;
  if (num_chunks > 0) {
    moe_align_histogram<<<num_chunks, kHistogramThreads, num_experts * sizeof(int32_t), stream>>>(
        topk_ids, num_pairs, num_experts, workspace);
    if ((status = cudaGetLastError()) != cudaSuccess) return status;
  }
  status = prime_kernels::launch_kernel(moe_align_offsets, dim3(1), dim3(kScanThreads), 0, stream,
                                        num_chunks > 0, num_chunks, num_experts, block_m, pad,
                                        max_padded, workspace, expert_ids, num_tokens_post_padded);
  if (status != cudaSuccess) return status;
  if (num_chunks > 0) {
    const int64_t blocks = (num_chunks + kScatterWarps - 1) / kScatterWarps;
    status = prime_kernels::launch_kernel(
        moe_align_scatter, dim3(unsigned(blocks)), dim3(kScatterWarps * 32), 0, stream, true,
        topk_ids, num_pairs, num_experts, num_chunks, workspace, sorted_token_ids);
  }
  return status;
}

}  // namespace prime_moe
