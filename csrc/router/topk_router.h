// Fused router scoring: scores of every expert, top-k selection, the
// renormalised probabilities, and what the auxiliary losses need, in one
// pass over the logits (one warp per token).
//
//   scores   softmax(l) or sigmoid(l) in fp32 (expf)
//   top-k    k rounds of a warp argmax; ties go to the lower expert index
//   probs    v_j / sum_j v_j in selection order (normalize), else v_j
//   lse      logsumexp(l) per token (the z-loss), optional
//   affinity per-CTA partial sums over tokens of s' (s for softmax,
//            s / sum_e s for sigmoid), (grid, experts), optional; the caller
//            reduces them in a fixed order (deterministic)
//   counts   per-CTA slots per expert, (grid, experts) int32, optional
//            (shared-memory integer atomics: exact)
//
// Limits: experts <= kMaxExperts, k <= 32 (callers use PyTorch ops beyond).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "common/dtypes.h"

namespace lpmoe {
namespace router {

constexpr int kMaxExperts = 512;
constexpr int kMaxTopK = 32;
constexpr int kWarpsPerCta = 8;

struct TopKArgs {
  const void* logits = nullptr;  // (tokens, experts) row-major
  DType dtype = DType::kFloat32; // fp32, bf16 or fp16
  int64_t tokens = 0;
  int experts = 0;
  int k = 1;
  bool sigmoid = false;
  bool normalize = true;
  float* probs = nullptr;        // (tokens, k)
  int64_t* indices = nullptr;    // (tokens, k)
  float* lse = nullptr;          // (tokens,) or null
  float* affinity = nullptr;     // (grid, experts) or null
  int32_t* counts = nullptr;     // (grid, experts) slots per expert per CTA, or null
};

// CTAs a launch uses (the rows of `affinity`).
int grid_size(int64_t tokens, int sm_count);
cudaError_t launch_topk(const TopKArgs& args, int sm_count, cudaStream_t stream);

// The logits' gradient of the forward's differentiable outputs, the
// selection fixed by `indices` (router_backward.cu): one warp per token
// recomputes the scores s (as the forward does) and applies, in fp32,
//   v_j = s[idx_j], probs_j = v_j / sum_i v_i (normalize) or v_j
//   dv_j = (g_j - sum_i g_i probs_i) / sum_i v_i  (normalize), else g_j
//   ds_e = [e = idx_j] dv_j + (softmax: ga_e; sigmoid: (ga_e - sum_e' ga_e' s_e' / Z) / Z, Z = sum_e s_e)
//   dl_e = (softmax: s_e (ds_e - sum_e' ds_e' s_e'); sigmoid: ds_e s_e (1 - s_e))
//          + g_lse softmax(l)_e
// where g, ga, g_lse are the gradients of probs, of the affinity sums (the
// same for every token) and of the logsumexp; absent ones count as 0.
// `indices` must be the forward's: k distinct experts in [0, experts) per
// token.  Others are not checked (that would take a device flag): an
// out-of-range index adds nothing and a repeated one keeps one slot's g.
struct BackwardArgs {
  const void* logits = nullptr;      // (tokens, experts) row-major
  DType dtype = DType::kFloat32;
  int64_t tokens = 0;
  int experts = 0;
  int k = 1;
  bool sigmoid = false;
  bool normalize = true;
  const int64_t* indices = nullptr;  // (tokens, k) the forward's selection
  const float* grad_probs = nullptr; // (tokens, k) or null
  const float* grad_lse = nullptr;   // (tokens,) or null
  const float* grad_affinity = nullptr;  // (experts,) or null
  void* grad_logits = nullptr;       // (tokens, experts), the logits' dtype
};

cudaError_t launch_backward(const BackwardArgs& args, int sm_count, cudaStream_t stream);

}  // namespace router
}  // namespace lpmoe
