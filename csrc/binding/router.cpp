// Binding of the fused router scoring kernel (csrc/router).  Python
// (lpmoe/moe/router_kernel.py) allocates; this layer checks and launches.
#include <ATen/cuda/CUDAContext.h>

#include "binding/common.h"
#include "binding/ops.h"
#include "router/topk_router.h"

namespace lpmoe {
namespace binding {

int64_t router_grid_size(int64_t tokens) {
  return router::grid_size(tokens, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
}

void router_topk(const at::Tensor& logits, int64_t k, bool sigmoid, bool normalize, const at::Tensor& probs,
                 const at::Tensor& indices, const c10::optional<at::Tensor>& lse,
                 const c10::optional<at::Tensor>& affinity, const c10::optional<at::Tensor>& counts) {
  check_cuda(logits, "logits");
  check_contiguous(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "lpmoe: `logits` must be (tokens, experts), got ", logits.sizes());
  const int64_t t = logits.size(0), e = logits.size(1);
  TORCH_CHECK(e >= 1 && e <= router::kMaxExperts && k >= 1 && k <= router::kMaxTopK && k <= e,
              "lpmoe: the fused router takes 1..", router::kMaxExperts, " experts and 1..", router::kMaxTopK,
              " <= experts slots, got ", e, " experts, k ", k);
  check_dense(probs, logits, "probs", "logits", at::kFloat, t * k);
  check_dense(indices, logits, "indices", "logits", at::kLong, t * k);
  router::TopKArgs a;
  a.logits = logits.data_ptr();
  a.dtype = to_hp_dtype(logits.scalar_type(), "logits");
  a.tokens = t;
  a.experts = static_cast<int>(e);
  a.k = static_cast<int>(k);
  a.sigmoid = sigmoid;
  a.normalize = normalize;
  a.probs = probs.data_ptr<float>();
  a.indices = indices.data_ptr<int64_t>();
  if (lse.has_value()) {
    check_dense(*lse, logits, "lse", "logits", at::kFloat, t);
    a.lse = lse->data_ptr<float>();
  }
  if (affinity.has_value()) {
    check_dense(*affinity, logits, "affinity", "logits", at::kFloat, router_grid_size(t) * e);
    a.affinity = affinity->data_ptr<float>();
  }
  if (counts.has_value()) {
    check_dense(*counts, logits, "counts", "logits", at::kInt, router_grid_size(t) * e);
    a.counts = counts->data_ptr<int32_t>();
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  LPMOE_CHECK_LAUNCH(router::launch_topk(a, at::cuda::getCurrentDeviceProperties()->multiProcessorCount,
                                         current_stream()),
                     "router top-k");
}

void router_backward(const at::Tensor& logits, const at::Tensor& indices, const c10::optional<at::Tensor>& grad_probs,
                     const c10::optional<at::Tensor>& grad_lse, const c10::optional<at::Tensor>& grad_affinity,
                     bool sigmoid, bool normalize, const at::Tensor& grad_logits) {
  check_cuda(logits, "logits");
  check_contiguous(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "lpmoe: `logits` must be (tokens, experts), got ", logits.sizes());
  TORCH_CHECK(indices.dim() == 2 && indices.size(0) == logits.size(0), "lpmoe: `indices` must be (tokens, k), got ",
              indices.sizes());
  const int64_t t = logits.size(0), e = logits.size(1), k = indices.size(1);
  TORCH_CHECK(e >= 1 && e <= router::kMaxExperts && k >= 1 && k <= router::kMaxTopK && k <= e,
              "lpmoe: the router backward takes 1..", router::kMaxExperts, " experts and 1..", router::kMaxTopK,
              " <= experts slots, got ", e, " experts, k ", k);
  check_dense(indices, logits, "indices", "logits", at::kLong, t * k);
  check_dense(grad_logits, logits, "grad_logits", "logits", logits.scalar_type(), t * e);
  router::BackwardArgs a;
  a.logits = logits.data_ptr();
  a.dtype = to_hp_dtype(logits.scalar_type(), "logits");
  a.tokens = t;
  a.experts = static_cast<int>(e);
  a.k = static_cast<int>(k);
  a.sigmoid = sigmoid;
  a.normalize = normalize;
  a.indices = indices.data_ptr<int64_t>();
  if (grad_probs.has_value()) {
    check_dense(*grad_probs, logits, "grad_probs", "logits", at::kFloat, t * k);
    a.grad_probs = grad_probs->data_ptr<float>();
  }
  if (grad_lse.has_value()) {
    check_dense(*grad_lse, logits, "grad_lse", "logits", at::kFloat, t);
    a.grad_lse = grad_lse->data_ptr<float>();
  }
  if (grad_affinity.has_value()) {
    check_dense(*grad_affinity, logits, "grad_affinity", "logits", at::kFloat, e);
    a.grad_affinity = grad_affinity->data_ptr<float>();
  }
  a.grad_logits = grad_logits.data_ptr();
  const c10::cuda::CUDAGuard guard(logits.device());
  LPMOE_CHECK_LAUNCH(router::launch_backward(a, at::cuda::getCurrentDeviceProperties()->multiProcessorCount,
                                             current_stream()),
                     "router backward");
}

}  // namespace binding
}  // namespace lpmoe
