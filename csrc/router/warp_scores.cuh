// Per-token router math shared by the forward and backward kernels: a warp
// owns a token, lane l holds experts l, l+32, ... (kPerLane of them) in
// registers.  The backward recomputes the scores with the same expressions
// as the forward, so both see the same fp32 values.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "common/dtypes.h"
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

// Runs launch.template operator()<T, kPerLane>() for the logits' element type
// T and the register slots per lane (1, 2, 4, 8 or 16) the expert count
// needs: the one instantiation choice of the forward and backward kernels.
template <typename Launch>
cudaError_t dispatch_logits(DType dtype, int experts, Launch&& launch) {
  auto by_width = [&]<typename T>() -> cudaError_t {
    const int per_lane = (experts + 31) / 32;
    if (per_lane <= 1) return launch.template operator()<T, 1>();
    if (per_lane <= 2) return launch.template operator()<T, 2>();
    if (per_lane <= 4) return launch.template operator()<T, 4>();
    if (per_lane <= 8) return launch.template operator()<T, 8>();
    return launch.template operator()<T, 16>();
  };
  switch (dtype) {
    case DType::kFloat32: return by_width.template operator()<float>();
    case DType::kBFloat16: return by_width.template operator()<__nv_bfloat16>();
    case DType::kFloat16: return by_width.template operator()<__half>();
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace detail
}  // namespace router
}  // namespace lpmoe
