// Per-token router math shared by the forward and backward kernels: a warp
// owns a token, lane l holds experts l, l+32, ... (kPerLane of them) in
// registers.  The backward recomputes the scores with the same expressions
// as the forward, so both see the same fp32 values.
#pragma once

#include <cstdint>

#include "common/numerics.cuh"

namespace lpmoe {
namespace router {
namespace detail {

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One token's logits (fp32; -inf past the experts), their max m and
// sum(exp(l - m)) (the softmax's normaliser; the logsumexp is m + log(sum)),
// and the scores: softmax(l) or sigmoid(l), 0 past the experts.
template <typename T, int kPerLane>
__device__ __forceinline__ void token_scores(const T* row, int lane, int experts, bool sigmoid, float (&l)[kPerLane],
                                             float (&s)[kPerLane], float& m, float& sum) {
#pragma unroll
  for (int v = 0; v < kPerLane; ++v) {
    const int e = lane + 32 * v;
    l[v] = e < experts ? to_float<T>(row[e]) : -INFINITY;
  }
  m = -INFINITY;
#pragma unroll
  for (int v = 0; v < kPerLane; ++v) m = fmaxf(m, l[v]);
  m = warp_max(m);
  sum = 0.0f;
#pragma unroll
  for (int v = 0; v < kPerLane; ++v) sum += (lane + 32 * v < experts) ? expf(l[v] - m) : 0.0f;
  sum = warp_sum(sum);
#pragma unroll
  for (int v = 0; v < kPerLane; ++v) {
    const bool real = lane + 32 * v < experts;
    s[v] = !real ? 0.0f : sigmoid ? 1.0f / (1.0f + expf(-l[v])) : expf(l[v] - m) / sum;
  }
}

}  // namespace detail
}  // namespace router
}  // namespace lpmoe
