// Binding of the fused router scoring kernel (csrc/router).  Python
// (lpmoe/moe/router_kernel.py) allocates; this layer checks and launches.
#include <ATen/cuda/CUDAContext.h>

#include "binding/common.h"
#include "binding/ops.h"
#include "router/topk_router.h"

namespace lpmoe {
namespace binding {

namespace {

// The (tokens, experts) logits and the slot count every router kernel takes,
// checked, and the fields their argument structs share, filled.
template <typename Args>
void score_args(Args& a, const at::Tensor& logits, int64_t k, bool sigmoid, bool normalize, const char* kernel) {
  check_cuda(logits, "logits");
  check_contiguous(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "lpmoe: `logits` must be (tokens, experts), got ", logits.sizes());
  const int64_t e = logits.size(1);
  TORCH_CHECK(e >= 1 && e <= router::kMaxExperts && k >= 1 && k <= router::kMaxTopK && k <= e, "lpmoe: ", kernel,
              " takes 1..", router::kMaxExperts, " experts and 1..", router::kMaxTopK, " <= experts slots, got ", e,
              " experts, k ", k);
  a.logits = logits.data_ptr();
  a.dtype = to_hp_dtype(logits.scalar_type(), "logits");
  a.tokens = logits.size(0);
  a.experts = static_cast<int>(e);
  a.k = static_cast<int>(k);
  a.sigmoid = sigmoid;
  a.normalize = normalize;
}

}  // namespace

int64_t router_grid_size(int64_t tokens) {
  return router::grid_size(tokens, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
}

void router_topk(const at::Tensor& logits, int64_t k, bool sigmoid, bool normalize, const at::Tensor& probs,
                 const at::Tensor& indices, const c10::optional<at::Tensor>& lse,
                 const c10::optional<at::Tensor>& affinity, const c10::optional<at::Tensor>& counts) {
  router::TopKArgs a;
  score_args(a, logits, k, sigmoid, normalize, "the fused router");
  const int64_t t = a.tokens, e = a.experts;
  check_dense(probs, logits, "probs", "logits", at::kFloat, t * k);
  check_dense(indices, logits, "indices", "logits", at::kLong, t * k);
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
  TORCH_CHECK(indices.dim() == 2, "lpmoe: `indices` must be (tokens, k), got ", indices.sizes());
  router::BackwardArgs a;
  score_args(a, logits, indices.size(1), sigmoid, normalize, "the router backward");
  const int64_t t = a.tokens, e = a.experts, k = a.k;
  TORCH_CHECK(indices.size(0) == t, "lpmoe: `indices` must be (tokens, k), got ", indices.sizes());
  check_dense(indices, logits, "indices", "logits", at::kLong, t * k);
  check_dense(grad_logits, logits, "grad_logits", "logits", logits.scalar_type(), t * e);
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
