// Routing map kernels (see routing_map.h for the algorithm and layouts).
#include "routing_map/routing_map.h"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "common/cuda_utils.h"

namespace lpmoe {
namespace routing_map {
namespace {

constexpr int kThreads = 32 * kWarpsPerCta;
constexpr int kScanWarps = 32;
// Experts per thread in the rank kernel's scan over experts.
constexpr int kExpertsPerThread = kMaxExperts / kThreads;
static_assert(kExpertsPerThread * kThreads == kMaxExperts, "experts must split evenly over the CTA");

// Expert of slot s, or `experts` (a sentinel that sorts nowhere) when the
// slot is out of range or the router dropped it.
template <typename IdxT>
__device__ __forceinline__ int expert_of(const IdxT* idx, int64_t s, int64_t slots, int experts) {
  if (s >= slots) return experts;
  const IdxT e = idx[s];
  return (e >= 0 && e < static_cast<IdxT>(experts)) ? static_cast<int>(e) : experts;
}

// 1. counts[chunk][e]: valid slots of expert e in the chunk (shared-memory
// integer atomics: order-free, exact).
template <typename IdxT>
__global__ void __launch_bounds__(kThreads) count_kernel(const Args a) {
  extern __shared__ int32_t hist_all[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + warp;
  if (chunk >= chunks(a.slots)) return;  // warp-uniform; no CTA barrier below
  int32_t* hist = hist_all + warp * a.experts;
  for (int e = lane; e < a.experts; e += 32) hist[e] = 0;
  __syncwarp();
  const IdxT* idx = static_cast<const IdxT*>(a.indices);
  const int64_t base = chunk * kChunkSlots;
  for (int r = 0; r < kRoundsPerChunk; ++r) {
    const int e = expert_of(idx, base + r * 32 + lane, a.slots, a.experts);
    if (e < a.experts) atomicAdd(&hist[e], 1);
  }
  __syncwarp();
  int32_t* row = a.counts + chunk * a.experts;
  for (int e = lane; e < a.experts; e += 32) row[e] = hist[e];
}

// 2. Per expert (a lane), the exclusive prefix of counts over the chunks,
// written in place, and the expert's total.  Each of the 32 warps sums a
// contiguous run of chunks; the runs' sums are scanned in shared memory.
// One CTA per 32 experts: with few experts and very many slots (16M slots
// = 32k chunks, ~1000 dependent loads per warp) a two-level scan would
// spread it further; at MoE sizes (<= 1M slots) it takes a few us.
__global__ void __launch_bounds__(32 * kScanWarps) scan_kernel(const Args a) {
  __shared__ int32_t part[kScanWarps][33];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e = blockIdx.x * 32 + lane;
  const int64_t n_chunks = chunks(a.slots);
  const int64_t per = (n_chunks + kScanWarps - 1) / kScanWarps;
  const int64_t lo = warp * per;
  const int64_t hi = lo + per < n_chunks ? lo + per : n_chunks;
  int32_t sum = 0;
  if (e < a.experts)
    for (int64_t c = lo; c < hi; ++c) sum += a.counts[c * a.experts + e];
  part[warp][lane] = sum;
  __syncthreads();
  if (warp == 0) {
    int32_t run = 0;
    for (int w = 0; w < kScanWarps; ++w) {
      const int32_t v = part[w][lane];
      part[w][lane] = run;
      run += v;
    }
    if (e < a.experts) a.totals[e] = run;
  }
  __syncthreads();
  if (e >= a.experts) return;
  int32_t run = part[warp][lane];
  for (int64_t c = lo; c < hi; ++c) {
    int32_t* p = a.counts + c * a.experts + e;
    const int32_t v = *p;
    *p = run;
    run += v;
  }
}

// 3. Each warp ranks its chunk's slots in flat order; see routing_map.h.
template <typename IdxT>
__global__ void __launch_bounds__(kThreads) rank_kernel(const Args a) {
  using Scan = cub::BlockScan<int32_t, kThreads>;
  using Reduce = cub::BlockReduce<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ typename Reduce::TempStorage reduce_tmp;
  extern __shared__ int32_t smem[];
  int32_t* offsets = smem;                 // (experts,) packed layout: first row of each expert
  int32_t* run_all = smem + a.experts;     // (warps, experts) running counts
  const int64_t cap = a.capacity < 0 ? INT64_MAX : a.capacity;

  // Kept rows per expert, and their exclusive scan (every CTA: E <= 1024, cheap).
  int32_t kept[kExpertsPerThread];
  int32_t mine = 0, over = 0;
#pragma unroll
  for (int i = 0; i < kExpertsPerThread; ++i) {
    const int e = threadIdx.x * kExpertsPerThread + i;
    const int32_t total = e < a.experts ? a.totals[e] : 0;
    kept[i] = static_cast<int64_t>(total) < cap ? total : static_cast<int32_t>(cap);
    mine += kept[i];
    over += total - kept[i];
  }
  int32_t first = 0, kept_total = 0;
  Scan(scan_tmp).ExclusiveSum(mine, first, kept_total);
  const int32_t dropped = Reduce(reduce_tmp).Sum(over);  // valid in thread 0
#pragma unroll
  for (int i = 0; i < kExpertsPerThread; ++i) {
    const int e = threadIdx.x * kExpertsPerThread + i;
    if (e < a.experts) {
      offsets[e] = first;
      if (blockIdx.x == 0) a.m_splits[e] = kept[i];
    }
    first += kept[i];
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (a.used != nullptr) a.used[0] = kept_total;
    a.dropped[0] = dropped;
  }
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + warp;
  if (chunk >= chunks(a.slots)) return;
  int32_t* run = run_all + warp * a.experts;
  const int32_t* prefix = a.counts + chunk * a.experts;
  for (int e = lane; e < a.experts; e += 32) run[e] = prefix[e];
  __syncwarp();
  const IdxT* idx = static_cast<const IdxT*>(a.indices);
  const unsigned below = (1u << lane) - 1u;
  for (int r = 0; r < kRoundsPerChunk; ++r) {
    const int64_t s0 = chunk * kChunkSlots + r * 32;
    if (s0 >= a.slots) break;  // warp-uniform
    const int64_t s = s0 + lane;
    const int e = expert_of(idx, s, a.slots, a.experts);
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const bool valid = e < a.experts;
    const int32_t rank = valid ? run[e] + __popc(peers & below) : 0;
    __syncwarp();
    if (valid && lane == __ffs(peers) - 1) run[e] += __popc(peers);
    __syncwarp();
    if (s < a.slots) {
      int32_t row = -1;
      if (valid && rank < cap)
        row = a.padded ? static_cast<int32_t>(e * a.capacity + rank) : offsets[e] + rank;
      a.row_map[s] = row;
    }
  }
}

template <typename IdxT>
cudaError_t launch_typed(const Args& a, cudaStream_t stream) {
  const int64_t n_chunks = chunks(a.slots);
  const int64_t ctas = ceil_div<int64_t>(n_chunks, kWarpsPerCta);
  const size_t hist_bytes = sizeof(int32_t) * kWarpsPerCta * a.experts;
  if (n_chunks > 0) count_kernel<IdxT><<<static_cast<unsigned>(ctas), kThreads, hist_bytes, stream>>>(a);
  LPMOE_RETURN_IF_ERROR(last_launch_error());
  scan_kernel<<<static_cast<unsigned>(ceil_div(a.experts, 32)), 32 * kScanWarps, 0, stream>>>(a);
  LPMOE_RETURN_IF_ERROR(last_launch_error());
  // at least one CTA: it writes m_splits, used and dropped even without slots
  rank_kernel<IdxT><<<static_cast<unsigned>(ctas > 0 ? ctas : 1), kThreads, hist_bytes + sizeof(int32_t) * a.experts,
                      stream>>>(a);
  return last_launch_error();
}

}  // namespace

cudaError_t launch_routing_map(const Args& a, cudaStream_t stream) {
  if (a.experts < 1 || a.experts > kMaxExperts || a.slots < 0 || a.slots >= (int64_t{1} << 31) ||
      (a.padded && a.capacity < 0))
    return cudaErrorInvalidValue;
  return a.indices_int64 ? launch_typed<int64_t>(a, stream) : launch_typed<int32_t>(a, stream);
}

}  // namespace routing_map
}  // namespace lpmoe
