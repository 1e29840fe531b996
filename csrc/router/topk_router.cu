// Fused router scoring kernel (topk_router.h).  A warp owns a token: lane
// l holds experts l, l+32, ... (kPerLane of them) in registers, so scores,
// the k argmax rounds and the affinity sums never leave the warp.
#include "router/topk_router.h"

#include <algorithm>
#include <cfloat>

#include "common/numerics.cuh"
#include "router/warp_scores.cuh"

namespace lpmoe {
namespace router {
namespace {

constexpr int kThreads = kWarpsPerCta * 32;
using detail::warp_sum;

// (value, index) argmax over the warp: larger value wins, ties to the lower index.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
}

template <typename T, int kPerLane>
__global__ void __launch_bounds__(kThreads) topk_kernel(TopKArgs a) {
  __shared__ float s_aff[kWarpsPerCta][kPerLane * 32];
  __shared__ int32_t s_count[kPerLane * 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int e = threadIdx.x; e < kPerLane * 32; e += kThreads) s_count[e] = 0;
  __syncthreads();
  const T* logits = static_cast<const T*>(a.logits);
  float aff[kPerLane];
#pragma unroll
  for (int v = 0; v < kPerLane; ++v) aff[v] = 0.0f;
  for (int64_t t = int64_t(blockIdx.x) * kWarpsPerCta + warp; t < a.tokens;
       t += int64_t(gridDim.x) * kWarpsPerCta) {
    float l[kPerLane], s[kPerLane], m, sum;
    detail::token_scores<T, kPerLane>(logits + t * a.experts, lane, a.experts, a.sigmoid, l, s, m, sum);
    if (a.lse != nullptr && lane == 0) a.lse[t] = m + logf(sum);
    float s_total = 0.0f;
#pragma unroll
    for (int v = 0; v < kPerLane; ++v) s_total += s[v];
    if (a.affinity != nullptr) {
      const float z = a.sigmoid ? warp_sum(s_total) : 1.0f;
#pragma unroll
      for (int v = 0; v < kPerLane; ++v) aff[v] += a.sigmoid ? s[v] / z : s[v];
    }
    // k argmax rounds; a chosen expert drops out with -inf.  Every lane
    // ends each round knowing (value, index); lane j keeps round j's.
    float work[kPerLane];
#pragma unroll
    for (int v = 0; v < kPerLane; ++v) work[v] = (lane + 32 * v < a.experts) ? s[v] : -INFINITY;
    float mine_v = 0.0f, picked = 0.0f;
    int mine_i = 0;
    for (int j = 0; j < a.k; ++j) {
      float bv = -INFINITY;
      int bi = INT32_MAX;
#pragma unroll
      for (int v = 0; v < kPerLane; ++v) {
        const int e = lane + 32 * v;
        if (work[v] > bv || (work[v] == bv && e < bi && e < a.experts)) {
          bv = work[v];
          bi = e;
        }
      }
      warp_argmax(bv, bi);
#pragma unroll
      for (int v = 0; v < kPerLane; ++v)
        if (lane + 32 * v == bi) work[v] = -INFINITY;
      if (lane == j) {
        mine_v = bv;
        mine_i = bi;
      }
      picked += bv;  // selection order on every lane
    }
    if (lane < a.k) {
      a.probs[t * a.k + lane] = a.normalize ? mine_v / picked : mine_v;
      a.indices[t * a.k + lane] = mine_i;
      if (a.counts != nullptr && mine_i < a.experts) atomicAdd(&s_count[mine_i], 1);
    }
  }
  if (a.counts != nullptr) {
    __syncthreads();
    for (int e = threadIdx.x; e < a.experts; e += kThreads) a.counts[int64_t(blockIdx.x) * a.experts + e] = s_count[e];
  }
  if (a.affinity != nullptr) {
#pragma unroll
    for (int v = 0; v < kPerLane; ++v) s_aff[warp][lane + 32 * v] = aff[v];
    __syncthreads();
    for (int e = threadIdx.x; e < a.experts; e += kThreads) {
      float total = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarpsPerCta; ++w) total += s_aff[w][e];
      a.affinity[int64_t(blockIdx.x) * a.experts + e] = total;
    }
  }
}

}  // namespace

int grid_size(int64_t tokens, int sm_count) {
  const int64_t need = (tokens + kWarpsPerCta - 1) / kWarpsPerCta;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(need, int64_t(sm_count) * 8)));
}

cudaError_t launch_topk(const TopKArgs& a, int sm_count, cudaStream_t stream) {
  if (a.experts < 1 || a.experts > kMaxExperts || a.k < 1 || a.k > kMaxTopK || a.k > a.experts || a.tokens < 0)
    return cudaErrorInvalidValue;
  const int grid = grid_size(a.tokens, sm_count);
  return detail::dispatch_logits(a.dtype, a.experts, [&]<typename T, int kPerLane>() {
    topk_kernel<T, kPerLane><<<grid, kThreads, 0, stream>>>(a);
    return cudaGetLastError();
  });
}

}  // namespace router
}  // namespace lpmoe
