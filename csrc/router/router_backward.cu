// The router's backward (topk_router.h, BackwardArgs): one warp per token,
// experts in registers as in the forward; no shared memory, no atomics, so
// each token's gradient is computed in a fixed order (deterministic).
#include "router/topk_router.h"
#include "router/warp_scores.cuh"

namespace lpmoe {
namespace router {
namespace {

constexpr int kThreads = kWarpsPerCta * 32;
using detail::warp_sum;

template <typename T, int kPerLane>
__global__ void __launch_bounds__(kThreads) backward_kernel(BackwardArgs a) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T* logits = static_cast<const T*>(a.logits);
  T* out = static_cast<T*>(a.grad_logits);
  float ga[kPerLane];  // the affinity sums' gradient: the same for every token
#pragma unroll
  for (int v = 0; v < kPerLane; ++v) {
    const int e = lane + 32 * v;
    ga[v] = (a.grad_affinity != nullptr && e < a.experts) ? a.grad_affinity[e] : 0.0f;
  }
  for (int64_t t = int64_t(blockIdx.x) * kWarpsPerCta + warp; t < a.tokens;
       t += int64_t(gridDim.x) * kWarpsPerCta) {
    float l[kPerLane], s[kPerLane], m, sum;
    detail::token_scores<T, kPerLane>(logits + t * a.experts, lane, a.experts, a.sigmoid, l, s, m, sum);
    // the selection: lane j < k brings slot j's expert and gradient
    const int my_e = lane < a.k ? static_cast<int>(a.indices[t * a.k + lane]) : -1;
    const float my_g = (lane < a.k && a.grad_probs != nullptr) ? a.grad_probs[t * a.k + lane] : 0.0f;
    bool sel[kPerLane];
    float g[kPerLane];
#pragma unroll
    for (int v = 0; v < kPerLane; ++v) {
      sel[v] = false;
      g[v] = 0.0f;
    }
    for (int j = 0; j < a.k; ++j) {
      const int e = __shfl_sync(0xffffffffu, my_e, j);
      const float gj = __shfl_sync(0xffffffffu, my_g, j);
#pragma unroll
      for (int v = 0; v < kPerLane; ++v)
        if (lane + 32 * v == e) {
          sel[v] = true;
          g[v] = gj;
        }
    }
    float picked = 0.0f, weighted = 0.0f, s_total = 0.0f, ga_s = 0.0f;
#pragma unroll
    for (int v = 0; v < kPerLane; ++v) {
      picked += sel[v] ? s[v] : 0.0f;
      weighted += sel[v] ? g[v] * s[v] : 0.0f;
      s_total += s[v];
      ga_s += ga[v] * s[v];
    }
    picked = warp_sum(picked);
    weighted = warp_sum(weighted);
    const float z = a.sigmoid ? warp_sum(s_total) : 1.0f;
    const float ga_mean = a.sigmoid ? warp_sum(ga_s) / z : 0.0f;
    const float g_mean = a.normalize ? weighted / picked : 0.0f;
    float ds[kPerLane], ds_s = 0.0f;
#pragma unroll
    for (int v = 0; v < kPerLane; ++v) {
      const float dv = !sel[v] ? 0.0f : a.normalize ? (g[v] - g_mean) / picked : g[v];
      ds[v] = dv + (a.sigmoid ? (ga[v] - ga_mean) / z : ga[v]);
      ds_s += ds[v] * s[v];
    }
    if (!a.sigmoid) ds_s = warp_sum(ds_s);
    const float g_lse = a.grad_lse != nullptr ? a.grad_lse[t] : 0.0f;
#pragma unroll
    for (int v = 0; v < kPerLane; ++v) {
      const int e = lane + 32 * v;
      if (e >= a.experts) continue;
      float d = a.sigmoid ? ds[v] * s[v] * (1.0f - s[v]) : s[v] * (ds[v] - ds_s);
      if (g_lse != 0.0f) d += g_lse * (a.sigmoid ? expf(l[v] - m) / sum : s[v]);
      out[t * a.experts + e] = from_float<T>(d);
    }
  }
}

}  // namespace

cudaError_t launch_backward(const BackwardArgs& a, int sm_count, cudaStream_t stream) {
  if (a.experts < 1 || a.experts > kMaxExperts || a.k < 1 || a.k > kMaxTopK || a.k > a.experts || a.tokens < 0)
    return cudaErrorInvalidValue;
  if (a.tokens == 0) return cudaSuccess;
  const int grid = grid_size(a.tokens, sm_count);
  return detail::dispatch_logits(a.dtype, a.experts, [&]<typename T, int kPerLane>() {
    backward_kernel<T, kPerLane><<<grid, kThreads, 0, stream>>>(a);
    return cudaGetLastError();
  });
}

}  // namespace router
}  // namespace lpmoe
